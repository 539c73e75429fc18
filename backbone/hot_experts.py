"""Hot experts: the backbone computes an expert itself when that is cheaper than the round trip.

The backbone keeps every expert resident (it is the fallback replica), so asking a worker is a
choice, not a need. Per layer step, :class:`HotExperts` splits the selected experts: the ones
it computes here (on the calling thread, while the others' requests are in flight) and the ones
it sends to the swarm (:class:`backbone.dispatch.RemoteExperts`). The plan, from two measured
models:

* the remote side: each expert's smoothed round trip (:class:`backbone.replicas.LatencyBook`,
  fed by the dispatch whatever node answered; the layer's when the expert has none yet);
* the local side: the seconds this node spends per call, ``a + b x rows``, fitted to its own
  timed local computes.

The layer takes ``max(slowest remote round trip, sum of local computes)``. Taking the slowest
experts first, moving the ``k`` slowest local gives ``T_k = max(r_(k+1), c_1 + ... + c_k)``;
the plan is the ``k`` with the smallest ``T_k`` (ties and near-ties, within ``margin``, keep
more remote: the workers' CPU is what they are there for). On a slow link (a long round trip,
cheap experts) that is "all local"; on a fast one, "all remote". Every ``refresh_every`` steps
of a layer planned with locals, the plan is "all remote" once, so the round trips on record
follow the link.

Whoever computes an expert, the function and its input are the same: the output is
bit-identical either way. The market still sees the call (its demand counts every routed
expert: ``record_call(..., remote=False)``); no worker is credited for it (no ledger event). In
the dispatch's counters a hot expert is a ``local_choice`` with its ``rows_local``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from backbone.replicas import LatencyBook
from kvasir_bus.errors import UsageError

HOT_MODES = ("auto", "off")


@dataclass(frozen=True)
class HotConfig:
    mode: str = "off"
    margin: float = 0.9  # compute locally only if that makes the layer at least this much faster
    refresh_every: int = 64  # steps of a layer planned with locals, then one all-remote step
    samples: int = 256  # local computes kept for the cost fit

    def __post_init__(self) -> None:
        if self.mode not in HOT_MODES:
            raise UsageError(f"--hot must be one of {', '.join(HOT_MODES)}, got {self.mode!r}")
        if not 0 < self.margin <= 1:
            raise UsageError(f"hot margin must be in (0, 1], got {self.margin}")
        if self.refresh_every < 1:
            raise UsageError(f"hot refresh_every must be >= 1, got {self.refresh_every}")


class LocalCost:
    """Seconds this node spends on one expert call of ``rows`` rows: ``a + b x rows``, a least
    squares fit to recent timed calls (proportional while the row counts do not vary)."""

    def __init__(self, samples: int = 256):
        self._samples: deque = deque(maxlen=samples)
        self._fit: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def observe(self, rows: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((rows, seconds))
            if len(self._samples) % 16 == 1:
                self._fit = None  # refit now and then, not on every call

    @property
    def known(self) -> bool:
        return bool(self._samples)

    def __call__(self, rows: int) -> float:
        with self._lock:
            if self._fit is None and self._samples:
                x, y = np.array(self._samples, dtype=np.float64).T
                if len(set(x.tolist())) >= 2:
                    b, a = np.polyfit(x, y, 1)
                    self._fit = (max(0.0, float(a)), max(0.0, float(b)))
                else:
                    self._fit = (0.0, float(y.sum() / x.sum()))
            a, b = self._fit or (0.0, 0.0)
        return a + b * rows


def plan_split(remote_s: list[float], local_s: list[float], margin: float = 1.0) -> tuple[int, float, float]:
    """``remote_s`` sorted slowest first, ``local_s`` the local cost of the same experts ->
    (k, T_k, T_0): move the first ``k`` local, the layer then takes ``T_k`` instead of ``T_0``.

    >>> plan_split([0.05, 0.05], [0.001, 0.001])  # a slow link: both local
    (2, 0.002, 0.05)
    >>> plan_split([0.002, 0.002], [0.001, 0.001])  # a fast one: nothing saved
    (0, 0.002, 0.002)
    """
    n = len(remote_s)
    best_k, best_t = 0, remote_s[0] if n else 0.0
    local = 0.0
    for k in range(1, n + 1):
        local += local_s[k - 1]
        t = max(remote_s[k] if k < n else 0.0, local)
        if t < best_t * margin and t < best_t:
            best_k, best_t = k, t
    return best_k, best_t, (remote_s[0] if n else 0.0)


class HotExperts:
    """An :class:`~backbone.experts.ExpertBackend`: the hot experts here, the rest on the swarm.

    ``remote``: a :class:`~backbone.dispatch.RemoteExperts` (its ``local`` is this node's
    experts, its ``recorder`` the market link); ``book``: the round trips its replies took.
    Thread-safe: two micro-batches may plan and run layers at once.
    """

    def __init__(self, remote, book: LatencyBook, cfg: HotConfig = HotConfig(mode="auto")):
        self.remote, self.local, self.book, self.cfg = remote, remote.local, book, cfg
        self.cost = LocalCost(cfg.samples)
        self.hot_calls = 0  # expert calls computed here by choice
        self.hot_rows = 0
        self.planned = 0  # layer steps planned
        self.saved_s = 0.0  # sum over plans of T_0 - T_k: what the model says was saved
        self._since_refresh: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvasir-hot")  # one per lane

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def to_dict(self) -> dict:
        return {"mode": self.cfg.mode, "hot_calls": self.hot_calls, "hot_rows": self.hot_rows,
                "planned_layers": self.planned, "modelled_saving_s": round(self.saved_s, 4)}

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> set[int]:
        """Indices into ``calls`` to compute here."""
        if self.cfg.mode == "off" or not calls:
            return set()
        if not self.cost.known:  # calibrate: the smallest call, here (exact either way)
            return {min(range(len(calls)), key=lambda i: len(calls[i][1]))}
        known = [(self.book.mean(layer, e), i) for i, (e, _) in enumerate(calls)]
        if any(r is None for r, _ in known):
            return set()  # learn the round trips first
        known.sort(key=lambda ri: -ri[0])
        k, t_k, t_0 = plan_split([r for r, _ in known], [self.cost(len(calls[i][1])) for _, i in known],
                                 self.cfg.margin)
        with self._lock:
            self.planned += 1
            if k:
                n = self._since_refresh.get(layer, 0) + 1
                self._since_refresh[layer] = n % self.cfg.refresh_every
                if n >= self.cfg.refresh_every:
                    return set()  # all remote once: keep the round trips on record current
            self.saved_s += t_0 - t_k
        return {i for _, i in known[:k]}

    # -- the layer step ---------------------------------------------------------------------------

    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]],
                  while_waiting: Callable[[], None] | None = None) -> list[np.ndarray]:
        """As :meth:`RemoteExperts.run_layer`; ``while_waiting`` runs once the remote part is
        handed on, before the hot experts are computed here."""
        here = self.plan(layer, calls)
        if not here:
            return self.remote.run_layer(layer, calls, while_waiting=while_waiting)
        away = [i for i in range(len(calls)) if i not in here]
        pending = self._pool.submit(self.remote.run_layer, layer, [calls[i] for i in away]) if away else None
        if while_waiting is not None:
            while_waiting()
        outs: list[np.ndarray | None] = [None] * len(calls)
        for i in sorted(here):  # while the others' requests are in flight
            expert, rows = calls[i]
            t0 = time.perf_counter()
            outs[i] = self.local.compute(layer, expert, rows)
            self.cost.observe(len(rows), time.perf_counter() - t0)
            self._record(layer, expert, len(rows))
        if pending is not None:
            for i, out in zip(away, pending.result()):
                outs[i] = out
        return outs

    def _record(self, layer: int, expert: int, rows: int) -> None:
        with self._lock:
            self.hot_calls += 1
            self.hot_rows += rows
            stats = self.remote.stats.layer(layer)
            stats.local_choice += 1
            stats.rows_local += rows
        if self.remote.recorder is not None:  # demand sees it; no worker is paid for it
            self.remote.recorder.record_call(layer, expert, rows, remote=False)
