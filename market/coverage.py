"""The coverage map: which node holds which experts, built from heartbeats.

Pure: every method takes ``now`` (Unix seconds) instead of reading a clock, so tests can walk
time by hand.

* A heartbeat makes a node *live* with the holdings it announces. A node whose last heartbeat is
  older than ``expiry_s`` drops out (:meth:`CoverageMap.expire`).
* An assignment handed to a volunteer is *pending* until the node heartbeats holdings that
  include it, or until ``grace_s`` has passed. Pending experts count as replicas, so the next
  volunteer is not sent to the same hole while the first one is still downloading its slice.
* Heartbeat times are the market's receipt times, never the worker's clock.
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

    @property
    def counted(self) -> tuple[Holding, ...]:
        """Everything that counts as a replica: announced and pending holdings."""
        return self.holdings + self.pending


def _experts(holdings: Iterable[Holding]) -> set[tuple[int, int]]:
    return {(h.layer, e) for h in holdings for e in range(h.lo, h.hi)}


class CoverageMap:
    """Nodes and their holdings, with heartbeat expiry and pending assignments."""

    def __init__(self, expiry_s: float, grace_s: float) -> None:
        if expiry_s <= 0 or grace_s < 0:
            raise ValueError(f"expiry_s must be > 0 and grace_s >= 0, got {expiry_s}, {grace_s}")
        self.expiry_s = expiry_s
        self.grace_s = grace_s
        self._nodes: dict[str, NodeEntry] = {}

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
        holdings, or its pending assignment confirmed)."""
        old = self._nodes.get(hb.node)
        pending, until = (old.pending, old.pending_until) if old else ((), 0.0)
        if pending and _experts(pending) <= _experts(hb.holdings):
            pending, until = (), 0.0  # the worker now serves what it was assigned
        entry = NodeEntry(node=hb.node, holdings=tuple(hb.holdings), pending=pending,
                          pending_until=until, budget_bytes=hb.budget_bytes, load=hb.load,
                          served=hb.served, version=hb.version, kernel=hb.kernel,
                          sent_at=hb.sent_at, seen_at=now)
        self._nodes[hb.node] = entry
        if old is None or old.seen_at is None:
            return True
        return _experts(old.counted) != _experts(entry.counted)

    def assign(self, node: str, holdings: Iterable[Holding], budget_bytes: int,
               now: float, until: float | None = None) -> None:
        """Record an assignment: ``holdings`` count for ``node`` until it heartbeats them or
        ``until`` (default ``now + grace_s``). Replaces any earlier pending assignment."""
        old = self._nodes.get(node) or NodeEntry(node=node)
        self._nodes[node] = replace(old, pending=tuple(holdings), budget_bytes=budget_bytes,
                                    pending_until=now + self.grace_s if until is None
                                    else until)

    def forget(self, node: str) -> bool:
        """Drop a node entirely (a volunteer starts afresh); True if it was known."""
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

    def copies(self, n_layer: int, n_expert: int) -> np.ndarray:
        """How many nodes hold each expert: int32 (n_layer, n_expert). A node counts once per
        expert however its holdings overlap; holdings beyond the shape are ignored."""
        out = np.zeros((n_layer, n_expert), dtype=np.int32)
        mask = np.zeros((n_layer, n_expert), dtype=bool)
        for entry in self._nodes.values():
            if not entry.counted:
                continue
            mask[:] = False
            for h in entry.counted:
                if h.layer < n_layer and h.lo < n_expert:
                    mask[h.layer, h.lo:min(h.hi, n_expert)] = True
            out += mask
        return out
