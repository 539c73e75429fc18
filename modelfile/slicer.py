"""Cutting a slice: copy chosen experts' byte ranges out of an MoE GGUF into a mini-GGUF.

In a GGUF the expert index is the outermost dimension of ``blk.L.ffn_{gate,up,down}_exps``,
so experts ``A..B`` of one tensor are the single contiguous range
``[start + A*nb2, start + (B+1)*nb2)`` with ``nb2 = ne[1] * row_bytes``. A slice is those
ranges copied verbatim (layout: :mod:`modelfile.slice_file`). The copy streams through one
bounded buffer (:data:`CHUNK_BYTES`), so a source larger than RAM slices in constant memory;
the source is read with plain ``read`` calls, not through the memory map, so the pages copied
never count as this process' resident memory.

Two steps: :func:`plan_slice` opens the source, checks the request against it and returns a
:class:`SlicePlan` (pure data: which source byte ranges become which tensors);
:func:`write_slice` writes the plan to a temporary file next to the output, reads it back,
and renames it into place.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, GGUFWriter

from kvasir_bus.errors import ModelFileError, UsageError
from kvasir_bus.fingerprint import model_fingerprint
from modelfile.slice_file import (KEYS, KINDS, SLICE_VERSION, SLICE_VERSION_BIAS, Holding, has_expert_bias,
                                slice_bias_name, slice_from_reader, slice_tensor_name, source_bias_name,
                                source_tensor_name)
from kernels.tensors import SplitReader, open_gguf, part_of

CHUNK_BYTES = 8 << 20  # the copy buffer: the most memory the byte copy ever uses
_VERIFY_BYTES = 4096  # bytes compared with the source at each end of every tensor after writing

Span = tuple[int, int]  # inclusive (first, last), as a person types it: A-B
Progress = Callable[[int, int], None]  # (bytes copied so far, bytes to copy in all)

_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SPAN = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_span(text: str, what: str) -> Span | None:
    """``"A-B"`` (inclusive) or ``"A"`` -> ``(A, B)``; ``"all"`` -> None. ``what`` names the flag."""
    if text.strip().lower() == "all":
        return None
    m = _SPAN.match(text)
    if m is None:
        raise UsageError(f"{what} {text!r}: expected A-B (inclusive), a single A, or 'all'")
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) is not None else first
    if first > last:
        raise UsageError(f"{what} {text}: range is reversed (first {first} > last {last})")
    return first, last


@dataclass(frozen=True)
class SliceTensor:
    """One tensor of the slice and the source byte range it is a copy of."""

    name: str
    holding: Holding
    kind: str  # gate | up | down
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order; the last = experts held: (ne0, ne1, n) weights, (rows, n) bias rows
    src_offset: int  # absolute offset in the source file
    nbytes: int
    bias: bool = False  # the held experts' bias rows of ``kind`` (F32), not their weights
    src_path: str = ""  # the file src_offset is in, when not the plan's source (a part of a split GGUF)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Numpy-order shape in bytes (what GGUFWriter takes with ``raw_dtype``)."""
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return (*reversed(self.ne[1:]), self.ne[0] // block * type_size)


@dataclass(frozen=True)
class SlicePlan:
    source: str
    fingerprint: str
    arch: str
    name: str  # general.name of the source, "" if none
    alignment: int
    n_layer: int
    n_expert: int
    n_embd: int
    n_ff: int
    holdings: tuple[Holding, ...]
    tensors: tuple[SliceTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_held(self) -> int:
        return sum(h.count for h in self.holdings)


@dataclass(frozen=True)
class SliceResult:
    path: str
    holdings: tuple[Holding, ...]
    n_held: int
    nbytes: int  # size of the written file
    seconds: float


def plan_slice(source: str | os.PathLike, requests: Iterable[tuple[Span | None, Span | None]]) -> SlicePlan:
    """Check ``(layers, experts)`` requests against ``source``; None means all of them.

    Requests may overlap; each layer's expert ranges are merged (overlapping or adjacent
    ranges become one), so every held expert is stored once.
    """
    source = os.fspath(source)
    reader = open_gguf(source)
    if KEYS.VERSION in reader.fields:
        raise ModelFileError(f"{source}: is already a kvasir slice; slice the original model")
    arch = _meta(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{source}: no general.architecture")

    block_count = _meta(reader, f"{arch}.block_count")
    nextn = _meta(reader, f"{arch}.nextn_predict_layers")
    # multi-token-prediction blocks (the last ``nextn_predict_layers``, qwen35moe) are never
    # executed, so their experts are never dispatched: no slice or manifest holds them
    first_mtp = int(block_count) - int(nextn) if isinstance(block_count, int) and isinstance(nextn, int) \
        and nextn > 0 else None
    layers: dict[int, dict[str, object]] = {}
    for t in reader.tensors:
        m = _EXPS.match(t.name)
        if m and (first_mtp is None or int(m.group(1)) < first_mtp):
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if not layers:
        raise ModelFileError(f"{source}: not a Mixture-of-Experts GGUF: no blk.N.ffn_{{gate,up,down}}_exps "
                             "expert tensors")
    dims = None
    for layer, kinds in sorted(layers.items()):
        missing = [k for k in KINDS if k not in kinds]
        if missing:
            raise ModelFileError(f"{source}: layer {layer} lacks {source_tensor_name(layer, missing[0])}")
        gate, up, down = (kinds[k] for k in KINDS)
        ne = [tuple(int(n) for n in t.shape) for t in (gate, up, down)]
        if any(len(x) != 3 for x in ne) or ne[0] != ne[1] or ne[2] != (ne[0][1], ne[0][0], ne[0][2]):
            raise ModelFileError(f"{source}: layer {layer}: unexpected expert tensor shapes "
                                 f"gate {ne[0]}, up {ne[1]}, down {ne[2]}")
        if dims is None:
            dims = ne[0]
        elif ne[0] != dims:
            raise ModelFileError(f"{source}: layer {layer}: expert shape {ne[0]} differs from "
                                 f"{dims} of earlier layers (not supported)")
    n_embd, n_ff, n_expert = dims
    n_layer = max(int(block_count) if isinstance(block_count, int) else 0, max(layers) + 1)
    expert_layers = sorted(layers)
    biases = {t.name: t for t in reader.tensors if t.name.endswith("_exps.bias")}

    def _part_path(name: str) -> str:  # "" (the source itself) unless the source is split
        return part_of(reader, name, source)[0] if isinstance(reader, SplitReader) else ""
    with_bias = has_expert_bias(arch)

    wanted: dict[int, list[Span]] = {}
    for layer_span, expert_span in requests:
        if layer_span is None:
            chosen = expert_layers
        else:
            a, b = layer_span
            if a < 0 or a > b:
                raise UsageError(f"bad layer range {a}-{b}")
            if b >= n_layer:
                raise UsageError(f"layer {b} out of range: {source} has {n_layer} layers "
                                 f"(0-{n_layer - 1})")
            chosen = list(range(a, b + 1))
            for layer in chosen:
                if layer not in layers:
                    what = ("is the multi-token-prediction block, never executed" if first_mtp is not None
                            and layer >= first_mtp else "has no expert tensors")
                    raise UsageError(f"layer {layer} {what} (layers with experts: {_compact(expert_layers)})")
        if expert_span is None:
            expert_span = (0, n_expert - 1)
        if expert_span[0] < 0 or expert_span[0] > expert_span[1]:
            raise UsageError(f"bad expert range {expert_span[0]}-{expert_span[1]}")
        if expert_span[1] >= n_expert:
            raise UsageError(f"expert {expert_span[1]} out of range: {source} has {n_expert} experts "
                             f"per layer (0-{n_expert - 1})")
        for layer in chosen:
            wanted.setdefault(layer, []).append(expert_span)
    if not wanted:
        raise UsageError("nothing to slice: give at least one --layer/--experts pair")

    holdings = []
    tensors = []
    for layer in sorted(wanted):
        for first, last in _merge(wanted[layer]):
            h = Holding.inclusive(layer, first, last)
            holdings.append(h)
            for kind in KINDS:
                t = layers[layer][kind]
                gtype = GGMLQuantizationType(int(t.tensor_type))
                ne0, ne1, _ = (int(n) for n in t.shape)
                block, type_size = GGML_QUANT_SIZES[gtype]
                nb2 = ne1 * (ne0 // block) * type_size
                tensors.append(SliceTensor(
                    slice_tensor_name(layer, kind, first, last), h, kind, gtype, (ne0, ne1, h.count),
                    int(t.data_offset) + first * nb2, h.count * nb2, src_path=_part_path(t.name)))
            if with_bias:  # the held experts' bias rows: again one contiguous range per kind
                for kind in KINDS:
                    rows = n_embd if kind == "down" else n_ff
                    b = biases.get(source_bias_name(layer, kind))
                    if b is None or tuple(int(n) for n in b.shape) != (rows, n_expert) \
                            or int(b.tensor_type) != GGMLQuantizationType.F32:
                        raise ModelFileError(f"{source}: {arch} needs {source_bias_name(layer, kind)} as F32 "
                                             f"ne=({rows}, {n_expert})")
                    tensors.append(SliceTensor(
                        slice_bias_name(layer, kind, first, last), h, kind, GGMLQuantizationType.F32,
                        (rows, h.count), int(b.data_offset) + first * rows * 4, h.count * rows * 4, bias=True,
                        src_path=_part_path(b.name)))

    alignment = reader.alignment if "general.alignment" in reader.fields else GGUF_DEFAULT_ALIGNMENT
    name = _meta(reader, "general.name")
    return SlicePlan(source, model_fingerprint(reader), arch, name if isinstance(name, str) else "",
                     int(alignment), n_layer, n_expert, n_embd, n_ff, tuple(holdings), tuple(tensors))


def write_slice(plan: SlicePlan, out: str | os.PathLike, *, progress: Progress | None = None) -> SliceResult:
    """Write ``plan`` to ``out`` (via a temporary file in the same directory, renamed at the end)."""
    out = _check_output(plan.source, os.fspath(out))
    t0 = time.perf_counter()
    tmp = os.path.join(os.path.dirname(out) or ".",
                       f".{os.path.basename(out)}.{secrets.token_hex(4)}.part")
    try:
        with open(tmp, "xb"):  # claim the name; honours the umask, unlike mkstemp's 0600
            pass
        write_slice_header(plan, tmp)
        offsets = _copy_data(plan, tmp, progress)
        _verify(plan, tmp, offsets)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return SliceResult(out, plan.holdings, plan.n_held, os.path.getsize(out), time.perf_counter() - t0)


def write_slice_header(plan: SlicePlan, path: str) -> None:
    """Header, metadata and tensor infos through gguf's writer (it computes the data offsets).

    Public: a volunteer's download writes the same header before it fetches the slabs."""
    w = GGUFWriter(path, plan.arch)
    if plan.alignment != GGUF_DEFAULT_ALIGNMENT:
        w.add_custom_alignment(plan.alignment)
    if plan.name:
        w.add_name(plan.name)
    w.add_uint32(KEYS.VERSION, SLICE_VERSION_BIAS if any(t.bias for t in plan.tensors) else SLICE_VERSION)
    w.add_string(KEYS.SOURCE_FINGERPRINT, plan.fingerprint)
    w.add_string(KEYS.SOURCE_NAME, os.path.basename(plan.source))
    w.add_uint32(KEYS.BLOCK_COUNT, plan.n_layer)
    w.add_uint32(KEYS.EXPERT_COUNT, plan.n_expert)
    w.add_uint32(KEYS.N_EMBD, plan.n_embd)
    w.add_uint32(KEYS.N_FF, plan.n_ff)
    for key, values in ((KEYS.LAYERS, [h.layer for h in plan.holdings]),
                        (KEYS.EXPERT_FIRST, [h.lo for h in plan.holdings]),
                        (KEYS.EXPERT_LAST, [h.last for h in plan.holdings])):
        w.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    for t in plan.tensors:
        w.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()


def _copy_data(plan: SlicePlan, path: str, progress: Progress | None) -> list[int]:
    """Append the aligned data section, range by range; returns each tensor's file offset."""
    total = plan.nbytes
    done = 0
    offsets = []
    buf = memoryview(bytearray(max(1, min(CHUNK_BYTES, max((t.nbytes for t in plan.tensors), default=1)))))
    sources: dict[str, object] = {}
    with open(path, "ab", buffering=0) as dst:
        pos = dst.seek(0, os.SEEK_END)
        for t in plan.tensors:
            pos += _pad(dst, pos, plan.alignment)
            offsets.append(pos)
            src_path = t.src_path or plan.source
            if src_path not in sources:
                sources[src_path] = open(src_path, "rb", buffering=0)
            src = sources[src_path]
            src.seek(t.src_offset)
            left = t.nbytes
            while left:
                n = src.readinto(buf[:min(left, len(buf))])
                if not n:
                    raise ModelFileError(f"{plan.source}: ended early while copying {t.name} "
                                         "(was the file changed while slicing?)")
                _write_all(dst, buf[:n])
                left -= n
                pos += n
                done += n
                if progress is not None:
                    progress(done, total)
        pos += _pad(dst, pos, plan.alignment)
        os.fsync(dst.fileno())
        for src in sources.values():
            src.close()
    return offsets


def _verify(plan: SlicePlan, path: str, offsets: Sequence[int]) -> None:
    """Read the file back with gguf's reader: same tensor table, data where it was written."""
    reader = open_gguf(path)
    info = slice_from_reader(reader, path)  # the worker's own checks of metadata and shapes
    if info.fingerprint != plan.fingerprint or info.holdings != plan.holdings:
        raise ModelFileError(f"{path}: read back different holdings or fingerprint (bug)")
    got = {t.name: t for t in reader.tensors}
    for t, off in zip(plan.tensors, offsets):
        r = got[t.name]
        if int(r.data_offset) != off or int(r.n_bytes) != t.nbytes or int(r.tensor_type) != t.ggml_type:
            raise ModelFileError(f"{path}: tensor {t.name} read back at offset {int(r.data_offset)} "
                                 f"({int(r.n_bytes)} bytes), written at {off} ({t.nbytes} bytes) (bug)")
        with open(t.src_path or plan.source, "rb", buffering=0) as src:
            for rel in {0, max(0, t.nbytes - _VERIFY_BYTES)}:
                n = min(_VERIFY_BYTES, t.nbytes - rel)
                want = os.pread(src.fileno(), n, t.src_offset + rel)
                if want != reader.data[off + rel:off + rel + n].tobytes():
                    raise ModelFileError(f"{path}: tensor {t.name} differs from the source after copying")


def _check_output(source: str, out: str) -> str:
    if not out:
        raise UsageError("output path is empty")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError(f"{out}: output directory {parent} does not exist")
    if os.path.isdir(out):
        raise UsageError(f"{out}: is a directory; give the slice's file name")
    if os.path.realpath(out) == os.path.realpath(source) or (
            os.path.exists(out) and os.path.samefile(out, source)):
        raise UsageError(f"{out}: output is the source file itself")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{out}: cannot write in {parent}")
    return out


def _pad(dst, pos: int, alignment: int) -> int:
    n = -pos % alignment
    if n:
        _write_all(dst, bytes(n))
    return n


def _write_all(dst, data) -> None:
    view = memoryview(data)
    while view:
        n = dst.write(view)
        view = view[n:]


def _merge(spans: Sequence[Span]) -> list[Span]:
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _compact(values: Sequence[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _merge([(v, v) for v in values]))


def describe_holdings(holdings: Sequence[Holding]) -> str:
    """Human summary, grouping runs of layers that hold the same experts:
    ``layers 0-3 experts 0-7; layer 5 experts 2,9-11``."""
    by_layer: dict[int, list[Span]] = {}
    for h in holdings:
        by_layer.setdefault(h.layer, []).append((h.lo, h.last))
    groups: list[tuple[int, int, tuple[Span, ...]]] = []
    for layer in sorted(by_layer):
        spans = tuple(by_layer[layer])
        if groups and groups[-1][1] == layer - 1 and groups[-1][2] == spans:
            groups[-1] = (groups[-1][0], layer, spans)
        else:
            groups.append((layer, layer, spans))
    parts = []
    for a, b, spans in groups:
        layers = f"layer {a}" if a == b else f"layers {a}-{b}"
        experts = ",".join(f"{x}" if x == y else f"{x}-{y}" for x, y in spans)
        parts.append(f"{layers} experts {experts}")
    return "; ".join(parts)


def _meta(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # a malformed field we only wanted for information
        return None
