"""The coverage map: which node holds which experts, built from heartbeats.

Pure: every method takes ``now`` (Unix seconds) instead of reading a clock, so tests can walk
time by hand.

* A heartbeat makes a node *live* with the holdings it announces. A node whose last heartbeat is
  older than ``expiry_s`` drops out (:meth:`CoverageMap.expire`).
* Claims are not proof: an announced holding counts as a replica only once the node has
  answered for one of its experts (a winning reply the backbone's ledger event names,
  :meth:`CoverageMap.mark_served`). Per holding, not per expert: a cold expert may go unrouted
  for a long time, and the backbone computes any expert nobody answers for itself.
* An assignment handed to a volunteer is *pending* until the node serves it, or until
  ``grace_s`` has passed. Pending experts count for the assigner only (``pending=True``), so
  the next volunteer is not sent to the same hole; they are never replicas in the demand map.
* Heartbeat times are the market's receipt times, never the worker's clock.
* Bounded: at most ``max_nodes`` nodes; nothing here expands a claimed range into a set, so a
  heartbeat claiming experts 0..10^9 costs what one claiming 0..8 does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from kvasir_bus.codec import Heartbeat
from kvasir_bus.wire import Holding


@dataclass(frozen=True)
class NodeEntry:
    """One node as the market knows it.

    ``seen_at``: receipt time of its last heartbeat (None: assigned, never heard from).
    ``holdings``: what its last heartbeat announced; ``pending``: assigned, not yet announced,
    counted until ``pending_until``.
    """

    node: str
    holdings: tuple[Holding, ...] = ()
    pending: tuple[Holding, ...] = ()
    pending_until: float = 0.0
    budget_bytes: int = 0
    load: float = 0.0
    served: int = 0
    version: str = ""
    kernel: str = ""
    sent_at: float = 0.0
    seen_at: float | None = None
    oversubscribed: bool = False  # from its heartbeat: its threads exceed its share of its cores

    @property
    def counted(self) -> tuple[Holding, ...]:
        """Everything that counts as a replica: announced and pending holdings."""
        return self.holdings + self.pending


MAX_NODES = 65_536


class CoverageMap:
    """Nodes and their holdings, with heartbeat expiry and pending assignments."""

    def __init__(self, expiry_s: float, grace_s: float, max_nodes: int = MAX_NODES) -> None:
        if expiry_s <= 0 or grace_s < 0:
            raise ValueError(f"expiry_s must be > 0 and grace_s >= 0, got {expiry_s}, {grace_s}")
        self.expiry_s = expiry_s
        self.grace_s = grace_s
        self.max_nodes = max_nodes
        self._nodes: dict[str, NodeEntry] = {}
        self._served: dict[str, set[tuple[int, int]]] = {}  # node -> (layer, expert) answered for
        self.banned: set[str] = set()                       # quarantined: never counted again

    def _verified(self, node: str, holdings: Iterable[Holding]) -> tuple[Holding, ...]:
        served = self._served.get(node)
        if not served:
            return ()
        return tuple(h for h in holdings if any(l == h.layer and h.lo <= e < h.hi for l, e in served))

    def verified(self, node: str) -> tuple[Holding, ...]:
        """The node's announced holdings it has answered for."""
        entry = self._nodes.get(node)
        return () if entry is None else self._verified(node, entry.holdings)

    def mark_served(self, node: str, layer: int, expert: int) -> tuple[bool, bool]:
        """A winning reply of ``node`` for (layer, expert) was credited. Returns (counted
        holdings changed, a pending assignment was confirmed by it)."""
        if node in self.banned:
            return False, False
        served = self._served.get(node)
        if served is None:
            if len(self._served) >= self.max_nodes:
                return False, False
            served = self._served[node] = set()
        if (layer, expert) in served:
            return False, False
        entry = self._nodes.get(node)
        before = self.verified(node)
        served.add((layer, expert))
        if entry is None:
            return False, False
        confirmed = bool(entry.pending) and any(
            h.layer == layer and h.lo <= expert < h.hi for h in entry.pending)
        if confirmed:  # the worker serves what it was assigned: no longer pending
            self._nodes[node] = replace(entry, pending=(), pending_until=0.0)
        return self.verified(node) != before or confirmed, confirmed

    def ban(self, node: str) -> bool:
        """Quarantine ``node``: dropped now, its heartbeats and services ignored from now on."""
        self.banned.add(node)
        self._served.pop(node, None)
        return self._nodes.pop(node, None) is not None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: str) -> bool:
        return node in self._nodes

    def get(self, node: str) -> NodeEntry | None:
        return self._nodes.get(node)

    def nodes(self) -> list[NodeEntry]:
        """Every known node, sorted by id."""
        return [self._nodes[n] for n in sorted(self._nodes)]

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Take a heartbeat in; True if what the node counts for changed (new node, other
        holdings). A banned node, or a new one beyond ``max_nodes``, is ignored (False)."""
        old = self._nodes.get(hb.node)
        if hb.node in self.banned or (old is None and len(self._nodes) >= self.max_nodes):
            return False
        pending, until = (old.pending, old.pending_until) if old else ((), 0.0)
        entry = NodeEntry(node=hb.node, holdings=tuple(hb.holdings), pending=pending,
                          pending_until=until, budget_bytes=hb.budget_bytes, load=hb.load,
                          served=hb.served, version=hb.version, kernel=hb.kernel,
                          sent_at=hb.sent_at, seen_at=now, oversubscribed=hb.oversubscribed)
        self._nodes[hb.node] = entry
        if old is None or old.seen_at is None:
            return True
        return old.holdings != entry.holdings

    def assign(self, node: str, holdings: Iterable[Holding], budget_bytes: int,
               now: float, until: float | None = None) -> None:
        """Record an assignment: ``holdings`` count for ``node`` until it heartbeats them or
        ``until`` (default ``now + grace_s``). Replaces any earlier pending assignment."""
        if node in self.banned:
            return
        old = self._nodes.get(node) or NodeEntry(node=node)
        self._nodes[node] = replace(old, pending=tuple(holdings), budget_bytes=budget_bytes,
                                    pending_until=now + self.grace_s if until is None
                                    else until)

    def forget(self, node: str) -> bool:
        """Drop a node entirely (a volunteer starts afresh; what it served stays known);
        True if it was known."""
        return self._nodes.pop(node, None) is not None

    def expire(self, now: float) -> list[str]:
        """Drop heartbeats older than ``expiry_s`` and pending assignments past their grace;
        return the nodes whose counted holdings changed (sorted)."""
        changed = []
        for node in sorted(self._nodes):
            entry = self._nodes[node]
            live = entry.seen_at is not None and now - entry.seen_at <= self.expiry_s
            pending_live = bool(entry.pending) and now <= entry.pending_until
            if not live and not pending_live:
                del self._nodes[node]
                if entry.counted:
                    changed.append(node)
                continue
            new = entry
            if not live and entry.seen_at is not None:
                new = replace(new, holdings=(), seen_at=None, load=0.0)
            if entry.pending and not pending_live:
                new = replace(new, pending=(), pending_until=0.0)
            if new is not entry:
                self._nodes[node] = new
                changed.append(node)
        return changed

    def copies(self, n_layer: int, n_expert: int, pending: bool = False) -> np.ndarray:
        """How many nodes hold each expert: int32 (n_layer, n_expert), counting announced
        holdings the node has answered for (and, with ``pending``, its pending assignment).
        A node counts once per expert however its holdings overlap; holdings beyond the shape
        are ignored."""
        out = np.zeros((n_layer, n_expert), dtype=np.int32)
        mask = np.zeros((n_layer, n_expert), dtype=bool)
        for entry in self._nodes.values():
            counted = self._verified(entry.node, entry.holdings) + (entry.pending if pending else ())
            if not counted:
                continue
            mask[:] = False
            for h in counted:
                if h.layer < n_layer and h.lo < n_expert:
                    mask[h.layer, h.lo:min(h.hi, n_expert)] = True
            out += mask
        return out
