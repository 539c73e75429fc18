"""Wire codecs: msgpack payloads decoded into typed, frozen, validated records.

Every payload is a msgpack map with a version ``v`` and a kind ``t``; a receiver rejects a
version it does not speak with :class:`UnsupportedVersionError` rather than guessing. Keys a
receiver does not know are ignored, so a later version 1 sender may add fields. Arrays travel as
raw little-endian bytes (msgpack ``bin``) with ``dtype`` and ``shape`` beside them, and the byte
count must equal ``prod(shape) * itemsize`` exactly: a frame cut short or padded (the 64 KiB
frame-length bug of the relay, DESIGN section 7) is refused, never read as shifted numbers.

Records validate themselves on construction, so a bad record can neither be sent nor received;
every failure is a :class:`CodecError` whose message names the record and the field.

Messages (``t``):

* ``x`` :class:`DispatchRequest`  backbone -> worker on ``kvasir.<model>.x.<layer>.<expert>``
* ``r`` :class:`DispatchReply`    worker -> backbone, the expert's output rows (float32)
* ``e`` :class:`ErrorReply`       worker -> backbone, why it could not answer
* ``hb`` :class:`Heartbeat`       worker -> market on ``kvasir.<model>.coverage.<node>``

Decoded arrays are read-only views over the payload bytes (no copy); copy before writing.
NaN and inf pass the codec (they are data, and the backbone's audit decides what to do with
them); :func:`all_finite` is the check.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import msgpack
import numpy as np

from kvasir_bus import subjects
from kvasir_bus.errors import KvasirError

VERSION = 1

#: Largest payload accepted by default: ``max_payload`` in deploy/nats.conf.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

#: Wire dtypes (little-endian) by name; decoded arrays come back in native byte order.
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
REQUEST_DTYPES = ("float32", "float16")
REPLY_DTYPES = ("float32",)

MAX_DIM = 1 << 31
MAX_HOLDINGS = 65_536
MAX_ERROR_MESSAGE = 1024

# Error codes a worker puts in an ErrorReply.
ERR_BAD_REQUEST = "bad_request"   # the request did not decode or does not fit this expert
ERR_NOT_HELD = "not_held"         # this node does not hold (layer, expert)
ERR_WRONG_MODEL = "wrong_model"   # another model fingerprint
ERR_OVERLOADED = "overloaded"     # shedding load
ERR_INTERNAL = "internal"         # the kernel failed

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_LABEL_RE = re.compile(r"[\x21-\x7e]{1,64}")  # printable ASCII, no spaces: version, kernel


class CodecError(KvasirError):
    """A payload or record is malformed; ``field`` names the offending field when known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedVersionError(CodecError):
    """The payload's version ``v`` is not one this build speaks."""


class PayloadTooLargeError(CodecError):
    """The payload, or the number of rows in it, is beyond the receiver's limit."""


# -- field checks (shared by record construction and decoding) ------------------------------

def _fail(record: str, field: str, problem: str) -> CodecError:
    return CodecError(f"{record}: field '{field}' {problem}", field=field)


def _int(record: str, field: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = value.__index__()
    except (AttributeError, TypeError):
        raise _fail(record, field, f"must be an integer, got {type(value).__name__} "
                                   f"{value!r}") from None
    if number < lo or (hi is not None and number > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise _fail(record, field, f"is out of range: {number} (expected {bound})")
    return number


def _float(record: str, field: str, value: Any, lo: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _fail(record, field, f"must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < lo:
        raise _fail(record, field, f"must be a finite number >= {lo}, got {number!r}")
    return number


def _str(record: str, field: str, value: Any, pattern: re.Pattern[str] | None = None,
         max_len: int = 64, what: str = "") -> str:
    if not isinstance(value, str):
        raise _fail(record, field, f"must be a string, got {type(value).__name__} {value!r}")
    if len(value) > max_len:
        raise _fail(record, field, f"is too long: {len(value)} characters (max {max_len})")
    if pattern is not None and not pattern.fullmatch(value):
        raise _fail(record, field, f"is not valid: {value!r} (expected {what})")
    return value


def _token(record: str, field: str, value: Any, check) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise _fail(record, field, f"is not valid: {exc}") from None


def _index(record: str, field: str, value: Any) -> int:
    return _int(record, field, value, 0, subjects.MAX_INDEX)


def _request_id(record: str, value: Any, allow_empty: bool = False) -> str:
    if allow_empty and value == "":
        return value
    return _str(record, "request_id", value, _REQUEST_ID_RE,
                what="1-64 characters from [A-Za-z0-9_.:-]")


def _rows(record: str, value: Any, allowed: tuple[str, ...]) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise _fail(record, "rows", f"must be a numpy array, got {type(value).__name__}")
    if value.dtype.name not in allowed:
        raise _fail(record, "rows", f"has dtype {value.dtype}; allowed: {', '.join(allowed)}")
    if value.ndim != 2 or value.shape[0] < 1 or value.shape[1] < 1:
        raise _fail(record, "rows", f"must be 2-D (rows, n_embd) with both >= 1, got shape "
                                    f"{value.shape}")
    return value


def all_finite(arr: np.ndarray) -> bool:
    """True if ``arr`` holds no NaN or infinity (the codec itself lets them through)."""
    return bool(np.isfinite(arr).all())


# -- records --------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class DispatchRequest:
    """Rows of ``cur`` for one expert: ``rows`` is (n, n_embd) float32 or float16."""

    model: str
    layer: int
    expert: int
    rows: np.ndarray
    request_id: str

    def __post_init__(self) -> None:
        r = "dispatch request"
        object.__setattr__(self, "model", _token(r, "model", self.model, subjects.check_model))
        object.__setattr__(self, "layer", _index(r, "layer", self.layer))
        object.__setattr__(self, "expert", _index(r, "expert", self.expert))
        _rows(r, self.rows, REQUEST_DTYPES)
        _request_id(r, self.request_id)

    def encode(self) -> bytes:
        return encode(self)

    @classmethod
    def decode(cls, data: bytes, *, max_rows: int | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES, n_embd: int | None = None) -> DispatchRequest:
        return decode_request(data, max_rows=max_rows, max_bytes=max_bytes, n_embd=n_embd)


@dataclass(frozen=True, eq=False)
class DispatchReply:
    """The expert's output for a request: ``rows`` is (n, n_embd) float32."""

    request_id: str
    node: str
    rows: np.ndarray

    def __post_init__(self) -> None:
        r = "dispatch reply"
        _request_id(r, self.request_id)
        _token(r, "node", self.node, subjects.check_node)
        _rows(r, self.rows, REPLY_DTYPES)

    def encode(self) -> bytes:
        return encode(self)


@dataclass(frozen=True)
class ErrorReply:
    """A worker's refusal: ``code`` is one of the ``ERR_*`` constants (or another short
    lower-case token), ``message`` at most :data:`MAX_ERROR_MESSAGE` characters.
    ``request_id`` is empty when the request was too broken to read one from it."""

    request_id: str
    node: str
    code: str
    message: str

    def __post_init__(self) -> None:
        r = "error reply"
        _request_id(r, self.request_id, allow_empty=True)
        _token(r, "node", self.node, subjects.check_node)
        _str(r, "code", self.code, _CODE_RE, max_len=32, what="a lower-case token like "
             "'not_held'")
        _str(r, "message", self.message, max_len=MAX_ERROR_MESSAGE)

    def encode(self) -> bytes:
        return encode(self)


class Holding(NamedTuple):
    """Experts ``lo <= e < hi`` (half-open, like ``range``) of one layer."""

    layer: int
    lo: int
    hi: int

    @property
    def experts(self) -> range:
        return range(self.lo, self.hi)

    def covers(self, layer: int, expert: int) -> bool:
        return layer == self.layer and self.lo <= expert < self.hi


@dataclass(frozen=True)
class Heartbeat:
    """A worker's coverage announcement.

    ``holdings``: the experts it serves, as half-open :class:`Holding` ranges; ``budget_bytes``:
    memory it offers; ``load``: requests in flight; ``served``: requests answered since start;
    ``version``: software version; ``kernel``: which expert kernel it runs; ``sent_at``: Unix
    time of sending (seconds). Lists and numpy numbers are normalised on construction.
    """

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
        r = "heartbeat"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        s("node", _token(r, "node", self.node, subjects.check_node))
        s("holdings", _holdings(r, self.holdings))
        s("budget_bytes", _int(r, "budget_bytes", self.budget_bytes))
        s("load", _float(r, "load", self.load))
        s("served", _int(r, "served", self.served))
        s("version", _str(r, "version", self.version, _LABEL_RE, what="printable ASCII"))
        s("kernel", _str(r, "kernel", self.kernel, _LABEL_RE, what="printable ASCII"))
        s("sent_at", _float(r, "sent_at", self.sent_at))

    def encode(self) -> bytes:
        return encode(self)

    @classmethod
    def decode(cls, data: bytes, *, max_bytes: int = 1024 * 1024) -> Heartbeat:
        return decode_heartbeat(data, max_bytes=max_bytes)


def _holdings(record: str, value: Any) -> tuple[Holding, ...]:
    if not isinstance(value, (list, tuple)):
        raise _fail(record, "holdings", f"must be a list of (layer, lo, hi), got "
                                        f"{type(value).__name__}")
    if len(value) > MAX_HOLDINGS:
        raise _fail(record, "holdings", f"has {len(value)} ranges (max {MAX_HOLDINGS})")
    out = []
    for i, item in enumerate(value):
        field = f"holdings[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise _fail(record, field, f"must be (layer, lo, hi), got {item!r}")
        layer = _index(record, field + ".layer", item[0])
        lo = _index(record, field + ".lo", item[1])
        hi = _int(record, field + ".hi", item[2], 0, subjects.MAX_INDEX + 1)
        if hi <= lo:
            raise _fail(record, field, f"is an empty range: lo={lo}, hi={hi} (half-open, "
                                       "need lo < hi)")
        out.append(Holding(layer, lo, hi))
    return tuple(out)


Reply = Union[DispatchReply, ErrorReply]
Message = Union[DispatchRequest, DispatchReply, ErrorReply, Heartbeat]


# -- encoding -------------------------------------------------------------------------------

def _array_fields(rows: np.ndarray) -> dict[str, Any]:
    wire = np.ascontiguousarray(rows, dtype=DTYPES[rows.dtype.name])
    # A memoryview packs as msgpack bin without another copy of the rows.
    return {"dtype": rows.dtype.name, "shape": list(rows.shape),
            "data": memoryview(wire).cast("B")}


def encode(msg: Message) -> bytes:
    """Any record -> msgpack bytes (the record was validated when it was built)."""
    if isinstance(msg, DispatchRequest):
        body = {"t": "x", "model": msg.model, "layer": msg.layer, "expert": msg.expert,
                "request_id": msg.request_id, **_array_fields(msg.rows)}
    elif isinstance(msg, DispatchReply):
        body = {"t": "r", "request_id": msg.request_id, "node": msg.node,
                **_array_fields(msg.rows)}
    elif isinstance(msg, ErrorReply):
        body = {"t": "e", "request_id": msg.request_id, "node": msg.node, "code": msg.code,
                "message": msg.message}
    elif isinstance(msg, Heartbeat):
        body = {"t": "hb", "model": msg.model, "node": msg.node,
                "holdings": [list(h) for h in msg.holdings], "budget_bytes": msg.budget_bytes,
                "load": msg.load, "served": msg.served, "version": msg.version,
                "kernel": msg.kernel, "sent_at": msg.sent_at}
    else:
        raise CodecError(f"cannot encode a {type(msg).__name__}: not a Kvasir message")
    return msgpack.packb({"v": VERSION, **body}, use_bin_type=True)


# -- decoding -------------------------------------------------------------------------------

_KINDS = {"x": "dispatch request", "r": "dispatch reply", "e": "error reply",
          "hb": "heartbeat"}


def _unpack(data: Any, max_bytes: int, kinds: tuple[str, ...], what: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"{what}: payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"{what}: payload is {len(data)} bytes, over the limit of "
                                   f"{max_bytes}", field="payload")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CodecError(f"{what}: payload is not valid msgpack ({type(exc).__name__}: {exc})",
                         field="payload") from None
    if not isinstance(body, dict):
        raise CodecError(f"{what}: payload must be a msgpack map, got {type(body).__name__}",
                         field="payload")
    if "v" not in body:
        raise _fail(what, "v", "is missing (no message version)")
    version = body["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _fail(what, "v", f"must be an integer, got {version!r}")
    if version != VERSION:
        raise UnsupportedVersionError(f"{what}: message version {version} is not supported "
                                      f"(this build speaks version {VERSION})", field="v")
    kind = body.get("t")
    if kind not in kinds:
        expected = " or ".join(repr(k) for k in kinds)
        raise _fail(what, "t", f"is {kind!r}, expected {expected}")
    return body


def _need(body: dict, record: str, field: str) -> Any:
    try:
        return body[field]
    except KeyError:
        raise _fail(record, field, "is missing") from None


def _decode_rows(body: dict, record: str, allowed: tuple[str, ...], max_rows: int | None,
                 n_embd: int | None) -> np.ndarray:
    dtype = _need(body, record, "dtype")
    if dtype not in allowed:
        raise _fail(record, "dtype", f"is {dtype!r}; allowed: {', '.join(allowed)}")
    shape = _need(body, record, "shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise _fail(record, "shape", f"must be [rows, n_embd], got {shape!r}")
    n = _int(record, "shape", shape[0], 1, MAX_DIM)
    width = _int(record, "shape", shape[1], 1, MAX_DIM)
    if max_rows is not None and n > max_rows:
        raise PayloadTooLargeError(f"{record}: field 'shape' has {n} rows, over the limit of "
                                   f"{max_rows}", field="shape")
    if n_embd is not None and width != n_embd:
        raise _fail(record, "shape", f"has n_embd {width}, expected {n_embd}")
    data = _need(body, record, "data")
    if not isinstance(data, bytes):
        raise _fail(record, "data", f"must be bytes (msgpack bin), got {type(data).__name__}")
    wire = DTYPES[dtype]
    expected = n * width * wire.itemsize
    if len(data) != expected:
        raise _fail(record, "data", f"has {len(data)} bytes but shape {[n, width]} of {dtype} "
                                    f"needs {expected}")
    # Little-endian on the wire, native in memory: a no-op view on little-endian hosts.
    return np.frombuffer(data, dtype=wire).reshape(n, width).astype(wire.newbyteorder("="),
                                                                    copy=False)


def decode_request(data: bytes, *, max_rows: int | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES,
                   n_embd: int | None = None) -> DispatchRequest:
    """Bytes -> :class:`DispatchRequest`; ``n_embd`` (if given) must match the rows' width."""
    r = "dispatch request"
    body = _unpack(data, max_bytes, ("x",), r)
    rows = _decode_rows(body, r, REQUEST_DTYPES, max_rows, n_embd)
    return DispatchRequest(model=_need(body, r, "model"), layer=_need(body, r, "layer"),
                           expert=_need(body, r, "expert"), rows=rows,
                           request_id=_need(body, r, "request_id"))


def decode_reply(data: bytes, *, max_rows: int | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, n_embd: int | None = None) -> Reply:
    """Bytes -> :class:`DispatchReply` or :class:`ErrorReply`."""
    body = _unpack(data, max_bytes, ("r", "e"), "reply")
    if body["t"] == "e":
        r = "error reply"
        return ErrorReply(request_id=_need(body, r, "request_id"), node=_need(body, r, "node"),
                          code=_need(body, r, "code"), message=_need(body, r, "message"))
    r = "dispatch reply"
    rows = _decode_rows(body, r, REPLY_DTYPES, max_rows, n_embd)
    return DispatchReply(request_id=_need(body, r, "request_id"), node=_need(body, r, "node"),
                         rows=rows)


def decode_heartbeat(data: bytes, *, max_bytes: int = 1024 * 1024) -> Heartbeat:
    """Bytes -> :class:`Heartbeat`."""
    r = "heartbeat"
    body = _unpack(data, max_bytes, ("hb",), r)
    fields = ("model", "node", "holdings", "budget_bytes", "load", "served", "version",
              "kernel", "sent_at")
    return Heartbeat(**{f: _need(body, r, f) for f in fields})


# -- NATS headers ---------------------------------------------------------------------------

def headers_for(msg: Message) -> dict[str, str]:
    """Human-readable NATS headers for a message, so ``nats sub 'kvasir.>'`` shows what flows.

    They are a view for people and tools; receivers trust the payload, not the headers.
    """
    h = {"Kvasir-Version": str(VERSION)}
    if isinstance(msg, DispatchRequest):
        h.update({"Kvasir-Layer": str(msg.layer), "Kvasir-Expert": str(msg.expert),
                  "Kvasir-Rows": str(msg.rows.shape[0]), "Kvasir-Dtype": msg.rows.dtype.name,
                  "Kvasir-Request": msg.request_id})
    elif isinstance(msg, DispatchReply):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Request": msg.request_id,
                  "Kvasir-Rows": str(msg.rows.shape[0]), "Kvasir-Dtype": msg.rows.dtype.name})
    elif isinstance(msg, ErrorReply):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Error": msg.code})
        if msg.request_id:
            h["Kvasir-Request"] = msg.request_id
    elif isinstance(msg, Heartbeat):
        h.update({"Kvasir-Node": msg.node})
    else:
        raise CodecError(f"no headers for a {type(msg).__name__}: not a Kvasir message")
    return h
