"""GGUF tensors as raw, typed byte ranges: the unit both the engine and the workers compute on.

A :class:`QTensor` is one weight tensor exactly as it lies in the GGUF: its ggml type, its
shape in ggml order (``ne``, innermost first) and its bytes (a read-only view of the
memory-mapped file; nothing is copied or dequantised). For the 3-D expert tensors
``ffn_{gate,up,down}_exps`` the expert index is ``ne[2]``, the outermost dimension, so expert
``e`` is the contiguous slab ``data[e*nb2:(e+1)*nb2]`` (:meth:`QTensor.expert`).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from kvasir_bus.errors import ModelFileError


@dataclass(frozen=True, eq=False)
class QTensor:
    """One weight tensor as it lies in the GGUF. Immutable; compared and hashed by identity (its
    bytes are a memmap view: value equality would mean comparing megabytes), so a kernel can
    remember the tensors it has already validated (``kernels.checks``)."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (input features)
    data: np.ndarray  # uint8, 1-D, exactly nbytes long, C-contiguous
    # What a routed expert's projection carries besides its matrix (gpt-oss; None/"swiglu" elsewhere):
    bias: np.ndarray | None = None  # float32 (ne[1],), added to every output row (llama.cpp: ggml_add_id)
    glu: str = "swiglu"  # on an expert's gate: the gated activation joining it to up (swiglu, swiglu_oai)
    # An expert's 2-D view (:meth:`expert`): the 3-D tensor it is slab ``slab_index`` of. A kernel
    # that lays the 3-D tensor out anew (ggml's weight repacking) finds the view's bytes in it.
    slab: "QTensor | None" = None
    slab_index: int = -1

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.ne[0] // block * type_size

    @property
    def nbytes(self) -> int:
        rows = 1
        for n in self.ne[1:]:
            rows *= n
        return rows * self.row_bytes

    @property
    def n_expert(self) -> int:
        if len(self.ne) != 3:
            raise ValueError(f"{self.name} is not a 3-D expert tensor (ne={self.ne})")
        return self.ne[2]

    @property
    def expert_bytes(self) -> int:
        """nb[2]: the size of one expert's slab."""
        return self.ne[1] * self.row_bytes

    def expert(self, e: int, bias: np.ndarray | None = None, glu: str = "swiglu") -> "QTensor":
        """Expert ``e`` of a 3-D expert tensor, as a 2-D tensor viewing the same bytes.
        ``bias``: the expert tensor's bias rows (E, ne[1]) float32, of which row ``e`` goes along."""
        if not 0 <= e < self.n_expert:
            raise IndexError(f"{self.name}: expert {e} out of range 0..{self.n_expert - 1}")
        nb2 = self.expert_bytes
        return QTensor(f"{self.name}[{e}]", self.ggml_type, self.ne[:2], self.data[e * nb2:(e + 1) * nb2],
                       None if bias is None else bias[e], glu, self, e)

    @functools.cached_property
    def ptr(self) -> int:
        """The address of ``data`` (what a ggml graph binds; made once: the bytes never move)."""
        return self.data.ctypes.data

    @functools.cached_property
    def shape_key(self) -> tuple[int, ...]:
        """(ggml type, *ne): what a compute graph's shape depends on, as one flat tuple of ints
        (a graph cache key hashes it on every call; never the bytes, which are bound per call)."""
        return (int(self.ggml_type), *self.ne)

    @functools.cached_property
    def bias_ptr(self) -> int | None:
        """The address of ``bias`` (None without one), made once like :attr:`ptr`."""
        return None if self.bias is None else self.bias.ctypes.data

    def f32(self) -> np.ndarray:
        """Dequantised copy in numpy order (``ne`` reversed), float32."""
        from gguf.quants import dequantize

        shape = tuple(reversed(self.ne))
        if self.ggml_type == GGMLQuantizationType.F32:
            return self.data.view(np.float32).reshape(shape).copy()
        if self.ggml_type == GGMLQuantizationType.F16:
            return self.data.view(np.float16).reshape(shape).astype(np.float32)
        rows = self.data.reshape(-1, self.row_bytes)
        return dequantize(rows, self.ggml_type).reshape(shape).astype(np.float32, copy=False)


SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")  # llama.cpp's gguf-split
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_paths(path: str | os.PathLike) -> list[str] | None:
    """The parts of a split GGUF named like ``name-00001-of-00003.gguf`` (any part may be
    given), in order; None for a name that is not a split part."""
    path = os.fspath(path)
    m = _SPLIT_NAME.match(path)
    if m is None:
        return None
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise ModelFileError(f"{path}: part {int(m['no'])} of {count} is not a valid split part name")
    return [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


class SplitReader:
    """The parts of a split GGUF as one reader, as llama.cpp loads them (``split.count`` parts,
    ``split.no`` 0.. in order, ``split.tensors.count`` tensors in all): the metadata of the
    first part without the ``split.*`` keys (so the fingerprint is the one of the single file
    gguf-split was given), every part's tensors in order, and for each tensor the part it
    lies in (:meth:`part_of`). ``data`` is the first part's map (what the metadata views)."""

    def __init__(self, paths: list[str], readers: list[GGUFReader]):
        first = readers[0]
        self.path, self.paths, self.parts = paths[0], paths, readers
        self.fields = {k: v for k, v in first.fields.items() if k not in SPLIT_KEYS}
        self.data = first.data
        self.alignment = first.alignment
        self.data_offset = first.data_offset
        self.tensors = [t for r in readers for t in r.tensors]
        self._part = {t.name: i for i, r in enumerate(readers) for t in r.tensors}

    def part_of(self, name: str) -> tuple[str, GGUFReader]:
        """(path, reader) of the part holding tensor ``name``."""
        i = self._part[name]
        return self.paths[i], self.parts[i]


def part_of(reader, name: str, path: str) -> tuple[str, GGUFReader]:
    """(file, reader) holding tensor ``name``: the file itself, or its part of a split GGUF."""
    return reader.part_of(name) if isinstance(reader, SplitReader) else (path, reader)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Memory-map a GGUF file, turning every way it can be unreadable into one clear error.
    A part of a split GGUF (``name-0000i-of-0000n.gguf``, any i) opens all its parts as one
    :class:`SplitReader`."""
    path = os.fspath(path)
    parts = split_part_paths(path)
    if parts is not None:
        return _open_split(path, parts)
    return _open_one(path)


def _open_split(given: str, paths: list[str]) -> SplitReader:
    for i, p in enumerate(paths):
        if not os.path.exists(p):
            raise ModelFileError(f"{given}: part {i + 1} of {len(paths)} ({p}) is missing")
    readers = []
    for i, p in enumerate(paths):
        r = _open_one(p)
        no, count = _split_int(r, "split.no", p), _split_int(r, "split.count", p)
        if (no, count) != (i, len(paths)):
            raise ModelFileError(f"{p}: split.no {no} of split.count {count}, expected part {i} of {len(paths)} "
                                 "(parts of different splits mixed?)")
        readers.append(r)
    want = _split_int(readers[0], "split.tensors.count", paths[0])
    got = sum(len(r.tensors) for r in readers)
    if got != want:
        raise ModelFileError(f"{given}: the parts hold {got} tensors, split.tensors.count says {want}")
    return SplitReader(paths, readers)


def _split_int(reader: GGUFReader, key: str, path: str) -> int:
    f = reader.fields.get(key)
    if f is None:
        raise ModelFileError(f"{path}: named as a split part but has no {key}")
    return int(f.parts[f.data[0]][0])


def _open_one(path: str) -> GGUFReader:
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on damage
        raise ModelFileError(f"{path}: corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise ModelFileError(
                f"{path}: truncated: tensor {t.name} needs bytes up to {t.data_offset + int(t.n_bytes)}, "
                f"file has {size}")
    return reader


def tensor_from_reader(reader: GGUFReader, name: str) -> QTensor:
    for t in reader.tensors:
        if t.name == name:
            return _qtensor(reader, t)
    raise KeyError(name)


def tensors_from_reader(reader: GGUFReader) -> dict[str, QTensor]:
    return {t.name: _qtensor(reader, t) for t in reader.tensors}


def _qtensor(reader: GGUFReader, t) -> QTensor:
    ne = tuple(int(n) for n in t.shape)
    start = int(t.data_offset)
    data = part_of(reader, t.name, "")[1].data[start:start + int(t.n_bytes)]
    return QTensor(t.name, GGMLQuantizationType(int(t.tensor_type)), ne, data)
