"""Replica modes on the backbone's side: how long to wait for an expert, and when to ask again.

Two ways for the workers holding the same expert to share its subject (``--replicas`` on both):

* ``race``: every replica subscribes plainly; each request reaches all of them, every one
  computes, the first reply wins (the design card's default: the fastest replica sets the pace,
  and the others burn their CPU for nothing).
* ``balance``: the replicas subscribe in one NATS queue group (:data:`BALANCE_QUEUE`, the same
  name on every subject: a queue group is scoped to its subject), so each request reaches *one*
  member and is computed once. NATS prefers a member on the publisher's own server, cluster or
  leafnode: that is "route to a nearby replica". Its risk is a member that has frozen: the
  request waits for it alone. So in balance mode the backbone **hedges**: if no reply came after
  a delay (the p95 of that expert's recent latencies, and at least twice their median: a busy
  machine's jitter is no frozen member; bounded), it sends the request again, and
  the queue group picks a member again (most often another one); the first reply wins, the
  timeout and the local fallback stay behind it.

With bundles (:mod:`backbone.dispatch`), a call for bundle-capable holders goes in every
holder's bundle in race mode, and in one holder's in balance mode: the one with the fewest calls
of the step so far, then the lowest smoothed round trip (:meth:`LatencyBook.node_mean`); its
hedge goes to the expert's subject, where the queue group picks a member.

The worker's side is only its subscription (``queue=``); which mode a worker runs is announced
in its ``$SRV`` card (``queue_group``). A mismatch costs efficiency, never an answer: hedges
against racing workers compute twice, a racing backbone in front of a queue group waits for a
frozen member until its timeout and computes locally.

:class:`LatencyBook` keeps every expert's recent round trips (whatever the mode): the hedge
delay reads its quantile, and the hot-expert planner (:mod:`backbone.hot_experts`) its mean.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
import numpy as np

from kvasir_bus.errors import UsageError
from kvasir_bus.subjects import BALANCE_QUEUE  # noqa: F401 (the group balance-mode workers share)

REPLICA_MODES = ("race", "balance")


@dataclass(frozen=True)
class ReplicaConfig:
    mode: str = "race"
    hedge_quantile: float = 95.0  # percent: hedge once a call has waited longer than this share of its past
    hedge_floor_s: float = 0.01  # never sooner: a loaded machine's jitter is no frozen member
    hedge_ceiling_s: float = 0.5
    hedge_initial_s: float = 0.1  # before an expert has any latency on record
    max_hedges: int = 2  # re-sends per call, one delay apart (a queue group may pick the frozen member again)
    window: int = 64  # latencies kept per expert

    def __post_init__(self) -> None:
        if self.mode not in REPLICA_MODES:
            raise UsageError(f"--replicas must be one of {', '.join(REPLICA_MODES)}, got {self.mode!r}")
        if not 0 < self.hedge_floor_s <= self.hedge_ceiling_s:
            raise UsageError(f"hedge bounds must be 0 < floor <= ceiling, got {self.hedge_floor_s} "
                             f"and {self.hedge_ceiling_s}")
        if not 0 < self.hedge_quantile <= 100:
            raise UsageError(f"hedge quantile must be in (0, 100], got {self.hedge_quantile}")
        if self.max_hedges < 0 or self.window < 1:
            raise UsageError("max_hedges must be >= 0 and window >= 1")


class LatencyBook:
    """Recent round trips per (layer, expert), and a smoothed mean. Written on the bus loop,
    read by engine threads: every access under one lock."""

    def __init__(self, window: int = 64):
        self.window = window
        self._recent: dict[tuple[int, int], deque] = {}
        self._mean: dict[tuple[int, int], float] = {}
        self._layer_mean: dict[int, float] = {}
        self._node_mean: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, layer: int, expert: int, seconds: float) -> None:
        key = (layer, expert)
        with self._lock:
            self._recent.setdefault(key, deque(maxlen=self.window)).append(seconds)
            m = self._mean.get(key)
            self._mean[key] = seconds if m is None else 0.875 * m + 0.125 * seconds
            lm = self._layer_mean.get(layer)
            self._layer_mean[layer] = seconds if lm is None else 0.875 * lm + 0.125 * seconds

    def observe_wins(self, layer: int, wins: list[tuple[int, str, float]]) -> None:
        """A layer step's won calls, ``(expert, node, seconds)`` each: :meth:`observe` and
        :meth:`observe_node` for every one, under one lock."""
        recent, means, node_means = self._recent, self._mean, self._node_mean
        with self._lock:
            lm = self._layer_mean.get(layer)
            for expert, node, seconds in wins:
                key = (layer, expert)
                window = recent.get(key)
                if window is None:
                    window = recent[key] = deque(maxlen=self.window)
                window.append(seconds)
                m = means.get(key)
                means[key] = seconds if m is None else 0.875 * m + 0.125 * seconds
                lm = seconds if lm is None else 0.875 * lm + 0.125 * seconds
                m = node_means.get(node)
                node_means[node] = seconds if m is None else 0.875 * m + 0.125 * seconds
            self._layer_mean[layer] = lm

    def observe_node(self, node: str, seconds: float) -> None:
        """A round trip of a call that ``node`` answered (or the timeout it let pass)."""
        with self._lock:
            m = self._node_mean.get(node)
            self._node_mean[node] = seconds if m is None else 0.875 * m + 0.125 * seconds

    def node_mean(self, node: str) -> float | None:
        """The node's smoothed round trip (None: no call on record)."""
        with self._lock:
            return self._node_mean.get(node)

    def quantiles(self, layer: int, expert: int, qs: tuple[float, ...]) -> list[float] | None:
        """Percentiles ``qs`` of the expert's recent round trips (None: none on record)."""
        with self._lock:
            recent = self._recent.get((layer, expert))
            values = list(recent) if recent else None
        return [float(v) for v in np.percentile(values, qs)] if values else None

    def mean(self, layer: int, expert: int) -> float | None:
        """The expert's smoothed round trip; the layer's when the expert has none yet."""
        with self._lock:
            m = self._mean.get((layer, expert))
            return m if m is not None else self._layer_mean.get(layer)


class Replicas:
    """The hedging policy the dispatch (:class:`backbone.dispatch.RemoteExperts`) follows: when
    to re-send a call in balance mode (:meth:`hedge_delay`, at most ``max_hedges`` times, one
    delay apart); every won call's latency goes into :attr:`book`; the counts of re-sends."""

    def __init__(self, cfg: ReplicaConfig = ReplicaConfig(), book: LatencyBook | None = None):
        self.cfg = cfg
        self.book = book or LatencyBook(cfg.window)
        self.hedges = 0  # re-sends
        self.hedged_calls = 0  # calls that needed at least one

    def hedge_delay(self, layer: int, expert: int) -> float | None:
        """Seconds to wait before re-sending (None: never, in race mode)."""
        if self.cfg.mode != "balance" or self.cfg.max_hedges == 0:
            return None
        q = self.book.quantiles(layer, expert, (self.cfg.hedge_quantile, 50.0))
        delay = self.cfg.hedge_initial_s if q is None else max(q[0], 2 * q[1])
        return min(self.cfg.hedge_ceiling_s, max(self.cfg.hedge_floor_s, delay))

    def to_dict(self) -> dict:
        return {"mode": self.cfg.mode, "hedges": self.hedges, "hedged_calls": self.hedged_calls}
