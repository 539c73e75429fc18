"""A discrete-event model of the swarm, as the code runs it (plain Python, heapq).

What it follows, and where in the code that behaviour lives:

* **continuous batching** (``backbone/scheduler.py``): every request arrives at t = 0 (the check's
  closed set of clients), up to ``max_active`` run; each step takes every decoding sequence's
  token, then prompt chunks while ``step_tokens`` lasts; a sequence's first token comes at the end
  of the step that reads its prompt's last chunk, then one per step. ``micro_batches`` lanes
  (sequences split at admission to the lane with fewer) step on their own, interleaved.
* **a layer step** (``backbone/model.py`` forward, ``backbone/dispatch.py``): the layer's dense
  part on the backbone (attention or delta-net, at the rows and context of the step), the router's
  choice (``n_expert_used`` distinct experts per row, uniform: a real router's skew only helps),
  the calls grouped per worker into one bundle each (``--bundles on``) or one message per
  expert, planned and encoded by the engine thread, relayed by nats-server, computed by the
  worker (its CPU per message plus its kernel on the bundle's experts and rows, FIFO on its
  cores), relayed back; the shared expert, local fallbacks and audited calls' references run on
  the engine thread while the replies travel (``_audit_ahead``); the step ends when every call
  has its answer (the first replica's in race mode; one holder's, hedged, in balance mode).
* **placement** (``launch.swarm.split_experts`` with ``--layer all``): each worker holds one
  range of expert indices on every layer; past ``n_expert`` workers the ranges repeat (replicas).
* **timeouts and silence** (``AdaptiveTimeout``, ``backbone/coverage_view.py``): a worker that stops
  answering (``stop_at``) costs one timeout (``srtt + 4 rttvar``, clamped, or the fixed one), then
  its experts are computed locally at once while probes go on; a worker that is gone (churn) is
  "no responders": local at once, no wait.
* **resources**: the backbone's dense cores, its dispatch thread (the GIL's: planning, encoding,
  replies), nats-server, each worker's cores, the backbone's uplink; ``colocated`` = C puts all
  of them on one pool of C cores (the check on this machine: workers share the backbone's cores).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from planner.profile import Costs
from planner.shapes import Shapes

FAST = True  # the vectorised path where it applies (tests compare it with the general one)

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
    max_active: int = 1024
    step_tokens: int = 1024
    replicated: bool = False  # every worker holds every expert (replicas of the whole model)
    # Colocated only: other programs' runnable threads on the same cores, on average. Each of our
    # tasks then gets a time-shared core: it takes max(1, (R + 1) / cores) times its CPU time.
    background_runnable: float = 0.0
    remote_layers: int | None = None  # only the first N MoE layers ask workers; the rest run here
    worker_speedup: float = 1.0  # workers' kernels this many times faster than the profile's (a GPU)
    seed: int = 0


class Pool:
    """``n`` identical servers, FIFO in the order work is handed to them; busy time counted."""

    def __init__(self, n: int):
        self.free = [0.0] * max(1, n)
        self.busy = 0.0

    def run(self, ready: float, seconds: float) -> float:
        t = heapq.heappop(self.free)
        start = max(t, ready)
        end = start + seconds
        heapq.heappush(self.free, end)
        self.busy += seconds
        return end

    @property
    def size(self) -> int:
        return len(self.free)


class _Routing:
    """Per-expert row counts of a step of ``rows`` rows, from a pool of samples per size."""

    def __init__(self, n_expert: int, k: int, rng: np.random.Generator, pool: int = 24):
        self.E, self.k, self.rng, self.pool, self.cache, self.turn = n_expert, k, rng, pool, {}, 0

    def counts(self, rows: int) -> np.ndarray:
        samples = self.cache.get(rows)
        if samples is None:
            samples = []
            for _ in range(self.pool):
                if rows * self.k <= 4 * self.E:
                    chosen = np.concatenate([self.rng.choice(self.E, self.k, replace=False) for _ in range(rows)])
                else:
                    chosen = np.argpartition(self.rng.random((rows, self.E)), self.k, axis=1)[:, :self.k].ravel()
                samples.append(np.bincount(chosen, minlength=self.E))
            self.cache[rows] = samples
        self.turn += 1
        return samples[self.turn % self.pool]


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


def simulate(shapes: Shapes, costs: Costs, cfg: Config, worker_costs: list[Costs] | None = None) -> Result:
    """Run the model; ``worker_costs``: per worker (cycled) the kernel and per-message CPU of its
    device (``--worker-profile``), default ``costs``'."""
    kinds_of_worker = worker_costs or [costs]
    rng = np.random.default_rng(cfg.seed)
    E, K, L = shapes.n_expert, shapes.n_expert_used, shapes.n_layer
    kinds = ["recurrent" if shapes.n_attention_layers and (il + 1) % max(1, round(L / shapes.n_attention_layers)) != 0
             and shapes.n_recurrent_layers else "attention" for il in range(L)]
    if shapes.n_recurrent_layers == 0:
        kinds = ["attention"] * L
    moe_layer = [il >= L - shapes.n_moe_layers for il in range(L)]  # DeepSeek-V3: the first 3 are dense
    holders = [list(range(cfg.workers))] * E if cfg.replicated else holders_of(E, cfg.workers)
    routing = _Routing(E, K, rng)
    rtt = [cfg.rtt_s[w % len(cfg.rtt_s)] for w in range(max(1, cfg.workers))]

    # Resources. Colocated: one pool of cores for everything (the backbone's dense graphs, its
    # dispatch thread, nats-server and every worker).
    if cfg.colocated_cores:
        stretch = max(1.0, (cfg.background_runnable + 1.0) / cfg.colocated_cores)
        if stretch > 1.0:
            costs = _stretched(costs, stretch)
            kinds_of_worker = [_stretched(c, stretch) for c in kinds_of_worker]
        shared = Pool(cfg.colocated_cores)
        dense_pool = disp_pool = nats_pool = shared
        worker_pools = [shared] * max(1, cfg.workers)
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

    def stopped_arr(t: float) -> np.ndarray | None:
        if cfg.stop_at_s is None:
            return None
        return np.arange(max(1, cfg.workers)) == 0

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

    def current_timeout() -> float:
        if cfg.timeout_s is not None:
            return cfg.timeout_s
        if srtt is None:
            return 0.5
        return min(2.0, max(0.05, srtt + 4 * rttvar))

    def layer_step(t: float, il: int, rows: int, ctx_rows: float) -> float:
        """One layer of one lane's step starting at ``t``: its end time."""
        nonlocal srtt, rttvar, timeouts
        line = costs.recurrent if kinds[il] == "recurrent" else costs.attention
        t = dense_pool.run(t, line(rows, ctx_rows))
        if not moe_layer[il]:
            return t
        counts = routing.counts(rows)
        chosen = np.nonzero(counts)[0]
        n_hot = int(round(cfg.hot_fraction * len(chosen)))
        if cfg.remote_layers is not None and il - (L - shapes.n_moe_layers) >= cfg.remote_layers:
            n_hot = len(chosen)  # a layer the backbone keeps: every expert here, as without workers
        local_calls: list[int] = list(chosen[:n_hot]) if n_hot else []
        by_node: dict[int, list[int]] = {}
        for e in chosen[n_hot:]:
            e = int(e)
            live = [w for w in holders[e] if not is_down(w, t)]
            if not live or (il, e) in silent:
                local_calls.append(e)
                if (il, e) in silent:  # the probe still goes
                    for w in live:
                        by_node.setdefault(w, [])
                continue
            if cfg.replicas == "race":
                for w in live:
                    by_node.setdefault(w, []).append(e)
            else:  # balance: the holder with the fewest calls of this step
                w = min(live, key=lambda n: (len(by_node.get(n, ())), n))
                by_node.setdefault(w, []).append(e)
        # Messages: one per node (bundles) or one per call.
        messages: list[tuple[int, list[int]]] = []
        for w, es in by_node.items():
            if not es:
                continue
            if cfg.bundles:
                messages.append((w, es))
            else:
                messages.extend((w, [e]) for e in es)
        # A call's planning, booking and records are paid once whatever its replicas (race sends it
        # to every holder; the losers' replies are compared and dropped: a message's cost).
        unique = {e for _, es in messages for e in es}
        n_calls = len(unique)
        rows_calls = sum(int(counts[e]) for e in unique)
        send_cpu = len(messages) * costs.backbone_per_message / 2 + n_calls * costs.backbone_per_call \
            + rows_calls * costs.backbone_per_row / 2
        t_sent = disp_pool.run(t, send_cpu)
        # The engine thread, while the replies travel: the shared expert, local calls, audits' references.
        remote_calls = len({e for _, es in messages for e in es})
        audited = int(round(cfg.audit * remote_calls))
        local_rows = sum(int(counts[e]) for e in local_calls)
        audit_rows = int(round(cfg.audit * rows_calls / max(1, len(by_node) if cfg.replicas == "race" else 1)))
        engine_work = costs.shared(rows)
        if local_calls:
            engine_work += costs.backbone_kernel(len(local_calls), local_rows)
        if audited:
            engine_work += costs.backbone_kernel(audited, audit_rows)
        t_engine = dense_pool.run(t_sent, engine_work) if engine_work > 0 else t_sent
        answered: dict[int, float] = {}
        wait_for: set[int] = {e for _, es in messages for e in es}
        row_b = costs.row_bytes
        if fast and messages and len({w for w, _ in messages}) == len(messages):
            srtt, rttvar = _fast_flights(messages, counts, rows, t_sent, costs, cfg, rtt_arr, worker_free, nats_pool,
                                         disp_pool, answered, totals, srtt, rttvar, stopped_arr(t_sent))
        else:
            # In phases, each in time order (the pools serve work in the order it is handed to
            # them): the requests through nats-server, the workers, the replies back.
            flights = []
            for w, es in messages:
                rows_m = sum(int(counts[e]) for e in es)
                union = min(rows, rows_m) if cfg.bundles else rows_m
                out_b = union * row_b + len(es) * costs.call_bytes + costs.message_bytes
                in_b = rows_m * row_b + len(es) * costs.call_bytes + costs.message_bytes
                totals["bytes_out"] += out_b
                totals["bytes_in"] += in_b
                totals["messages"] += 1
                depart = uplink.run(t_sent, out_b * 8 / cfg.uplink_bps) if cfg.uplink_bps else t_sent
                at_nats = nats_pool.run(depart, costs.nats_per_message)
                flights.append((at_nats + rtt[w] / 2, w, es, rows_m))
            done_at = []
            for arrive, w, es, rows_m in sorted(flights, key=lambda f: f[0]):
                if stopped(w, arrive):
                    continue  # a frozen worker: never answers
                wc = kinds_of_worker[w % len(kinds_of_worker)]
                work = wc.worker_per_message + wc.worker_kernel(len(es), rows_m) / cfg.worker_speedup
                done_at.append((worker_pools[w].run(arrive, work) + rtt[w] / 2, w, es, rows_m))
            for back, w, es, rows_m in sorted(done_at, key=lambda f: f[0]):
                relayed = nats_pool.run(back, costs.nats_per_message)
                got = disp_pool.run(relayed, costs.backbone_per_message / 2 + rows_m * costs.backbone_per_row / 2)
                for e in es:
                    if e not in answered or got < answered[e]:
                        answered[e] = got
                lat = got - t_sent
                if srtt is None:
                    srtt, rttvar = lat, lat / 2
                else:
                    rttvar = 0.75 * rttvar + 0.25 * abs(srtt - lat)
                    srtt = 0.875 * srtt + 0.125 * lat
        missing = wait_for - set(answered)
        end = max([t_engine, *answered.values()]) if answered else t_engine
        if missing:  # a frozen holder: the timeout, then computed here; silent from now on
            timeouts += 1
            deadline = t_sent + current_timeout()
            missing_rows = sum(int(counts[e]) for e in missing)
            end = max(end, dense_pool.run(deadline, costs.backbone_kernel(len(missing), missing_rows)))
            silent.update((il, e) for e in missing)
            local_calls.extend(missing)
        totals["calls"] += len(chosen)
        totals["local"] += len(local_calls)
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
            t = layer_step(t, il, rows, ctx_rows)
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
        bottleneck="", bounds=bounds, seconds=round(span, 4), timeouts=timeouts)
    result.bottleneck = _bottleneck(result, cfg)
    return result


def _fifo(ready: np.ndarray, cost: np.ndarray, free: float) -> np.ndarray:
    """End times of jobs on one FIFO server, in the order given: e_i = max(e_{i-1}, r_i) + c_i,
    e_{-1} = ``free``, as a closed form (max-plus: e_i = C_i + max(free, max_{j<=i} r_j - C_{j-1}))."""
    c = np.cumsum(cost)
    prev = np.concatenate([[0.0], c[:-1]])
    return c + np.maximum(free, np.maximum.accumulate(ready - prev))


def _fast_flights(messages, counts, rows, t_sent, costs, cfg, rtt_arr, worker_free, nats_pool, disp_pool,
                  answered, totals, srtt, rttvar, frozen):
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
    at_nats = _fifo(np.full(M, t_sent), np.full(M, nc), nats_pool.free[0])
    nats_pool.free[0] = float(at_nats[-1])
    nats_pool.busy += M * nc
    arrive = at_nats + rtt_arr[ws] / 2
    k = costs.worker_kernel
    work = costs.worker_per_message + (k.c0 + k.c1 * n_calls + k.c2 * rows_m) / cfg.worker_speedup
    done = np.maximum(worker_free[ws], arrive) + work
    live = np.ones(M, bool) if frozen is None else ~frozen[ws]
    worker_free[ws[live]] = done[live]
    busy = totals.setdefault("worker_busy", np.zeros(len(worker_free)))
    np.add.at(busy, ws[live], work[live])
    back = (done + rtt_arr[ws] / 2)[live]
    idx = np.nonzero(live)[0]
    if not len(idx):
        return srtt, rttvar
    order = np.argsort(back, kind="stable")
    back, idx = back[order], idx[order]
    relayed = _fifo(back, np.full(len(idx), nc), nats_pool.free[0])
    nats_pool.free[0] = float(relayed[-1])
    nats_pool.busy += len(idx) * nc
    handle = costs.backbone_per_message / 2 + rows_m[idx] * costs.backbone_per_row / 2
    got = _fifo(relayed, handle, disp_pool.free[0])
    disp_pool.free[0] = float(got[-1])
    disp_pool.busy += float(np.sum(handle))
    for g, i in zip(got.tolist(), idx.tolist()):
        for e in messages[i][1]:
            if e not in answered or g < answered[e]:
                answered[e] = g
    for lat in (got - t_sent).tolist():  # the adaptive timeout's smoothing, reply by reply
        if srtt is None:
            srtt, rttvar = lat, lat / 2
        else:
            rttvar = 0.75 * rttvar + 0.25 * abs(srtt - lat)
            srtt = 0.875 * srtt + 0.125 * lat
    return srtt, rttvar


def _stretched(c: Costs, k: float) -> Costs:
    """Every CPU cost of ``c`` times ``k`` (a time-shared core); the wire's bytes unchanged."""
    from dataclasses import replace

    lines = {n: getattr(c, n).scaled(k) for n in ("attention", "recurrent", "shared", "head", "backbone_kernel",
                                                   "worker_kernel")}
    return replace(c, **lines, backbone_per_message=c.backbone_per_message * k, backbone_per_call=c.backbone_per_call * k,
                   backbone_per_row=c.backbone_per_row * k, worker_per_message=c.worker_per_message * k,
                   nats_per_message=c.nats_per_message * k, hop=c.hop * k, request=c.request * k, token=c.token * k)


def _bounds(shapes: Shapes, costs: Costs, cfg: Config) -> dict:
    """The three bounds no prediction may beat (DESIGN.md section 13), decode only: the dense path
    at the batch, the workers' compute summed over workers, the round trips S / (L x r)."""
    S, L = cfg.streams, shapes.n_layer
    B = min(S, cfg.max_active)
    lanes = max(1, cfg.micro_batches)
    per_lane = math.ceil(B / lanes)
    dense = L * min(costs.attention(per_lane), costs.recurrent(per_lane)) + costs.head(per_lane)
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
