"""The GGUF header (metadata and tensor table) parsed from the file's first bytes, pure: no I/O.

A volunteer reads a model's header over ranged HTTP reads before it downloads anything, so the
parser must say, when the bytes end too early, how many more it needs at least:
:func:`parse_header` raises :class:`NeedMore` with a *lower bound* on the header's end (a
string array of N items needs at least 8*N more bytes, every tensor info at least 24), and
the caller fetches a few precise rounds instead of guessing a size. Metadata arrays are
described (:class:`GGUFArray`), not decoded: a vocabulary is large and nobody here needs it.

The header also gives the model fingerprint (:func:`kvasir_bus.fingerprint.fingerprint` over
the key/value records as encoded and the tensor table), equal to ``compute_fingerprint`` of
the whole file through gguf-py's reader. A part of a split GGUF (``split.*`` keys) keeps its
key/value records, so that :func:`split_fingerprint` can give the fingerprint of the model its
parts were split from (the one a :class:`kernels.tensors.SplitReader` computes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from kernels.tensors import SPLIT_KEYS
from kvasir_bus.errors import ModelFileError
from kvasir_bus.fingerprint import fingerprint

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


class NeedMore(Exception):
    """The header continues past the bytes given; it ends at ``end`` bytes or later."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, described but not decoded (token lists are large)."""

    item_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, with its offset made absolute."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order, innermost first
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass(frozen=True, eq=False)
class GGUFHeader:
    """Everything before a GGUF's data section, and where each tensor's bytes lie."""

    version: int
    metadata: dict[str, Any]  # scalars and strings decoded; arrays as GGUFArray
    tensors: tuple[TensorInfo, ...]
    alignment: int
    header_end: int  # end of the tensor infos
    data_offset: int  # start of the data section (header_end padded to the alignment)
    fingerprint: str  # of these bytes (a slice's: its own; its source's is in the metadata)
    records: tuple[tuple[str, bytes], ...] = ()  # (key, record as encoded): kept for split parts only

    @property
    def split(self) -> tuple[int, int] | None:
        """``(split.no, split.count)`` of a part of a split GGUF (0-based no), else None."""
        no, count = self.metadata.get("split.no"), self.metadata.get("split.count")
        if isinstance(no, int) and isinstance(count, int):
            return no, count
        return None

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def file_bytes_needed(self) -> int:
        return max((t.offset + t.nbytes for t in self.tensors), default=self.data_offset)


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}
_MIN_KV = 8 + 4 + 1  # key length, type, smallest value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class _Cursor:
    """Reads little-endian values from ``buf``; running out raises NeedMore with a bound that
    includes ``tail``, the least the rest of the header still needs after the current item."""

    def __init__(self, buf, name: str) -> None:
        self.buf = buf
        self.pos = 0
        self.tail = 0
        self.name = name

    def need(self, n: int, extra: int = 0) -> None:
        if self.pos + n > len(self.buf):
            raise NeedMore(self.pos + n + extra + self.tail)

    def take(self, n: int, extra: int = 0):
        self.need(n, extra)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, extra: int = 0):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, extra))[0]

    def string(self, what: str, extra: int = 0) -> bytes:
        n = self.unpack("<Q", extra)
        if n > (1 << 40):
            raise ModelFileError(f"{self.name}: corrupt GGUF header: {what} has length {n}")
        return bytes(self.take(n, extra))


def parse_header(buf: bytes | bytearray | memoryview, name: str = "GGUF") -> GGUFHeader:
    """Parse a GGUF header from the file's first bytes (pure; no I/O).

    Raises :class:`NeedMore` if ``buf`` ends before the header does, and
    :class:`ModelFileError` if the bytes are not a GGUF this reader handles (same rules as
    gguf-py's reader: little-endian, version 2 or 3, unique keys and tensor names, a
    power-of-two ``general.alignment`` of type uint32).
    """
    buf = memoryview(buf).cast("B")
    c = _Cursor(buf, name)
    c.need(4 + 4 + 8 + 8)
    magic = bytes(c.take(4))
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{name}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = c.unpack("<I")
    if version & 0xFFFF == 0:
        raise ModelFileError(f"{name}: a big-endian GGUF; only little-endian files are supported")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{name}: GGUF version {version} is not supported "
                             f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = c.unpack("<Q")
    n_kv = c.unpack("<Q")
    if n_tensors > (1 << 24) or n_kv > (1 << 24):
        raise ModelFileError(f"{name}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")

    metadata: dict[str, Any] = {}
    records: list[tuple[str, memoryview]] = []  # (key, its bytes as encoded), for the fingerprint
    for i in range(n_kv):
        c.tail = (n_kv - i - 1) * _MIN_KV + n_tensors * _MIN_TENSOR_INFO
        start = c.pos
        key = _utf8(c.string("a metadata key"), name, "metadata key")
        vtype = _value_type(c.unpack("<I"), name, key)
        value = _value(c, vtype, key)
        if key in metadata:
            raise ModelFileError(f"{name}: metadata key {key!r} appears twice")
        metadata[key] = value
        records.append((key, buf[start:c.pos]))

    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        value = metadata["general.alignment"]
        if not isinstance(value, _U32) or value == 0 or value & (value - 1):
            raise ModelFileError(f"{name}: general.alignment must be a power-of-two uint32, got "
                                 f"{value!r}")
        alignment = int(value)

    raw_tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        c.tail = (n_tensors - i - 1) * _MIN_TENSOR_INFO
        tname = _utf8(c.string("a tensor name"), name, "tensor name")
        n_dims = c.unpack("<I")
        if n_dims > 8:
            raise ModelFileError(f"{name}: tensor {tname!r} has {n_dims} dimensions")
        ne = tuple(c.unpack("<Q", 12) for _ in range(n_dims))
        raw_type = c.unpack("<I", 8)
        rel = c.unpack("<Q")
        if tname in names:
            raise ModelFileError(f"{name}: tensor {tname!r} appears twice")
        names.add(tname)
        try:
            gtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{name}: tensor {tname!r} has unknown ggml type {raw_type}") from None
        n_elems = 1
        for n in ne:
            n_elems *= n
        raw_tensors.append((tname, gtype, ne, rel, n_elems * type_size // block))
    header_end = c.pos
    data_offset = header_end + (-header_end % alignment)
    tensors = tuple(TensorInfo(n, t, ne, data_offset + rel, nbytes) for n, t, ne, rel, nbytes in raw_tensors)
    fp = fingerprint(records, ((t.name, t.ggml_type, t.ne, t.nbytes) for t in tensors))
    kept = tuple((k, bytes(r)) for k, r in records) if "split.count" in metadata else ()
    return GGUFHeader(version, metadata, tensors, alignment, header_end, data_offset, fp, kept)


def split_fingerprint(parts: "list[GGUFHeader]", name: str = "GGUF") -> str:
    """The fingerprint of the model split into ``parts`` (headers of every part, in order):
    the first part's metadata without the ``split.*`` keys and every part's tensors, as
    ``compute_fingerprint`` of a :class:`kernels.tensors.SplitReader` (and of the single file
    llama-gguf-split was given). Refuses parts that are not one split, in order."""
    for i, h in enumerate(parts):
        if h.split != (i, len(parts)):
            raise ModelFileError(f"{name}: part {i + 1} of {len(parts)} says split.no={h.metadata.get('split.no')} "
                                 f"of split.count={h.metadata.get('split.count')} (parts of different splits?)")
    want = parts[0].metadata.get("split.tensors.count")
    got = sum(len(h.tensors) for h in parts)
    if want != got:
        raise ModelFileError(f"{name}: the parts hold {got} tensors, split.tensors.count says {want}")
    records = [(k, r) for k, r in parts[0].records if k not in SPLIT_KEYS]
    return fingerprint(records, ((t.name, t.ggml_type, t.ne, t.nbytes) for h in parts for t in h.tensors))


class _U32(int):
    """An int that was stored as uint32 (general.alignment must be one)."""


def _utf8(raw: bytes, name: str, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFileError(f"{name}: corrupt GGUF header: a {what} is not UTF-8") from None


def _value_type(raw: int, name: str, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ModelFileError(f"{name}: metadata {key!r} has unknown value type {raw}") from None


def _value(c: _Cursor, vtype: GGUFValueType, key: str):
    if vtype == GGUFValueType.STRING:
        return _utf8_lenient(c.string(f"metadata {key!r}"))
    fmt = _SCALARS.get(vtype)
    if fmt is not None:
        value = c.unpack(fmt)
        return _U32(value) if vtype == GGUFValueType.UINT32 else value
    if vtype == GGUFValueType.ARRAY:
        itype = _value_type(c.unpack("<I"), c.name, key)
        count = c.unpack("<Q")
        if count > (1 << 32):
            raise ModelFileError(f"{c.name}: metadata {key!r} claims {count} items")
        if itype == GGUFValueType.ARRAY:
            for i in range(count):  # nested arrays: walk them (rare)
                _value(c, itype, key)
            return GGUFArray(itype, count)
        if itype == GGUFValueType.STRING:
            for i in range(count):
                # this string's length and bytes, then at least 8 bytes per string left
                n = c.unpack("<Q", extra=8 * (count - i - 1))
                c.take(n, extra=8 * (count - i - 1))
            return GGUFArray(itype, count)
        size = struct.calcsize(_SCALARS[itype])
        c.take(size * count)
        return GGUFArray(itype, count)
    raise ModelFileError(f"{c.name}: metadata {key!r} has unhandled value type {vtype.name}")


def _utf8_lenient(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")
