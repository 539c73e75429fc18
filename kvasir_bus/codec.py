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
    check_float, check_holdings, check_id, check_index, check_int, check_label, check_model,
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


def _rows(record: str, value: Any, allowed: tuple[str, ...]) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise fail(record, "rows", f"must be a numpy array, got {type(value).__name__}")
    if dtype_name(value.dtype) not in allowed:
        raise fail(record, "rows", f"has dtype {value.dtype}; allowed: {', '.join(allowed)}")
    if value.ndim != 2 or value.shape[0] < 1 or value.shape[1] < 1:
        raise fail(record, "rows", f"must be 2-D (rows, n_embd) with both >= 1, got shape "
                                   f"{value.shape}")
    return value


def all_finite(arr: np.ndarray) -> bool:
    """True if ``arr`` holds no NaN or infinity (the codec itself lets them through)."""
    return bool(np.isfinite(arr).all())


def _array_fields(rows: np.ndarray) -> dict[str, Any]:
    name = dtype_name(rows.dtype)
    wire = np.ascontiguousarray(rows, dtype=DTYPES[name])
    # A memoryview packs as msgpack bin without another copy of the rows.
    return {"dtype": name, "shape": list(rows.shape),
            "data": memoryview(wire).cast("B")}


def _decode_rows(body: dict, record: str, allowed: tuple[str, ...], limits: Limits) -> np.ndarray:
    dtype = need(body, record, "dtype")
    if dtype not in allowed:
        raise fail(record, "dtype", f"is {dtype!r}; allowed: {', '.join(allowed)}")
    shape = need(body, record, "shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise fail(record, "shape", f"must be [rows, n_embd], got {shape!r}")
    n, width = shape
    if type(n) is not int or not 1 <= n <= MAX_DIM:
        n = check_int(record, "shape", n, 1, MAX_DIM)
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

    def __post_init__(self) -> None:
        r = self.what
        _token(_check_model, r, "model", self.model)
        object.__setattr__(self, "layer", _index(r, "layer", self.layer))
        object.__setattr__(self, "expert", _index(r, "expert", self.expert))
        _rows(r, self.rows, REQUEST_DTYPES)
        if not is_id(self.request_id):
            check_id(r, "request_id", self.request_id)

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "layer": self.layer, "expert": self.expert,
                "request_id": self.request_id, **_array_fields(self.rows)}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> DispatchRequest:
        r = cls.what
        rows = _decode_rows(body, r, REQUEST_DTYPES, limits)
        try:
            return cls(body["model"], body["layer"], body["expert"], rows, body["request_id"])
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
    time of sending (seconds). Lists and numpy numbers are normalised on construction.
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

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "node": self.node,
                "holdings": holding_list(self.holdings), "budget_bytes": self.budget_bytes,
                "load": self.load, "served": self.served, "version": self.version,
                "kernel": self.kernel, "sent_at": self.sent_at}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Heartbeat:
        return cls(**{f.name: need(body, cls.what, f.name) for f in fields(cls)})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node}

    @classmethod
    def decode(cls, data: bytes, *, max_bytes: int = HEARTBEAT_MAX_BYTES) -> Heartbeat:
        return decode_heartbeat(data, max_bytes=max_bytes)


# -- the hot path: one request and one reply per remote expert call ----------------------------

class RequestEncoder:
    """``DispatchRequest(model, layer, expert, rows, request_id).encode()`` without building the
    record per request: the model is checked once here, the rest per call with the record's own
    checks (cheap ones first). The bytes are the record's, key for key (tested)."""

    def __init__(self, model: str):
        self.model = check_model(DispatchRequest.what, model)

    def encode(self, layer: int, expert: int, request_id: str, rows: np.ndarray) -> bytes:
        r = DispatchRequest.what
        if type(layer) is not int or not 0 <= layer <= MAX_INDEX:
            layer = check_index(r, "layer", layer)
        if type(expert) is not int or not 0 <= expert <= MAX_INDEX:
            expert = check_index(r, "expert", expert)
        if not is_id(request_id):
            check_id(r, "request_id", request_id)
        _rows(r, rows, REQUEST_DTYPES)
        return msgpack.packb({"v": VERSION, "t": DispatchRequest.kind, "model": self.model, "layer": layer,
                              "expert": expert, "request_id": request_id, **_array_fields(rows)},
                             use_bin_type=True)


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


Reply = Union[DispatchReply, ErrorReply]
Message = Union[DispatchRequest, DispatchReply, ErrorReply, Heartbeat]


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
