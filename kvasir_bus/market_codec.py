"""Wire codecs of the coverage market (milestone M3): manifest, volunteering, routing
statistics, demand, ledger and status.

The envelope, field checks and record registry are :mod:`kvasir_bus.wire`'s, as for the
dispatch records: every payload is a msgpack map with a version ``v`` and a kind ``t``;
records are frozen and validate themselves on construction; every failure is a
:class:`~kvasir_bus.wire.CodecError` naming the record and the field.

Messages (``t``), with the subject each travels on (``M`` = model fingerprint):

* ``mf`` :class:`Manifest`         backbone -> anyone, reply on ``kvasir.M.manifest``
* ``vq`` :class:`VolunteerRequest` worker -> market on ``kvasir.M.market.volunteer.NODE``
* ``as`` :class:`Assignment`       market -> worker, the reply (or an ``e`` ErrorReply)
* ``rs`` :class:`RoutingStats`     backbone -> market on ``kvasir.M.routing``
* ``dm`` :class:`DemandMap`        market -> everyone on ``kvasir.M.demand``
* ``lb`` :class:`LedgerBatch`      backbone -> market, request on ``kvasir.M.ledger``
* ``la`` :class:`LedgerAck`        market -> backbone, the reply (or an ``e`` ErrorReply)
* ``ms`` :class:`MarketStatus`     market -> anyone, reply on ``kvasir.M.market.status``
* ``mo`` :class:`MarketOverview`   market -> anyone, reply on ``kvasir._market.status``
* ``nr`` :class:`NodeReport`       market -> a node, reply on ``kvasir.M.market.node.NODE``
* ``rv`` :class:`Revocation`       enrolment service -> market on ``kvasir._enrol.revoked``
* ``rl`` :class:`RevocationList`   enrolment service -> market, reply on ``kvasir._enrol.revocations``
* ``e``  :class:`~kvasir_bus.wire.ErrorReply` for refusals

The manifest travels as parallel little-endian arrays (and SHA-256 digests as raw bytes): 57
bytes per slab, so the 122B model's 36,864 slabs are about 2.1 MB, within deploy/nats.conf's
8 MB ``max_payload`` (not within NATS' 1 MB default).

A manifest with bias-row slabs (gpt-oss) or of a split GGUF (slabs in several part files) is
sent as message version 2 (:data:`MANIFEST_V2`): it adds ``parts`` and a ``slab_part`` array
(1 byte per slab), and kind codes 3..5 for the bias rows. A version-1 reader refuses it on the
envelope ("message version 2 is not supported") instead of fetching wrong ranges; any other
manifest is still sent as version 1, byte for byte as before.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar, Union

import numpy as np

from kvasir_bus import subjects
from kvasir_bus.wire import (  # noqa: F401 (the names callers know market_codec by)
    DEFAULT_MAX_BYTES, ERR_BAD_REQUEST, ERR_INTERNAL, ERR_NO_FIT, ERR_NO_MANIFEST,
    ERR_UNKNOWN_MODEL, ERR_WARMING_UP, ERR_WRONG_MODEL, NO_LIMITS, VERSION, CodecError,
    ErrorReply, Holding, Limits, PayloadTooLargeError, Record, UnsupportedVersionError,
    check_bool, check_float, check_holdings, check_id, check_index, check_int, check_label,
    check_model, check_node, check_opt_float, check_str, decode, encode, fail, headers_for,
    holding_list, need, record, tuple_of, unpack)

KINDS = ("gate", "up", "down")          # weight slab kinds, in the order of one expert's slabs
#: Bias-row slab kinds (gpt-oss): expert e's row of ``blk.L.ffn_{kind}_exps.bias`` (F32).
BIAS_KINDS = ("gate_bias", "up_bias", "down_bias")
SLAB_KINDS = KINDS + BIAS_KINDS         # wire kind code = index here
MANIFEST_V2 = 2                         # bias-row slabs or several parts
MAX_PARTS = 255
MAX_SLABS = 1 << 22
MAX_HITS = 1 << 22
MAX_ENTRIES = 1 << 20
MAX_LEDGER_EVENTS = 100_000
MAX_NODES = 65_536
MAX_LATENCY_NODES = 4096  # nodes with a latency in one routing window
MAX_AUDIT_NODES = 4096  # nodes with audit counts in one routing window
MAX_URL = 2048

#: Refusals that mean "not now": ask again later (a ledger batch must be kept and re-sent).
#: Any other code is final for that request.
RETRY_CODES = frozenset({ERR_NO_MANIFEST, ERR_WARMING_UP, ERR_INTERNAL})

_SHA_RE = re.compile(r"[0-9a-f]{64}")
_PART_RE = re.compile(r"[^/\\\x00-\x1f]{1,255}")
_U32, _U64, _U8 = np.dtype("<u4"), np.dtype("<u8"), np.dtype("u1")


def should_retry(reply: object) -> bool:
    """True if ``reply`` is an ErrorReply whose code is in :data:`RETRY_CODES`."""
    return isinstance(reply, ErrorReply) and reply.code in RETRY_CODES


def _array(body: dict, record: str, name: str, dtype: np.dtype, n: int) -> np.ndarray:
    data = need(body, record, name)
    if not isinstance(data, bytes):
        raise fail(record, name, f"must be bytes (msgpack bin), got {type(data).__name__}")
    expected = n * dtype.itemsize
    if len(data) != expected:
        raise fail(record, name, f"has {len(data)} bytes but {n} entries need {expected}")
    return np.frombuffer(data, dtype=dtype)


def _fields(d: Any, cls: type) -> dict:
    """A msgpack map -> keyword arguments of dataclass ``cls`` (its fields without a default
    required; those with one are additions older senders may lack)."""
    if not isinstance(d, dict):
        raise TypeError(f"expected a map, got {type(d).__name__}")
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    return {f.name: d[f.name] for f in fields(cls) if f.name in d}


# -- manifest -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlabRef:
    """One expert's tensor slab in the source GGUF: bytes ``[offset, offset + size)`` of part
    ``part`` (0 unless the model is a split GGUF)."""

    layer: int
    expert: int
    kind: str          # one of SLAB_KINDS: "gate", "up", "down" or their "_bias" rows
    offset: int        # absolute byte offset in the source file (its part)
    size: int
    sha256: str        # 64 lower-case hex digits of the slab's bytes
    part: int = 0      # index into Manifest.parts (split GGUF)

    def __post_init__(self) -> None:
        r = "slab"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("layer", check_index(r, "layer", self.layer))
        s("expert", check_index(r, "expert", self.expert))
        if self.kind not in SLAB_KINDS:
            raise fail(r, "kind", f"is {self.kind!r}, expected one of {', '.join(SLAB_KINDS)}")
        s("offset", check_int(r, "offset", self.offset, 0, (1 << 63) - 1))
        s("size", check_int(r, "size", self.size, 1, (1 << 63) - 1))
        check_str(r, "sha256", self.sha256, _SHA_RE, what="64 lower-case hex digits")
        s("part", check_int(r, "part", self.part, 0, MAX_PARTS - 1))


@dataclass(frozen=True)
class ManifestPart:
    """One file of a split GGUF (``name-0000i-of-0000n.gguf``): its name, size and where its
    tensor data starts."""

    name: str
    file_bytes: int
    data_offset: int

    def __post_init__(self) -> None:
        r = "manifest part"
        check_str(r, "name", self.name, _PART_RE, max_len=255, what="a file name (no slashes)")
        object.__setattr__(self, "file_bytes", check_int(r, "file_bytes", self.file_bytes, 0, (1 << 63) - 1))
        object.__setattr__(self, "data_offset",
                           check_int(r, "data_offset", self.data_offset, 0, self.file_bytes))


@record
@dataclass(frozen=True)
class Manifest(Record):
    """Where every expert of a model lies in its source GGUF, with a digest per slab.

    ``n_layer``: all blocks of the model (some may have no experts: dense layers);
    ``data_offset``: where the tensor data starts in the file; ``source_url``: where the file
    can be fetched by byte range ("" if nowhere). ``slabs`` are sorted on construction by
    (layer, expert, kind). Every (layer, expert) present has exactly one slab of each weight
    kind, the experts of a layer all have the bias-row slabs or none do, and a layer with
    experts has all ``n_expert`` of them.

    ``parts``: the files of a split GGUF in order (empty for a single file); ``file_bytes``
    and ``data_offset`` are then those of the first part, which ``source_url`` names, and
    each slab's ``part`` says which file its offset is in.
    """

    kind: ClassVar[str] = "mf"
    what: ClassVar[str] = "manifest"
    versions: ClassVar[tuple[int, ...]] = (VERSION, MANIFEST_V2)

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
    parts: tuple[ManifestPart, ...] = ()

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        check_label(r, "arch", self.arch)
        s("n_layer", check_int(r, "n_layer", self.n_layer, 1, subjects.MAX_INDEX))
        s("n_expert", check_int(r, "n_expert", self.n_expert, 1, subjects.MAX_INDEX))
        s("n_embd", check_int(r, "n_embd", self.n_embd, 1, 1 << 31))
        s("n_ff", check_int(r, "n_ff", self.n_ff, 1, 1 << 31))
        s("file_bytes", check_int(r, "file_bytes", self.file_bytes, 0, (1 << 63) - 1))
        s("data_offset", check_int(r, "data_offset", self.data_offset, 0, self.file_bytes))
        check_str(r, "source_url", self.source_url, max_len=MAX_URL)
        parts = tuple_of(r, "parts", self.parts, ManifestPart, MAX_PARTS,
                         build=lambda item: ManifestPart(*item))
        if len(parts) == 1:
            raise fail(r, "parts", "has one part: a single file has none")
        if parts and (parts[0].file_bytes, parts[0].data_offset) != (self.file_bytes, self.data_offset):
            raise fail(r, "parts", "[0] differs from the manifest's file_bytes and data_offset")
        s("parts", parts)
        slabs = tuple_of(r, "slabs", self.slabs, SlabRef, MAX_SLABS,
                          build=lambda item: SlabRef(*item))
        kind_order = {k: i for i, k in enumerate(SLAB_KINDS)}
        slabs = tuple(sorted(slabs, key=lambda x: (x.layer, x.expert, kind_order[x.kind])))
        s("slabs", slabs)
        self._check_slabs()

    @property
    def wire_version(self) -> int:
        """Version 2 when a version-1 reader would misread it (bias slabs, several parts)."""
        if self.parts or any(x.kind in BIAS_KINDS for x in self.slabs):
            return MANIFEST_V2
        return VERSION

    def part_bounds(self, part: int) -> tuple[int, int]:
        """``(data_offset, file_bytes)`` of file ``part`` (0 for a single file)."""
        if not self.parts:
            return self.data_offset, self.file_bytes
        p = self.parts[part]
        return p.data_offset, p.file_bytes

    def _check_slabs(self) -> None:
        r = "manifest"
        seen: dict[tuple[int, int], list[str]] = {}
        for i, slab in enumerate(self.slabs):
            where = f"slabs[{i}]"
            if slab.layer >= self.n_layer:
                raise fail(r, where, f"has layer {slab.layer}, but the model has "
                                      f"{self.n_layer} layers")
            if slab.expert >= self.n_expert:
                raise fail(r, where, f"has expert {slab.expert}, but layers have "
                                      f"{self.n_expert} experts")
            if slab.part >= max(1, len(self.parts)):
                raise fail(r, where, f"is in part {slab.part}, but the model has "
                                      f"{max(1, len(self.parts))} file(s)")
            lo, hi = self.part_bounds(slab.part)
            if slab.offset < lo or slab.offset + slab.size > hi:
                raise fail(r, where, f"bytes [{slab.offset}, {slab.offset + slab.size}) lie "
                                      f"outside the tensor data [{lo}, {hi})")
            kinds = seen.setdefault((slab.layer, slab.expert), [])
            if slab.kind in kinds:
                raise fail(r, where, f"repeats layer {slab.layer} expert {slab.expert} "
                                      f"{slab.kind}")
            kinds.append(slab.kind)
        per_layer: dict[int, int] = {}
        layer_kinds: dict[int, frozenset[str]] = {}
        for (layer, expert), kinds in seen.items():
            missing = [k for k in KINDS if k not in kinds]
            if any(k in kinds for k in BIAS_KINDS):
                missing += [k for k in BIAS_KINDS if k not in kinds]
            if missing:
                raise fail(r, "slabs", f"lack the {', '.join(missing)} slab of layer {layer} "
                                        f"expert {expert}")
            if layer_kinds.setdefault(layer, frozenset(kinds)) != frozenset(kinds):
                raise fail(r, "slabs", f"of layer {layer}: some experts have bias-row slabs, "
                                        f"expert {expert} has not")
            per_layer[layer] = per_layer.get(layer, 0) + 1
        for layer, count in per_layer.items():
            if count != self.n_expert:
                raise fail(r, "slabs", f"cover {count} experts of layer {layer}, expected "
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
        """The gate, up and down slabs of one expert (then its bias rows, if the model has
        them); KeyError if the manifest has none."""
        try:
            return self._index[(layer, expert)]
        except KeyError:
            raise KeyError(f"manifest of {self.model} has no layer {layer} expert "
                           f"{expert}") from None

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer`` (all its slabs); KeyError for a dense layer."""
        try:
            return self._expert_bytes[layer]
        except KeyError:
            raise KeyError(f"manifest of {self.model}: layer {layer} has no experts") from None

    def body(self) -> dict[str, Any]:
        n = len(self.slabs)
        kind = {k: i for i, k in enumerate(SLAB_KINDS)}
        layer = np.fromiter((x.layer for x in self.slabs), dtype=_U32, count=n)
        expert = np.fromiter((x.expert for x in self.slabs), dtype=_U32, count=n)
        kinds = np.fromiter((kind[x.kind] for x in self.slabs), dtype=_U8, count=n)
        offset = np.fromiter((x.offset for x in self.slabs), dtype=_U64, count=n)
        size = np.fromiter((x.size for x in self.slabs), dtype=_U64, count=n)
        sha = bytes.fromhex("".join(x.sha256 for x in self.slabs))
        return {"model": self.model, "arch": self.arch, "n_layer": self.n_layer,
                "n_expert": self.n_expert, "n_embd": self.n_embd, "n_ff": self.n_ff,
                "file_bytes": self.file_bytes, "data_offset": self.data_offset,
                "source_url": self.source_url, "n_slabs": n,
                "slab_layer": layer.tobytes(), "slab_expert": expert.tobytes(),
                "slab_kind": kinds.tobytes(), "slab_offset": offset.tobytes(),
                "slab_size": size.tobytes(), "slab_sha256": sha,
                **self._body_v2()}

    def _body_v2(self) -> dict[str, Any]:
        if self.wire_version < MANIFEST_V2:
            return {}
        part = np.fromiter((x.part for x in self.slabs), dtype=_U8, count=len(self.slabs))
        return {"parts": [[p.name, p.file_bytes, p.data_offset] for p in self.parts],
                "slab_part": part.tobytes()}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Manifest:
        r = cls.what
        v2 = body.get("v") == MANIFEST_V2
        n = check_int(r, "n_slabs", need(body, r, "n_slabs"), 0, MAX_SLABS)
        layer = _array(body, r, "slab_layer", _U32, n)
        expert = _array(body, r, "slab_expert", _U32, n)
        kind = _array(body, r, "slab_kind", _U8, n)
        offset = _array(body, r, "slab_offset", _U64, n)
        size = _array(body, r, "slab_size", _U64, n)
        sha = need(body, r, "slab_sha256")
        if not isinstance(sha, bytes) or len(sha) != 32 * n:
            got = len(sha) if isinstance(sha, bytes) else type(sha).__name__
            raise fail(r, "slab_sha256", f"must be {32 * n} bytes (32 per slab), got {got}")
        kinds = SLAB_KINDS if v2 else KINDS
        if n and int(kind.max()) >= len(kinds):
            raise fail(r, "slab_kind", f"has kind code {int(kind.max())} (expected 0..{len(kinds) - 1})")
        part = _array(body, r, "slab_part", _U8, n) if v2 else np.zeros(n, dtype=_U8)
        parts = need(body, r, "parts") if v2 else ()
        hexes = sha.hex()
        slabs = [SlabRef(int(layer[i]), int(expert[i]), kinds[kind[i]], int(offset[i]),
                         int(size[i]), hexes[64 * i:64 * i + 64], int(part[i])) for i in range(n)]
        return cls(**{f: need(body, r, f) for f in (
            "model", "arch", "n_layer", "n_expert", "n_embd", "n_ff", "file_bytes",
            "data_offset", "source_url")}, slabs=tuple(slabs), parts=parts)

    def headers(self) -> dict[str, str]:
        parts = {"Kvasir-Parts": str(len(self.parts))} if self.parts else {}
        return {"Kvasir-Layers": str(self.n_layer), "Kvasir-Experts": str(self.n_expert),
                "Kvasir-Slabs": str(len(self.slabs)), **parts}


# -- volunteering ---------------------------------------------------------------------------

@record
@dataclass(frozen=True)
class VolunteerRequest(Record):
    """A worker offers ``budget_bytes`` of memory for experts of ``model``."""

    kind: ClassVar[str] = "vq"
    what: ClassVar[str] = "volunteer request"

    model: str
    node: str
    budget_bytes: int

    def __post_init__(self) -> None:
        r = self.what
        object.__setattr__(self, "model", check_model(r, self.model))
        object.__setattr__(self, "node", check_node(r, "node", self.node))
        object.__setattr__(self, "budget_bytes",
                           check_int(r, "budget_bytes", self.budget_bytes, 0, (1 << 63) - 1))

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "node": self.node, "budget_bytes": self.budget_bytes}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> VolunteerRequest:
        return cls(**{f: need(body, cls.what, f) for f in ("model", "node", "budget_bytes")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node, "Kvasir-Budget": str(self.budget_bytes)}


@record
@dataclass(frozen=True)
class Assignment(Record):
    """What a volunteer should hold: half-open ``holdings``, ``bytes`` in all, and the reward
    per row served it earns there at the moment of assignment."""

    kind: ClassVar[str] = "as"
    what: ClassVar[str] = "assignment"

    model: str
    node: str
    holdings: tuple[Holding, ...]
    bytes: int
    reward_rate: float

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("node", check_node(r, "node", self.node))
        s("holdings", check_holdings(r, self.holdings))
        if not self.holdings:
            raise fail(r, "holdings", "is empty: an assignment holds at least one expert")
        s("bytes", check_int(r, "bytes", self.bytes, 1, (1 << 63) - 1))
        s("reward_rate", check_float(r, "reward_rate", self.reward_rate))

    @property
    def n_experts(self) -> int:
        return sum(h.count for h in self.holdings)

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "node": self.node,
                "holdings": holding_list(self.holdings), "bytes": self.bytes,
                "reward_rate": self.reward_rate}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Assignment:
        return cls(**{f: need(body, cls.what, f) for f in ("model", "node", "holdings", "bytes",
                                                             "reward_rate")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node, "Kvasir-Experts": str(self.n_experts),
                "Kvasir-Bytes": str(self.bytes)}


# -- routing statistics ---------------------------------------------------------------------

def _hit_list(r: str, field: str, value: Any) -> tuple[tuple[int, int, int], ...]:
    """``(layer, expert, rows)`` triples, checked."""
    if isinstance(value, np.ndarray):
        value = tuple(tuple(int(v) for v in row) for row in value.reshape(-1, 3))
    if not isinstance(value, (list, tuple)):
        raise fail(r, field, f"must be a list of (layer, expert, rows), got {type(value).__name__}")
    if len(value) > MAX_HITS:
        raise fail(r, field, f"has {len(value)} entries (max {MAX_HITS})")
    out = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise fail(r, where, f"must be (layer, expert, rows), got {item!r}")
        out.append((check_index(r, where + ".layer", item[0]),
                    check_index(r, where + ".expert", item[1]),
                    check_int(r, where + ".rows", item[2], 0, (1 << 63) - 1)))
    return tuple(out)


def _hit_body(count: str, prefix: str, hits) -> dict[str, Any]:
    a = np.asarray(hits, dtype=np.uint64).reshape(-1, 3)
    return {count: len(hits), f"{prefix}_layer": a[:, 0].astype(_U32).tobytes(),
            f"{prefix}_expert": a[:, 1].astype(_U32).tobytes(),
            f"{prefix}_rows": a[:, 2].astype(_U64).tobytes()}


def _hit_read(body: dict, r: str, count: str, prefix: str) -> tuple:
    n = check_int(r, count, need(body, r, count), 0, MAX_HITS)
    return tuple(zip(_array(body, r, f"{prefix}_layer", _U32, n).tolist(),
                     _array(body, r, f"{prefix}_expert", _U32, n).tolist(),
                     _array(body, r, f"{prefix}_rows", _U64, n).tolist()))


def _latency_list(r: str, field: str, value: Any) -> tuple[tuple[str, int, float], ...]:
    """``(node, calls, mean_ms)`` triples, checked: at most one per node, calls >= 1."""
    if not isinstance(value, (list, tuple)):
        raise fail(r, field, f"must be a list of (node, calls, mean_ms), got {type(value).__name__}")
    if len(value) > MAX_LATENCY_NODES:
        raise fail(r, field, f"has {len(value)} entries (max {MAX_LATENCY_NODES})")
    out, seen = [], set()
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise fail(r, where, f"must be (node, calls, mean_ms), got {item!r}")
        node = check_node(r, where + ".node", item[0])
        if node in seen:
            raise fail(r, where + ".node", f"repeats node {node}")
        seen.add(node)
        out.append((node, check_int(r, where + ".calls", item[1], 1, 1 << 40),
                    check_float(r, where + ".mean_ms", item[2])))
    return tuple(out)


def _audit_list(r: str, field: str, value: Any) -> tuple[tuple[str, int, int], ...]:
    """``(node, passed, failed)`` triples, checked: at most one per node, at least one audit each."""
    if not isinstance(value, (list, tuple)):
        raise fail(r, field, f"must be a list of (node, passed, failed), got {type(value).__name__}")
    if len(value) > MAX_AUDIT_NODES:
        raise fail(r, field, f"has {len(value)} entries (max {MAX_AUDIT_NODES})")
    out, seen = [], set()
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise fail(r, where, f"must be (node, passed, failed), got {item!r}")
        node = check_node(r, where + ".node", item[0])
        if node in seen:
            raise fail(r, where + ".node", f"repeats node {node}")
        seen.add(node)
        passed = check_int(r, where + ".passed", item[1], 0, 1 << 40)
        failed = check_int(r, where + ".failed", item[2], 0, 1 << 40)
        if passed + failed == 0:
            raise fail(r, where, "counts no audit")
        out.append((node, passed, failed))
    return tuple(out)


@record
@dataclass(frozen=True)
class RoutingStats(Record):
    """How often the router selected each expert during the last ``window_s`` seconds.

    ``hits``: sparse ``(layer, expert, rows)``, rows = token rows routed to that expert
    (experts not listed had none). ``fallback_rate``: expert calls the backbone computed
    itself / all expert calls in the window (None: not measured). ``node``: the backbone.
    ``remote``: sparse ``(layer, expert, rows)`` of the rows a worker's reply won (optional,
    a later field): the market never credits more rows to (layer, expert) than these.
    ``latency``: ``(node, calls, mean_ms)`` per worker whose replies won in the window, the
    mean time from request to its last reply chunk as the backbone measured it (optional,
    a later field; a quarantined node has none). ``tokens``: tokens the backbone ran
    through its MoE layers in the window (optional; 0: not counted, and left off
    the wire, as older backbones do), so the market can show tokens/s rather than rows/s.
    ``audits``: ``(node, passed, failed)`` per worker the backbone audited in the window, the
    audits it judged (passed and failed) of that node's replies (optional, a later field): the
    market adds them up per node, once per record (its id), and shows them in its status.
    """

    kind: ClassVar[str] = "rs"
    what: ClassVar[str] = "routing stats"

    model: str
    node: str
    window_s: float
    hits: tuple[tuple[int, int, int], ...]
    fallback_rate: float | None = None
    remote: tuple[tuple[int, int, int], ...] = ()
    latency: tuple[tuple[str, int, float], ...] = ()
    tokens: int = 0
    audits: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("node", check_node(r, "node", self.node))
        s("window_s", check_float(r, "window_s", self.window_s))
        s("tokens", check_int(r, "tokens", self.tokens, 0, 1 << 40))
        s("fallback_rate", check_opt_float(r, "fallback_rate", self.fallback_rate, 0.0, 1.0))
        s("hits", _hit_list(r, "hits", self.hits))
        s("remote", _hit_list(r, "remote", self.remote))
        s("latency", _latency_list(r, "latency", self.latency))
        s("audits", _audit_list(r, "audits", self.audits))

    def body(self) -> dict[str, Any]:
        out = {"model": self.model, "node": self.node, "window_s": self.window_s,
               "fallback_rate": self.fallback_rate, **_hit_body("n_hits", "hit", self.hits)}
        if self.remote:  # absent when empty: older readers see the record they know
            out.update(_hit_body("n_remote", "remote", self.remote))
        if self.latency:  # likewise
            out["latency"] = [list(item) for item in self.latency]
        if self.tokens:  # likewise
            out["tokens"] = self.tokens
        if self.audits:  # likewise
            out["audits"] = [list(item) for item in self.audits]
        return out

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> RoutingStats:
        r = cls.what
        return cls(model=need(body, r, "model"), node=need(body, r, "node"),
                   window_s=need(body, r, "window_s"), hits=_hit_read(body, r, "n_hits", "hit"),
                   fallback_rate=body.get("fallback_rate"),
                   remote=_hit_read(body, r, "n_remote", "remote") if "n_remote" in body else (),
                   latency=body.get("latency", ()), tokens=body.get("tokens", 0),
                   audits=body.get("audits", ()))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node, "Kvasir-Hits": str(len(self.hits))}


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
        s("layer", check_index(r, "layer", self.layer))
        s("lo", check_index(r, "lo", self.lo))
        s("hi", check_int(r, "hi", self.hi, 0, subjects.MAX_INDEX + 1))
        if self.hi <= self.lo:
            raise fail(r, "hi", f"must be > lo (half-open range), got lo={self.lo}, "
                                 f"hi={self.hi}")
        s("replicas", check_int(r, "replicas", self.replicas, 0, 1 << 31))
        s("target", check_int(r, "target", self.target, 0, 1 << 31))
        s("usage", check_float(r, "usage", self.usage))
        s("demand", check_float(r, "demand", self.demand))
        s("reward_rate", check_float(r, "reward_rate", self.reward_rate))

    @property
    def missing(self) -> int:
        return max(0, self.target - self.replicas)

    @property
    def holding(self) -> Holding:
        return Holding(self.layer, self.lo, self.hi)


def _entry(item: Any) -> DemandEntry:
    return DemandEntry(*item)


@record
@dataclass(frozen=True)
class DemandMap(Record):
    """The market's demand over every range of ``model``, as of ``sent_at`` (Unix seconds)."""

    kind: ClassVar[str] = "dm"
    what: ClassVar[str] = "demand map"

    model: str
    sent_at: float
    entries: tuple[DemandEntry, ...]

    def __post_init__(self) -> None:
        r = self.what
        object.__setattr__(self, "model", check_model(r, self.model))
        object.__setattr__(self, "sent_at", check_float(r, "sent_at", self.sent_at))
        object.__setattr__(self, "entries", tuple_of(r, "entries", self.entries, DemandEntry,
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

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "sent_at": self.sent_at,
                "entries": _entry_list(self.entries)}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> DemandMap:
        return cls(**{f: need(body, cls.what, f) for f in ("model", "sent_at", "entries")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Ranges": str(len(self.entries)), "Kvasir-Holes": str(len(self.holes))}


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
        check_id(r, "event_id", self.event_id)
        s("node", check_node(r, "node", self.node))
        s("layer", check_index(r, "layer", self.layer))
        s("expert", check_index(r, "expert", self.expert))
        s("rows", check_int(r, "rows", self.rows, 1, 1 << 40))
        s("at", check_float(r, "at", self.at))


@record
@dataclass(frozen=True)
class LedgerBatch(Record):
    """Ledger events from backbone ``source``, sent by request on ``kvasir.<model>.ledger``
    until a :class:`LedgerAck` with the same ``batch_id`` comes back."""

    kind: ClassVar[str] = "lb"
    what: ClassVar[str] = "ledger batch"

    model: str
    source: str
    batch_id: str
    events: tuple[LedgerEvent, ...]

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("source", check_node(r, "source", self.source))
        check_id(r, "batch_id", self.batch_id)
        s("events", tuple_of(r, "events", self.events, LedgerEvent, MAX_LEDGER_EVENTS,
                              build=lambda item: LedgerEvent(*item)))

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "source": self.source, "batch_id": self.batch_id,
                "events": [[e.event_id, e.node, e.layer, e.expert, e.rows, e.at]
                           for e in self.events]}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> LedgerBatch:
        return cls(**{f: need(body, cls.what, f) for f in ("model", "source", "batch_id",
                                                             "events")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.source, "Kvasir-Batch": self.batch_id,
                "Kvasir-Events": str(len(self.events))}


@record
@dataclass(frozen=True)
class LedgerAck(Record):
    """The market stored batch ``batch_id``: ``accepted`` new events, ``duplicates`` seen
    before (or twice in the batch). Sent only after the events are durable."""

    kind: ClassVar[str] = "la"
    what: ClassVar[str] = "ledger ack"

    batch_id: str
    accepted: int
    duplicates: int

    def __post_init__(self) -> None:
        r = self.what
        check_id(r, "batch_id", self.batch_id)
        object.__setattr__(self, "accepted", check_int(r, "accepted", self.accepted))
        object.__setattr__(self, "duplicates", check_int(r, "duplicates", self.duplicates))

    def body(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "accepted": self.accepted,
                "duplicates": self.duplicates}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> LedgerAck:
        return cls(**{f: need(body, cls.what, f) for f in ("batch_id", "accepted",
                                                             "duplicates")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Batch": self.batch_id, "Kvasir-Accepted": str(self.accepted)}


# -- status ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeStatus:
    """One worker as the market sees it. ``holdings``: from its last heartbeat;
    ``pending``: assigned but not yet confirmed by a heartbeat (they count as replicas for a
    grace period); ``age_s``: seconds since its last heartbeat (None: none yet);
    ``latency_ms``: the mean latency of its won replies in the last routing window a backbone
    reported it in (None: it has not served lately)."""

    node: str
    holdings: tuple[Holding, ...]
    pending: tuple[Holding, ...]
    budget_bytes: int
    load: float
    served: int
    age_s: float | None
    version: str
    kernel: str
    latency_ms: float | None = None
    oversubscribed: bool = False  # its heartbeat says its threads exceed its share of its cores

    def __post_init__(self) -> None:
        r = "node status"
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("node", check_node(r, "node", self.node))
        s("holdings", check_holdings(r, self.holdings))
        s("pending", check_holdings(r + " (pending)", self.pending))
        s("budget_bytes", check_int(r, "budget_bytes", self.budget_bytes, 0, (1 << 63) - 1))
        s("load", check_float(r, "load", self.load))
        s("served", check_int(r, "served", self.served, 0, (1 << 63) - 1))
        s("age_s", check_opt_float(r, "age_s", self.age_s))
        check_str(r, "version", self.version, max_len=64)
        check_str(r, "kernel", self.kernel, max_len=64)
        s("latency_ms", check_opt_float(r, "latency_ms", self.latency_ms))
        s("oversubscribed", check_bool(r, "oversubscribed", self.oversubscribed))


@dataclass(frozen=True)
class NodeTotals:
    """Ledger totals of one node: events counted, rows served, reward earned."""

    node: str
    events: int
    rows: int
    reward: float

    def __post_init__(self) -> None:
        r = "node totals"
        object.__setattr__(self, "node", check_node(r, "node", self.node))
        object.__setattr__(self, "events", check_int(r, "events", self.events, 0, (1 << 63) - 1))
        object.__setattr__(self, "rows", check_int(r, "rows", self.rows, 0, (1 << 63) - 1))
        object.__setattr__(self, "reward", check_float(r, "reward", self.reward))


@dataclass(frozen=True)
class NodeAudits:
    """Audits of one node's replies that the backbones judged and reported (routing
    statistics' ``audits``), as the market added them up: ``passed`` and ``failed``."""

    node: str
    passed: int
    failed: int

    def __post_init__(self) -> None:
        r = "node audits"
        object.__setattr__(self, "node", check_node(r, "node", self.node))
        object.__setattr__(self, "passed", check_int(r, "passed", self.passed, 0, (1 << 63) - 1))
        object.__setattr__(self, "failed", check_int(r, "failed", self.failed, 0, (1 << 63) - 1))


@record
@dataclass(frozen=True)
class Quarantine(Record):
    """The backbone caught ``node`` in a failed audit of its reply for (``layer``, ``expert``):
    from now on its replies are ignored and it earns nothing. ``error``: the relative L2 error of
    the reply against the backbone's own result (inf for a non-finite or misshaped reply);
    ``exact``: whether identical bits were demanded; ``at``: Unix time (seconds)."""

    kind: ClassVar[str] = "q"
    what: ClassVar[str] = "quarantine"

    model: str
    node: str
    layer: int
    expert: int
    kernel: str
    exact: bool
    error: float
    at: float
    since: float = 0.0  # the node's last passed audit (Unix time; 0: none): only its events from then on are void

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("since", check_float(r, "since", self.since))
        s("model", check_model(r, self.model))
        s("node", check_node(r, "node", self.node))
        s("layer", check_index(r, "layer", self.layer))
        s("expert", check_index(r, "expert", self.expert))
        if self.kernel:
            check_label(r, "kernel", self.kernel)
        s("exact", check_bool(r, "exact", self.exact))
        if not (isinstance(self.error, (int, float)) and not isinstance(self.error, bool)) or self.error != self.error \
                or self.error < 0:
            raise CodecError(f"{r}: field 'error' must be a number >= 0 or inf, got {self.error!r}", "error")
        s("error", float(self.error))
        s("at", check_float(r, "at", self.at))

    def body(self) -> dict[str, Any]:
        body = {f: getattr(self, f) for f in ("model", "node", "layer", "expert", "kernel", "exact",
                                              "error", "at")}
        if self.since:  # absent: the bytes of a verdict without it (everything of the node void)
            body["since"] = self.since
        return body

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Quarantine:
        return cls(**{f: need(body, cls.what, f) for f in ("model", "node", "layer", "expert", "kernel",
                                                             "exact", "error", "at")},
                   since=body.get("since", 0.0))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Model": self.model, "Kvasir-Node": self.node, "Kvasir-Layer": str(self.layer),
                "Kvasir-Expert": str(self.expert)}


def decode_quarantine(data: bytes, *, max_bytes: int = 64 * 1024) -> Quarantine:
    """Bytes -> :class:`Quarantine`."""
    return decode(data, ("q",), Quarantine.what, max_bytes=max_bytes)


MAX_QUARANTINED_LISTED = 4096  # quarantined nodes a market status lists (the most recent)
MAX_REVOKED_LISTED = 64  # revocations a market status or the enrolment service's list carries (the most recent)
_USER_KEY_RE = re.compile(r"U[A-Z2-7]{55}")
_LINE_RE = re.compile(r"[^\x00-\x1f\x7f]{0,200}")


@record
@dataclass(frozen=True)
class Revocation(Record):
    """The enrolment service revoked enrolled node ``node``'s user key ``key`` at ``at`` (Unix
    time): the server dropped it and refuses it from then on. ``why``: one line (the verdict
    that caught it); ``model``: the model of that verdict ("" if none). Published on
    ``kvasir._enrol.revoked``; a market lists the most recent in its status."""

    kind: ClassVar[str] = "rv"
    what: ClassVar[str] = "revocation"

    node: str
    key: str
    at: float
    why: str
    model: str = ""

    def __post_init__(self) -> None:
        r = self.what
        object.__setattr__(self, "node", check_node(r, "node", self.node))
        check_str(r, "key", self.key, _USER_KEY_RE, what="a user public nkey (U...)")
        object.__setattr__(self, "at", check_float(r, "at", self.at))
        check_str(r, "why", self.why, _LINE_RE, max_len=200, what="one line of text")
        if self.model:
            check_model(r, self.model)

    def body(self) -> dict[str, Any]:
        return {"node": self.node, "key": self.key, "at": self.at, "why": self.why,
                **({"model": self.model} if self.model else {})}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> Revocation:
        if not isinstance(body, dict):
            raise CodecError(f"{cls.what}: must be a map, got {type(body).__name__}")
        return cls(**{f: need(body, cls.what, f) for f in ("node", "key", "at", "why")},
                   model=body.get("model", ""))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Node": self.node}


@record
@dataclass(frozen=True)
class RevocationList(Record):
    """The enrolment service's answer on ``kvasir._enrol.revocations``: its most recent
    revocations, oldest first."""

    kind: ClassVar[str] = "rl"
    what: ClassVar[str] = "revocation list"

    revoked: tuple[Revocation, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "revoked", tuple_of(self.what, "revoked", self.revoked, Revocation,
                                                      MAX_REVOKED_LISTED, build=Revocation.from_body))

    def body(self) -> dict[str, Any]:
        return {"revoked": [x.body() for x in self.revoked]}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> RevocationList:
        return cls(revoked=need(body, cls.what, "revoked"))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Revoked": str(len(self.revoked))}


def decode_revocation(data: bytes, *, max_bytes: int = 4096) -> Revocation:
    """Bytes -> :class:`Revocation`."""
    return decode(data, ("rv",), Revocation.what, max_bytes=max_bytes)


def decode_revocation_list(data: bytes, *, max_bytes: int = 64 * 1024) -> RevocationList | ErrorReply:
    """The enrolment service's answer on ``kvasir._enrol.revocations``."""
    return decode(data, ("rl", "e"), RevocationList.what, max_bytes=max_bytes)


@record
@dataclass(frozen=True)
class MarketStatus(Record):
    """The market's view of one model: its shape (0 while no manifest is known), the range
    size it cuts layers into, each worker, the demand map, ledger totals per node, and the
    backbone's fallback rate (None: no backbone reported one recently)."""

    kind: ClassVar[str] = "ms"
    what: ClassVar[str] = "market status"

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
    quarantined: tuple[str, ...] = ()  # nodes a backbone caught (a backbone loads them at start), most recent
    revoked: tuple[Revocation, ...] = ()  # keys the enrolment service revoked (most recent, oldest first)
    audits: tuple[NodeAudits, ...] = ()  # per node, the audits backbones reported (most recently audited first)

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("market", check_node(r, "market", self.market))
        s("sent_at", check_float(r, "sent_at", self.sent_at))
        s("manifest_known", check_bool(r, "manifest_known", self.manifest_known))
        s("n_layer", check_int(r, "n_layer", self.n_layer, 0, subjects.MAX_INDEX))
        s("n_expert", check_int(r, "n_expert", self.n_expert, 0, subjects.MAX_INDEX))
        s("range_experts", check_int(r, "range_experts", self.range_experts, 1, subjects.MAX_INDEX))
        s("expiry_s", check_float(r, "expiry_s", self.expiry_s))
        s("nodes", tuple_of(r, "nodes", self.nodes, NodeStatus, MAX_NODES,
                             build=lambda d: NodeStatus(**_fields(d, NodeStatus))))
        s("demand", tuple_of(r, "demand", self.demand, DemandEntry, MAX_ENTRIES,
                              build=_entry))
        s("totals", tuple_of(r, "totals", self.totals, NodeTotals, MAX_NODES,
                              build=lambda item: NodeTotals(*item)))
        s("fallback_rate", check_opt_float(r, "fallback_rate", self.fallback_rate, 0.0, 1.0))
        if not isinstance(self.quarantined, (list, tuple)) or len(self.quarantined) > MAX_QUARANTINED_LISTED:
            raise CodecError(f"{r}: field 'quarantined' must be a list of at most {MAX_QUARANTINED_LISTED} nodes",
                             "quarantined")
        s("quarantined", tuple(check_node(r, "quarantined", n) for n in self.quarantined))
        s("revoked", tuple_of(r, "revoked", self.revoked, Revocation, MAX_REVOKED_LISTED,
                              build=Revocation.from_body))
        s("audits", tuple_of(r, "audits", self.audits, NodeAudits, MAX_NODES,
                             build=lambda item: NodeAudits(*item)))

    def body(self) -> dict[str, Any]:
        extra = {"quarantined": list(self.quarantined)} if self.quarantined else {}  # absent: the old bytes
        if self.revoked:
            extra["revoked"] = [x.body() for x in self.revoked]
        if self.audits:  # likewise absent when none
            extra["audits"] = [[a.node, a.passed, a.failed] for a in self.audits]
        return {**extra, "model": self.model, "market": self.market, "sent_at": self.sent_at,
                "manifest_known": self.manifest_known, "n_layer": self.n_layer,
                "n_expert": self.n_expert, "range_experts": self.range_experts,
                "expiry_s": self.expiry_s,
                "nodes": [{"node": n.node, "holdings": holding_list(n.holdings),
                           "pending": holding_list(n.pending), "budget_bytes": n.budget_bytes,
                           "load": n.load, "served": n.served, "age_s": n.age_s,
                           "version": n.version, "kernel": n.kernel,
                           **({} if n.latency_ms is None else {"latency_ms": n.latency_ms}),
                           **({"oversubscribed": True} if n.oversubscribed else {})}
                          for n in self.nodes],
                "demand": _entry_list(self.demand),
                "totals": [[t.node, t.events, t.rows, t.reward] for t in self.totals],
                "fallback_rate": self.fallback_rate}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> MarketStatus:
        return cls(**{f.name: need(body, cls.what, f.name) for f in fields(cls)
                      if f.name not in ("fallback_rate", "quarantined", "revoked", "audits")},
                   fallback_rate=body.get("fallback_rate"), quarantined=tuple(body.get("quarantined", ())),
                   revoked=body.get("revoked", ()), audits=body.get("audits", ()))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Market": self.market, "Kvasir-Nodes": str(len(self.nodes))}


@record
@dataclass(frozen=True)
class MarketOverview(Record):
    """The market's view of every model it knows."""

    kind: ClassVar[str] = "mo"
    what: ClassVar[str] = "market overview"

    sent_at: float
    models: tuple[MarketStatus, ...] = field(default=())

    def __post_init__(self) -> None:
        r = self.what
        object.__setattr__(self, "sent_at", check_float(r, "sent_at", self.sent_at))
        object.__setattr__(self, "models", tuple_of(r, "models", self.models, MarketStatus,
                                                     4096))

    def body(self) -> dict[str, Any]:
        return {"sent_at": self.sent_at, "models": [m.body() for m in self.models]}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> MarketOverview:
        r = cls.what
        models = need(body, r, "models")
        if not isinstance(models, list):
            raise fail(r, "models", f"must be a list, got {type(models).__name__}")
        out = []
        for i, item in enumerate(models):
            if not isinstance(item, dict):
                raise fail(r, f"models[{i}]", f"must be a map, got {type(item).__name__}")
            out.append(MarketStatus.from_body(item))
        return cls(sent_at=need(body, r, "sent_at"), models=tuple(out))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Models": str(len(self.models))}


@record
@dataclass(frozen=True)
class NodeReport(Record):
    """What the market holds of one node of ``model``: the ledger's credit (``events``,
    ``rows``, ``reward``), the audits the backbones reported of its replies (``audits_passed``,
    ``audits_failed``) and whether it is quarantined: a few dozen bytes, so a worker (a browser
    tab) can ask for its own every few seconds without fetching the whole market status."""

    kind: ClassVar[str] = "nr"
    what: ClassVar[str] = "node report"

    model: str
    node: str
    market: str
    sent_at: float
    events: int
    rows: int
    reward: float
    audits_passed: int
    audits_failed: int
    quarantined: bool

    def __post_init__(self) -> None:
        r = self.what
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("model", check_model(r, self.model))
        s("node", check_node(r, "node", self.node))
        s("market", check_node(r, "market", self.market))
        s("sent_at", check_float(r, "sent_at", self.sent_at))
        for name in ("events", "rows", "audits_passed", "audits_failed"):
            s(name, check_int(r, name, getattr(self, name), 0, (1 << 63) - 1))
        s("reward", check_float(r, "reward", self.reward))
        s("quarantined", check_bool(r, "quarantined", self.quarantined))

    def body(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> NodeReport:
        return cls(**{f.name: need(body, cls.what, f.name) for f in fields(cls)})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Market": self.market, "Kvasir-Node": self.node}


Message = Union[Manifest, VolunteerRequest, Assignment, RoutingStats, DemandMap, LedgerBatch,
                LedgerAck, MarketStatus, MarketOverview, NodeReport, ErrorReply]


def _entry_list(entries) -> list[list]:
    return [[e.layer, e.lo, e.hi, e.replicas, e.target, e.usage, e.demand, e.reward_rate]
            for e in entries]


# -- decoding -------------------------------------------------------------------------------

def decode_manifest(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest:
    """Bytes -> :class:`Manifest`."""
    return decode(data, ("mf",), Manifest.what, max_bytes=max_bytes)


def decode_manifest_reply(data: bytes, *,
                          max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest | ErrorReply:
    """The answer to a manifest request: :class:`Manifest` or ErrorReply."""
    return decode(data, ("mf", "e"), "manifest reply", max_bytes=max_bytes)


def decode_volunteer(data: bytes, *, max_bytes: int = 64 * 1024) -> VolunteerRequest:
    """Bytes -> :class:`VolunteerRequest`."""
    return decode(data, ("vq",), VolunteerRequest.what, max_bytes=max_bytes)


def decode_volunteer_reply(data: bytes, *,
                           max_bytes: int = DEFAULT_MAX_BYTES) -> Assignment | ErrorReply:
    """The market's answer to a volunteer: :class:`Assignment` or ErrorReply: ``no_fit``
    (final for that budget), ``no_manifest`` and ``warming_up`` (ask again in a few seconds),
    ``bad_request``, ``wrong_model``, ``internal``."""
    return decode(data, ("as", "e"), "volunteer reply", max_bytes=max_bytes)


def decode_routing(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> RoutingStats:
    """Bytes -> :class:`RoutingStats`."""
    return decode(data, ("rs",), RoutingStats.what, max_bytes=max_bytes)


def decode_demand(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> DemandMap:
    """Bytes -> :class:`DemandMap`."""
    return decode(data, ("dm",), DemandMap.what, max_bytes=max_bytes)


def decode_ledger(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> LedgerBatch:
    """Bytes -> :class:`LedgerBatch`."""
    return decode(data, ("lb",), LedgerBatch.what, max_bytes=max_bytes)


def decode_ledger_reply(data: bytes, *,
                        max_bytes: int = 64 * 1024) -> LedgerAck | ErrorReply:
    """The market's answer to a ledger batch: :class:`LedgerAck` or ErrorReply. On an
    ErrorReply (``no_manifest``, ``warming_up``, ``internal``; ``bad_request`` only for a
    batch that could never be stored) the batch is not stored: keep it and send it again."""
    return decode(data, ("la", "e"), "ledger reply", max_bytes=max_bytes)


def decode_node_report_reply(data: bytes, *, max_bytes: int = 64 * 1024) -> NodeReport | ErrorReply:
    """The market's answer on ``kvasir.<model>.market.node.<node>``."""
    return decode(data, ("nr", "e"), "node report reply", max_bytes=max_bytes)


def decode_status_reply(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES
                        ) -> MarketStatus | MarketOverview | ErrorReply:
    """The market's answer to a status request (per model, or the overview of all)."""
    return decode(data, ("ms", "mo", "e"), "status reply", max_bytes=max_bytes)
