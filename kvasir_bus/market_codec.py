"""Wire codecs of the coverage market (milestone M3): manifest, volunteering, routing
statistics, demand, ledger and status.

Same rules as :mod:`kvasir_bus.codec`: every payload is a msgpack map with a version ``v`` and
a kind ``t``; records are frozen and validate themselves on construction, so a bad record can
neither be sent nor received; every failure is a :class:`~kvasir_bus.codec.CodecError` naming
the record and the field. Keys a receiver does not know are ignored within a version.

Messages (``t``), with the subject each travels on (``M`` = model fingerprint):

* ``mf`` :class:`Manifest`         backbone -> anyone, reply on ``kvasir.M.manifest``
* ``vq`` :class:`VolunteerRequest` worker -> market on ``kvasir.M.market.volunteer``
* ``as`` :class:`Assignment`       market -> worker, the reply (or an ``e`` ErrorReply)
* ``rs`` :class:`RoutingStats`     backbone -> market on ``kvasir.M.routing``
* ``dm`` :class:`DemandMap`        market -> everyone on ``kvasir.M.demand``
* ``lb`` :class:`LedgerBatch`      backbone -> market, request on ``kvasir.M.ledger``
* ``la`` :class:`LedgerAck`        market -> backbone, the reply (or an ``e`` ErrorReply)
* ``ms`` :class:`MarketStatus`     market -> anyone, reply on ``kvasir.M.market.status``
* ``mo`` :class:`MarketOverview`   market -> anyone, reply on ``kvasir._market.status``
* ``e``  :class:`~kvasir_bus.codec.ErrorReply` (from codec.py) for refusals

The manifest travels as parallel little-endian arrays (and SHA-256 digests as raw bytes): 57
bytes per slab, so the 122B model's 36,864 slabs are about 2.1 MB, within deploy/nats.conf's
8 MB ``max_payload`` (not within NATS' 1 MB default).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Union

import msgpack
import numpy as np

from kvasir_bus import codec, subjects
from kvasir_bus.codec import (CodecError, ErrorReply, Holding, PayloadTooLargeError,  # noqa: F401 (re-exported)
                              UnsupportedVersionError, _fail, _float, _holdings, _index, _int,
                              _need, _str, _token)

VERSION = 1

#: Largest payload accepted by default (deploy/nats.conf's max_payload).
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

KINDS = ("gate", "up", "down")          # slab kinds, in the order of one expert's slabs
MAX_SLABS = 1 << 22
MAX_HITS = 1 << 22
MAX_ENTRIES = 1 << 20
MAX_LEDGER_EVENTS = 100_000
MAX_NODES = 65_536
MAX_URL = 2048

# Error codes the market puts in an ErrorReply (codec.ERR_* cover the generic ones).
ERR_NO_FIT = "no_fit"                # the budget cannot hold even one expert
ERR_NO_MANIFEST = "no_manifest"      # the market has no manifest for the model (yet)
ERR_UNKNOWN_MODEL = "unknown_model"  # the market has never heard of the model
ERR_WARMING_UP = "warming_up"        # the market just restarted: ask again in a few seconds
ERR_BAD_REQUEST = "bad_request"
ERR_WRONG_MODEL = "wrong_model"
ERR_INTERNAL = "internal"

#: Refusals that mean "not now": ask again later (a ledger batch must be kept and re-sent).
#: Any other code is final for that request.
RETRY_CODES = frozenset({ERR_NO_MANIFEST, ERR_WARMING_UP, ERR_INTERNAL})

_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_LABEL_RE = re.compile(r"[\x21-\x7e]{1,64}")
_ID_WHAT = "1-64 characters from [A-Za-z0-9_.:-]"
_U32, _U64, _U8 = np.dtype("<u4"), np.dtype("<u8"), np.dtype("u1")


def should_retry(reply: object) -> bool:
    """True if ``reply`` is an ErrorReply whose code is in :data:`RETRY_CODES`."""
    return isinstance(reply, ErrorReply) and reply.code in RETRY_CODES


def _opt_float(record: str, name: str, value: Any, lo: float = 0.0,
               hi: float | None = None) -> float | None:
    if value is None:
        return None
    number = _float(record, name, value, lo)
    if hi is not None and number > hi:
        raise _fail(record, name, f"must be <= {hi}, got {number!r}")
    return number


def _tuple_of(record: str, name: str, value: Any, cls: type, limit: int,
              build=None) -> tuple:
    """A list/tuple of ``cls`` records; items that are lists/dicts are built with ``build``."""
    if not isinstance(value, (list, tuple)):
        raise _fail(record, name, f"must be a list, got {type(value).__name__}")
    if len(value) > limit:
        raise _fail(record, name, f"has {len(value)} items (max {limit})")
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
                raise _fail(record, f"{name}[{i}]", f"is malformed: {exc}") from None
        else:
            raise _fail(record, f"{name}[{i}]", f"must be a {cls.__name__}, got "
                                                 f"{type(item).__name__}")
    return tuple(out)


def _bool(record: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(record, name, f"must be true or false, got {value!r}")
    return bool(value)


# -- manifest -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlabRef:
    """One expert's tensor slab in the source GGUF: bytes ``[offset, offset + size)``."""

    layer: int
    expert: int
    kind: str          # "gate", "up" or "down"
    offset: int        # absolute byte offset in the source file
    size: int
    sha256: str        # 64 lower-case hex digits of the slab's bytes

    def __post_init__(self) -> None:
        r = "slab"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("layer", _index(r, "layer", self.layer))
        s("expert", _index(r, "expert", self.expert))
        if self.kind not in KINDS:
            raise _fail(r, "kind", f"is {self.kind!r}, expected one of {', '.join(KINDS)}")
        s("offset", _int(r, "offset", self.offset, 0, (1 << 63) - 1))
        s("size", _int(r, "size", self.size, 1, (1 << 63) - 1))
        _str(r, "sha256", self.sha256, _SHA_RE, what="64 lower-case hex digits")


@dataclass(frozen=True)
class Manifest:
    """Where every expert of a model lies in its source GGUF, with a digest per slab.

    ``n_layer``: all blocks of the model (some may have no experts: dense layers);
    ``data_offset``: where the tensor data starts in the file; ``source_url``: where the file
    can be fetched by byte range ("" if nowhere). ``slabs`` are sorted on construction by
    (layer, expert, kind). Every (layer, expert) present has exactly one slab of each kind,
    and a layer with experts has all ``n_expert`` of them.
    """

    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_embd: int
    n_ff: int
    file_bytes: int
    data_offset: int
    source_url: str
    slabs: tuple[SlabRef, ...]

    def __post_init__(self) -> None:
        r = "manifest"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        _str(r, "arch", self.arch, _LABEL_RE, what="printable ASCII")
        s("n_layer", _int(r, "n_layer", self.n_layer, 1, subjects.MAX_INDEX))
        s("n_expert", _int(r, "n_expert", self.n_expert, 1, subjects.MAX_INDEX))
        s("n_embd", _int(r, "n_embd", self.n_embd, 1, 1 << 31))
        s("n_ff", _int(r, "n_ff", self.n_ff, 1, 1 << 31))
        s("file_bytes", _int(r, "file_bytes", self.file_bytes, 0, (1 << 63) - 1))
        s("data_offset", _int(r, "data_offset", self.data_offset, 0, self.file_bytes))
        _str(r, "source_url", self.source_url, max_len=MAX_URL)
        slabs = _tuple_of(r, "slabs", self.slabs, SlabRef, MAX_SLABS,
                          build=lambda item: SlabRef(*item))
        kind_order = {k: i for i, k in enumerate(KINDS)}
        slabs = tuple(sorted(slabs, key=lambda x: (x.layer, x.expert, kind_order[x.kind])))
        s("slabs", slabs)
        self._check_slabs()

    def _check_slabs(self) -> None:
        r = "manifest"
        seen: dict[tuple[int, int], list[str]] = {}
        for i, slab in enumerate(self.slabs):
            where = f"slabs[{i}]"
            if slab.layer >= self.n_layer:
                raise _fail(r, where, f"has layer {slab.layer}, but the model has "
                                      f"{self.n_layer} layers")
            if slab.expert >= self.n_expert:
                raise _fail(r, where, f"has expert {slab.expert}, but layers have "
                                      f"{self.n_expert} experts")
            if slab.offset < self.data_offset or slab.offset + slab.size > self.file_bytes:
                raise _fail(r, where, f"bytes [{slab.offset}, {slab.offset + slab.size}) lie "
                                      f"outside the tensor data [{self.data_offset}, "
                                      f"{self.file_bytes})")
            kinds = seen.setdefault((slab.layer, slab.expert), [])
            if slab.kind in kinds:
                raise _fail(r, where, f"repeats layer {slab.layer} expert {slab.expert} "
                                      f"{slab.kind}")
            kinds.append(slab.kind)
        per_layer: dict[int, int] = {}
        for (layer, expert), kinds in seen.items():
            if len(kinds) != len(KINDS):
                missing = [k for k in KINDS if k not in kinds]
                raise _fail(r, "slabs", f"lack the {', '.join(missing)} slab of layer {layer} "
                                        f"expert {expert}")
            per_layer[layer] = per_layer.get(layer, 0) + 1
        for layer, count in per_layer.items():
            if count != self.n_expert:
                raise _fail(r, "slabs", f"cover {count} experts of layer {layer}, expected "
                                        f"all {self.n_expert}")

    @cached_property
    def _index(self) -> dict[tuple[int, int], tuple[SlabRef, ...]]:
        index: dict[tuple[int, int], list[SlabRef]] = {}
        for slab in self.slabs:
            index.setdefault((slab.layer, slab.expert), []).append(slab)
        return {key: tuple(value) for key, value in index.items()}

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers that have routed experts, ascending."""
        return tuple(sorted({slab.layer for slab in self.slabs}))

    @cached_property
    def _expert_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (layer, _expert), slabs in self._index.items():
            out[layer] = max(out.get(layer, 0), sum(slab.size for slab in slabs))
        return out

    def slabs_for(self, layer: int, expert: int) -> tuple[SlabRef, ...]:
        """The gate, up and down slabs of one expert; KeyError if the manifest has none."""
        try:
            return self._index[(layer, expert)]
        except KeyError:
            raise KeyError(f"manifest of {self.model} has no layer {layer} expert "
                           f"{expert}") from None

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer`` (its three slabs); KeyError for a dense layer."""
        try:
            return self._expert_bytes[layer]
        except KeyError:
            raise KeyError(f"manifest of {self.model}: layer {layer} has no experts") from None

    def encode(self) -> bytes:
        return encode(self)


# -- volunteering ---------------------------------------------------------------------------

@dataclass(frozen=True)
class VolunteerRequest:
    """A worker offers ``budget_bytes`` of memory for experts of ``model``."""

    model: str
    node: str
    budget_bytes: int

    def __post_init__(self) -> None:
        r = "volunteer request"
        object.__setattr__(self, "model", _token(r, "model", self.model, subjects.check_model))
        object.__setattr__(self, "node", _token(r, "node", self.node, subjects.check_node))
        object.__setattr__(self, "budget_bytes",
                           _int(r, "budget_bytes", self.budget_bytes, 0, (1 << 63) - 1))

    def encode(self) -> bytes:
        return encode(self)


@dataclass(frozen=True)
class Assignment:
    """What a volunteer should hold: half-open ``holdings``, ``bytes`` in all, and the reward
    per row served it earns there at the moment of assignment."""

    model: str
    node: str
    holdings: tuple[Holding, ...]
    bytes: int
    reward_rate: float

    def __post_init__(self) -> None:
        r = "assignment"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        s("node", _token(r, "node", self.node, subjects.check_node))
        s("holdings", _holdings(r, self.holdings))
        if not self.holdings:
            raise _fail(r, "holdings", "is empty: an assignment holds at least one expert")
        s("bytes", _int(r, "bytes", self.bytes, 1, (1 << 63) - 1))
        s("reward_rate", _float(r, "reward_rate", self.reward_rate))

    @property
    def n_experts(self) -> int:
        return sum(h.hi - h.lo for h in self.holdings)

    def encode(self) -> bytes:
        return encode(self)


# -- routing statistics ---------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingStats:
    """How often the router selected each expert during the last ``window_s`` seconds.

    ``hits``: sparse ``(layer, expert, rows)``, rows = token rows routed to that expert
    (experts not listed had none). ``fallback_rate``: expert calls the backbone computed
    itself / all expert calls in the window (None: not measured). ``node``: the backbone.
    """

    model: str
    node: str
    window_s: float
    hits: tuple[tuple[int, int, int], ...]
    fallback_rate: float | None = None

    def __post_init__(self) -> None:
        r = "routing stats"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        s("node", _token(r, "node", self.node, subjects.check_node))
        s("window_s", _float(r, "window_s", self.window_s))
        s("fallback_rate", _opt_float(r, "fallback_rate", self.fallback_rate, 0.0, 1.0))
        if isinstance(self.hits, np.ndarray):
            s("hits", tuple(tuple(int(v) for v in row) for row in self.hits.reshape(-1, 3)))
        if not isinstance(self.hits, (list, tuple)):
            raise _fail(r, "hits", f"must be a list of (layer, expert, rows), got "
                                   f"{type(self.hits).__name__}")
        if len(self.hits) > MAX_HITS:
            raise _fail(r, "hits", f"has {len(self.hits)} entries (max {MAX_HITS})")
        out = []
        for i, item in enumerate(self.hits):
            where = f"hits[{i}]"
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise _fail(r, where, f"must be (layer, expert, rows), got {item!r}")
            out.append((_index(r, where + ".layer", item[0]),
                        _index(r, where + ".expert", item[1]),
                        _int(r, where + ".rows", item[2], 0, (1 << 63) - 1)))
        s("hits", tuple(out))

    def encode(self) -> bytes:
        return encode(self)


# -- demand ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DemandEntry:
    """One range ``lo <= e < hi`` of ``layer``: live ``replicas`` against a ``target``.

    ``usage``: the range's share of all routed rows (0..1; 0 for all ranges while no routing
    statistics came in); ``demand``: usage weight x missing replicas (0 when at target);
    ``reward_rate``: reward per row served there now.
    """

    layer: int
    lo: int
    hi: int
    replicas: int
    target: int
    usage: float
    demand: float
    reward_rate: float

    def __post_init__(self) -> None:
        r = "demand entry"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("layer", _index(r, "layer", self.layer))
        s("lo", _index(r, "lo", self.lo))
        s("hi", _int(r, "hi", self.hi, 0, subjects.MAX_INDEX + 1))
        if self.hi <= self.lo:
            raise _fail(r, "hi", f"must be > lo (half-open range), got lo={self.lo}, "
                                 f"hi={self.hi}")
        s("replicas", _int(r, "replicas", self.replicas, 0, 1 << 31))
        s("target", _int(r, "target", self.target, 0, 1 << 31))
        s("usage", _float(r, "usage", self.usage))
        s("demand", _float(r, "demand", self.demand))
        s("reward_rate", _float(r, "reward_rate", self.reward_rate))

    @property
    def missing(self) -> int:
        return max(0, self.target - self.replicas)

    @property
    def holding(self) -> Holding:
        return Holding(self.layer, self.lo, self.hi)


def _entry(item: Any) -> DemandEntry:
    return DemandEntry(*item)


@dataclass(frozen=True)
class DemandMap:
    """The market's demand over every range of ``model``, as of ``sent_at`` (Unix seconds)."""

    model: str
    sent_at: float
    entries: tuple[DemandEntry, ...]

    def __post_init__(self) -> None:
        r = "demand map"
        object.__setattr__(self, "model", _token(r, "model", self.model, subjects.check_model))
        object.__setattr__(self, "sent_at", _float(r, "sent_at", self.sent_at))
        object.__setattr__(self, "entries", _tuple_of(r, "entries", self.entries, DemandEntry,
                                                      MAX_ENTRIES, build=_entry))

    @property
    def holes(self) -> tuple[DemandEntry, ...]:
        """Ranges nobody holds."""
        return tuple(e for e in self.entries if e.replicas == 0)

    def entry(self, layer: int, lo: int) -> DemandEntry:
        for e in self.entries:
            if e.layer == layer and e.lo == lo:
                return e
        raise KeyError(f"demand map has no range starting at layer {layer} expert {lo}")

    def encode(self) -> bytes:
        return encode(self)


# -- ledger ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LedgerEvent:
    """A winning reply: ``node`` served ``rows`` rows of (``layer``, ``expert``) at ``at``.

    ``event_id`` is unique for all time (the backbone makes it, e.g. ``<source>:<boot>:<seq>``);
    the market counts an id once, however often it is re-sent.
    """

    event_id: str
    node: str
    layer: int
    expert: int
    rows: int
    at: float

    def __post_init__(self) -> None:
        r = "ledger event"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        _str(r, "event_id", self.event_id, _ID_RE, what=_ID_WHAT)
        s("node", _token(r, "node", self.node, subjects.check_node))
        s("layer", _index(r, "layer", self.layer))
        s("expert", _index(r, "expert", self.expert))
        s("rows", _int(r, "rows", self.rows, 1, 1 << 40))
        s("at", _float(r, "at", self.at))


@dataclass(frozen=True)
class LedgerBatch:
    """Ledger events from backbone ``source``, sent by request on ``kvasir.<model>.ledger``
    until a :class:`LedgerAck` with the same ``batch_id`` comes back."""

    model: str
    source: str
    batch_id: str
    events: tuple[LedgerEvent, ...]

    def __post_init__(self) -> None:
        r = "ledger batch"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        s("source", _token(r, "source", self.source, subjects.check_node))
        _str(r, "batch_id", self.batch_id, _ID_RE, what=_ID_WHAT)
        s("events", _tuple_of(r, "events", self.events, LedgerEvent, MAX_LEDGER_EVENTS,
                              build=lambda item: LedgerEvent(*item)))

    def encode(self) -> bytes:
        return encode(self)


@dataclass(frozen=True)
class LedgerAck:
    """The market stored batch ``batch_id``: ``accepted`` new events, ``duplicates`` seen
    before (or twice in the batch). Sent only after the events are durable."""

    batch_id: str
    accepted: int
    duplicates: int

    def __post_init__(self) -> None:
        r = "ledger ack"
        _str(r, "batch_id", self.batch_id, _ID_RE, what=_ID_WHAT)
        object.__setattr__(self, "accepted", _int(r, "accepted", self.accepted))
        object.__setattr__(self, "duplicates", _int(r, "duplicates", self.duplicates))

    def encode(self) -> bytes:
        return encode(self)


# -- status ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeStatus:
    """One worker as the market sees it. ``holdings``: from its last heartbeat;
    ``pending``: assigned but not yet confirmed by a heartbeat (they count as replicas for a
    grace period); ``age_s``: seconds since its last heartbeat (None: none yet)."""

    node: str
    holdings: tuple[Holding, ...]
    pending: tuple[Holding, ...]
    budget_bytes: int
    load: float
    served: int
    age_s: float | None
    version: str
    kernel: str

    def __post_init__(self) -> None:
        r = "node status"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("node", _token(r, "node", self.node, subjects.check_node))
        s("holdings", _holdings(r, self.holdings))
        s("pending", _holdings(r + " (pending)", self.pending))
        s("budget_bytes", _int(r, "budget_bytes", self.budget_bytes, 0, (1 << 63) - 1))
        s("load", _float(r, "load", self.load))
        s("served", _int(r, "served", self.served, 0, (1 << 63) - 1))
        s("age_s", _opt_float(r, "age_s", self.age_s))
        _str(r, "version", self.version, max_len=64)
        _str(r, "kernel", self.kernel, max_len=64)


@dataclass(frozen=True)
class NodeTotals:
    """Ledger totals of one node: events counted, rows served, reward earned."""

    node: str
    events: int
    rows: int
    reward: float

    def __post_init__(self) -> None:
        r = "node totals"
        object.__setattr__(self, "node", _token(r, "node", self.node, subjects.check_node))
        object.__setattr__(self, "events", _int(r, "events", self.events, 0, (1 << 63) - 1))
        object.__setattr__(self, "rows", _int(r, "rows", self.rows, 0, (1 << 63) - 1))
        object.__setattr__(self, "reward", _float(r, "reward", self.reward))


@dataclass(frozen=True)
class MarketStatus:
    """The market's view of one model: its shape (0 while no manifest is known), the range
    size it cuts layers into, each worker, the demand map, ledger totals per node, and the
    backbone's fallback rate (None: no backbone reported one recently)."""

    model: str
    market: str
    sent_at: float
    manifest_known: bool
    n_layer: int
    n_expert: int
    range_experts: int
    expiry_s: float
    nodes: tuple[NodeStatus, ...]
    demand: tuple[DemandEntry, ...]
    totals: tuple[NodeTotals, ...]
    fallback_rate: float | None = None

    def __post_init__(self) -> None:
        r = "market status"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", _token(r, "model", self.model, subjects.check_model))
        s("market", _token(r, "market", self.market, subjects.check_node))
        s("sent_at", _float(r, "sent_at", self.sent_at))
        s("manifest_known", _bool(r, "manifest_known", self.manifest_known))
        s("n_layer", _int(r, "n_layer", self.n_layer, 0, subjects.MAX_INDEX))
        s("n_expert", _int(r, "n_expert", self.n_expert, 0, subjects.MAX_INDEX))
        s("range_experts", _int(r, "range_experts", self.range_experts, 1, subjects.MAX_INDEX))
        s("expiry_s", _float(r, "expiry_s", self.expiry_s))
        s("nodes", _tuple_of(r, "nodes", self.nodes, NodeStatus, MAX_NODES,
                             build=lambda d: NodeStatus(**_fields(d, NodeStatus))))
        s("demand", _tuple_of(r, "demand", self.demand, DemandEntry, MAX_ENTRIES,
                              build=_entry))
        s("totals", _tuple_of(r, "totals", self.totals, NodeTotals, MAX_NODES,
                              build=lambda item: NodeTotals(*item)))
        s("fallback_rate", _opt_float(r, "fallback_rate", self.fallback_rate, 0.0, 1.0))

    def encode(self) -> bytes:
        return encode(self)


@dataclass(frozen=True)
class MarketOverview:
    """The market's view of every model it knows."""

    sent_at: float
    models: tuple[MarketStatus, ...] = field(default=())

    def __post_init__(self) -> None:
        r = "market overview"
        object.__setattr__(self, "sent_at", _float(r, "sent_at", self.sent_at))
        object.__setattr__(self, "models", _tuple_of(r, "models", self.models, MarketStatus,
                                                     4096))

    def encode(self) -> bytes:
        return encode(self)


def _fields(d: Any, cls: type) -> dict:
    if not isinstance(d, dict):
        raise TypeError(f"expected a map, got {type(d).__name__}")
    names = cls.__dataclass_fields__
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    return {n: d[n] for n in names}


Message = Union[Manifest, VolunteerRequest, Assignment, RoutingStats, DemandMap, LedgerBatch,
                LedgerAck, MarketStatus, MarketOverview, ErrorReply]


# -- encoding -------------------------------------------------------------------------------

def _holding_list(holdings: Iterable[Holding]) -> list[list[int]]:
    return [list(h) for h in holdings]


def _entry_list(entries: Iterable[DemandEntry]) -> list[list]:
    return [[e.layer, e.lo, e.hi, e.replicas, e.target, e.usage, e.demand, e.reward_rate]
            for e in entries]


def _status_body(st: MarketStatus) -> dict[str, Any]:
    return {"model": st.model, "market": st.market, "sent_at": st.sent_at,
            "manifest_known": st.manifest_known, "n_layer": st.n_layer,
            "n_expert": st.n_expert, "range_experts": st.range_experts,
            "expiry_s": st.expiry_s,
            "nodes": [{"node": n.node, "holdings": _holding_list(n.holdings),
                       "pending": _holding_list(n.pending), "budget_bytes": n.budget_bytes,
                       "load": n.load, "served": n.served, "age_s": n.age_s,
                       "version": n.version, "kernel": n.kernel} for n in st.nodes],
            "demand": _entry_list(st.demand),
            "totals": [[t.node, t.events, t.rows, t.reward] for t in st.totals],
            "fallback_rate": st.fallback_rate}


def _manifest_body(m: Manifest) -> dict[str, Any]:
    n = len(m.slabs)
    kind = {k: i for i, k in enumerate(KINDS)}
    layer = np.fromiter((x.layer for x in m.slabs), dtype=_U32, count=n)
    expert = np.fromiter((x.expert for x in m.slabs), dtype=_U32, count=n)
    kinds = np.fromiter((kind[x.kind] for x in m.slabs), dtype=_U8, count=n)
    offset = np.fromiter((x.offset for x in m.slabs), dtype=_U64, count=n)
    size = np.fromiter((x.size for x in m.slabs), dtype=_U64, count=n)
    sha = bytes.fromhex("".join(x.sha256 for x in m.slabs))
    return {"model": m.model, "arch": m.arch, "n_layer": m.n_layer, "n_expert": m.n_expert,
            "n_embd": m.n_embd, "n_ff": m.n_ff, "file_bytes": m.file_bytes,
            "data_offset": m.data_offset, "source_url": m.source_url, "n_slabs": n,
            "slab_layer": layer.tobytes(), "slab_expert": expert.tobytes(),
            "slab_kind": kinds.tobytes(), "slab_offset": offset.tobytes(),
            "slab_size": size.tobytes(), "slab_sha256": sha}


def encode(msg: Message) -> bytes:
    """Any market record -> msgpack bytes (the record was validated when it was built)."""
    if isinstance(msg, Manifest):
        body = {"t": "mf", **_manifest_body(msg)}
    elif isinstance(msg, VolunteerRequest):
        body = {"t": "vq", "model": msg.model, "node": msg.node,
                "budget_bytes": msg.budget_bytes}
    elif isinstance(msg, Assignment):
        body = {"t": "as", "model": msg.model, "node": msg.node,
                "holdings": _holding_list(msg.holdings), "bytes": msg.bytes,
                "reward_rate": msg.reward_rate}
    elif isinstance(msg, RoutingStats):
        hits = np.asarray(msg.hits, dtype=np.uint64).reshape(-1, 3)
        body = {"t": "rs", "model": msg.model, "node": msg.node, "window_s": msg.window_s,
                "fallback_rate": msg.fallback_rate, "n_hits": len(msg.hits),
                "hit_layer": hits[:, 0].astype(_U32).tobytes(),
                "hit_expert": hits[:, 1].astype(_U32).tobytes(),
                "hit_rows": hits[:, 2].astype(_U64).tobytes()}
    elif isinstance(msg, DemandMap):
        body = {"t": "dm", "model": msg.model, "sent_at": msg.sent_at,
                "entries": _entry_list(msg.entries)}
    elif isinstance(msg, LedgerBatch):
        body = {"t": "lb", "model": msg.model, "source": msg.source, "batch_id": msg.batch_id,
                "events": [[e.event_id, e.node, e.layer, e.expert, e.rows, e.at]
                           for e in msg.events]}
    elif isinstance(msg, LedgerAck):
        body = {"t": "la", "batch_id": msg.batch_id, "accepted": msg.accepted,
                "duplicates": msg.duplicates}
    elif isinstance(msg, MarketStatus):
        body = {"t": "ms", **_status_body(msg)}
    elif isinstance(msg, MarketOverview):
        body = {"t": "mo", "sent_at": msg.sent_at,
                "models": [_status_body(m) for m in msg.models]}
    elif isinstance(msg, ErrorReply):
        body = {"t": "e", "request_id": msg.request_id, "node": msg.node, "code": msg.code,
                "message": msg.message}
    else:
        raise CodecError(f"cannot encode a {type(msg).__name__}: not a market message")
    return msgpack.packb({"v": VERSION, **body}, use_bin_type=True)


# -- decoding -------------------------------------------------------------------------------

def unpack(data: Any, max_bytes: int, kinds: tuple[str, ...], what: str) -> dict:
    """Bytes -> the checked msgpack map of a message of one of ``kinds`` (the same envelope
    and version rules as the dispatch codecs: one implementation, in codec.py)."""
    return codec._unpack(data, max_bytes, kinds, what)


def _array(body: dict, record: str, name: str, dtype: np.dtype, n: int,
           width: int = 1) -> np.ndarray:
    data = _need(body, record, name)
    if not isinstance(data, bytes):
        raise _fail(record, name, f"must be bytes (msgpack bin), got {type(data).__name__}")
    expected = n * width * dtype.itemsize
    if len(data) != expected:
        raise _fail(record, name, f"has {len(data)} bytes but {n} entries need {expected}")
    return np.frombuffer(data, dtype=dtype)


def _error(body: dict) -> ErrorReply:
    r = "error reply"
    return ErrorReply(request_id=_need(body, r, "request_id"), node=_need(body, r, "node"),
                      code=_need(body, r, "code"), message=_need(body, r, "message"))


def _manifest_from(body: dict) -> Manifest:
    r = "manifest"
    n = _int(r, "n_slabs", _need(body, r, "n_slabs"), 0, MAX_SLABS)
    layer = _array(body, r, "slab_layer", _U32, n)
    expert = _array(body, r, "slab_expert", _U32, n)
    kind = _array(body, r, "slab_kind", _U8, n)
    offset = _array(body, r, "slab_offset", _U64, n)
    size = _array(body, r, "slab_size", _U64, n)
    sha = _need(body, r, "slab_sha256")
    if not isinstance(sha, bytes) or len(sha) != 32 * n:
        got = len(sha) if isinstance(sha, bytes) else type(sha).__name__
        raise _fail(r, "slab_sha256", f"must be {32 * n} bytes (32 per slab), got {got}")
    if n and int(kind.max()) >= len(KINDS):
        raise _fail(r, "slab_kind", f"has kind code {int(kind.max())} (expected 0..2)")
    hexes = sha.hex()
    slabs = [SlabRef(int(layer[i]), int(expert[i]), KINDS[kind[i]], int(offset[i]),
                     int(size[i]), hexes[64 * i:64 * i + 64]) for i in range(n)]
    return Manifest(**{f: _need(body, r, f) for f in (
        "model", "arch", "n_layer", "n_expert", "n_embd", "n_ff", "file_bytes",
        "data_offset", "source_url")}, slabs=tuple(slabs))


def _status_from(body: dict) -> MarketStatus:
    r = "market status"
    return MarketStatus(**{f: _need(body, r, f) for f in MarketStatus.__dataclass_fields__
                           if f != "fallback_rate"}, fallback_rate=body.get("fallback_rate"))


def decode_manifest(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest:
    """Bytes -> :class:`Manifest`."""
    return _manifest_from(unpack(data, max_bytes, ("mf",), "manifest"))


def decode_manifest_reply(data: bytes, *,
                          max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest | ErrorReply:
    """The answer to a manifest request: :class:`Manifest` or ErrorReply."""
    body = unpack(data, max_bytes, ("mf", "e"), "manifest reply")
    return _error(body) if body["t"] == "e" else _manifest_from(body)


def decode_volunteer(data: bytes, *, max_bytes: int = 64 * 1024) -> VolunteerRequest:
    """Bytes -> :class:`VolunteerRequest`."""
    r = "volunteer request"
    body = unpack(data, max_bytes, ("vq",), r)
    return VolunteerRequest(**{f: _need(body, r, f) for f in ("model", "node", "budget_bytes")})


def decode_volunteer_reply(data: bytes, *,
                           max_bytes: int = DEFAULT_MAX_BYTES) -> Assignment | ErrorReply:
    """The market's answer to a volunteer: :class:`Assignment` or ErrorReply: ``no_fit``
    (final for that budget), ``no_manifest`` and ``warming_up`` (ask again in a few seconds),
    ``bad_request``, ``wrong_model``, ``internal``."""
    body = unpack(data, max_bytes, ("as", "e"), "volunteer reply")
    if body["t"] == "e":
        return _error(body)
    r = "assignment"
    return Assignment(**{f: _need(body, r, f) for f in ("model", "node", "holdings", "bytes",
                                                          "reward_rate")})


def decode_routing(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> RoutingStats:
    """Bytes -> :class:`RoutingStats`."""
    r = "routing stats"
    body = unpack(data, max_bytes, ("rs",), r)
    n = _int(r, "n_hits", _need(body, r, "n_hits"), 0, MAX_HITS)
    layer = _array(body, r, "hit_layer", _U32, n)
    expert = _array(body, r, "hit_expert", _U32, n)
    rows = _array(body, r, "hit_rows", _U64, n)
    hits = tuple(zip(layer.tolist(), expert.tolist(), rows.tolist()))
    return RoutingStats(model=_need(body, r, "model"), node=_need(body, r, "node"),
                        window_s=_need(body, r, "window_s"), hits=hits,
                        fallback_rate=body.get("fallback_rate"))


def decode_demand(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> DemandMap:
    """Bytes -> :class:`DemandMap`."""
    r = "demand map"
    body = unpack(data, max_bytes, ("dm",), r)
    return DemandMap(**{f: _need(body, r, f) for f in ("model", "sent_at", "entries")})


def decode_ledger(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> LedgerBatch:
    """Bytes -> :class:`LedgerBatch`."""
    r = "ledger batch"
    body = unpack(data, max_bytes, ("lb",), r)
    return LedgerBatch(**{f: _need(body, r, f) for f in ("model", "source", "batch_id",
                                                           "events")})


def decode_ledger_reply(data: bytes, *,
                        max_bytes: int = 64 * 1024) -> LedgerAck | ErrorReply:
    """The market's answer to a ledger batch: :class:`LedgerAck` or ErrorReply. On an
    ErrorReply (``no_manifest``, ``warming_up``, ``internal``; ``bad_request`` only for a
    batch that could never be stored) the batch is not stored: keep it and send it again."""
    body = unpack(data, max_bytes, ("la", "e"), "ledger reply")
    if body["t"] == "e":
        return _error(body)
    r = "ledger ack"
    return LedgerAck(**{f: _need(body, r, f) for f in ("batch_id", "accepted", "duplicates")})


def decode_status_reply(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES
                        ) -> MarketStatus | MarketOverview | ErrorReply:
    """The market's answer to a status request (per model, or the overview of all)."""
    body = unpack(data, max_bytes, ("ms", "mo", "e"), "status reply")
    if body["t"] == "e":
        return _error(body)
    if body["t"] == "ms":
        return _status_from(body)
    r = "market overview"
    models = _need(body, r, "models")
    if not isinstance(models, list):
        raise _fail(r, "models", f"must be a list, got {type(models).__name__}")
    out = []
    for i, item in enumerate(models):
        if not isinstance(item, dict):
            raise _fail(r, f"models[{i}]", f"must be a map, got {type(item).__name__}")
        out.append(_status_from(item))
    return MarketOverview(sent_at=_need(body, r, "sent_at"), models=tuple(out))


#: ``t`` -> decoder of a whole payload, for tools that see any message (``kvasir tap``).
DECODERS = {
    "mf": decode_manifest_reply, "vq": decode_volunteer, "as": decode_volunteer_reply,
    "rs": decode_routing, "dm": decode_demand, "lb": decode_ledger, "la": decode_ledger_reply,
    "ms": decode_status_reply, "mo": decode_status_reply,
}


# -- NATS headers ---------------------------------------------------------------------------

def headers_for(msg: Message) -> dict[str, str]:
    """Human-readable NATS headers (a view for people and tools; receivers trust payloads)."""
    h = {"Kvasir-Version": str(VERSION)}
    if isinstance(msg, Manifest):
        h.update({"Kvasir-Layers": str(msg.n_layer), "Kvasir-Experts": str(msg.n_expert),
                  "Kvasir-Slabs": str(len(msg.slabs))})
    elif isinstance(msg, VolunteerRequest):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Budget": str(msg.budget_bytes)})
    elif isinstance(msg, Assignment):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Experts": str(msg.n_experts),
                  "Kvasir-Bytes": str(msg.bytes)})
    elif isinstance(msg, RoutingStats):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Hits": str(len(msg.hits))})
    elif isinstance(msg, DemandMap):
        h.update({"Kvasir-Ranges": str(len(msg.entries)),
                  "Kvasir-Holes": str(len(msg.holes))})
    elif isinstance(msg, LedgerBatch):
        h.update({"Kvasir-Node": msg.source, "Kvasir-Batch": msg.batch_id,
                  "Kvasir-Events": str(len(msg.events))})
    elif isinstance(msg, LedgerAck):
        h.update({"Kvasir-Batch": msg.batch_id, "Kvasir-Accepted": str(msg.accepted)})
    elif isinstance(msg, (MarketStatus, MarketOverview)):
        pass
    elif isinstance(msg, ErrorReply):
        h.update({"Kvasir-Node": msg.node, "Kvasir-Error": msg.code})
    else:
        raise CodecError(f"no headers for a {type(msg).__name__}: not a market message")
    return h
