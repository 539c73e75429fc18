"""Dispatch and heartbeat records: msgpack payloads decoded into typed, frozen, validated
records (the envelope, field checks and registry are :mod:`kvasir_bus.wire`).

Arrays travel as raw little-endian bytes (msgpack ``bin``) with ``dtype`` and ``shape`` beside
them, and the byte count must equal ``prod(shape) * itemsize`` exactly: a frame cut short or
padded (the 64 KiB frame-length bug of the relay, DESIGN section 7) is refused, never read as
shifted numbers.

Messages (``t``):

* ``x`` :class:`DispatchRequest`  backbone -> worker on ``kvasir.<model>.x.<layer>.<expert>``
* ``r`` :class:`DispatchReply`    worker -> backbone, the expert's output rows (float32)
* ``e`` :class:`~kvasir_bus.wire.ErrorReply` worker -> backbone, why it could not answer
* ``hb`` :class:`Heartbeat`       worker -> market on ``kvasir.<model>.coverage.<node>``

Decoded arrays are read-only views over the payload bytes (no copy); copy before writing.
NaN and inf pass the codec (they are data, and the backbone's audit decides what to do with
them); :func:`all_finite` is the check.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import struct
import sys
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

import msgpack
import numpy as np

from kvasir_bus.subjects import MAX_INDEX
from kvasir_bus.wire import (  # noqa: F401 (the names callers know codec by)
    DEFAULT_MAX_BYTES, ERR_BAD_REQUEST, ERR_INTERNAL, ERR_NOT_HELD, ERR_OVERLOADED,
    ERR_WRONG_MODEL, MAX_ERROR_MESSAGE, MAX_HOLDINGS, NO_LIMITS, VERSION, CodecError,
    ErrorReply, Holding, Limits, PayloadTooLargeError, Record, UnsupportedVersionError,
    check_bool, check_float, check_holdings, check_id, check_index, check_int, check_label, check_model,
    check_node, decode, encode, fail, headers_for, holding_list, is_id, need, record)

#: Wire dtypes (little-endian) by name; decoded arrays come back in native byte order.
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
REQUEST_DTYPES = ("float32", "float16")
REPLY_DTYPES = ("float32",)

MAX_DIM = 1 << 31

# numpy's ``dtype.name`` is a Python property that walks the type hierarchy (tens of µs on a
# slow core, several times per remote call): look the names up by dtype instead.
_NAME_OF = {np.dtype("float32"): "float32", np.dtype("float16"): "float16",
            np.dtype(">f4"): "float32", np.dtype(">f2"): "float16"}


_LITTLE_ENDIAN = sys.byteorder == "little"
_F32 = np.dtype("float32")


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a row dtype ("float32", "float16"), or numpy's name for any other."""
    name = _NAME_OF.get(dtype)
    return name if name is not None else dtype.name

# -- cheap checks for the hot path ------------------------------------------------------------
# A remote call decodes one request and one reply; the strings in them repeat (one model, a few
# nodes and kernel labels), so each distinct valid one is checked by the full check once and
# then found in a bounded cache. Anything not cached, or of another type, takes the full check,
# which raises the named error.

@functools.lru_cache(maxsize=4096)
def _valid(check, value: str) -> bool:
    try:
        check("", "", value)
        return True
    except CodecError:
        return False


def _token(check, record: str, field: str, value: Any) -> None:
    """``check(record, field, value)``, cached for valid strings."""
    if type(value) is not str or not _valid(check, value):
        check(record, field, value)


def _check_model(record: str, field: str, value: Any) -> str:
    return check_model(record, value)


def _index(record: str, field: str, value: Any) -> int:
    if type(value) is int and 0 <= value <= MAX_INDEX:
        return value
    return check_index(record, field, value)


@functools.lru_cache(maxsize=64)
def _limits(max_rows: int | None, n_embd: int | None) -> Limits:
    return Limits(max_rows, n_embd)


#: Heartbeats are small; a receiver refuses bigger ones by default.
HEARTBEAT_MAX_BYTES = 1024 * 1024


def _rows(record: str, value: Any, allowed: tuple[str, ...], min_rows: int = 1) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise fail(record, "rows", f"must be a numpy array, got {type(value).__name__}")
    if dtype_name(value.dtype) not in allowed:
        raise fail(record, "rows", f"has dtype {value.dtype}; allowed: {', '.join(allowed)}")
    if value.ndim != 2 or value.shape[0] < min_rows or value.shape[1] < 1:
        raise fail(record, "rows", f"must be 2-D (rows, n_embd) with rows >= {min_rows} and "
                                   f"n_embd >= 1, got shape {value.shape}")
    return value


def all_finite(arr: np.ndarray) -> bool:
    """True if ``arr`` holds no NaN or infinity (the codec itself lets them through).

    A finite sum proves it in one reduction, without a boolean array (NaN and infinity reach the
    sum: inf - inf is NaN); a sum that is not finite (one of them, or finite values whose sum
    overflows) is settled element by element."""
    return math.isfinite(np.add.reduce(arr, axis=None)) or bool(np.isfinite(arr).all())


def _array_fields(rows: np.ndarray) -> dict[str, Any]:
    name = dtype_name(rows.dtype)
    wire = np.ascontiguousarray(rows, dtype=DTYPES[name])
    # A memoryview packs as msgpack bin without another copy of the rows.
    return {"dtype": name, "shape": list(rows.shape),
            "data": memoryview(wire).cast("B") if wire.size else b""}


def _decode_rows(body: dict, record: str, allowed: tuple[str, ...], limits: Limits,
                 min_rows: int = 1) -> np.ndarray:
    dtype = need(body, record, "dtype")
    if dtype not in allowed:
        raise fail(record, "dtype", f"is {dtype!r}; allowed: {', '.join(allowed)}")
    shape = need(body, record, "shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise fail(record, "shape", f"must be [rows, n_embd], got {shape!r}")
    n, width = shape
    if type(n) is not int or not min_rows <= n <= MAX_DIM:
        n = check_int(record, "shape", n, min_rows, MAX_DIM)
    if type(width) is not int or not 1 <= width <= MAX_DIM:
        width = check_int(record, "shape", width, 1, MAX_DIM)
    if limits.max_rows is not None and n > limits.max_rows:
        raise PayloadTooLargeError(f"{record}: field 'shape' has {n} rows, over the limit of "
                                   f"{limits.max_rows}", field="shape")
    if limits.n_embd is not None and width != limits.n_embd:
        raise fail(record, "shape", f"has n_embd {width}, expected {limits.n_embd}")
    data = need(body, record, "data")
    if not isinstance(data, bytes):
        raise fail(record, "data", f"must be bytes (msgpack bin), got {type(data).__name__}")
    wire = DTYPES[dtype]
    expected = n * width * wire.itemsize
    if len(data) != expected:
        raise fail(record, "data", f"has {len(data)} bytes but shape {[n, width]} of {dtype} "
                                   f"needs {expected}")
    # Little-endian on the wire, native in memory: a no-op view on little-endian hosts.
    rows = np.ndarray((n, width), wire, data)  # a read-only view on the payload, no copy
    return rows if _LITTLE_ENDIAN else rows.astype(wire.newbyteorder("="))


#: The bytes of an X25519 public key (a request's ``box``).
BOX_BYTES = 32


def _check_box(record: str, box: Any) -> None:
    if box != b"" and not (type(box) is bytes and len(box) == BOX_BYTES):
        got = f"{len(box)} bytes" if isinstance(box, bytes) else type(box).__name__
        raise fail(record, "box", f"must be {BOX_BYTES} bytes (msgpack bin) or absent, got {got}")


# -- records --------------------------------------------------------------------------------

@record
@dataclass(frozen=True, eq=False)
class DispatchRequest(Record):
    """Rows of ``cur`` for one expert: ``rows`` is (n, n_embd) float32 or float16."""

    kind: ClassVar[str] = "x"
    what: ClassVar[str] = "dispatch request"

    model: str
    layer: int
    expert: int
    rows: np.ndarray
    request_id: str
    box: bytes = b""  # the backbone's X25519 public key: what a self-certifying node proves its reply to

    def __post_init__(self) -> None:
        r = self.what
        _token(_check_model, r, "model", self.model)
        object.__setattr__(self, "layer", _index(r, "layer", self.layer))
        object.__setattr__(self, "expert", _index(r, "expert", self.expert))
        _rows(r, self.rows, REQUEST_DTYPES)
        if not is_id(self.request_id):
            check_id(r, "request_id", self.request_id)
        _check_box(r, self.box)

    def body(self) -> dict[str, Any]:
        body = {"model": self.model, "layer": self.layer, "expert": self.expert,
                "request_id": self.request_id, **_array_fields(self.rows)}
        if self.box:
            body["box"] = self.box
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> DispatchRequest:
        r = cls.what
        rows = _decode_rows(body, r, REQUEST_DTYPES, limits)
        try:
            return cls(body["model"], body["layer"], body["expert"], rows, body["request_id"], body.get("box", b""))
        except KeyError:  # name the first missing field
            return cls(model=need(body, r, "model"), layer=need(body, r, "layer"),
                       expert=need(body, r, "expert"), rows=rows, request_id=need(body, r, "request_id"))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Layer": str(self.layer), "Kvasir-Expert": str(self.expert),
                "Kvasir-Rows": str(self.rows.shape[0]), "Kvasir-Dtype": dtype_name(self.rows.dtype),
                "Kvasir-Request": self.request_id}

    @classmethod
    def decode(cls, data: bytes, *, max_rows: int | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, n_embd: int | None = None) -> DispatchRequest:
        return decode_request(data, max_rows=max_rows, max_bytes=max_bytes, n_embd=n_embd)


@record
@dataclass(frozen=True, eq=False)
class DispatchReply(Record):
    """The expert's output for a request: ``rows`` is (n, n_embd) float32. ``kernel``: the label
    of the kernel that computed it (``ggml-x86_64``; "" from workers older than the field), which
    decides how the backbone audits it."""

    kind: ClassVar[str] = "r"
    what: ClassVar[str] = "dispatch reply"

    request_id: str
    node: str
    rows: np.ndarray
    kernel: str = ""

    def __post_init__(self) -> None:
        r = self.what
        if not is_id(self.request_id):
            check_id(r, "request_id", self.request_id)
        _token(check_node, r, "node", self.node)
        _rows(r, self.rows, REPLY_DTYPES)
        if self.kernel:
            _token(check_label, r, "kernel", self.kernel)

    def body(self) -> dict[str, Any]:
        body = {"request_id": self.request_id, "node": self.node, **_array_fields(self.rows)}
        if self.kernel:
            body["kernel"] = self.kernel
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> DispatchReply:
        r = cls.what
        rows = _decode_rows(body, r, REPLY_DTYPES, limits)
        try:
            return cls(body["request_id"], body["node"], rows, body.get("kernel", ""))
        except KeyError:  # name the first missing field
            return cls(request_id=need(body, r, "request_id"), node=need(body, r, "node"),
                       rows=rows, kernel=body.get("kernel", ""))

    def headers(self) -> dict[str, str]:
        headers = {"Kvasir-Node": self.node, "Kvasir-Request": self.request_id,
                   "Kvasir-Rows": str(self.rows.shape[0]), "Kvasir-Dtype": dtype_name(self.rows.dtype)}
        if self.kernel:
            headers["Kvasir-Kernel"] = self.kernel
        return headers


@record
@dataclass(frozen=True)
class Heartbeat(Record):
    """A worker's coverage announcement.

    ``holdings``: the experts it serves, as half-open :class:`Holding` ranges; ``budget_bytes``:
    memory it offers; ``load``: requests in flight; ``served``: requests answered since start;
    ``version``: software version; ``kernel``: which expert kernel it runs; ``sent_at``: Unix
    time of sending (seconds); ``bundles``: it also answers :class:`BundleRequest` on its node
    subject ``kvasir.<model>.n.<node>`` (absent on the wire, False, from workers older than
    bundles: they are served one request per expert). Lists and numpy numbers are normalised on
    construction.
    """

    kind: ClassVar[str] = "hb"
    what: ClassVar[str] = "heartbeat"

    model: str
    node: str
    holdings: tuple[Holding, ...]
    budget_bytes: int
    load: float
    served: int
    version: str
    kernel: str
    sent_at: float
    bundles: bool = False
    oversubscribed: bool = False  # its ggml threads exceed its share of the cores it shares

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("node", check_node(r, "node", self.node))
        s("holdings", check_holdings(r, self.holdings))
        s("budget_bytes", check_int(r, "budget_bytes", self.budget_bytes))
        s("load", check_float(r, "load", self.load))
        s("served", check_int(r, "served", self.served))
        s("version", check_label(r, "version", self.version))
        s("kernel", check_label(r, "kernel", self.kernel))
        s("sent_at", check_float(r, "sent_at", self.sent_at))
        s("bundles", check_bool(r, "bundles", self.bundles))
        s("oversubscribed", check_bool(r, "oversubscribed", self.oversubscribed))

    def body(self) -> dict[str, Any]:
        body = {"model": self.model, "node": self.node,
                "holdings": holding_list(self.holdings), "budget_bytes": self.budget_bytes,
                "load": self.load, "served": self.served, "version": self.version,
                "kernel": self.kernel, "sent_at": self.sent_at}
        if self.bundles:  # only then: a heartbeat without bundles is byte for byte the old one
            body["bundles"] = True
        if self.oversubscribed:  # likewise
            body["oversubscribed"] = True
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Heartbeat:
        return cls(**{f.name: need(body, cls.what, f.name) for f in fields(cls)
                      if f.name not in ("bundles", "oversubscribed")},
                   bundles=body.get("bundles", False), oversubscribed=body.get("oversubscribed", False))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node}

    @classmethod
    def decode(cls, data: bytes, *, max_bytes: int = HEARTBEAT_MAX_BYTES) -> Heartbeat:
        return decode_heartbeat(data, max_bytes=max_bytes)


# -- bundles: every call of a layer step for one worker in one message -------------------------

#: Calls in one bundle at most; a worker also refuses more calls than the layer has experts.
MAX_BUNDLE_CALLS = 4096
#: Row indices of a bundle request travel as little-endian uint32.
INDEX_DTYPE = np.dtype("<u4")


# Every id of a list in one regex call (a bundle carries one per call): the ids joined by a
# character no id may hold must match this; anything else takes the per-item check and its error.
_IDS_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}(?:,[A-Za-z0-9_.:-]{1,64})*")


def _plain_ids(ids: list | tuple) -> bool:
    """Whether every item is a valid id (a string of the id characters, so no comma): one regex
    over the joined list, with as many commas as separators. False may still be valid (the
    empty list): the caller then checks item by item."""
    try:
        joined = ",".join(ids)
    except TypeError:  # not all strings
        return False
    return _IDS_RE.fullmatch(joined) is not None and joined.count(",") == len(ids) - 1


def _id_list(record: str, field: str, value: Any, limit: int) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise fail(record, field, f"must be a list, got {type(value).__name__}")
    if len(value) > limit:
        raise fail(record, field, f"has {len(value)} items (max {limit})")
    if value and not _plain_ids(value):
        for item in value:
            if not is_id(item):
                check_id(record, field, item)
    return tuple(value)


def _int_list(record: str, field: str, value: Any, n: int, lo: int, hi: int) -> tuple[int, ...]:
    """A list of exactly ``n`` integers in ``lo..hi``."""
    if not isinstance(value, (list, tuple)):
        raise fail(record, field, f"must be a list, got {type(value).__name__}")
    if len(value) != n:
        raise fail(record, field, f"has {len(value)} items, expected {n} (one per call)")
    if n and set(map(type, value)) == {int} and lo <= min(value) and max(value) <= hi:
        return tuple(value)  # plain ints in range: the common case, checked in C
    for item in value:
        if type(item) is not int or not lo <= item <= hi:
            check_int(record, field, item, lo, hi)
    return tuple(int(v) for v in value)


def _unique(record: str, field: str, ids: tuple[str, ...]) -> None:
    if len(set(ids)) != len(ids):
        raise fail(record, field, "names a request id twice")


def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """``(0, c0, c0 + c1, ...)``: call ``i`` is ``[offsets[i], offsets[i + 1])``."""
    return (0, *itertools.accumulate(counts))


_NATIVE_INDEX = INDEX_DTYPE.newbyteorder("=")


def _index_array(record: str, value: Any, n: int, n_rows: int) -> np.ndarray:
    """Exactly ``n`` uint32 row indices, each below ``n_rows``."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype != _NATIVE_INDEX:
        raise fail(record, "index", f"must be a 1-D uint32 array, got {getattr(value, 'dtype', type(value).__name__)}")
    if len(value) != n:
        raise fail(record, "index", f"has {len(value)} entries, but the counts add up to {n}")
    top = (max(value.tolist()) if n <= 64 else int(value.max())) if n else -1  # a few: no numpy reduction
    if top >= n_rows:
        raise fail(record, "index", f"points at row {top}, but the bundle has {n_rows} rows")
    return value


@record
@dataclass(frozen=True, eq=False)
class BundleRequest(Record):
    """Every call of one layer step that the backbone sends to one worker, in one message, on the
    worker's node subject ``kvasir.<model>.n.<node>``.

    ``rows`` (R, n_embd) float32 or float16: the union of the calls' rows, each distinct row once
    (in decode every top-k expert gets the token's one row, so a bundle is about one request's
    size). Call ``i``: ``ids[i]`` its request id (the reply names it), ``experts[i]``, and
    ``counts[i]`` rows: the next ``counts[i]`` entries of ``index`` (uint32, each < R), in order,
    so its input is ``rows[index[o_i:o_i + counts[i]]]`` with ``o_i = counts[0] + ... +
    counts[i - 1]``. ``bundle_id`` names the bundle (an error reply about the whole of it)."""

    kind: ClassVar[str] = "xb"
    what: ClassVar[str] = "bundle request"

    model: str
    layer: int
    bundle_id: str
    rows: np.ndarray
    ids: tuple[str, ...]
    experts: tuple[int, ...]
    counts: tuple[int, ...]
    index: np.ndarray
    box: bytes = b""  # as a request's

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        _token(_check_model, r, "model", self.model)
        _check_box(r, self.box)
        s("layer", _index(r, "layer", self.layer))
        if not is_id(self.bundle_id):
            check_id(r, "bundle_id", self.bundle_id)
        _rows(r, self.rows, REQUEST_DTYPES)
        ids = _id_list(r, "ids", self.ids, MAX_BUNDLE_CALLS)
        if not ids:
            raise fail(r, "ids", "is empty (a bundle has at least one call)")
        _unique(r, "ids", ids)
        s("ids", ids)
        s("experts", _int_list(r, "experts", self.experts, len(ids), 0, MAX_INDEX))
        s("counts", _int_list(r, "counts", self.counts, len(ids), 1, MAX_DIM))
        s("offsets", _offsets(self.counts))  # call i is index[offsets[i]:offsets[i + 1]]
        _index_array(r, self.index, self.offsets[-1], self.rows.shape[0])

    def call_index(self, i: int) -> np.ndarray:
        """Call ``i``'s row indices into :attr:`rows`."""
        o = self.offsets
        return self.index[o[i]:o[i + 1]]

    def body(self) -> dict[str, Any]:
        body = {"model": self.model, "layer": self.layer, "bundle_id": self.bundle_id,
                **_array_fields(self.rows), "ids": list(self.ids), "experts": list(self.experts),
                "counts": list(self.counts), "index": _index_bytes(self.index)}
        if self.box:
            body["box"] = self.box
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> BundleRequest:
        r = cls.what
        rows = _decode_rows(body, r, REQUEST_DTYPES, limits)
        ids = _id_list(r, "ids", need(body, r, "ids"), MAX_BUNDLE_CALLS)
        counts = _int_list(r, "counts", need(body, r, "counts"), len(ids), 1, MAX_DIM)
        total = sum(counts)
        if limits.max_rows is not None and total > limits.max_rows:
            raise PayloadTooLargeError(f"{r}: field 'counts' adds up to {total} rows, over the limit of "
                                       f"{limits.max_rows}", field="counts")
        data = need(body, r, "index")
        if not isinstance(data, bytes) or len(data) != total * INDEX_DTYPE.itemsize:
            got = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
            raise fail(r, "index", f"must be {total} uint32 ({total * INDEX_DTYPE.itemsize} bytes of msgpack "
                                   f"bin), got {got}")
        index = np.frombuffer(data, INDEX_DTYPE)
        if not _LITTLE_ENDIAN:
            index = index.astype(INDEX_DTYPE.newbyteorder("="))
        return cls(need(body, r, "model"), need(body, r, "layer"), need(body, r, "bundle_id"), rows, ids,
                   need(body, r, "experts"), counts, index, body.get("box", b""))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Layer": str(self.layer), "Kvasir-Calls": str(len(self.ids)),
                "Kvasir-Rows": str(self.rows.shape[0]), "Kvasir-Dtype": dtype_name(self.rows.dtype),
                "Kvasir-Request": self.bundle_id}


def _index_bytes(index: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(index, dtype=INDEX_DTYPE)).cast("B")


@record
@dataclass(frozen=True, eq=False)
class BundleReply(Record):
    """A worker's one answer to a :class:`BundleRequest`: per call either its output or an error.

    ``ids[i]`` answered with ``counts[i]`` rows: the next ``counts[i]`` rows of ``rows`` (float32,
    (sum(counts), n_embd); no rows at all when no call was answered); ``errors``: ``(request_id,
    code, message)`` of each call it did not compute (``not_held``, ...). ``kernel`` as in
    :class:`DispatchReply`."""

    kind: ClassVar[str] = "rb"
    what: ClassVar[str] = "bundle reply"

    bundle_id: str
    node: str
    ids: tuple[str, ...]
    counts: tuple[int, ...]
    rows: np.ndarray
    errors: tuple[tuple[str, str, str], ...] = ()
    kernel: str = ""

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if not is_id(self.bundle_id):
            check_id(r, "bundle_id", self.bundle_id)
        _token(check_node, r, "node", self.node)
        ids = _id_list(r, "ids", self.ids, MAX_BUNDLE_CALLS)
        s("ids", ids)
        s("counts", _int_list(r, "counts", self.counts, len(ids), 1, MAX_DIM))
        s("offsets", _offsets(self.counts))  # call i is rows[offsets[i]:offsets[i + 1]]
        _rows(r, self.rows, REPLY_DTYPES, min_rows=0)
        if self.rows.shape[0] != self.offsets[-1]:
            raise fail(r, "shape", f"has {self.rows.shape[0]} rows, but the counts add up to {self.offsets[-1]}")
        s("errors", _errors(r, self.errors, MAX_BUNDLE_CALLS - len(ids)))
        _unique(r, "ids", ids + tuple(e[0] for e in self.errors))
        if self.kernel:
            _token(check_label, r, "kernel", self.kernel)

    def results(self):
        """``(request_id, rows)`` of every answered call, in order (views, no copies)."""
        o, rows = self.offsets, self.rows
        return [(rid, rows[o[i]:o[i + 1]]) for i, rid in enumerate(self.ids)]

    def body(self) -> dict[str, Any]:
        body = {"bundle_id": self.bundle_id, "node": self.node, "ids": list(self.ids),
                "counts": list(self.counts), **_array_fields(self.rows),
                "errors": [list(e) for e in self.errors]}
        if self.kernel:
            body["kernel"] = self.kernel
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> BundleReply:
        r = cls.what
        rows = _decode_rows(body, r, REPLY_DTYPES, limits, min_rows=0)
        return cls(need(body, r, "bundle_id"), need(body, r, "node"), need(body, r, "ids"),
                   need(body, r, "counts"), rows, body.get("errors", ()), body.get("kernel", ""))

    def headers(self) -> dict[str, str]:
        headers = {"Kvasir-Node": self.node, "Kvasir-Request": self.bundle_id,
                   "Kvasir-Calls": str(len(self.ids)), "Kvasir-Errors": str(len(self.errors))}
        if self.kernel:
            headers["Kvasir-Kernel"] = self.kernel
        return headers


def _errors(record: str, value: Any, limit: int) -> tuple[tuple[str, str, str], ...]:
    """``[[request_id, code, message], ...]`` as an :class:`ErrorReply` would carry them."""
    if not isinstance(value, (list, tuple)):
        raise fail(record, "errors", f"must be a list, got {type(value).__name__}")
    if len(value) > limit:
        raise fail(record, "errors", f"has {len(value)} items (max {limit} with the answered calls)")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise fail(record, f"errors[{i}]", f"must be [request_id, code, message], got {item!r:.80}")
        try:
            e = ErrorReply(request_id=item[0], node="x", code=item[1], message=item[2])
        except CodecError as exc:
            raise CodecError(f"{record}: field 'errors[{i}]': {exc}", field=f"errors[{i}]") from None
        if not e.request_id:
            raise fail(record, f"errors[{i}]", "has no request id")
        out.append((e.request_id, e.code, e.message))
    return tuple(out)


# -- the hot path: one request and one reply per remote expert call ----------------------------

class RequestEncoder:
    """``DispatchRequest(model, layer, expert, rows, request_id).encode()`` without building the
    record per request: the model is checked once here, the rest per call with the record's own
    checks (cheap ones first). The bytes are the record's, key for key (tested)."""

    def __init__(self, model: str, box: bytes = b""):
        self.model = check_model(DispatchRequest.what, model)
        _check_box(DispatchRequest.what, box)
        self.box = box  # every request carries it (kvasir_bus.attribution)

    def encode(self, layer: int, expert: int, request_id: str, rows: np.ndarray) -> bytes:
        r = DispatchRequest.what
        if type(layer) is not int or not 0 <= layer <= MAX_INDEX:
            layer = check_index(r, "layer", layer)
        if type(expert) is not int or not 0 <= expert <= MAX_INDEX:
            expert = check_index(r, "expert", expert)
        if not is_id(request_id):
            check_id(r, "request_id", request_id)
        _rows(r, rows, REQUEST_DTYPES)
        body = {"v": VERSION, "t": DispatchRequest.kind, "model": self.model, "layer": layer,
                "expert": expert, "request_id": request_id, **_array_fields(rows)}
        if self.box:
            body["box"] = self.box
        return msgpack.packb(body, use_bin_type=True)


class ReplyEncoder:
    """``DispatchReply(request_id, node, rows, kernel).encode()`` for one node and kernel, checked
    once here; the same bytes as the record's (tested)."""

    def __init__(self, node: str, kernel: str = ""):
        check_node(DispatchReply.what, "node", node)
        if kernel:
            check_label(DispatchReply.what, "kernel", kernel)
        self.node, self.kernel = node, kernel

    def encode(self, request_id: str, rows: np.ndarray) -> bytes:
        r = DispatchReply.what
        if not is_id(request_id):
            check_id(r, "request_id", request_id)
        _rows(r, rows, REPLY_DTYPES)
        body = {"v": VERSION, "t": DispatchReply.kind, "request_id": request_id, "node": self.node,
                **_array_fields(rows)}
        if self.kernel:
            body["kernel"] = self.kernel
        return msgpack.packb(body, use_bin_type=True)


_packb = functools.partial(msgpack.packb, use_bin_type=True)
_IDS_KEY, _EXPERTS_KEY = _packb("ids"), _packb("experts")


class BundleEncoder:
    """``BundleRequest(model, layer, bundle_id, rows, ids, experts, counts, index).encode()``
    without building the record: the model is checked once here, the rest per bundle with the
    record's own checks (``index`` a list of ints). The bytes are the record's (tested)."""

    def __init__(self, model: str, box: bytes = b""):
        self.model = check_model(BundleRequest.what, model)
        _check_box(BundleRequest.what, box)
        self.box = box  # every bundle carries it (kvasir_bus.attribution)
        self._parts: dict = {}  # encode_one_row's packed pieces: (layer, dtype, width) -> head, n -> tail

    def encode(self, layer: int, bundle_id: str, rows: np.ndarray, ids, experts, counts, index: list[int]) -> bytes:
        r = BundleRequest.what
        if type(layer) is not int or not 0 <= layer <= MAX_INDEX:
            layer = check_index(r, "layer", layer)
        if not is_id(bundle_id):
            check_id(r, "bundle_id", bundle_id)
        _rows(r, rows, REQUEST_DTYPES)
        ids = _id_list(r, "ids", ids, MAX_BUNDLE_CALLS)
        if not ids:
            raise fail(r, "ids", "is empty (a bundle has at least one call)")
        _unique(r, "ids", ids)
        experts = _int_list(r, "experts", experts, len(ids), 0, MAX_INDEX)
        counts = _int_list(r, "counts", counts, len(ids), 1, MAX_DIM)
        n = len(index)
        if n != sum(counts) or min(index) < 0 or max(index) >= rows.shape[0]:
            raise fail(r, "index", f"must be {sum(counts)} row indices below {rows.shape[0]}, got {n} "
                                   f"in {min(index, default=0)}..{max(index, default=0)}")
        body = {"v": VERSION, "t": BundleRequest.kind, "model": self.model, "layer": layer,
                "bundle_id": bundle_id, **_array_fields(rows), "ids": list(ids),
                "experts": list(experts), "counts": list(counts), "index": struct.pack(f"<{n}I", *index)}
        if self.box:
            body["box"] = self.box
        return msgpack.packb(body, use_bin_type=True)

    def encode_one_row(self, layer: int, bundle_id: str, row: np.ndarray, ids: list[str],
                       experts: list[int]) -> bytes:
        """``encode(layer, bundle_id, row, ids, experts, [1] * n, [0] * n)``: a decode step's
        bundle, every call on the one row ``row`` (1, n_embd). The same bytes and the same checks;
        what depends only on the layer, the row's dtype and width and the number of calls is
        packed once (a msgpack map is the concatenation of its keys' and values' encodings).
        Anything off the plain path (odd ids or experts) goes to :meth:`encode`, which refuses it
        with its named error."""
        n = len(ids)
        shape = row.shape if type(row) is np.ndarray else None
        if not (type(layer) is int and 0 <= layer <= MAX_INDEX and shape is not None and shape[0] == 1
                and shape[1] >= 1 and 0 < n <= MAX_BUNDLE_CALLS and len(experts) == n and is_id(bundle_id)
                and _plain_ids(ids) and len(set(ids)) == n and set(map(type, experts)) == {int}
                and 0 <= min(experts) and max(experts) <= MAX_INDEX):
            return self.encode(layer, bundle_id, row, ids, experts, [1] * n, [0] * n)
        parts = self._parts
        head = parts.get((layer, row.dtype, shape[1]))
        if head is None:
            _rows(BundleRequest.what, row, REQUEST_DTYPES)  # refuses any other dtype, once
            head = parts[(layer, row.dtype, shape[1])] = self._head(layer, row)
        tail = parts.get(n)
        if tail is None:
            tail = parts[n] = _packb("counts") + _packb([1] * n) + _packb("index") + _packb(bytes(4 * n)) \
                + (_packb("box") + _packb(self.box) if self.box else b"")
        if len(parts) > 4096:  # layers x widths x call counts: bounded all the same
            parts.clear()
        data = row.tobytes() if row.flags.c_contiguous and row.dtype.byteorder != ">" else \
            np.ascontiguousarray(row, dtype=DTYPES[dtype_name(row.dtype)]).tobytes()
        pack = msgpack.Packer(use_bin_type=True).pack  # one per call: two engine threads may encode at once
        return b"".join((head[0], pack(bundle_id), head[1], data, _IDS_KEY, pack(ids), _EXPERTS_KEY, pack(experts),
                         tail))

    def _head(self, layer: int, row: np.ndarray) -> tuple[bytes, bytes]:
        """The bundle request's map before the bundle id's value (its header, v, t, model, layer,
        the key ``bundle_id``), and after it up to the row's bytes (dtype, shape, the data's bin
        header), in the record's key order."""
        fields = _array_fields(np.ascontiguousarray(row, dtype=DTYPES[dtype_name(row.dtype)]))
        pk = msgpack.Packer(use_bin_type=True)
        before = pk.pack_map_header(13 if self.box else 12) + b"".join(
            map(pk.pack, ("v", VERSION, "t", BundleRequest.kind, "model", self.model, "layer", layer, "bundle_id")))
        data = pk.pack(fields["data"])
        after = b"".join(map(pk.pack, ("dtype", fields["dtype"], "shape", fields["shape"], "data"))) \
            + data[:len(data) - row.nbytes]
        return before, after


# -- the worker's hot path: decode a request or bundle, encode the bundle's reply ---------------
# The decoders check everything the records check, with the expected model, width and limits
# fixed once; a payload they do not accept at once (anything odd, wrong or of another model)
# is handed to the full decoder, which accepts it or raises its named error. So they accept
# exactly what the full decoder accepts, and give the same records (tested).

def _built(cls: type[Record], fields: dict[str, Any]) -> Record:
    """A record from fields its decoder has already checked as ``__post_init__`` would."""
    rec = object.__new__(cls)
    rec.__dict__.update(fields)
    return rec


def _fast_rows(body: dict, n_embd: int, max_rows: int) -> np.ndarray | None:
    """:func:`_decode_rows` (request dtypes, at least one row) when every check passes, else None."""
    dtype = body.get("dtype")
    wire = DTYPES.get(dtype) if type(dtype) is str else None
    shape = body.get("shape")
    data = body.get("data")
    if wire is None or type(shape) is not list or len(shape) != 2 or type(data) is not bytes:
        return None
    n, width = shape
    if type(n) is not int or not 1 <= n <= max_rows or width != n_embd or type(width) is not int \
            or len(data) != n * width * wire.itemsize:
        return None
    rows = np.ndarray((n, width), wire, data)  # a read-only view on the payload, no copy
    return rows if _LITTLE_ENDIAN else None


class _Decoder:
    def __init__(self, model: str, n_embd: int, max_rows: int | None, max_bytes: int, cls: type[Record]):
        self.model = check_model("decoder", model)
        if type(n_embd) is not int or not 1 <= n_embd <= MAX_DIM:
            raise ValueError(f"n_embd must be 1..{MAX_DIM}, got {n_embd!r}")
        self.n_embd, self.max_rows, self.max_bytes = n_embd, max_rows, max_bytes
        self._rows_limit = MAX_DIM if max_rows is None else min(max_rows, MAX_DIM)
        self._versions, self._kind = frozenset(cls.versions), cls.kind

    def _body(self, data: Any) -> dict | None:
        """The msgpack map of a payload of this kind, version and model, or None."""
        if type(data) is not bytes or len(data) > self.max_bytes:
            return None
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception:
            return None
        if type(body) is not dict:
            return None
        v = body.get("v")
        if type(v) is not int or v not in self._versions or body.get("t") != self._kind \
                or body.get("model") != self.model:
            return None
        return body


class RequestDecoder(_Decoder):
    """``decode_request(data, max_rows=, max_bytes=, n_embd=)`` for one model: the same record, or
    the same error; a request for another model decodes as :func:`decode_request` does (the
    caller names the mismatch)."""

    def __init__(self, model: str, n_embd: int, max_rows: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(model, n_embd, max_rows, max_bytes, DispatchRequest)

    def decode(self, data: bytes) -> DispatchRequest:
        body = self._body(data)
        if body is not None:
            rows = _fast_rows(body, self.n_embd, self._rows_limit)
            layer, expert, rid = body.get("layer"), body.get("expert"), body.get("request_id")
            box = body.get("box", b"")
            if rows is not None and type(layer) is int and 0 <= layer <= MAX_INDEX and type(expert) is int \
                    and 0 <= expert <= MAX_INDEX and type(rid) is str and is_id(rid) \
                    and type(box) is bytes and len(box) in (0, BOX_BYTES):
                return _built(DispatchRequest, {"model": self.model, "layer": layer, "expert": expert,
                                                "rows": rows, "request_id": rid, "box": box})
        return decode_request(data, max_rows=self.max_rows, max_bytes=self.max_bytes, n_embd=self.n_embd)


class BundleDecoder(_Decoder):
    """``decode_bundle(data, max_rows=, max_bytes=, n_embd=)`` for one model: the same record, or
    the same error."""

    def __init__(self, model: str, n_embd: int, max_rows: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(model, n_embd, max_rows, max_bytes, BundleRequest)

    def decode(self, data: bytes) -> BundleRequest:
        body = self._body(data)
        bundle = None if body is None else self._fast(body)
        if bundle is not None:
            return bundle
        return decode_bundle(data, max_rows=self.max_rows, max_bytes=self.max_bytes, n_embd=self.n_embd)

    def _fast(self, body: dict) -> BundleRequest | None:
        rows = _fast_rows(body, self.n_embd, self._rows_limit)
        layer, bid = body.get("layer"), body.get("bundle_id")
        ids, experts, counts, data = body.get("ids"), body.get("experts"), body.get("counts"), body.get("index")
        box = body.get("box", b"")
        if rows is None or type(layer) is not int or not 0 <= layer <= MAX_INDEX or type(bid) is not str \
                or not is_id(bid) or type(ids) is not list or type(experts) is not list or type(counts) is not list \
                or type(box) is not bytes or len(box) not in (0, BOX_BYTES):
            return None
        n = len(ids)
        if not 1 <= n <= MAX_BUNDLE_CALLS or len(experts) != n or len(counts) != n or type(data) is not bytes:
            return None
        if not _plain_ids(ids) or len(set(ids)) != n:
            return None
        if set(map(type, experts)) != {int} or min(experts) < 0 or max(experts) > MAX_INDEX \
                or set(map(type, counts)) != {int} or min(counts) < 1 or max(counts) > MAX_DIM:
            return None
        offsets = _offsets(counts)
        total = offsets[-1]
        if total > self._rows_limit or len(data) != total * INDEX_DTYPE.itemsize:
            return None
        index = np.frombuffer(data, INDEX_DTYPE)
        top = max(index.tolist()) if total <= 64 else int(index.max())
        if top >= len(rows):
            return None
        return _built(BundleRequest, {"model": self.model, "layer": layer, "bundle_id": bid, "rows": rows,
                                      "ids": tuple(ids), "experts": tuple(experts), "counts": tuple(counts),
                                      "index": index, "offsets": offsets, "box": box})


class BundleReplyEncoder:
    """``BundleReply(bundle_id, node, ids, counts, rows, errors, kernel).encode()`` for one node
    and kernel, checked once here; the rest with the record's own checks (cheap ones first).
    The same bytes as the record's (tested)."""

    def __init__(self, node: str, kernel: str = ""):
        check_node(BundleReply.what, "node", node)
        if kernel:
            check_label(BundleReply.what, "kernel", kernel)
        self.node, self.kernel = node, kernel

    def encode(self, bundle_id: str, ids: tuple[str, ...], counts: tuple[int, ...], rows: np.ndarray,
               errors: tuple[tuple[str, str, str], ...] = ()) -> bytes:
        r = BundleReply.what
        if not is_id(bundle_id):
            check_id(r, "bundle_id", bundle_id)
        ids = _id_list(r, "ids", ids, MAX_BUNDLE_CALLS)
        counts = _int_list(r, "counts", counts, len(ids), 1, MAX_DIM)
        _rows(r, rows, REPLY_DTYPES, min_rows=0)
        total = sum(counts)
        if rows.shape[0] != total:
            raise fail(r, "shape", f"has {rows.shape[0]} rows, but the counts add up to {total}")
        if errors:
            errors = _errors(r, errors, MAX_BUNDLE_CALLS - len(ids))
            _unique(r, "ids", ids + tuple(e[0] for e in errors))
        elif len(set(ids)) != len(ids):
            raise fail(r, "ids", "names a request id twice")
        body = {"v": VERSION, "t": BundleReply.kind, "bundle_id": bundle_id, "node": self.node, "ids": list(ids),
                "counts": list(counts), **_array_fields(rows), "errors": [list(e) for e in errors]}
        if self.kernel:
            body["kernel"] = self.kernel
        return msgpack.packb(body, use_bin_type=True)

    def encode_answers(self, bundle: BundleRequest, rows: np.ndarray) -> bytes:
        """The reply that answers every call of ``bundle`` with ``rows`` (float32, the calls' rows
        in its order): ``encode(bundle.bundle_id, bundle.ids, bundle.counts, rows)``, whose id,
        ids and counts the request's record has checked already; the rows are checked here."""
        if type(bundle) is not BundleRequest:
            raise CodecError(f"{BundleReply.what}: answers a BundleRequest, got {type(bundle).__name__}")
        if not (rows.__class__ is np.ndarray and rows.dtype == _F32 and rows.ndim == 2
                and rows.shape[0] == bundle.offsets[-1] and rows.shape[1] >= 1):
            return self.encode(bundle.bundle_id, bundle.ids, bundle.counts, rows)  # its checks name the fault
        body = {"v": VERSION, "t": BundleReply.kind, "bundle_id": bundle.bundle_id, "node": self.node,
                "ids": list(bundle.ids), "counts": list(bundle.counts), **_array_fields(rows), "errors": []}
        if self.kernel:
            body["kernel"] = self.kernel
        return msgpack.packb(body, use_bin_type=True)


Reply = Union[DispatchReply, ErrorReply]
Message = Union[DispatchRequest, DispatchReply, ErrorReply, Heartbeat, BundleRequest, BundleReply]


# -- decoding -------------------------------------------------------------------------------

def decode_request(data: bytes, *, max_rows: int | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES,
                   n_embd: int | None = None) -> DispatchRequest:
    """Bytes -> :class:`DispatchRequest`; ``n_embd`` (if given) must match the rows' width."""
    return decode(data, ("x",), DispatchRequest.what, max_bytes=max_bytes, limits=_limits(max_rows, n_embd))


def decode_reply(data: bytes, *, max_rows: int | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, n_embd: int | None = None) -> Reply:
    """Bytes -> :class:`DispatchReply` or :class:`ErrorReply`."""
    return decode(data, ("r", "e"), "reply", max_bytes=max_bytes, limits=_limits(max_rows, n_embd))


def decode_heartbeat(data: bytes, *, max_bytes: int = HEARTBEAT_MAX_BYTES) -> Heartbeat:
    """Bytes -> :class:`Heartbeat`."""
    return decode(data, ("hb",), Heartbeat.what, max_bytes=max_bytes)


def decode_bundle(data: bytes, *, max_rows: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                  n_embd: int | None = None) -> BundleRequest:
    """Bytes -> :class:`BundleRequest`; ``max_rows`` bounds both the union's rows and the calls'
    rows together, ``n_embd`` (if given) must match the rows' width."""
    return decode(data, ("xb",), BundleRequest.what, max_bytes=max_bytes, limits=_limits(max_rows, n_embd))


def decode_bundle_reply(data: bytes, *, max_rows: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                        n_embd: int | None = None) -> BundleReply | ErrorReply:
    """Bytes -> :class:`BundleReply`, or the :class:`ErrorReply` that refused the whole bundle."""
    if type(data) is bytes and len(data) <= max_bytes:
        reply = _bundle_reply_fast(data, max_rows, n_embd)
        if reply is not None:
            return reply
    return decode(data, ("rb", "e"), "bundle reply", max_bytes=max_bytes, limits=_limits(max_rows, n_embd))


_FAST_REPLY_KEYS = frozenset(("v", "t", "bundle_id", "node", "ids", "counts", "dtype", "shape", "data", "errors",
                              "kernel", "key", "proof"))  # key, proof: a self-certifying node's (attribution)


def _bundle_reply_fast(data: bytes, max_rows: int | None, n_embd: int | None) -> BundleReply | None:
    """The common bundle reply (every call answered, float32 rows, known node and kernel) checked
    in a few C calls: each test here is one the record's full decoding makes, or a stricter one;
    None for anything else (unreadable, an error, an odd field), which :func:`decode` then
    refuses with its named error or reads the slow way. A reply is decoded on the backbone's bus
    thread once per worker and layer step."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if type(body) is not dict or type(body.get("v")) is not int or body["v"] not in BundleReply.versions \
            or body.get("t") != "rb" or body.get("errors", []) != [] or not _FAST_REPLY_KEYS.issuperset(body):
        return None
    bundle_id, node, ids, counts, kernel = (body.get("bundle_id"), body.get("node"), body.get("ids"),
                                            body.get("counts"), body.get("kernel", ""))
    shape, rows_data = body.get("shape"), body.get("data")
    if type(bundle_id) is not str or type(node) is not str or type(kernel) is not str \
            or type(ids) is not list or type(counts) is not list or type(shape) is not list \
            or type(rows_data) is not bytes or body.get("dtype") != "float32":
        return None
    n = len(ids)
    if not 0 < n <= MAX_BUNDLE_CALLS or len(counts) != n or len(shape) != 2 or not is_id(bundle_id) \
            or not _valid(check_node, node) or (kernel and not _valid(check_label, kernel)):
        return None
    if not _plain_ids(ids):
        return None
    if set(map(type, counts)) != {int} or min(counts) < 1 or max(counts) > MAX_DIM or len(set(ids)) != n:
        return None
    offsets = _offsets(counts)
    total, (rows_n, width) = offsets[-1], shape
    if rows_n != total or type(rows_n) is not int or type(width) is not int or not 1 <= width <= MAX_DIM \
            or total > MAX_DIM or (max_rows is not None and total > max_rows) \
            or (n_embd is not None and width != n_embd) or len(rows_data) != 4 * total * width:
        return None
    rows = np.ndarray((total, width), DTYPES["float32"], rows_data)  # a read-only view on the payload
    if not _LITTLE_ENDIAN:
        rows = rows.astype(DTYPES["float32"].newbyteorder("="))
    reply = object.__new__(BundleReply)  # every check of __post_init__ is made above
    for name, value in (("bundle_id", bundle_id), ("node", node), ("ids", tuple(ids)), ("counts", tuple(counts)),
                        ("offsets", offsets), ("rows", rows), ("errors", ()), ("kernel", kernel)):
        object.__setattr__(reply, name, value)
    return reply
