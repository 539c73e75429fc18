"""A discrete-event model of the swarm, as the code runs it (plain Python, heapq).

What it follows, and where in the code that behaviour lives:

* **continuous batching** (``backbone/scheduler.py``): every request arrives at t = 0 (the check's
  closed set of clients), up to ``max_active`` run; each step takes every decoding sequence's
  token, then prompt chunks while ``step_tokens`` lasts; a sequence's first token comes at the end
  of the step that reads its prompt's last chunk, then one per step. ``micro_batches`` lanes
  (sequences split at admission to the lane with fewer) step on their own, interleaved.
* **a layer step** (``backbone/model.py`` forward, ``backbone/dispatch.py``): the layer's dense
  part on the backbone (attention or delta-net, at the rows and context of the step), the router's
  choice (``n_expert_used`` distinct experts per row, drawn by the experts' shares of the rows that
  ``kvasir calibrate`` measured for this model, or uniformly: ``_Routing``),
  the calls grouped per worker into one bundle each (``--bundles on``) or one message per
  expert, planned and encoded by the engine thread, relayed by nats-server, computed by the
  worker (its CPU per message plus its kernel on the bundle's experts and rows, FIFO on its
  cores), relayed back; the shared expert, local fallbacks and audited calls' references run on
  the engine thread while the replies travel (``_audit_ahead``); the step ends when every call
  has its answer (the first replica's in race mode; one holder's, hedged, in balance mode).
* **placement** (``launch.swarm.split_experts`` with ``--layer all``): each worker holds one
  range of expert indices on every layer; past ``n_expert`` workers the ranges repeat (replicas).
* **audits** (``backbone/audit.py``, ``RemoteExperts._audit_ahead`` and ``_finish_step``): every
  reply of a node is audited until it has passed ``probation`` audits (a step's verdicts are taken
  together, so the step that starts on probation is audited whole), then one at a random place
  in each window of ``ceil(1 / rate)`` of its replies on a layer. An audited call in one node's bundle has its
  reference computed ahead on the engine thread while the reply travels; a raced call's is
  computed once it is won. Where the worker's kernel is not one the backbone runs, the audit then
  recomputes with numpy (and takes the quant-step flips out): ``Costs.audit_recompute``, measured,
  plus ``Costs.audit_miss`` where the backbone's cache of dequantized weights (an LRU,
  ``_DequantCache``) does not hold the expert: what most of such an audit costs (py-spy of kvasir
  serve --audit 0.1 on the check's model: 56% of its audits' time dequantizing).
* **local computes** (fallbacks, silent experts, hot experts, audits' references) run one call at
  a time (``LocalExperts.compute``), each its own graph: ``Costs.local_call`` per call.
* **the engine thread's own connection** (``_run_direct``): an all-bundle step is sent and read on
  the engine thread, its replies read once the engine's own work of the step is done; a step with
  a call on an expert's subject, a probe, or in balance mode (hedges on a timer) goes through the
  bus client's loop thread, which costs ``Costs.bus_path`` more per layer step (measured).
* **hedges** (balance mode, ``backbone/replicas.py``): a call past the p95 of its expert's
  recent round trips is re-sent on its expert's subject, so about 5% of the calls: an extra
  request another holder computes (bench/plan_check.py's balance run under load: 9% of calls).
* **race confirmation** (``DispatchConfig.confirm``): in race mode a won step waits up to
  ``race_confirm`` times its round trip (at least 10 ms) for the replicas that raced a call another
  node won (nodes that answered bundles before; not one that missed that wait 3 steps in a row,
  but every 64th step).
* **timeouts and silence** (``AdaptiveTimeout``, ``backbone/coverage_view.py``): a worker that stops
  answering (``stop_at``) costs one timeout (``srtt + 4 rttvar``, clamped, or the fixed one), then
  its experts are computed locally at once while probes (one message per expert, not waited for)
  go on; a node whose bundle timed out gets none for a hold that doubles (2 s first), its experts
  asked on their subjects meanwhile; a worker that is gone (churn) is "no responders": local at
  once, no wait.
* **resources**: the backbone's dense cores, its dispatch thread (the GIL's: planning, encoding,
  replies), nats-server, each worker's cores, the backbone's uplink; ``colocated`` = C puts all
  of them on one pool of C cores (the check on this machine: workers share the backbone's cores),
  each process's Python one thread of work there, and other programs' runnable threads
  (``background_runnable``) time-share them with whatever of ours runs at the moment. A job goes
  into the earliest gap of a server where it fits (work ready early runs before work booked for
  later, such as a losing replica's reply). Each worker a layer step wakes past the first costs
  ``Costs.fanout`` more CPU there when the workers share the backbone's cores: fitted so that a
  second worker costs the model what it was measured to cost (processes woken at once).

What it leaves out: a fresh backbone's first layer step computed here while its calls are out
(``_before_any_answer``: only until the first reply ever, which kvasir serve's warm-up and the
check's first request see, not the measured runs); when a hedge is sent (the model sends them
with the step: only their cost counts, never an earlier answer); the clients' own CPU.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from planner.profile import Costs
from planner.shapes import Shapes

FAST = True  # the vectorised path where it applies (tests compare it with the general one)

# The dispatcher's constants the model follows (tests/planner check them against the code's):
# backbone.audit.DEFAULT_PROBATION, backbone.dispatch.MAX_UNPROVEN_BUNDLE_NODES, its race
# confirmation's floor, misses and retry (_CONFIRM_FLOOR_S, _CONFIRM_MISSES, _CONFIRM_RETRY), and
# backbone.coverage_view.CoverageView's silence_hold_s and max_hold_s (a bundle hold's first
# length and its cap).
PROBATION = 16
MAX_UNPROVEN_BUNDLE_NODES = 2
SILENCE_HOLD_S, MAX_HOLD_S = 2.0, 60.0
CONFIRM_FLOOR_S, CONFIRM_MISSES, CONFIRM_RETRY = 0.010, 3, 64
# backbone.replicas.ReplicaConfig's hedge_quantile (95): the share of calls past it, re-sent.
HEDGED_SHARE = 0.05
# backbone.dispatch.EXPLAINED_ROWS: the rows of a reply a foreign kernel's audit looks at, at most;
# kernels.backend.DEFAULT_CACHE_MB: the backbone's cache of dequantized (float64) weights.
AUDIT_ROWS = 16
DEQUANT_CACHE_MB = 1024

RTT_DISTS = {  # (median ms, lognormal sigma): a LAN, a WAN path, through a CDN edge (a relay)
    "lan": (1.0, 0.3), "wan": (40.0, 0.35), "cdn": (90.0, 0.35)}


@dataclass(frozen=True)
class Config:
    workers: int
    streams: int
    tokens: int
    prompt_tokens: int = 16
    rtt_s: tuple[float, ...] = (0.0,)  # per worker, cycled (one entry: every worker's)
    audit: float = 0.0
    probation: int = PROBATION  # replies of a new node all audited until it passed this many
    race_confirm: float = 1.0  # race mode: a won step waits up to this many times its round trip for the racing replicas
    replicas: str = "race"
    bundles: bool = True
    micro_batches: int = 1
    hot_fraction: float = 0.0  # share of calls the backbone computes itself (hot experts)
    churn_mtbf_s: float = 0.0  # 0: no churn
    churn_down_s: float = 60.0
    stop_at_s: float | None = None  # worker 0 stops answering (SIGSTOP) at this time
    timeout_s: float | None = None  # fixed per-request timeout; None: adaptive
    colocated_cores: int = 0  # 0: every role on machines of its own
    worker_cores: int = 1
    uplink_bps: float = 0.0  # 0: unbounded
    # The backbone's cache of dequantized weights that audits on the numpy paths read
    # (KVASIR_DEQUANT_CACHE_MB); warm: as a backbone that has served this load a while has it.
    dequant_cache_mb: float = DEQUANT_CACHE_MB
    warm_cache: bool = True
    max_active: int = 1024
    step_tokens: int = 1024
    replicated: bool = False  # every worker holds every expert (replicas of the whole model)
    # Colocated only: other programs' load on the same cores (cores busy, on average). While k of
    # our tasks run at once, each takes max(1, (R + k) / cores) times its CPU time (Pool).
    background_runnable: float = 0.0
    remote_layers: int | None = None  # only the first N MoE layers ask workers; the rest run here
    worker_speedup: float = 1.0  # workers' kernels this many times faster than the profile's (a GPU)
    seed: int = 0


class _Lane:
    """One server's busy intervals, in time order (the latest ``keep`` of them): a job goes into
    the earliest gap at or after it is ready that it fits (work handed over later but ready
    earlier, such as a step's planning after a slow replica's reply was booked, runs first)."""

    __slots__ = ("starts", "ends")
    keep = 512

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def earliest(self, ready: float, seconds: float) -> tuple[float, int]:
        i = bisect.bisect_right(self.ends, ready)
        t = ready
        while i < len(self.starts) and self.starts[i] < t + seconds:
            t = max(t, self.ends[i])
            i += 1
        return t, i

    def take(self, start: float, end: float, i: int) -> None:
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        if len(self.starts) > 2 * self.keep:
            del self.starts[:self.keep], self.ends[:self.keep]

    def busy_at(self, t: float) -> bool:
        i = bisect.bisect_right(self.ends, t)
        return i < len(self.starts) and self.starts[i] <= t


class Pool:
    """``n`` identical servers; a job runs on the one where it can start first (:class:`_Lane`);
    busy time counted.

    ``background``: other programs' runnable threads on the same cores, on average (a shared
    test machine). A job then runs on a time-shared core: while ``k`` of our jobs run at once
    (itself included), each takes ``max(1, (background + k) / n)`` times its CPU time.
    ``efficiency``: a core's speed while all ``n`` run our jobs, relative to one alone (shared
    caches and memory bandwidth, SMT siblings, a hypervisor's): while ``k`` do, each job takes
    ``1 + (1 / efficiency - 1) (k - 1) / (n - 1)`` times more (``Costs.core_efficiency``)."""

    def __init__(self, n: int, background: float = 0.0, efficiency: float = 1.0):
        self.lanes = [_Lane() for _ in range(max(1, n))]
        self.busy = 0.0
        self.background = background
        self.efficiency = efficiency

    def wall(self, start: float, seconds: float, lane: _Lane) -> float:
        if (self.background <= 0.0 and self.efficiency >= 1.0) or seconds <= 0.0:
            return seconds
        n = len(self.lanes)
        ours = 1 + sum(1 for other in self.lanes if other is not lane and other.busy_at(start))
        slow = 1.0 + (1.0 / self.efficiency - 1.0) * (ours - 1) / (n - 1) if n > 1 else 1.0
        return seconds * slow * max(1.0, (self.background + ours) / n)

    def earliest(self, ready: float, seconds: float) -> tuple[float, _Lane, int]:
        best = None
        for lane in self.lanes:
            t, i = lane.earliest(ready, seconds)
            if best is None or t < best[0]:
                best = (t, lane, i)
                if t == ready:
                    break
        return best

    def run(self, ready: float, seconds: float) -> float:
        start, lane, i = self.earliest(ready, seconds)
        end = start + self.wall(start, seconds, lane)
        lane.take(start, end, i)
        self.busy += seconds
        return end

    @property
    def size(self) -> int:
        return len(self.lanes)


class Serial:
    """One thread of work (a process's Python under its GIL, a single-threaded worker) on the
    cores of ``pool``: its jobs never overlap, each runs on whichever core is free."""

    def __init__(self, pool: Pool):
        self.pool, self.lane, self.busy = pool, _Lane(), 0.0

    def run(self, ready: float, seconds: float) -> float:
        t = ready
        for _ in range(64):  # a time both this thread and a core are free
            t, _ = self.lane.earliest(t, seconds)
            start, core, j = self.pool.earliest(t, seconds)
            if start == t:
                break
            t = start
        end = start + self.pool.wall(start, seconds, core)
        core.take(start, end, j)
        self.lane.take(start, end, self.lane.earliest(start, 0.0)[1])
        self.pool.busy += seconds
        self.busy += seconds
        return end

    @property
    def size(self) -> int:
        return 1


class _Routing:
    """Per-expert row counts of a layer step of ``rows`` rows: each row picks ``k`` distinct
    experts, uniformly or (``shares``: per layer, each expert's share of the rows, measured by
    ``kvasir calibrate``) weighted so, by successive sampling without replacement (the top ``k``
    of Gumbel-perturbed log shares). A small step is drawn afresh every time (``fresh``: rows x
    experts up to this many keys, a few microseconds), so that a rare expert turns up as seldom
    as it should; a big one's counts come from a pool of samples per (layer, size), one chosen
    at random each time (its counts sum over many rows: a pool stands for them well, and a
    1024-worker sweep stays quick)."""

    def __init__(self, n_expert: int, k: int, rng: np.random.Generator, pool: int = 24,
                 shares: list | None = None, fresh: int = 1 << 14):
        self.E, self.k, self.rng, self.pool, self.cache, self.fresh = n_expert, k, rng, pool, {}, fresh
        self.log_shares = None if shares is None else [None if p is None else np.log(np.asarray(p)) for p in shares]

    def _draw(self, rows: int, log_p) -> np.ndarray:
        keys = self.rng.gumbel(size=(rows, self.E))
        if log_p is not None:
            keys += log_p
        chosen = np.argpartition(-keys, self.k - 1, axis=1)[:, :self.k] if self.k < self.E else \
            np.broadcast_to(np.arange(self.E), (rows, self.E))
        return np.bincount(chosen.ravel(), minlength=self.E)

    def counts(self, rows: int, layer: int = 0) -> np.ndarray:
        log_p = None if self.log_shares is None else self.log_shares[layer]
        if rows * self.E <= self.fresh:
            return self._draw(rows, log_p)
        key = (rows, layer if log_p is not None else -1)
        samples = self.cache.get(key)
        if samples is None:
            samples = self.cache[key] = [self._draw(rows, log_p) for _ in range(self.pool)]
        return samples[int(self.rng.integers(self.pool))]


class _DequantCache:
    """The backbone's cache of dequantized weights (kernels/backend.py ``DequantCache``: an LRU
    of float64 copies, ``KVASIR_DEQUANT_CACHE_MB``) as the audits on the numpy paths use it (an
    ``explained`` audit and a ``numpy`` recomputation read the expert's three matrices there):
    per (layer, expert), its three matrices at 8 bytes a weight. A miss costs the audit the
    dequantization (``Costs.audit_miss``, measured by kvasir calibrate): on this machine's check
    model 341 of its 512 experts fit, and the audits' random picks reach most of them."""

    def __init__(self, capacity: int):
        self.capacity, self.entries = capacity, OrderedDict()
        self.misses = self.hits = 0

    def miss(self, key) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            self.hits += 1
            return False
        self.misses += 1
        if self.capacity > 0:
            self.entries[key] = None
            if len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        return True

    @classmethod
    def for_run(cls, shapes: Shapes, costs: Costs, cfg: Config, router: "_Routing", rng) -> "_DequantCache | None":
        """None where audits read no dequantized weights (a kernel this backbone reruns) or the
        profile did not measure a miss. ``cfg.warm_cache``: filled first as serving this load
        leaves it (the check's fastest round, a backbone serving for a while): audited calls
        drawn as the run draws them (a step's distinct experts by the measured routing, one of
        them at random per layer step) until the cache has turned over three times."""
        if costs.audit_path not in ("numpy", "explained") or costs.audit_miss <= 0:
            return None
        per_expert = 8 * 3 * shapes.n_embd * shapes.n_ff_exp
        cache = cls(int(cfg.dequant_cache_mb * (1 << 20) // per_expert) if per_expert else 0)
        L, E, K = shapes.n_layer, shapes.n_expert, shapes.n_expert_used
        moe = [il for il in range(L - shapes.n_moe_layers, L)]
        if not cfg.warm_cache or cache.capacity <= 0 or not moe:
            return cache
        rows = max(1, min(cfg.streams, cfg.max_active, 64))
        steps = math.ceil(3 * min(cache.capacity, len(moe) * E) / len(moe))
        per_draw = max(1, (1 << 18) // (rows * E))
        picks = {}
        for il in moe:
            log_p = None if router.log_shares is None else router.log_shares[il]
            out = []
            while len(out) < steps:
                n = min(per_draw, steps - len(out))
                keys = rng.gumbel(size=(n, rows, E)) + (0.0 if log_p is None else log_p)
                chosen = np.zeros((n, E), bool)
                top = np.argpartition(-keys, K - 1, axis=2)[:, :, :K] if K < E else np.broadcast_to(np.arange(E), (n, rows, E))
                np.put_along_axis(chosen, top.reshape(n, -1), True, axis=1)
                for step in chosen:
                    out.append(int(rng.choice(np.flatnonzero(step))))
            picks[il] = out
        for i in range(steps):
            for il in moe:
                cache.miss((il, picks[il][i]))
        cache.misses = cache.hits = 0
        return cache


@dataclass
class Result:
    tokens_per_s: float
    ttft_ms: dict
    itl_ms: dict
    utilisation: dict
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    messages_per_token: float
    local_fraction: float
    bottleneck: str
    bounds: dict
    seconds: float
    timeouts: int = 0
    extra: dict = field(default_factory=dict)


def _pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if len(values) else None


def holders_of(n_expert: int, workers: int) -> list[list[int]]:
    """Which workers hold each expert index (on every layer): ``split_experts`` ranges, repeated
    past ``n_expert`` workers (each repetition a replica)."""
    out: list[list[int]] = [[] for _ in range(n_expert)]
    if workers <= 0:
        return out
    groups = max(1, workers // n_expert) if workers >= n_expert else 1
    per_group = workers // groups
    for g in range(groups):
        base = g * per_group
        n = per_group if g < groups - 1 else workers - base
        bounds = [round(i * n_expert / n) for i in range(n + 1)]
        for w in range(n):
            for e in range(bounds[w], bounds[w + 1]):
                out[e].append(base + w)
    return out


def simulate(shapes: Shapes, costs: Costs, cfg: Config, worker_costs: list[Costs] | None = None,
             routing: list | None = None) -> Result:
    """Run the model; ``worker_costs``: per worker (cycled) the kernel and per-message CPU of its
    device (``--worker-profile``), default ``costs``'; ``routing``: per layer each expert's share
    of the rows (``planner.profile.routing_of``), None: uniform."""
    kinds_of_worker = worker_costs or [costs]
    rng = np.random.default_rng(cfg.seed)
    E, K, L = shapes.n_expert, shapes.n_expert_used, shapes.n_layer
    kinds = ["recurrent" if shapes.n_attention_layers and (il + 1) % max(1, round(L / shapes.n_attention_layers)) != 0
             and shapes.n_recurrent_layers else "attention" for il in range(L)]
    if shapes.n_recurrent_layers == 0:
        kinds = ["attention"] * L
    moe_layer = [il >= L - shapes.n_moe_layers for il in range(L)]  # DeepSeek-V3: the first 3 are dense
    holders = [list(range(cfg.workers))] * E if cfg.replicated else holders_of(E, cfg.workers)
    router = _Routing(E, K, rng, shares=routing)
    rtt = [cfg.rtt_s[w % len(cfg.rtt_s)] for w in range(max(1, cfg.workers))]

    # Resources. Colocated: one pool of cores for everything (the backbone's dense graphs, its
    # Python -- the engine thread's dispatch and the bus thread, one GIL --, nats-server and every
    # worker process, each of those one thread of work on the shared cores).
    if cfg.colocated_cores:
        shared = Pool(cfg.colocated_cores, cfg.background_runnable, costs.core_efficiency)
        dense_pool = shared
        disp_pool, nats_pool = Serial(shared), Serial(shared)
        worker_pools = [Serial(shared) for _ in range(max(1, cfg.workers))]
    else:
        shared = None
        dense_pool = Pool(max(1, cfg.micro_batches))  # each lane's graphs on the backbone's cores
        disp_pool, nats_pool = Pool(1), Pool(1)
        worker_pools = [Pool(cfg.worker_cores) for _ in range(max(1, cfg.workers))]
    uplink = Pool(1)
    # Dedicated machines, one core per worker, one kind of worker, no uplink bound: every message
    # of a layer step at once in numpy (the same arithmetic; a 1024-worker sweep in seconds).
    fast = FAST and cfg.bundles and not cfg.colocated_cores and cfg.worker_cores == 1 and not cfg.uplink_bps \
        and len(kinds_of_worker) == 1
    rtt_arr = np.asarray(rtt, dtype=float)
    worker_free = np.zeros(max(1, cfg.workers))

    # Churn: per worker, alternating up and down intervals (exponential), precomputed lazily.
    down: dict[int, list[tuple[float, float]]] = {}

    def is_down(w: int, t: float) -> bool:
        if cfg.churn_mtbf_s <= 0:
            return False
        spans = down.get(w)
        if spans is None:
            spans, s = [], float(rng.exponential(cfg.churn_mtbf_s))
            while s < 1e5 and len(spans) < 10000:
                d = float(rng.exponential(cfg.churn_down_s))
                spans.append((s, s + d))
                s += d + float(rng.exponential(cfg.churn_mtbf_s))
            down[w] = spans
        return any(a <= t < b for a, b in spans)

    def stopped(w: int, t: float) -> bool:
        return cfg.stop_at_s is not None and w == 0 and t >= cfg.stop_at_s

    silent: set[tuple[int, int]] = set()  # (layer, expert) of a stopped worker: computed locally at once
    srtt: float | None = None
    rttvar = 0.0
    timeouts = 0
    totals = {"bytes_out": 0.0, "bytes_in": 0.0, "messages": 0, "calls": 0, "local": 0}

    audit_window = math.ceil(1.0 / cfg.audit) if cfg.audit > 0 else 0
    passed = [0] * max(1, cfg.workers)  # per node: audits passed (probation ends at cfg.probation)
    windows: dict[tuple[int, int], tuple[int, int]] = {}  # (node, layer) -> (place in its window, the pick)
    audit_rng = np.random.default_rng([cfg.seed, 1])  # its own: the routing's draws stay those of a run without audits
    dequant = _DequantCache.for_run(shapes, costs, cfg, router, audit_rng) if audit_window else None
    held: dict[int, tuple[float, float]] = {}  # node -> (no bundles until, hold): its bundle timed out
    heard: set[int] = set()  # nodes that answered a bundle: racing replicas worth waiting for
    misses: dict[int, int] = {}  # node -> racing waits it missed in a row
    unproven_turn = [0]  # layer steps planned (the unproven nodes' turns)
    hedge_debt = [0.0]  # balance mode: hedged calls owed (a share of the calls, carried over)

    def current_timeout() -> float:
        if cfg.timeout_s is not None:
            return cfg.timeout_s
        if srtt is None:
            return 0.5
        return min(2.0, max(0.05, srtt + 4 * rttvar))

    def local_cost(rows_per_call) -> float:
        """Calls computed on the backbone one at a time (LocalExperts.compute each)."""
        rows_per_call = list(rows_per_call)
        return len(rows_per_call) * costs.local_call.c0 + costs.local_call.c1 * sum(rows_per_call)

    def audited(w: int, il: int, es: list[int]) -> list[int]:
        """Which of node ``w``'s replies ``es`` of this layer step are audited, in the order their
        verdicts are taken (backbone/audit.py ``should_audit``): every one while the node is on
        probation, else the one at a random place in each window of ceil(1 / rate) of its replies
        on that layer (``_Window.pick``, drawn afresh for each window)."""
        if not audit_window or not es:
            return []
        key = (w, il)
        at, pick = windows.get(key) or (0, int(audit_rng.integers(audit_window)))
        out = []
        for e in es:
            if cfg.audit >= 1.0 or passed[w] < cfg.probation or at == pick:
                out.append(e)
            at += 1
            if at == audit_window:
                at, pick = 0, int(audit_rng.integers(audit_window))
        windows[key] = (at, pick)
        return out

    def recompute_cost(il: int, e: int, rows: int) -> float:
        """An audited call's recomputation beyond its reference (``costs.audit_recompute``); on the
        numpy paths, plus the dequantization of the expert's weights where the backbone's numpy
        cache does not hold them (``dequant``)."""
        cost = costs.audit_recompute(min(rows, AUDIT_ROWS) if costs.audit_path == "explained" else rows)
        if dequant is not None and dequant.miss((il, e)):
            cost += costs.audit_miss
        return cost

    def layer_step(t: float, il: int, rows: int, ctx_rows: float, seqs: int) -> float:
        """One layer of one lane's step starting at ``t``: its end time (backbone/dispatch.py's
        run_layer, as the module docstring says)."""
        nonlocal srtt, rttvar, timeouts
        line = costs.recurrent if kinds[il] == "recurrent" else costs.attention
        t = dense_pool.run(t, line(rows, ctx_rows, seqs))
        if not moe_layer[il]:
            return t
        counts = router.counts(rows, il)
        chosen = np.nonzero(counts)[0]
        n_hot = int(round(cfg.hot_fraction * len(chosen)))
        if cfg.remote_layers is not None and il - (L - shapes.n_moe_layers) >= cfg.remote_layers:
            n_hot = len(chosen)  # a layer the backbone keeps: every expert here, as without workers
        local_calls: list[int] = list(chosen[:n_hot]) if n_hot else []
        unproven_turn[0] += 1
        unproven = [w for w in range(cfg.workers) if audit_window and cfg.audit < 1.0 and passed[w] < cfg.probation]
        if len(unproven) > MAX_UNPROVEN_BUNDLE_NODES:  # a few of them hold bundles a step, in turn
            k = unproven_turn[0] % len(unproven)
            out_of_turn = set((unproven[k:] + unproven[:k])[MAX_UNPROVEN_BUNDLE_NODES:])
        else:
            out_of_turn = set()
        by_node: dict[int, list[int]] = {}  # bundles
        singles: list[tuple[int, int]] = []  # (node, expert): a request on the expert's subject, waited for
        probes: list[tuple[int, int]] = []  # ... only a probe (a silent expert): nobody waits for it
        nodes_of: dict[int, tuple[int, ...]] = {}  # a waited call -> the nodes asked
        for e in chosen[n_hot:]:
            e = int(e)
            live = [w for w in holders[e] if not is_down(w, t)]
            if not live:  # "no responders": computed here at once
                local_calls.append(e)
                continue
            if (il, e) in silent:  # computed here at once; the request still goes, as a probe
                local_calls.append(e)
                probes.extend((w, e) for w in (live if cfg.replicas == "race" else live[:1]))
                continue
            bundled = [w for w in live if cfg.bundles and held.get(w, (0.0,))[0] <= t and w not in out_of_turn]
            if cfg.replicas == "balance" and bundled:  # one holder: the fewest calls of this step
                bundled = [min(bundled, key=lambda n: (len(by_node.get(n, ())), n))]
            for w in bundled:
                by_node.setdefault(w, []).append(e)
            if bundled:
                nodes_of[e] = tuple(bundled)
            else:  # on the expert's subject: every holder hears it (race), one of them (balance)
                asked = tuple(live) if cfg.replicas == "race" else (live[0],)
                singles.extend((w, e) for w in asked)
                nodes_of[e] = asked
        # Balance mode hedges: a call not answered after the p95 of its expert's recent round trips
        # (and twice their median) is re-sent on its expert's subject (backbone/replicas.py), so
        # about 1 - quantile of the calls, by the quantile's own definition: each an extra request
        # another holder computes, nobody waits for (the first answer wins).
        hedges: list[tuple[int, int]] = []
        if cfg.replicas == "balance" and by_node:
            hedge_debt[0] += HEDGED_SHARE * sum(len(es) for es in by_node.values())
            for w, es in by_node.items():
                for e in es:
                    others = [o for o in holders[e] if o != w and not is_down(o, t)]
                    if hedge_debt[0] < 1.0 or not others:
                        continue
                    hedge_debt[0] -= 1.0
                    hedges.append((others[0], e))
        # Messages: one per node's bundle, one per call on an expert's subject (probes, hedges too).
        messages: list[tuple[int, list[int], bool]] = [(w, es, True) for w, es in by_node.items()]
        messages += [(w, [e], True) for w, e in singles] + [(w, [e], False) for w, e in (*probes, *hedges)]
        n_calls = len(nodes_of) + len({e for _, e in probes})
        rows_calls = sum(int(counts[e]) for e in nodes_of)
        # The engine thread plans and encodes the step (a call's books once, whatever its replicas);
        # a step with anything on an expert's subject, or in balance mode (hedges on a timer), goes
        # through the bus client's loop thread instead of the engine thread's own connection.
        direct = cfg.bundles and not singles and not probes and cfg.replicas != "balance"
        send_cpu = len(messages) * costs.backbone_per_message / 2 + n_calls * (costs.backbone_per_call - costs.reply_per_call) \
            + rows_calls * costs.backbone_per_row / 2 + (0.0 if direct or not messages else costs.bus_path) \
            + (len(nodes_of) * costs.hedge_per_call if cfg.replicas == "balance" else 0.0)
        t_sent = disp_pool.run(t, send_cpu)
        # The engine thread while the replies travel: the shared expert, the calls nobody was asked
        # for, then (_audit_ahead) the references of the audited calls that one node answers.
        # The auditor's verdicts, per node in the order of its calls: a call in one node's
        # bundle has its reference computed ahead, while its reply travels (_audit_ahead); a call
        # that several replicas race for is recomputed once it is won and the step has settled.
        ahead: list[int] = []
        if audit_window:
            single: dict[int, list[int]] = {}
            for e, asked in nodes_of.items():
                if len(asked) == 1 and asked[0] in by_node and not stopped(asked[0], t_sent):
                    single.setdefault(asked[0], []).append(e)
            for w, es in sorted(single.items()):
                picked = audited(w, il, es)
                ahead += picked
                passed[w] += len(picked)
        engine_work = costs.shared(rows) + local_cost(int(counts[e]) for e in local_calls) \
            + local_cost(int(counts[e]) for e in ahead)
        t_engine = dense_pool.run(t_sent, engine_work) if engine_work > 0 else t_sent
        answered: dict[int, float] = {}
        winner: dict[int, int] = {}
        reply_at: dict[int, float] = {}  # node -> when its bundle's reply was taken
        wait_for: set[int] = set(nodes_of)
        waited = [(w, es) for w, es, wait in messages if wait]
        row_b = costs.row_bytes
        if fast and waited and not probes and not hedges and len({w for w, _ in waited}) == len(waited) and not singles:
            srtt, rttvar = _fast_flights(waited, counts, rows, t_sent, costs, cfg, rtt_arr, worker_free, nats_pool,
                                         disp_pool, answered, totals, srtt, rttvar, cfg.stop_at_s, winner,
                                         reply_at, t_engine if direct else 0.0)
        else:
            # In phases, each in time order (the pools serve work in the order it is handed to
            # them): the requests through nats-server, the workers, the replies back.
            flights = []
            for w, es, wait in messages:
                rows_m = sum(int(counts[e]) for e in es)
                union = min(rows, rows_m) if len(es) > 1 else rows_m
                out_b = union * row_b + len(es) * costs.call_bytes + costs.message_bytes
                in_b = rows_m * row_b + len(es) * costs.call_bytes + costs.message_bytes
                totals["bytes_out"] += out_b
                totals["bytes_in"] += in_b
                totals["messages"] += 1
                depart = uplink.run(t_sent, out_b * 8 / cfg.uplink_bps) if cfg.uplink_bps else t_sent
                at_nats = nats_pool.run(depart, costs.nats_per_message)
                flights.append((at_nats + rtt[w] / 2, w, es, rows_m, wait))
            done_at = []
            woken: set[int] = set()  # workers this layer step woke so far
            for arrive, w, es, rows_m, wait in sorted(flights, key=lambda f: f[0]):
                if stopped(w, arrive):
                    continue  # a frozen worker: never answers
                wc = kinds_of_worker[w % len(kinds_of_worker)]
                work = wc.worker_per_message + (wc.worker_kernel(len(es), rows_m) + _tiled(wc, es, counts)) / cfg.worker_speedup
                if cfg.colocated_cores and woken and w not in woken:  # another process woken on the shared cores
                    work += costs.fanout
                woken.add(w)
                done_at.append((worker_pools[w].run(arrive, work) + rtt[w] / 2, w, es, rows_m, wait))
            for back, w, es, rows_m, wait in sorted(done_at, key=lambda f: f[0]):
                relayed = nats_pool.run(back, costs.nats_per_message)
                # On the engine thread's own connection the replies are read by the engine thread,
                # once its work of the step is done; the bus thread takes them as they come.
                got = disp_pool.run(max(relayed, t_engine) if direct else relayed,
                                    costs.backbone_per_message / 2 + rows_m * costs.backbone_per_row / 2
                                    + (len(es) * costs.reply_per_call if wait else 0.0))
                if not wait:  # a probe's answer ends the silence; a hedge's is a duplicate
                    silent.difference_update((il, e) for e in es)
                    continue
                if w in by_node and by_node[w] is es:
                    reply_at[w] = got
                for e in es:
                    if e not in answered or got < answered[e]:
                        answered[e], winner[e] = got, w
                lat = got - t_sent
                if srtt is None:
                    srtt, rttvar = lat, lat / 2
                else:
                    rttvar = 0.75 * rttvar + 0.25 * abs(srtt - lat)
                    srtt = 0.875 * srtt + 0.125 * lat
        missing = wait_for - set(answered)
        end = max([t_engine, *answered.values()]) if answered else t_engine
        # Race mode: once every call is won, the step waits for the replicas that raced a call
        # another node won (nodes that answered bundles before, and did not miss that wait three
        # steps in a row, but every 64th step), up to race_confirm times its round trip (at least
        # 10 ms): their answers check the winners' before any is used.
        if cfg.replicas == "race" and cfg.race_confirm > 0 and cfg.audit < 1.0 and answered and not missing:
            t_won = max(answered.values())
            retry = unproven_turn[0] % CONFIRM_RETRY == 0
            racing = [w for w, es in by_node.items() if w in heard and reply_at.get(w, math.inf) > t_won
                      and (misses.get(w, 0) < CONFIRM_MISSES or retry) and any(winner.get(e, w) != w for e in es)]
            if racing:
                until = t_won + max(CONFIRM_FLOOR_S, cfg.race_confirm * (t_won - t_sent))
                last = max(reply_at.get(w, math.inf) for w in racing)
                end = max(end, min(last, until))
                for w in racing:
                    misses[w] = misses.get(w, 0) + 1 if reply_at.get(w, math.inf) > until else 0
        heard.update(reply_at)
        after: list[int] = []
        if audit_window:
            by_winner: dict[int, list[int]] = {}
            for e, w in winner.items():
                if len(nodes_of.get(e, ())) > 1:
                    by_winner.setdefault(w, []).append(e)
            for w, es in sorted(by_winner.items()):
                picked = audited(w, il, es)
                after += picked
                passed[w] += len(picked)
        if missing:  # a frozen holder: the timeout, then computed here; silent from now on
            timeouts += 1
            totals["timed_out_calls"] = totals.get("timed_out_calls", 0) + len(missing)
            deadline = t_sent + current_timeout()
            end = max(end, dense_pool.run(deadline, local_cost(int(counts[e]) for e in missing)))
            silent.update((il, e) for e in missing)
            for w in {w for e in missing for w in nodes_of[e] if w in by_node}:  # no bundles to it for a while
                until, hold = held.get(w, (0.0, SILENCE_HOLD_S / 2))
                if until <= deadline:
                    hold = min(MAX_HOLD_S, 2 * hold)
                    held[w] = (deadline + hold, hold)
            local_calls.extend(missing)
        # Once the step has settled (_finish_step): the audits' comparisons, and a recomputation
        # where the worker's kernel is not one this backbone runs (costs.audit_path); a raced
        # call's reference only now (_accept).
        audit_work = local_cost(int(counts[e]) for e in after) + sum(
            recompute_cost(il, e, int(counts[e])) for e in (*ahead, *after))
        if audit_work > 0:
            end = dense_pool.run(end, audit_work)
        if costs.bus_per_win and winner:  # the market link's share of the wins, on the bus thread
            disp_pool.run(end, costs.bus_per_win * len(winner))
        totals["calls"] += len(chosen)
        totals["local"] += len(local_calls)
        totals["audits"] = totals.get("audits", 0) + len(ahead) + len(after)
        return end + costs.hop

    # -- continuous batching over lanes ---------------------------------------------------------
    S, T, P = cfg.streams, cfg.tokens, cfg.prompt_tokens
    lanes = max(1, cfg.micro_batches)
    active = [[] for _ in range(lanes)]  # stream ids per lane
    admitted = min(S, cfg.max_active)
    for s in range(admitted):
        active[min(range(lanes), key=lambda i: len(active[i]))].append(s)
    queue = list(range(admitted, S))
    fed = [0] * S
    produced = [0] * S
    stamps: list[list[float]] = [[] for _ in range(S)]
    # kvasir serve takes each request in (HTTP, admission) before its first step.
    t0 = costs.request * (1 if S <= 1 else 1)
    events = [(t0, lane) for lane in range(lanes) if active[lane]]
    heapq.heapify(events)
    makespan = 0.0
    steps = 0
    while events:
        t, lane = heapq.heappop(events)
        mine = active[lane]
        if not mine:
            continue
        decoding = [s for s in mine if fed[s] >= P]
        budget = cfg.step_tokens - len(decoding)
        if budget <= 0:
            budget = max(1, cfg.step_tokens // 4)
        chunks = {}
        for s in mine:
            if budget <= 0:
                break
            if fed[s] < P:
                take = min(P - fed[s], budget)
                chunks[s] = take
                budget -= take
        rows = len(decoding) + sum(chunks.values())
        ctx_rows = sum(fed[s] + produced[s] for s in decoding) + sum(c * (fed[s] + c / 2) for s, c in chunks.items())
        for il in range(L):
            t = layer_step(t, il, rows, ctx_rows, len(decoding) + len(chunks))
        t = dense_pool.run(t, costs.head(len(decoding) + len(chunks)))
        emitting = len(decoding) + sum(1 for s, c in chunks.items() if fed[s] + c >= P)
        if costs.token and emitting:  # each token's streamed event (the HTTP layer, on the GIL)
            t = disp_pool.run(t, costs.token * emitting)
        steps += 1
        finished = []
        for s in decoding:
            produced[s] += 1
            stamps[s].append(t)
        for s, c in chunks.items():
            fed[s] += c
            if fed[s] >= P:
                produced[s] += 1
                stamps[s].append(t)
        for s in mine:
            if produced[s] >= T:
                finished.append(s)
        for s in finished:
            mine.remove(s)
            if queue:
                nxt = queue.pop(0)
                active[min(range(lanes), key=lambda i: len(active[i]))].append(nxt)
        makespan = max(makespan, t)
        if mine:
            heapq.heappush(events, (t, lane))
        for other in range(lanes):  # a lane that was empty and got work
            if other != lane and active[other] and all(ev[1] != other for ev in events):
                heapq.heappush(events, (t, other))
        if steps > 10_000_000:
            break
    tokens = sum(produced)
    ttft = [st[0] for st in stamps if st]
    gaps = [b - a for st in stamps for a, b in zip(st, st[1:])]
    span = max(makespan, 1e-12)
    worker_util = [p.busy / span / p.size for p in worker_pools] if not shared else []
    if fast:
        worker_util = list(totals.get("worker_busy", np.zeros(len(worker_pools))) / span)
    util = {
        "backbone_dense": round(dense_pool.busy / span / dense_pool.size, 3) if not shared else None,
        "backbone_dispatch": round(disp_pool.busy / span, 3) if not shared else None,
        "nats_server": round(nats_pool.busy / span, 3) if not shared else None,
        "workers_mean": round(float(np.mean(worker_util)), 3) if worker_util else None,
        "workers_max": round(float(np.max(worker_util)), 3) if worker_util else None,
        "uplink": round(uplink.busy / span, 3) if cfg.uplink_bps else None,
        "colocated_cores": round(shared.busy / span / shared.size, 3) if shared else None,
    }
    util = {k: v for k, v in util.items() if v is not None}
    bounds = _bounds(shapes, costs, cfg)
    result = Result(
        tokens_per_s=round(tokens / span, 3), ttft_ms={"p50": _pct(ttft, 50), "p95": _pct(ttft, 95)},
        itl_ms={"p50": _pct(gaps, 50), "p95": _pct(gaps, 95)}, utilisation=util,
        uplink_bytes_per_s=round(totals["bytes_out"] / span), downlink_bytes_per_s=round(totals["bytes_in"] / span),
        messages_per_token=round(totals["messages"] / max(1, tokens), 2),
        local_fraction=round(totals["local"] / max(1, totals["calls"]), 4),
        bottleneck="", bounds=bounds, seconds=round(span, 4), timeouts=timeouts,
        extra={"audits": totals.get("audits", 0),
               "dequant_misses": dequant.misses if dequant is not None else None, "timed_out_calls": totals.get("timed_out_calls", 0),
               # each thread of work's busy share (colocated: of one core), where a miss comes from
               "busy": {"engine_python": round(disp_pool.busy / span, 3), "nats_server": round(nats_pool.busy / span, 3),
                        "workers": [round(p.busy / span, 3) for p in worker_pools] if not fast else None,
                        "dense": round(dense_pool.busy / span, 3) if not shared else None}})
    result.bottleneck = _bottleneck(result, cfg)
    return result


def _tiled(costs: Costs, es, counts) -> float:
    """What a worker's calls of ``tiled_from`` rows or more cost less than its kernel line says
    (a fast-mode worker's ggml runs them with its tiled kernels: ``Costs.tiled_call``/``tiled_row``)."""
    if not costs.tiled_from:
        return 0.0
    big = [int(counts[e]) for e in es if counts[e] >= costs.tiled_from]
    return len(big) * costs.tiled_call + sum(big) * costs.tiled_row if big else 0.0


def _fifo(ready: np.ndarray, cost: np.ndarray, free: float) -> np.ndarray:
    """End times of jobs on one FIFO server, in the order given: e_i = max(e_{i-1}, r_i) + c_i,
    e_{-1} = ``free``, as a closed form (max-plus: e_i = C_i + max(free, max_{j<=i} r_j - C_{j-1}))."""
    c = np.cumsum(cost)
    prev = np.concatenate([[0.0], c[:-1]])
    return c + np.maximum(free, np.maximum.accumulate(ready - prev))


def _fast_flights(messages, counts, rows, t_sent, costs, cfg, rtt_arr, worker_free, nats_pool, disp_pool,
                  answered, totals, srtt, rttvar, stop_at, winner, reply_at, read_from=0.0):
    """The three phases of a layer step's messages (requests through nats-server, the workers,
    the replies) for messages to distinct single-core workers, vectorised."""
    ws = np.fromiter((w for w, _ in messages), dtype=np.int64, count=len(messages))
    n_calls = np.fromiter((len(es) for _, es in messages), dtype=float, count=len(messages))
    rows_m = np.fromiter((sum(int(counts[e]) for e in es) for _, es in messages), dtype=float, count=len(messages))
    union = np.minimum(rows, rows_m) if cfg.bundles else rows_m
    row_b = costs.row_bytes
    totals["bytes_out"] += float(np.sum(union * row_b + n_calls * costs.call_bytes + costs.message_bytes))
    totals["bytes_in"] += float(np.sum(rows_m * row_b + n_calls * costs.call_bytes + costs.message_bytes))
    totals["messages"] += len(messages)
    M = len(messages)
    nc = costs.nats_per_message
    at_nats = _fifo(np.full(M, t_sent), np.full(M, nc), nats_pool.run(t_sent, 0.0))
    if M:
        lane = nats_pool.lanes[0]
        lane.take(float(at_nats[0]) - nc, float(at_nats[-1]), lane.earliest(float(at_nats[0]) - nc, 0.0)[1])
    nats_pool.busy += M * nc
    arrive = at_nats + rtt_arr[ws] / 2
    k = costs.worker_kernel
    tiled = np.fromiter((_tiled(costs, es, counts) for _, es in messages), dtype=float, count=len(messages)) \
        if costs.tiled_from else 0.0
    work = costs.worker_per_message + (k.c0 + k.c1 * n_calls + k.c2 * rows_m + tiled) / cfg.worker_speedup
    done = np.maximum(worker_free[ws], arrive) + work
    live = np.ones(M, bool) if stop_at is None else ~((ws == 0) & (arrive >= stop_at))  # worker 0 frozen from then
    worker_free[ws[live]] = done[live]
    busy = totals.setdefault("worker_busy", np.zeros(len(worker_free)))
    np.add.at(busy, ws[live], work[live])
    back = (done + rtt_arr[ws] / 2)[live]
    idx = np.nonzero(live)[0]
    if not len(idx):
        return srtt, rttvar
    order = np.argsort(back, kind="stable")
    back, idx = back[order], idx[order]
    relayed = np.array([nats_pool.run(b, nc) for b in back.tolist()])
    handle = costs.backbone_per_message / 2 + rows_m[idx] * costs.backbone_per_row / 2 + n_calls[idx] * costs.reply_per_call
    got = np.array([disp_pool.run(max(r, read_from), h) for r, h in zip(relayed.tolist(), handle.tolist())])
    for g, i in zip(got.tolist(), idx.tolist()):
        reply_at[int(ws[i])] = g
        for e in messages[i][1]:
            if e not in answered or g < answered[e]:
                answered[e], winner[e] = g, int(ws[i])
    for lat in (got - t_sent).tolist():  # the adaptive timeout's smoothing, reply by reply
        if srtt is None:
            srtt, rttvar = lat, lat / 2
        else:
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - lat)
            srtt = 0.875 * srtt + 0.125 * lat
    return srtt, rttvar


def _bounds(shapes: Shapes, costs: Costs, cfg: Config) -> dict:
    """The three bounds no prediction may beat (DESIGN.md section 13), decode only: the dense path
    at the batch, the workers' compute summed over workers, the round trips S / (L x r)."""
    S, L = cfg.streams, shapes.n_layer
    B = min(S, cfg.max_active)
    lanes = max(1, cfg.micro_batches)
    per_lane = math.ceil(B / lanes)
    dense = L * min(costs.attention(per_lane, 0, per_lane), costs.recurrent(per_lane, 0, per_lane)) + costs.head(per_lane)
    out = {"dense_path_tok_s": round(per_lane * min(lanes, 1 if cfg.colocated_cores else lanes) / dense, 2)
           if dense > 0 else None}
    # Worker compute: every row's K experts, at the kernel's per-row cost, on every worker's cores.
    w_cores = max(1, cfg.workers) * cfg.worker_cores if not cfg.colocated_cores else cfg.colocated_cores
    replicas = (cfg.workers if cfg.replicated else max(1, cfg.workers // shapes.n_expert)) \
        if cfg.replicas == "race" else 1
    per_token = shapes.n_moe_layers * shapes.n_expert_used * costs.worker_kernel.c2 * replicas
    out["worker_compute_tok_s"] = round(w_cores / per_token, 2) if per_token > 0 and cfg.workers else None
    r = min(cfg.rtt_s)
    out["round_trip_tok_s"] = round(S / (shapes.n_moe_layers * r), 2) if r > 0 else None
    return out


def _bottleneck(r: Result, cfg: Config) -> str:
    """The busiest resource, named as the issue names them; below 70% busy everywhere, the round
    trips (links: the steps wait on the wire). A swarm that computes most calls locally for lack
    of workers is coverage-bound."""
    if r.local_fraction > 0.5 and cfg.hot_fraction < 0.5 and cfg.remote_layers is None:
        return "coverage"
    u = r.utilisation
    if "colocated_cores" in u:
        return "shared cores" if u["colocated_cores"] >= 0.7 else "links (round trips)"
    named = {"backbone dense path": u.get("backbone_dense", 0), "backbone dispatch": u.get("backbone_dispatch", 0),
             "worker compute": u.get("workers_max", 0), "nats-server": u.get("nats_server", 0),
             "links (bandwidth)": u.get("uplink", 0)}
    name, busy = max(named.items(), key=lambda kv: kv[1])
    return name if busy >= 0.7 else "links (round trips)"
