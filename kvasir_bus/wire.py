"""The wire contract every Kvasir message shares: envelope, field checks, records, ranges.

Every payload is a msgpack map with a version ``v`` and a kind ``t``; a receiver rejects a
version it does not speak with :class:`UnsupportedVersionError` rather than guessing. Keys a
receiver does not know are ignored, so a later version 1 sender may add fields.

A message is a *record*: a frozen dataclass that validates itself on construction (so a bad
record can neither be sent nor received) and declares, in one place, its kind ``t``, its body
(:meth:`Record.body` / :meth:`Record.from_body`) and the NATS headers people see
(:meth:`Record.headers`). :func:`record` registers a record class under its kind, so
:func:`encode`, :func:`headers_for` and :func:`decode` dispatch on the registry: a new message
is one class, not four ``isinstance`` ladders. The records themselves live in
:mod:`kvasir_bus.codec` (dispatch, heartbeat) and :mod:`kvasir_bus.market_codec` (market).

The field checks below (``check_*``) are public: both codecs build their records from them, and
every failure is a :class:`CodecError` whose message names the record and the field.

Expert ranges are :class:`Holding`: half-open ``[lo, hi)`` inside (on the wire, in code, like
``range``), and inclusive ``L<layer>:<first>-<last>`` wherever a person reads or types one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, TypeVar

import msgpack
import numpy as np

from kvasir_bus import subjects
from kvasir_bus.errors import KvasirError

VERSION = 1

#: Largest payload accepted by default: ``max_payload`` in deploy/nats.conf.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

MAX_HOLDINGS = 65_536
MAX_ERROR_MESSAGE = 1024

# Error codes of an ErrorReply. Any sender may use the generic ones.
ERR_BAD_REQUEST = "bad_request"   # the request did not decode or does not fit
ERR_WRONG_MODEL = "wrong_model"   # another model fingerprint
ERR_INTERNAL = "internal"         # the handler failed (a bug or a broken kernel)
# ... a worker's:
ERR_NOT_HELD = "not_held"         # this node does not hold (layer, expert)
ERR_OVERLOADED = "overloaded"     # shedding load
# ... the market's:
ERR_NO_FIT = "no_fit"                # the budget cannot hold even one expert
ERR_NO_MANIFEST = "no_manifest"      # the market has no manifest for the model (yet)
ERR_UNKNOWN_MODEL = "unknown_model"  # the market has never heard of the model
ERR_WARMING_UP = "warming_up"        # the market just restarted: ask again in a few seconds

_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_ID_WHAT = "1-64 characters from [A-Za-z0-9_.:-]"
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

def fail(record: str, field: str, problem: str) -> CodecError:
    """The error for one bad field: ``<record>: field '<field>' <problem>``."""
    return CodecError(f"{record}: field '{field}' {problem}", field=field)


def check_int(record: str, field: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    """An integer (numpy integers too, never a bool) in ``lo..hi`` (inclusive bounds)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = value.__index__()
    except (AttributeError, TypeError):
        raise fail(record, field, f"must be an integer, got {type(value).__name__} "
                                  f"{value!r}") from None
    if number < lo or (hi is not None and number > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise fail(record, field, f"is out of range: {number} (expected {bound})")
    return number


def check_float(record: str, field: str, value: Any, lo: float = 0.0) -> float:
    """A finite number ``>= lo``, as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise fail(record, field, f"must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < lo:
        raise fail(record, field, f"must be a finite number >= {lo}, got {number!r}")
    return number


def check_opt_float(record: str, field: str, value: Any, lo: float = 0.0,
                    hi: float | None = None) -> float | None:
    """None, or a finite number in ``lo..hi``."""
    if value is None:
        return None
    number = check_float(record, field, value, lo)
    if hi is not None and number > hi:
        raise fail(record, field, f"must be <= {hi}, got {number!r}")
    return number


def check_bool(record: str, field: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise fail(record, field, f"must be true or false, got {value!r}")
    return bool(value)


def check_str(record: str, field: str, value: Any, pattern: re.Pattern[str] | None = None,
              max_len: int = 64, what: str = "") -> str:
    """A string of at most ``max_len`` characters that ``pattern`` (if given) matches whole."""
    if not isinstance(value, str):
        raise fail(record, field, f"must be a string, got {type(value).__name__} {value!r}")
    if len(value) > max_len:
        raise fail(record, field, f"is too long: {len(value)} characters (max {max_len})")
    if pattern is not None and not pattern.fullmatch(value):
        raise fail(record, field, f"is not valid: {value!r} (expected {what})")
    return value


def check_token(record: str, field: str, value: Any, check: Callable[[Any], str]) -> str:
    """A subject token, checked by one of :mod:`kvasir_bus.subjects`' ``check_*``."""
    try:
        return check(value)
    except ValueError as exc:
        raise fail(record, field, f"is not valid: {exc}") from None


def check_model(record: str, value: Any) -> str:
    return check_token(record, "model", value, subjects.check_model)


def check_node(record: str, field: str, value: Any) -> str:
    return check_token(record, field, value, subjects.check_node)


def check_index(record: str, field: str, value: Any) -> int:
    """A layer or expert number (what a subject token can carry)."""
    return check_int(record, field, value, 0, subjects.MAX_INDEX)


def is_id(value: Any) -> bool:
    """True if ``value`` can be a request, event or batch id (1-64 of ``[A-Za-z0-9_.:-]``)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_id(record: str, field: str, value: Any, allow_empty: bool = False) -> str:
    """A request, event or batch id; ``allow_empty`` admits "" (no id known)."""
    if allow_empty and value == "":
        return value
    return check_str(record, field, value, _ID_RE, what=_ID_WHAT)


def check_label(record: str, field: str, value: Any) -> str:
    """1-64 printable ASCII characters without spaces: a version, a kernel, an arch."""
    return check_str(record, field, value, _LABEL_RE, what="printable ASCII")


def need(body: dict, record: str, field: str) -> Any:
    """``body[field]``, or a CodecError saying it is missing."""
    try:
        return body[field]
    except KeyError:
        raise fail(record, field, "is missing") from None


def tuple_of(record: str, name: str, value: Any, cls: type, limit: int,
             build: Callable[[Any], Any] | None = None) -> tuple:
    """A list/tuple of ``cls`` records; items that are lists/maps are built with ``build``."""
    if not isinstance(value, (list, tuple)):
        raise fail(record, name, f"must be a list, got {type(value).__name__}")
    if len(value) > limit:
        raise fail(record, name, f"has {len(value)} items (max {limit})")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, cls):
            out.append(item)
        elif build is not None:
            try:
                out.append(build(item))
            except CodecError as exc:
                where = f"{name}[{i}]" + (f".{exc.field}" if exc.field else "")
                raise CodecError(f"{record}: field '{name}[{i}]': {exc}", field=where) from None
            except (TypeError, ValueError) as exc:
                raise fail(record, f"{name}[{i}]", f"is malformed: {exc}") from None
        else:
            raise fail(record, f"{name}[{i}]", f"must be a {cls.__name__}, got "
                                                f"{type(item).__name__}")
    return tuple(out)


# -- expert ranges ---------------------------------------------------------------------------

_HOLDING_RE = re.compile(r"\s*L(\d+):(\d+)(?:-(\d+))?\s*")


class Holding(NamedTuple):
    """Experts ``lo <= e < hi`` (half-open, like ``range``) of one layer.

    Half-open is the inside convention (wire, market, slices); people read and type the
    inclusive form ``L<layer>:<first>-<last>`` (:meth:`__str__`, :meth:`parse`), and a file
    format that stores inclusive ends uses :meth:`inclusive` and :attr:`last`.
    """

    layer: int
    lo: int
    hi: int

    @classmethod
    def inclusive(cls, layer: int, first: int, last: int) -> Holding:
        """The holding of experts ``first..last``, both included."""
        return cls(layer, first, last + 1)

    @classmethod
    def parse(cls, text: str) -> Holding:
        """``"L3:16-31"`` (inclusive) or ``"L3:16"`` -> ``Holding(3, 16, 32)``;
        ValueError saying what was expected otherwise."""
        m = _HOLDING_RE.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"{text!r} is not an expert range: expected L<layer>:<first>-<last> "
                             "(inclusive), e.g. L3:16-31, or L<layer>:<expert>")
        layer, first = int(m.group(1)), int(m.group(2))
        last = int(m.group(3)) if m.group(3) is not None else first
        if last < first:
            raise ValueError(f"{text!r}: range is reversed (first {first} > last {last})")
        return cls.inclusive(layer, first, last)

    @property
    def last(self) -> int:
        """The last expert held (inclusive end)."""
        return self.hi - 1

    @property
    def count(self) -> int:
        return self.hi - self.lo

    @property
    def experts(self) -> range:
        return range(self.lo, self.hi)

    def covers(self, layer: int, expert: int) -> bool:
        return layer == self.layer and self.lo <= expert < self.hi

    @property
    def span(self) -> str:
        """The experts as a person reads them: ``first-last``, both included."""
        return f"{self.lo}-{self.last}"

    def __str__(self) -> str:
        return f"L{self.layer}:{self.span}"


def check_holdings(record: str, value: Any, field: str = "holdings") -> tuple[Holding, ...]:
    """A list of ``(layer, lo, hi)`` half-open, non-empty ranges -> Holdings."""
    if not isinstance(value, (list, tuple)):
        raise fail(record, field, f"must be a list of (layer, lo, hi), got "
                                  f"{type(value).__name__}")
    if len(value) > MAX_HOLDINGS:
        raise fail(record, field, f"has {len(value)} ranges (max {MAX_HOLDINGS})")
    out = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise fail(record, where, f"must be (layer, lo, hi), got {item!r}")
        layer = check_index(record, where + ".layer", item[0])
        lo = check_index(record, where + ".lo", item[1])
        hi = check_int(record, where + ".hi", item[2], 0, subjects.MAX_INDEX + 1)
        if hi <= lo:
            raise fail(record, where, f"is an empty range: lo={lo}, hi={hi} (half-open, "
                                      "need lo < hi)")
        out.append(Holding(layer, lo, hi))
    return tuple(out)


def holding_list(holdings) -> list[list[int]]:
    """Holdings as they travel: ``[[layer, lo, hi], ...]`` (half-open)."""
    return [list(h) for h in holdings]


# -- records and their registry ----------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What a receiver accepts beyond the payload size: rows per array, the rows' width."""

    max_rows: int | None = None
    n_embd: int | None = None


NO_LIMITS = Limits()


class Record:
    """A message: subclasses set ``kind`` (the ``t`` on the wire) and ``what`` (its name in
    errors), and implement :meth:`body`, :meth:`from_body` and :meth:`headers`."""

    kind: ClassVar[str]
    what: ClassVar[str]
    #: The message versions ``v`` this record's decoder reads; a record whose layout changed
    #: in a way an older reader would misread (the manifest) sends a higher one when it must.
    versions: ClassVar[tuple[int, ...]] = (VERSION,)

    @property
    def wire_version(self) -> int:
        """The ``v`` this record is sent with (the lowest one that can carry it)."""
        return VERSION

    def body(self) -> dict[str, Any]:
        """The payload's fields after ``v`` and ``t``, in wire order."""
        raise NotImplementedError

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Record:
        """A checked msgpack map (:func:`unpack`) -> the record."""
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        """NATS headers for people and tools (without ``Kvasir-Version``)."""
        raise NotImplementedError

    def encode(self) -> bytes:
        return encode(self)


#: ``t`` -> record class, filled by :func:`record` as the codec modules are imported.
RECORDS: dict[str, type[Record]] = {}

R = TypeVar("R", bound=type)


def record(cls: R) -> R:
    """Class decorator: register a :class:`Record` under its ``kind``."""
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} declares no kind")
    if kind in RECORDS and RECORDS[kind] is not cls:
        raise TypeError(f"kind {kind!r} of {cls.__name__} is taken by {RECORDS[kind].__name__}")
    for method in ("body", "from_body", "headers"):
        if getattr(cls, method) is getattr(Record, method):
            raise TypeError(f"{cls.__name__} does not implement {method}()")
    RECORDS[kind] = cls
    _SPOKEN.clear()  # a new kind may speak other versions
    return cls


#: ``kinds`` -> the versions their records read: built once per kinds tuple, not per message.
_SPOKEN: dict[tuple[str, ...], frozenset[int]] = {}


def _spoken(kinds: tuple[str, ...]) -> frozenset[int]:
    spoken = _SPOKEN.get(kinds)
    if spoken is None:
        spoken = _SPOKEN[kinds] = frozenset(v for k in kinds for v in getattr(RECORDS.get(k), "versions", (VERSION,)))
    return spoken


def _registered(msg: Any, doing: str) -> Record:
    cls = RECORDS.get(getattr(type(msg), "kind", None))
    if cls is None or type(msg) is not cls:
        raise CodecError(f"{doing} a {type(msg).__name__}: not a Kvasir message")
    return msg


def encode(msg: Record) -> bytes:
    """Any record -> msgpack bytes (the record was validated when it was built)."""
    msg = _registered(msg, "cannot encode")
    return msgpack.packb({"v": msg.wire_version, "t": msg.kind, **msg.body()}, use_bin_type=True)


def headers_for(msg: Record) -> dict[str, str]:
    """Human-readable NATS headers for a message, so ``nats sub 'kvasir.>'`` shows what flows.

    They are a view for people and tools; receivers trust the payload, not the headers.
    """
    msg = _registered(msg, "no headers for")
    # Kind and model on every message, so `nats sub 'kvasir.>'` tells what flows and for which
    # model without decoding a payload (replies carry no model: their request named it).
    common = {"Kvasir-Version": str(msg.wire_version), "Kvasir-Kind": type(msg).what.replace(" ", "_")}
    model = getattr(msg, "model", None)
    if isinstance(model, str) and model:
        common["Kvasir-Model"] = model
    return {**common, **msg.headers()}


def unpack(data: Any, max_bytes: int, kinds: tuple[str, ...], what: str) -> dict:
    """Bytes -> the checked msgpack map of a message of one of ``kinds``: bytes, size bound,
    a map, version ``v`` spoken here, kind ``t`` expected."""
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
        raise fail(what, "v", "is missing (no message version)")
    version = body["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise fail(what, "v", f"must be an integer, got {version!r}")
    spoken = _spoken(kinds)
    if version not in spoken:
        raise UnsupportedVersionError(f"{what}: message version {version} is not supported "
                                      f"(this build speaks version {max(spoken)}): upgrade kvasir",
                                      field="v")
    kind = body.get("t")
    if kind not in kinds:
        expected = " or ".join(repr(k) for k in kinds)
        raise fail(what, "t", f"is {kind!r}, expected {expected}")
    if version not in getattr(RECORDS.get(kind), "versions", (VERSION,)):
        raise UnsupportedVersionError(f"{what}: a {kind!r} of message version {version} is not "
                                      "supported: upgrade kvasir", field="v")
    return body


def decode(data: Any, kinds: tuple[str, ...], what: str, *,
           max_bytes: int = DEFAULT_MAX_BYTES, limits: Limits = NO_LIMITS) -> Record:
    """Bytes -> the record of whichever of ``kinds`` the payload is (all must be registered)."""
    body = unpack(data, max_bytes, kinds, what)
    return RECORDS[body["t"]].from_body(body, limits)


def decode_any(data: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Record:
    """Bytes -> any registered record (for tools that see every message: ``kvasir tap``)."""
    return decode(data, tuple(RECORDS), "message", max_bytes=max_bytes)


# -- the one record every sender may answer with -------------------------------------------

@record
@dataclass(frozen=True)
class ErrorReply(Record):
    """A refusal: ``code`` is one of the ``ERR_*`` constants (or another short lower-case
    token), ``message`` at most :data:`MAX_ERROR_MESSAGE` characters. ``request_id`` is empty
    when the request was too broken to read one from it."""

    kind: ClassVar[str] = "e"
    what: ClassVar[str] = "error reply"

    request_id: str
    node: str
    code: str
    message: str

    def __post_init__(self) -> None:
        r = self.what
        check_id(r, "request_id", self.request_id, allow_empty=True)
        check_node(r, "node", self.node)
        check_str(r, "code", self.code, _CODE_RE, max_len=32,
                  what="a lower-case token like 'not_held'")
        check_str(r, "message", self.message, max_len=MAX_ERROR_MESSAGE)

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "node": self.node, "code": self.code,
                "message": self.message}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> ErrorReply:
        r = cls.what
        return cls(request_id=need(body, r, "request_id"), node=need(body, r, "node"),
                   code=need(body, r, "code"), message=need(body, r, "message"))

    def headers(self) -> dict[str, str]:
        h = {"Kvasir-Node": self.node, "Kvasir-Error": self.code}
        if self.request_id:  # no empty header values
            h["Kvasir-Request"] = self.request_id
        return h
