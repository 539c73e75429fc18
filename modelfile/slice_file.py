"""Reading a slice: the mini-GGUF a worker holds, cut from an MoE GGUF by ``kvasir slice``.

Layout (format version 1)
-------------------------
A slice is a plain GGUF file (gguf-py and llama.cpp's ``gguf`` tools read it) that holds only
routed-expert weights. For every *holding* — one layer ``L`` and an inclusive expert range
``A..B`` — it has three 3-D tensors, in this order::

    blk.L.ffn_gate_exps.A-B.weight   ne = (n_embd, n_ff, B-A+1)
    blk.L.ffn_up_exps.A-B.weight     ne = (n_embd, n_ff, B-A+1)
    blk.L.ffn_down_exps.A-B.weight   ne = (n_ff, n_embd, B-A+1)

with the ggml type of the source tensor (format version 2 adds bias rows, below). Each tensor's bytes are the source tensor's bytes
``[start + A*nb2, start + (B+1)*nb2)`` exactly: the held experts' slabs, contiguous, in expert
order, nothing dequantised or repacked. Holdings are sorted by (layer, first expert), and the
ranges of one layer never overlap or touch (adjacent ranges are merged when slicing).

Metadata (besides ``general.architecture``, copied from the source; :data:`KEYS` names them):

=====================================  ======  ==============================================
``kvasir.slice.version``               uint32  format version, :data:`SLICE_VERSION`
``kvasir.slice.source_fingerprint``    string  ``model_fingerprint`` of the source GGUF
``kvasir.slice.source_name``           string  the source's file name (for people only)
``kvasir.slice.block_count``           uint32  layers of the source
``kvasir.slice.expert_count``          uint32  experts per layer of the source (``ne[2]``)
``kvasir.slice.embedding_length``      uint32  n_embd
``kvasir.slice.expert_feed_forward_length`` uint32  n_ff of one expert
``kvasir.slice.layers``                uint32[] holding i: its layer
``kvasir.slice.expert_first``          uint32[] holding i: its first expert (inclusive)
``kvasir.slice.expert_last``           uint32[] holding i: its last expert (inclusive)
=====================================  ======  ==============================================

Bias rows (format version 2, written only for models whose experts have them: gpt-oss). The
source's ``blk.L.ffn_{kind}_exps.bias`` (ne = (rows, n_expert), F32) holds one row per expert,
so the held experts' rows are again one contiguous range; each holding then also has::

    blk.L.ffn_gate_exps.A-B.bias   ne = (n_ff, B-A+1)     F32
    blk.L.ffn_up_exps.A-B.bias     ne = (n_ff, B-A+1)     F32
    blk.L.ffn_down_exps.A-B.bias   ne = (n_embd, B-A+1)   F32

after its three weight tensors. A slice of such a model without them is refused (its experts
would compute something else); a version-1 reader refuses version 2, which is the point.

:func:`load_slice` memory-maps a slice, checks all of the above and hands out one expert's
three weight matrices as 2-D :class:`~kernels.tensors.QTensor` views of the mapped bytes
(with their bias rows and the architecture's activation, :data:`kernels.expert.EXPERT_GLU`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import numpy as np

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from kvasir_bus.errors import ModelFileError
from kvasir_bus.wire import Holding
from kvasir_bus.fingerprint import SLICE_SOURCE_KEY
from kernels.expert import EXPERT_GLU
from kernels.tensors import QTensor, open_gguf, tensors_from_reader

SLICE_VERSION = 1  # a slice without bias rows
SLICE_VERSION_BIAS = 2  # a slice with bias rows (gpt-oss)
READABLE_VERSIONS = (SLICE_VERSION, SLICE_VERSION_BIAS)
KINDS = ("gate", "up", "down")


class KEYS:
    """Metadata key names of a slice (the single place they are spelled)."""

    VERSION = "kvasir.slice.version"
    SOURCE_FINGERPRINT = SLICE_SOURCE_KEY
    SOURCE_NAME = "kvasir.slice.source_name"
    BLOCK_COUNT = "kvasir.slice.block_count"
    EXPERT_COUNT = "kvasir.slice.expert_count"
    N_EMBD = "kvasir.slice.embedding_length"
    N_FF = "kvasir.slice.expert_feed_forward_length"
    LAYERS = "kvasir.slice.layers"
    EXPERT_FIRST = "kvasir.slice.expert_first"
    EXPERT_LAST = "kvasir.slice.expert_last"


def slice_tensor_name(layer: int, kind: str, first: int, last: int) -> str:
    """Name of one holding's tensor in a slice: ``blk.L.ffn_{kind}_exps.A-B.weight``."""
    return f"blk.{layer}.ffn_{kind}_exps.{first}-{last}.weight"


def source_tensor_name(layer: int, kind: str) -> str:
    """Name of the source GGUF's 3-D expert tensor: ``blk.L.ffn_{kind}_exps.weight``."""
    return f"blk.{layer}.ffn_{kind}_exps.weight"


def slice_bias_name(layer: int, kind: str, first: int, last: int) -> str:
    """Name of one holding's bias rows in a slice: ``blk.L.ffn_{kind}_exps.A-B.bias``."""
    return f"blk.{layer}.ffn_{kind}_exps.{first}-{last}.bias"


def source_bias_name(layer: int, kind: str) -> str:
    """Name of the source GGUF's expert bias rows: ``blk.L.ffn_{kind}_exps.bias``."""
    return f"blk.{layer}.ffn_{kind}_exps.bias"


def has_expert_bias(arch: str) -> bool:
    """Whether the routed experts of ``arch`` carry bias rows (their activation is not plain swiglu)."""
    return EXPERT_GLU.get(arch, "swiglu") == "swiglu_oai"


class ExpertTypes(NamedTuple):
    """ggml types of one layer's gate, up and down expert tensors (they may differ)."""

    gate: GGMLQuantizationType
    up: GGMLQuantizationType
    down: GGMLQuantizationType


@dataclass(frozen=True, eq=False)
class SliceInfo:
    """A loaded slice: what it holds, what a worker needs to compute on it, and the weights."""

    path: str
    fingerprint: str  # of the source model: the <model> of the bus subjects
    arch: str
    n_embd: int
    n_ff: int  # one expert's FFN size
    n_expert: int  # experts per layer in the source model
    n_layer: int  # layers in the source model
    holdings: tuple[Holding, ...]  # half-open, like every Holding (the file stores first..last)
    types: dict[int, ExpertTypes]  # layer -> types of its gate/up/down tensors
    _weights: dict[Holding, tuple[QTensor, QTensor, QTensor]] = field(repr=False)
    _biases: dict[Holding, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(repr=False, default_factory=dict)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({h.layer for h in self.holdings}))

    @property
    def n_held(self) -> int:
        return sum(h.count for h in self.holdings)

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights held."""
        return sum(t.nbytes for triple in self._weights.values() for t in triple)

    def experts(self) -> Iterator[tuple[int, int]]:
        """Every held ``(layer, expert)``, in file order."""
        for h in self.holdings:
            for e in h.experts:
                yield h.layer, e

    def holds(self, layer: int, expert: int) -> bool:
        return self._holding(layer, expert) is not None

    def expert_weights(self, layer: int, expert: int) -> tuple[QTensor, QTensor, QTensor]:
        """``(gate, up, down)`` of one held expert: 2-D tensors viewing the mapped slice.

        gate and up have ne = (n_embd, n_ff), down has ne = (n_ff, n_embd); their names and
        bytes equal the source's ``QTensor.expert(expert)`` of the same tensors.
        Raises KeyError if the slice does not hold that expert.
        """
        h = self._holding(layer, expert)
        if h is None:
            held = ", ".join(str(x) for x in self.holdings if x.layer == layer) or "no experts"
            raise KeyError(f"{self.path}: holds no expert {expert} of layer {layer} "
                           f"(layer {layer}: {held})")
        i = expert - h.lo
        biases = self._biases.get(h, (None, None, None))
        glu = EXPERT_GLU.get(self.arch, "swiglu")
        out = []
        for kind, t, b in zip(KINDS, self._weights[h], biases):
            nb2 = t.expert_bytes
            out.append(QTensor(f"{source_tensor_name(layer, kind)}[{expert}]", t.ggml_type,
                               t.ne[:2], t.data[i * nb2:(i + 1) * nb2], None if b is None else b[i],
                               glu if kind == "gate" else "swiglu", t, i))
        return out[0], out[1], out[2]

    def holding_slabs(self, h: Holding) -> tuple[tuple[QTensor, QTensor, QTensor], tuple, str]:
        """The 3-D gate, up and down tensors of one holding (expert ``h.lo + i`` is slab ``i``),
        their bias arrays (or None) and the activation, as :func:`kernels.expert.moe_ffn` takes
        them: every held expert of a layer step in one graph. KeyError if ``h`` is not held."""
        return self._weights[h], self._biases.get(h, (None, None, None)), EXPERT_GLU.get(self.arch, "swiglu")

    def slab(self, layer: int, expert: int, kind: str) -> bytes:
        """The bytes of one held expert's slab as the source stores it: ``kind`` is gate, up or
        down (its weights) or ``{kind}_bias`` (its F32 bias row). KeyError if not held."""
        if kind.endswith("_bias"):
            row = self.expert_weights(layer, expert)[KINDS.index(kind[:-5])].bias
            if row is None:
                raise KeyError(f"{self.path}: layer {layer} expert {expert} has no {kind} row")
            return np.ascontiguousarray(row, dtype="<f4").tobytes()
        return bytes(self.expert_weights(layer, expert)[KINDS.index(kind)].data)

    def _holding(self, layer: int, expert: int) -> Holding | None:
        for h in self.holdings:
            if h.covers(layer, expert):
                return h
        return None


def load_slice(path: str | os.PathLike) -> SliceInfo:
    """Memory-map and validate a slice; raises ModelFileError saying what is wrong."""
    path = os.fspath(path)
    reader = open_gguf(path)
    return slice_from_reader(reader, path)


def slice_from_reader(reader: GGUFReader, path: str) -> SliceInfo:
    fields = reader.fields
    if KEYS.VERSION not in fields:
        hint = ""
        if any(t.name.endswith("_exps.weight") for t in reader.tensors):
            hint = " (it looks like a whole MoE model: cut a slice from it with `kvasir slice`)"
        raise ModelFileError(f"{path}: not a kvasir slice: no {KEYS.VERSION}{hint}")
    version = _scalar(reader, path, KEYS.VERSION)
    if version not in READABLE_VERSIONS:
        raise ModelFileError(f"{path}: slice format version {version}, this build reads "
                             f"versions {READABLE_VERSIONS} (re-cut it with this version's `kvasir slice`)")
    fingerprint = _string(reader, path, SLICE_SOURCE_KEY)
    if not fingerprint:
        raise ModelFileError(f"{path}: {SLICE_SOURCE_KEY} is empty")
    arch = _string(reader, path, "general.architecture")
    n_layer = _scalar(reader, path, KEYS.BLOCK_COUNT)
    n_expert = _scalar(reader, path, KEYS.EXPERT_COUNT)
    n_embd = _scalar(reader, path, KEYS.N_EMBD)
    n_ff = _scalar(reader, path, KEYS.N_FF)
    layers = _array(reader, path, KEYS.LAYERS)
    firsts = _array(reader, path, KEYS.EXPERT_FIRST)
    lasts = _array(reader, path, KEYS.EXPERT_LAST)
    if not len(layers) == len(firsts) == len(lasts):
        raise ModelFileError(f"{path}: {KEYS.LAYERS}, {KEYS.EXPERT_FIRST} and {KEYS.EXPERT_LAST} "
                             f"differ in length ({len(layers)}, {len(firsts)}, {len(lasts)})")
    if not layers:
        raise ModelFileError(f"{path}: the slice holds no experts")

    holdings = tuple(Holding.inclusive(int(l), int(a), int(b)) for l, a, b in zip(layers, firsts, lasts))
    for h in holdings:
        if not (0 <= h.layer < n_layer and 0 <= h.lo < h.hi <= n_expert):
            raise ModelFileError(f"{path}: bad holding {h} (source has {n_layer} layers of "
                                 f"{n_expert} experts)")
    for prev, h in zip(holdings, holdings[1:]):
        if (h.layer, h.lo) < (prev.layer, prev.hi):
            raise ModelFileError(f"{path}: holdings out of order or overlapping: {prev}, {h}")

    tensors = tensors_from_reader(reader)
    weights: dict[Holding, tuple[QTensor, QTensor, QTensor]] = {}
    types: dict[int, ExpertTypes] = {}
    for h in holdings:
        triple = []
        for kind in KINDS:
            name = slice_tensor_name(h.layer, kind, h.lo, h.last)
            t = tensors.get(name)
            if t is None:
                raise ModelFileError(f"{path}: holding {h} has no tensor {name}")
            want = (n_ff, n_embd, h.count) if kind == "down" else (n_embd, n_ff, h.count)
            if t.ne != want:
                raise ModelFileError(f"{path}: tensor {name} has ne={t.ne}, expected {want}")
            triple.append(t)
        ts = ExpertTypes(*(t.ggml_type for t in triple))
        if types.setdefault(h.layer, ts) != ts:
            raise ModelFileError(f"{path}: layer {h.layer}: expert tensor types differ between "
                                 f"ranges ({types[h.layer]} vs {ts})")
        weights[h] = (triple[0], triple[1], triple[2])
    biases: dict[Holding, tuple] = {}
    if has_expert_bias(arch):
        for h in holdings:
            rows = []
            for kind in KINDS:
                name = slice_bias_name(h.layer, kind, h.lo, h.last)
                t = tensors.get(name)
                if t is None:
                    raise ModelFileError(f"{path}: holding {h} has no tensor {name}: {arch}'s experts need "
                                         "their bias rows (re-cut it with this version's `kvasir slice`)")
                want = (n_embd if kind == "down" else n_ff, h.count)
                if t.ne != want or t.ggml_type != GGMLQuantizationType.F32:
                    raise ModelFileError(f"{path}: tensor {name} is {t.ggml_type.name} ne={t.ne}, expected F32 "
                                         f"ne={want}")
                rows.append(t.f32())  # (count, rows), a few KB: copied out of the map once
            biases[h] = tuple(rows)
    return SliceInfo(path, fingerprint, arch, n_embd, n_ff, n_expert, n_layer, holdings, types, weights, biases)


def _field(reader: GGUFReader, path: str, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise ModelFileError(f"{path}: slice metadata {key} is missing")
    return f


_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32, GGUFValueType.UINT64,
              GGUFValueType.INT8, GGUFValueType.INT16, GGUFValueType.INT32, GGUFValueType.INT64}


def _scalar(reader: GGUFReader, path: str, key: str) -> int:
    f = _field(reader, path, key)
    if f.types != [f.types[0]] or f.types[0] not in _INT_TYPES:
        raise ModelFileError(f"{path}: slice metadata {key} should be an integer, "
                             f"is {'/'.join(t.name for t in f.types)}")
    return int(f.contents())


def _string(reader: GGUFReader, path: str, key: str) -> str:
    f = _field(reader, path, key)
    if f.types != [GGUFValueType.STRING]:
        raise ModelFileError(f"{path}: metadata {key} should be a string, "
                             f"is {'/'.join(t.name for t in f.types)}")
    return f.contents()


def _array(reader: GGUFReader, path: str, key: str) -> list[int]:
    f = _field(reader, path, key)
    if len(f.types) != 2 or f.types[0] != GGUFValueType.ARRAY or f.types[1] not in _INT_TYPES:
        raise ModelFileError(f"{path}: slice metadata {key} should be an integer array, "
                             f"is {'/'.join(t.name for t in f.types)}")
    return [int(v) for v in f.contents()]
