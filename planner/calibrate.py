"""``kvasir calibrate``: what each piece of the swarm costs on this machine, for one model's shapes.

Measured with the project's own code, nothing modelled:

* **backbone dense path** (``--role backbone|both``): the engine itself (:class:`backbone.model.
  Engine`) stepping B sequences at a context of C tokens, with an expert backend that timestamps
  every layer's call (:class:`_Clock`), so a step splits into each layer's dense part (attention or
  delta-net, norms, router), the shared expert (run while the routed experts are away), the
  routed experts and the head. Fitted per layer kind as ``c0 + c_row * B + c_ctx * B * C``.
* **expert kernel** (every role): :meth:`backbone.experts.LocalExperts.run_layer`, the ggml graph a
  worker runs for a bundle (``kernels.expert.moe_ffn``), on ``calls`` experts of ``rows`` rows,
  with the worker's threads (``--threads``, default 1 as :func:`launch.swarm.spawn_worker` gives
  co-located workers); fitted as ``c0 + c_call * calls + c_row * rows``.
* **dispatch** (``--role backbone|both``): one real ``kvasir worker`` process holding every expert
  on an embedded nats-server, the backbone's :class:`backbone.service.BackboneService` in this
  process; B-row decode steps with bundles on and off. The process CPU of the sharded steps less
  that of the same steps with a backend that computes nothing gives the backbone's CPU per
  message, per call and per row (least squares over the runs); the worker process's CPU less its
  kernel's gives its CPU per message; nats-server's CPU per message relayed; the wall time left
  over per layer step (wake-ups, the loopback) is ``hop_s``. Bytes per message, call and row are
  the dispatcher's own counters. Balance mode's hedge delay and timer per call
  (:func:`measure_hedge`), on the bus thread, timed on the code's own functions.

* **routing** (``--role backbone|both``): the rows each expert gets per layer while the engine
  reads prompts and decodes greedily (:func:`measure_routing`): ``kvasir plan`` draws each layer
  step's experts from these shares (``--routing measured``) rather than uniformly.

The profile records the model's shapes and fingerprint: ``kvasir plan`` refuses a profile of
another model unless told to rescale it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
import tempfile
import platform
import sys
import time

import numpy as np

from planner.profile import PROFILE_KIND, PROFILE_VERSION


def _say(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


def _proc_cpu_s(pid) -> float:
    """CPU seconds of a process (every live thread) or, as ``self/task/TID``, of one thread: the
    scheduler's nanosecond counts (schedstat), not /proc/stat's 10 ms ticks, which a short
    calibration of a small model could not resolve."""
    base = f"/proc/{pid}"
    tasks = [base] if "/task/" in str(pid) else [f"{base}/task/{t}" for t in os.listdir(f"{base}/task")]
    total = 0
    for task in tasks:
        try:
            with open(f"{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            continue
    return total / 1e9


def fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares by clipping: the coefficients of ``y = x . c`` (a negative
    coefficient is set to 0 and the rest refitted; costs are never negative)."""
    X, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    keep = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while keep:
        c, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (c >= 0).all():
            coef[keep] = c
            break
        keep.pop(int(np.argmin(c)))
    return [float(v) for v in coef]


class _Clock:
    """An expert backend that computes the experts locally (or not at all: ``null``) and
    timestamps each layer: entry, after the caller's overlapped work, exit."""

    def __init__(self, local, null: bool = False):
        self.local, self.null, self.marks = local, null, []

    def run_layer(self, layer, calls, while_waiting=None):
        t0 = time.perf_counter()
        if while_waiting is not None:
            while_waiting()
        t1 = time.perf_counter()
        if self.null:
            outs = [np.zeros_like(rows) for _, rows in calls]
        else:
            outs = self.local.run_layer(layer, calls)
        self.marks.append((layer, t0, t1, time.perf_counter(), len(calls), sum(len(r) for _, r in calls)))
        return outs


def _sequences(engine, n: int, ctx: int, rng) -> list:
    """``n`` sequences with ``ctx`` prompt tokens read (in one batched prefill step)."""
    seqs = [engine.new_sequence() for _ in range(n)]
    engine.forward([(s, rng.integers(0, engine.cfg.n_vocab, ctx)) for s in seqs], all_logits=False)
    return seqs


def _decode_step(engine, seqs, rng) -> None:
    engine.forward([(s, rng.integers(0, engine.cfg.n_vocab, 1)) for s in seqs], all_logits=False)


def _dense_marks(clock, kinds, per, t_start: float, t_end: float | None) -> None:
    """One step's :class:`_Clock` marks split into each layer's dense part (from the previous
    layer's exit to this layer's entry), its shared expert and (``t_end``) the head."""
    prev = t_start
    for (layer, t0, t1, t2, _, _) in clock.marks:
        per[kinds(layer)].append(t0 - prev)
        per["shared"].append(t1 - t0)
        prev = t2
    if t_end is not None:
        per["head"].append(t_end - prev)


def measure_dense(engine, rows: list[int], contexts: list[int], steps: int, rounds: int = 2,
                  prompts: tuple[int, ...] = (1, 4, 8), prompt_tokens: int = 16) -> dict:
    """Per layer kind: samples ``(rows, mean context, seconds, sequences)`` of the dense part, the
    shared expert's, the head's; fitted. Decode steps of B sequences at a context of C (B rows,
    B sequences), and prompt steps of n sequences reading ``prompt_tokens`` each (n x P rows of
    n sequences: a prompt's rows share its sequence's work, so a row costs less there, and a
    prefill predicted at a decode row's cost would come out slow). Fitted as
    ``c0 + c_row * rows + c_row_ctx * rows * context + c_seq * sequences``."""
    cfg = engine.cfg
    clock = _Clock(engine.local_experts)
    rng = np.random.default_rng(0)
    samples = {"attention": [], "recurrent": [], "shared": [], "head": []}
    best: dict = {}

    def kind(layer: int) -> str:
        return "recurrent" if cfg.is_recurrent(layer) else "attention"

    def keep(per: dict, key: tuple) -> None:
        for k, v in per.items():
            if v:
                # A low quantile over the steps (the layers of a kind share a cell), the least over
                # the rounds: on a shared machine other processes' bursts only ever add time.
                value = float(np.percentile(v, 10))
                best[(k, *key)] = min(best.get((k, *key), value), value)

    for ctx, b in [(c, b) for _ in range(rounds) for c in contexts for b in rows]:
        engine.use_experts(None)
        seqs = _sequences(engine, b, ctx, rng)
        engine.use_experts(clock)
        _decode_step(engine, seqs, rng)  # warm this shape's graphs
        per = {k: [] for k in samples}
        for _ in range(steps):
            clock.marks = []
            t_start = time.perf_counter()
            _decode_step(engine, seqs, rng)
            _dense_marks(clock, kind, per, t_start, time.perf_counter())
        keep(per, (b, ctx + steps // 2 + 1, b))
        step_ms = 1e3 * sum(float(np.percentile(v, 10)) * (1 if k == "head" else len(v) / steps)
                            for k, v in per.items() if v)
        _say(f"dense path: {b} rows at context {ctx}: {step_ms:.2f} ms per step without the routed experts")
    for n in [n for _ in range(rounds) for n in prompts]:
        per = {k: [] for k in samples}
        for _ in range(max(2, steps // 2)):
            seqs = [engine.new_sequence() for _ in range(n)]
            batch = [(s, rng.integers(0, cfg.n_vocab, prompt_tokens)) for s in seqs]
            engine.use_experts(clock)
            clock.marks = []
            t_start = time.perf_counter()
            engine.forward(batch, all_logits=False)
            _dense_marks(clock, kind, per, t_start, None)  # the head: each sequence's last row only
            engine.use_experts(None)
        per.pop("head")
        keep(per, (n * prompt_tokens, (prompt_tokens + 1) / 2, n))
        _say(f"dense path: {n} prompt(s) of {prompt_tokens} tokens: "
             f"{1e3 * sum(float(np.percentile(v, 10)) * len(v) for v in per.values() if v) / max(2, steps // 2):.2f} ms "
             "per step without the routed experts")
    engine.use_experts(None)
    for (k, b, n_ctx, n_seq), v in sorted(best.items()):
        samples[k].append((b, n_ctx, v, n_seq))
    out = {}
    for kind_ in ("attention", "recurrent"):
        s = samples[kind_]
        if s:
            c0, c_row, c_ctx, c_seq = fit([[1, b, b * c, q] for b, c, _, q in s], [t for _, _, t, _ in s])
            out[kind_] = {"c0_s": c0, "c_row_s": c_row, "c_row_ctx_s": c_ctx, "c_seq_s": c_seq, "samples": s}
    for kind_ in ("shared", "head"):
        s = samples[kind_]
        c0, c_row = fit([[1, b] for b, *_ in s], [t for _, _, t, _ in s])
        out[kind_] = {"c0_s": c0, "c_row_s": c_row, "samples": s}
    return out


ROUTING_PROMPT_IDS = 256  # the prompts' token ids come from the vocabulary's first 256 (see measure_routing)


def measure_routing(engine, streams: int = 8, prompt: int = 16, tokens: int = 32) -> dict:
    """Which experts the router picks, per layer, on a serving-like workload: ``streams``
    prompts of ``prompt`` token ids drawn from the vocabulary's first ``ROUTING_PROMPT_IDS`` (a
    text's tokens are a small part of a vocabulary; bench/throughput.py's prompts are drawn so)
    read in one step, then ``tokens`` greedy decode steps of all of them, as kvasir serve runs
    them. Returns the rows each expert got on each layer (a list per layer, empty for a layer
    without routed experts): ``kvasir plan`` draws its routing from them (a real router is
    skewed: the rarely picked experts are the last a frozen worker's timeouts reach, and fewer
    distinct experts a step means fewer calls)."""
    cfg = engine.cfg
    rng = np.random.default_rng(5)
    counts: dict[int, np.ndarray] = {}

    class Count(_Clock):
        def run_layer(self, layer, calls, while_waiting=None):
            row = counts.setdefault(layer, np.zeros(cfg.n_expert, dtype=np.int64))
            for expert, rows in calls:
                row[int(expert)] += len(rows)
            return super().run_layer(layer, calls, while_waiting)

    engine.use_experts(Count(engine.local_experts))
    try:
        seqs = [engine.new_sequence() for _ in range(streams)]
        high = min(ROUTING_PROMPT_IDS, cfg.n_vocab)
        logits = engine.forward([(s, rng.integers(0, high, prompt)) for s in seqs], all_logits=False)
        for _ in range(tokens - 1):
            nxt = [np.asarray([int(np.argmax(lg[-1]))]) for lg in logits]
            logits = engine.forward(list(zip(seqs, nxt)), all_logits=False)
    finally:
        engine.use_experts(None)
    per_layer = [counts[il].tolist() if il in counts else [] for il in range(cfg.n_layer)]
    rows = sum(sum(c) for c in per_layer)
    shares = np.sort(np.concatenate([np.asarray(c, float) / max(1, sum(c)) for c in per_layer if c]))
    _say(f"routing: {rows} expert rows over {streams} streams x {tokens} tokens; the rarest tenth of the "
         f"experts got {100 * shares[: max(1, len(shares) // 10)].sum() / max(1, sum(1 for c in per_layer if c)):.1f}% "
         f"of a layer's rows (uniform: 10%)")
    return {"workload": {"streams": streams, "prompt_tokens": prompt, "tokens": tokens,
                         "prompt_ids": high, "decode": "greedy"},
            "rows": rows, "counts": per_layer}


def measure_kernel(engine, threads: int, quick: bool, grid: list[tuple[int, int]] | None = None,
                   say: bool = True) -> dict:
    """The expert kernel a worker runs for one layer step (``moe_ffn`` of ``calls`` experts on
    ``rows`` rows in all), with ``threads`` ggml threads: fitted ``c0 + c_call * calls + c_row * rows``."""
    from kernels.ggml import ENV_THREADS

    cfg = engine.cfg
    local = engine.local_experts
    rng = np.random.default_rng(1)
    if grid is None:
        grid = [(1, 1), (1, 8), (1, 32), (4, 4), (8, 8), (8, 32), (16, 16), (32, 32), (8, 128)]
        if quick:
            grid = [(1, 1), (1, 16), (8, 8), (8, 32), (16, 16)]
    grid = [(min(c, cfg.n_expert), r) for c, r in grid]
    old = os.environ.get(ENV_THREADS)
    os.environ[ENV_THREADS] = str(threads)
    samples = []
    try:
        for n_calls, n_rows in grid:
            per = max(1, n_rows // n_calls)
            experts = rng.choice(cfg.n_expert, n_calls, replace=False)
            calls = [(int(e), rng.standard_normal((per, cfg.n_embd)).astype(np.float32)) for e in experts]
            local.run_layer(0, calls)
            times = []
            deadline = time.perf_counter() + (0.15 if quick else 0.4)
            while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
                layer = int(rng.integers(0, cfg.n_layer))  # another layer's weights: cold as a worker's
                t0 = time.perf_counter()
                local.run_layer(layer, calls)
                times.append(time.perf_counter() - t0)
            samples.append((n_calls, per * n_calls, float(np.percentile(times, 25))))
    finally:
        if old is None:
            os.environ.pop(ENV_THREADS, None)
        else:
            os.environ[ENV_THREADS] = old
    c0, c_call, c_row = fit([[1, c, r] for c, r, _ in samples], [t for *_, t in samples])
    if say:
        _say(f"expert kernel ({threads} thread(s)): {1e6 * c0:.0f} us + {1e6 * c_call:.0f} us per expert "
             f"+ {1e6 * c_row:.1f} us per row")
    return {"threads": threads, "c0_s": c0, "c_call_s": c_call, "c_row_s": c_row, "samples": samples}


#: ggml's fast mode runs a routed expert's K-quant product with its one-row kernel below this many
#: rows and with its tiled (repacked) kernels from it (backbone/audit.py DET_CHUNK_ROWS + 1); the
#: deterministic mode takes the one-row kernel at every row count.
TILED_FROM_ROWS = 8


def _tiled_main() -> None:
    """A child's part of :func:`measure_tiled`: (path, threads, quick, grid) pickled on stdin, the
    kernel's timing and this process's kernel label pickled on stdout."""
    import pickle

    import kvasir_bus  # noqa: F401  (thread settings before ggml loads)
    from backbone.model import Engine
    from kernels.backend import kernel_label

    path, threads, quick, grid = pickle.load(sys.stdin.buffer)
    engine = Engine(path, n_ctx=64)
    pickle.dump((measure_kernel(engine, threads, quick, grid, say=False), kernel_label()), sys.stdout.buffer)


def measure_tiled(path: str, threads: int, quick: bool, kernel: dict) -> dict | None:
    """The expert kernel of a fast-mode worker (a ``kvasir worker`` started without
    --deterministic: what the check's workers and most volunteers run) on calls of
    :data:`TILED_FROM_ROWS` rows or more, where ggml's tiled kernels take over: in a child of the
    fast mode, calls of 8 to 32 rows each. Fitted per call and per row beyond ``kernel``'s own
    fixed part (``c0``), as ``c_call_s`` and ``c_row_s`` of such a call: a prompt's calls (16-32
    rows each in the check) ran 2x faster there than the one-row kernel the deterministic mode
    keeps (0.20 against 0.45 ms for 32 rows). Below 8 rows both modes run the same kernel. None
    where the child fails (said on stderr)."""
    import pickle
    import subprocess

    from kvasir_bus import threads as thr

    grid = [(1, 8), (1, 16), (1, 32), (2, 32), (4, 64), (4, 128), (8, 128), (16, 128)]
    if quick:
        grid = [(1, 8), (1, 32), (4, 64), (8, 128)]
    env = {**os.environ, thr.ENV_MODE: "fast", "GGML_CPU_TILED_MM": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH")]))}
    try:
        res = subprocess.run([sys.executable, "-c", "from planner.calibrate import _tiled_main; _tiled_main()"],
                             input=pickle.dumps((path, threads, quick, grid)), capture_output=True, env=env, timeout=300)
        if res.returncode != 0:
            why = res.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            _say(f"fast-mode kernel: not measured ({why[0]})")
            return None
        timed, label = pickle.loads(res.stdout)
    except (OSError, subprocess.SubprocessError, pickle.UnpicklingError) as exc:
        _say(f"fast-mode kernel: not measured ({type(exc).__name__}: {exc})")
        return None
    samples = timed["samples"]
    c_call, c_row = fit([[c, r] for c, r, _ in samples], [max(0.0, t - kernel["c0_s"]) for c, r, t in samples])
    _say(f"fast-mode expert kernel ({label}) on calls of {TILED_FROM_ROWS} rows or more: "
         f"{1e6 * c_call:.0f} us per expert + {1e6 * c_row:.1f} us per row")
    return {"label": label, "from_rows": TILED_FROM_ROWS, "c_call_s": c_call, "c_row_s": c_row, "samples": samples}


def measure_local_call(engine, quick: bool) -> dict:
    """One expert computed alone on the backbone (:meth:`backbone.experts.LocalExperts.compute`,
    the path of a fallback, an audit's recomputation, a silent expert and a fresh backbone's
    compute-ahead: one call at a time, each its own graph), against its rows: fitted
    ``c0 + c_row * rows`` per call. The local kernel above times a whole layer's calls in one
    graph (hot experts), which these paths never run."""
    cfg = engine.cfg
    local = engine.local_experts
    rng = np.random.default_rng(3)
    sizes = [1, 2, 4, 8] if quick else [1, 2, 4, 8, 16, 32]
    samples = []
    for n in sizes:
        rows = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        local.compute(0, 0, rows)
        times = []
        deadline = time.perf_counter() + (0.1 if quick else 0.3)
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 400):
            layer, expert = int(rng.integers(0, cfg.n_layer)), int(rng.integers(0, cfg.n_expert))
            t0 = time.perf_counter()
            local.compute(layer, expert, rows)
            times.append(time.perf_counter() - t0)
        samples.append((n, float(np.percentile(times, 25))))
    c0, c_row = fit([[1, n] for n, _ in samples], [t for _, t in samples])
    _say(f"one expert alone on the backbone (fallback, audit): {1e6 * c0:.0f} us + {1e6 * c_row:.1f} us per row")
    return {"c0_s": c0, "c_row_s": c_row, "samples": samples}


def _replies_main() -> None:
    """A child's part of :func:`_other_mode`: (path, items) pickled on stdin, each item's
    :meth:`LocalExperts.compute` pickled on stdout."""
    import pickle

    import kvasir_bus  # noqa: F401  (thread settings before ggml loads)
    from backbone.model import Engine

    path, items = pickle.load(sys.stdin.buffer)
    local = Engine(path, n_ctx=64).local_experts
    pickle.dump([local.compute(layer, expert, rows) for layer, expert, rows in items], sys.stdout.buffer)


def _other_mode(path: str, items) -> list[np.ndarray] | None:
    """Each (layer, expert, rows) as a worker of the other kernel mode computes it (fast for a
    deterministic backbone: what a worker started without --deterministic answers), in a child.
    None where the child fails."""
    import pickle
    import subprocess

    from kvasir_bus import threads

    other = "fast" if threads.kernel_mode() == "deterministic" else "deterministic"
    env = {**os.environ, threads.ENV_MODE: other, "GGML_CPU_TILED_MM": "1" if other == "fast" else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH")]))}
    try:
        res = subprocess.run([sys.executable, "-c", "from planner.calibrate import _replies_main; _replies_main()"],
                             input=pickle.dumps((path, items)), capture_output=True, env=env, timeout=300)
        if res.returncode == 0:
            return pickle.loads(res.stdout)
        why = res.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    except (OSError, subprocess.SubprocessError, pickle.UnpicklingError) as exc:
        why = [f"{type(exc).__name__}: {exc}"]
    _say(f"audit: no reply of the other kernel mode ({why[0]}); timed on this one's")
    return None


class _Capture:
    """An expert backend that computes locally and keeps the rows each expert was handed."""

    def __init__(self, local):
        self.local, self.rows = local, []

    def run_layer(self, layer, calls):
        self.rows += [rows for _, rows in calls]
        return self.local.run_layer(layer, calls)


def _expert_inputs(engine, sizes: list[int], rng) -> dict[int, np.ndarray]:
    """Per row count, rows as the engine hands them to an expert (normed hidden states of real
    decode steps): an audit's flip analysis looks at how close activations sit to rounding
    boundaries, which random rows do not show as real ones do."""
    capture = _Capture(engine.local_experts)
    seqs = _sequences(engine, max(sizes), 16, rng)
    engine.use_experts(capture)
    try:
        for _ in range(2):
            _decode_step(engine, seqs, rng)
    finally:
        engine.use_experts(None)
    rows = np.concatenate(capture.rows) if capture.rows else rng.standard_normal((max(sizes), engine.cfg.n_embd))
    return {n: np.ascontiguousarray(rows[rng.choice(len(rows), n, replace=len(rows) < n)], dtype=np.float32)
            for n in sizes}


def measure_audit(engine, path: str, quick: bool) -> dict:
    """An audit's recomputation of one call, by the path backbone/audit.py takes for the kernel
    a worker announced: ``exact`` (a kernel this backbone runs: the reference computed ahead is
    compared, nothing more; a deterministic worker audited by a fast backbone reruns in chunks of
    7 rows, :func:`backbone.audit.rerun_rows`), ``numpy`` (the numpy kernel of another CPU, the
    browser's: recomputed with numpy) and ``explained`` (any other kernel, such as a fast-mode
    worker audited by a deterministic backbone: numpy with the quant-step flips taken out,
    :func:`kernels.flips.explained_gap`, on the replies of a worker of the other kernel mode).

    Both read the expert's weights dequantized to float64 from the numpy backend's cache
    (kernels/backend.py ``DequantCache``, an LRU of 1 GiB by default), and what a miss costs
    dominates: dequantizing the expert's three matrices (about 10 ms on this machine's check
    model, against under 1 ms for the rest at a row or two; kvasir serve --audit 0.1 ran 14
    tok/s with the cache off, 40 with it warm, 74 with every expert in it). So each audit is
    timed twice, on weights just evicted (``cold_samples``) and again at once (``samples``): the
    second fits ``c0 + c_row * rows`` per call, the difference is ``miss_s`` per call (the model
    keeps the cache's contents itself, planner/sim.py ``_DequantCache``). Timed as a backbone runs
    them: a few after each layer's ggml graph (numpy's OpenBLAS threads and ggml's OpenMP team then
    wake in turn, which costs more than back-to-back calls show), on pairs drawn at random."""
    from kernels.backend import get_backend

    cfg = engine.cfg
    local = engine.local_experts
    cache = get_backend("numpy").cache
    rng = np.random.default_rng(4)
    sizes = [1, 4] if quick else [1, 2, 4, 8, 16]  # a decode step's calls: a few rows each; a prompt's more
    inputs = _expert_inputs(engine, sizes, rng)
    per_layer = 4  # audits after one layer's graph: 0.1 of a node's ~40 calls
    iterations = 6 if quick else 12
    draws = {(name, n): [(int(rng.integers(0, cfg.n_layer)), int(rng.integers(0, cfg.n_expert)))
                         for _ in range(iterations * per_layer)]
             for name in ("numpy", "explained") for n in sizes}
    items = [(layer, expert, inputs[n]) for n in sizes for layer, expert in draws[("explained", n)]]
    # An honest reply of each: a worker's of the other kernel mode, whose gap to numpy's is the
    # flips the audit takes out.
    replies = _other_mode(path, items) or [local.compute(layer, expert, rows) for layer, expert, rows in items]
    out = {}
    k_reply = 0
    for name in ("numpy", "explained"):
        samples, cold_samples, misses = [], [], []
        for n in sizes:
            rows = inputs[n]
            seq = draws[(name, n)]
            cold, warm = [], []
            for it in range(iterations):
                batch = seq[it * per_layer:(it + 1) * per_layer]
                answers = replies[k_reply:k_reply + per_layer] if name == "explained" else [None] * per_layer
                k_reply += per_layer if name == "explained" else 0
                for times in (cold, warm):
                    if times is cold:
                        cache.clear()
                    layer = int(rng.integers(0, cfg.n_layer))
                    local.run_layer(layer, [(int(e), rows) for e in rng.choice(cfg.n_expert, 8, replace=False)])
                    t0 = time.perf_counter()
                    for (layer_a, expert_a), reply in zip(batch, answers):
                        if name == "numpy":
                            local.compute(layer_a, expert_a, rows, backend="numpy")
                        else:
                            local.explained_gap(layer_a, expert_a, rows, reply)
                    times.append((time.perf_counter() - t0) / per_layer)
            samples.append((n, float(np.median(warm))))  # every layer's first audit wakes the threads
            cold_samples.append((n, float(np.median(cold))))
            misses.append(float(np.median(np.subtract(cold, warm))))
        c0, c_row = fit([[1, n] for n, _ in samples], [t for _, t in samples])
        out[name] = {"c0_s": c0, "c_row_s": c_row, "miss_s": max(0.0, float(np.median(misses))),
                     "samples": samples, "cold_samples": cold_samples, "cache_mb": cache.max_bytes / (1 << 20)}
    cache.clear()
    _say(f"an audit's recomputation per call: numpy {1e6 * out['numpy']['c0_s']:.0f} us + "
         f"{1e6 * out['numpy']['c_row_s']:.1f} us per row; a foreign kernel's (flips taken out) "
         f"{1e6 * out['explained']['c0_s']:.0f} us + {1e6 * out['explained']['c_row_s']:.1f} us per row; "
         f"either + {1e3 * out['explained']['miss_s']:.1f} ms where the expert's weights are not in the cache "
         f"of dequantized weights")
    return out


def measure_dispatch(engine, path: str, rows: list[int], steps: int, rounds: int = 3, progress=_say) -> dict:
    """Real dispatch to one worker process over an embedded nats-server (module docstring)."""
    from backbone.audit import AuditConfig
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats
    from launch.swarm import spawn_worker, wait_for_nodes

    cfg = engine.cfg
    fp = model_fingerprint(engine.reader)
    rng = np.random.default_rng(2)
    runs = []
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server:
        worker = spawn_worker(server.url, "calibrate-0", ["--model", path, "--layer", "all",
                                                          "--experts", f"0-{cfg.n_expert - 1}"])
        try:
            asyncio.run(wait_for_nodes(server.url, fp, {worker.node}, procs=[worker], timeout=300))
            # As kvasir serve --nats runs it (routing statistics and ledger events for a market, a
            # spool for them), with audits off and a timeout no reply here comes near.
            role = BackboneConfig(model_path=path, nats_url=server.url, serve_manifest=False,
                                  spool=os.path.join(tempfile.mkdtemp(prefix="kvasir-calibrate-"), "spool"),
                                  dispatch=DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=0.0)))
            with BackboneService(engine, role) as backbone:
                remote = backbone.dispatch
                deadline = time.monotonic() + 30
                while remote.coverage.bundle_nodes < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                null = _Clock(engine.local_experts, null=True)
                in_dispatch = [0.0]
                run_layer = remote.run_layer

                def timed(*a, **kw):  # the engine thread's CPU inside the dispatch
                    t = time.thread_time()
                    try:
                        return run_layer(*a, **kw)
                    finally:
                        in_dispatch[0] += time.thread_time() - t

                remote.run_layer = timed
                bus_tid = getattr(getattr(remote.bus, "_thread", None), "native_id", None)

                def bus_cpu() -> float:  # the bus loop thread's CPU (replies taken, encoded requests sent)
                    if bus_tid is None:
                        return 0.0
                    try:
                        return _proc_cpu_s(f"self/task/{bus_tid}")
                    except OSError:
                        return 0.0

                for b in rows:
                    engine.use_experts(None)
                    seqs = _sequences(engine, b, 16, rng)
                    direct_cfg = remote.cfg
                    # One round unmeasured, as measure_fanout's: the first round of new sequences on
                    # a fresh worker, nats-server and service ran up to 4 ms a 1-row step slower here.
                    engine.use_experts(remote)
                    for _ in range(steps):
                        _decode_step(engine, seqs, rng)
                    # Bundles on the engine thread's own connection (as kvasir serve's race and
                    # split steps go), one message per call, and bundles through the bus
                    # client's loop thread (as balance mode's, and any step with a call on an
                    # expert's subject or a probe, go: ``bus_path``).
                    for bundles, via_bus in ((True, False), (False, False), (True, True)):
                        remote.bundles = bundles
                        remote.cfg = replace(direct_cfg, engine_connection=not via_bus)
                        best = None
                        walls = []  # every round's, in order: the first rounds on a fresh worker and nats-server
                        paired = []  # through the bus thread: each round's wall less a direct round's just before
                        for _ in range(rounds):  # the quietest round counts: others share the cores
                            engine.use_experts(remote)
                            if via_bus:
                                remote.cfg = direct_cfg
                                _decode_step(engine, seqs, rng)
                                t = time.perf_counter()
                                for _ in range(steps):
                                    _decode_step(engine, seqs, rng)
                                direct_wall = time.perf_counter() - t
                                remote.cfg = replace(direct_cfg, engine_connection=False)
                            _decode_step(engine, seqs, rng)  # warm
                            before = remote.stats.to_dict()["totals"]
                            w0, c0, k0, n0 = time.perf_counter(), time.process_time(), \
                                _proc_cpu_s(worker.proc.pid), _proc_cpu_s(server.pid)
                            e0, l0 = in_dispatch[0], bus_cpu()
                            for _ in range(steps):
                                _decode_step(engine, seqs, rng)
                            wall = time.perf_counter() - w0
                            walls.append(wall)
                            if via_bus:
                                paired.append(wall - direct_wall)
                            engine_cpu, loop_cpu = in_dispatch[0] - e0, bus_cpu() - l0
                            cpu, wcpu, ncpu = time.process_time() - c0, _proc_cpu_s(worker.proc.pid) - k0, \
                                _proc_cpu_s(server.pid) - n0
                            after = remote.stats.to_dict()["totals"]
                            d = {k: after[k] - before[k] for k in ("calls", "remote", "local", "bytes_out",
                                                                   "bytes_in", "bundles", "bundled_calls")}
                            engine.use_experts(null)
                            _decode_step(engine, seqs, rng)
                            w1, c1 = time.perf_counter(), time.process_time()
                            for _ in range(steps):
                                _decode_step(engine, seqs, rng)
                            null_wall, null_cpu = time.perf_counter() - w1, time.process_time() - c1
                            layer_steps = steps * cfg.n_layer
                            messages = d["bundles"] + d["calls"] - d["local"] - d["bundled_calls"]
                            run = {"rows": b, "bundles": bundles, "via_bus": via_bus, "steps": steps, "wall_s": wall, "cpu_s": cpu,
                                   "worker_cpu_s": wcpu, "nats_cpu_s": ncpu, "null_wall_s": null_wall,
                                   "null_cpu_s": null_cpu, "layer_steps": layer_steps, "messages": messages,
                                   "calls": d["remote"], "local_calls": d["local"],
                                   "rows_sent": b * cfg.n_expert_used * steps * cfg.n_layer,
                                   "bytes_out": d["bytes_out"], "bytes_in": d["bytes_in"],
                                   "engine_dispatch_cpu_s": engine_cpu, "bus_thread_cpu_s": loop_cpu}
                            if best is None:
                                best = run
                            elif wall < best["wall_s"]:  # each the least disturbed of the rounds
                                best = {**run, "null_wall_s": min(null_wall, best["null_wall_s"]),
                                        "null_cpu_s": min(null_cpu, best["null_cpu_s"])}
                            else:
                                best["null_wall_s"] = min(null_wall, best["null_wall_s"])
                                best["null_cpu_s"] = min(null_cpu, best["null_cpu_s"])
                        best["rounds_wall_s"] = walls
                        if via_bus:
                            best["paired_extra_s"] = paired
                        runs.append(best)
                        wall, null_wall, messages, layer_steps = best["wall_s"], best["null_wall_s"], \
                            best["messages"], best["layer_steps"]
                        progress(f"dispatch: {b} rows, bundles {'on' if bundles else 'off'}"
                                 f"{' through the bus thread' if via_bus else ''}: "
                                 f"{1e3 * wall / steps:.1f} ms per step ({1e3 * null_wall / steps:.1f} without experts), "
                                 f"{messages / layer_steps:.1f} messages per layer step")
                remote.cfg = direct_cfg
                engine.use_experts(None)
        finally:
            worker.stop()
    return {"runs": runs}


def measure_hedge(n_layer: int, n_expert: int, calls: int = 4000) -> dict:
    """Balance mode's work per call on the bus thread (backbone/dispatch.py's send of a step):
    when to hedge it (:meth:`backbone.replicas.Replicas.hedge_delay`, the percentiles of the
    expert's recent round trips, from a book as full as serving keeps it) and its timer, armed and
    fired (a won call's timer still fires and finds it done). The CPU seconds per call, the median
    of five rounds."""
    from backbone.replicas import ReplicaConfig, Replicas

    replicas = Replicas(ReplicaConfig(mode="balance"))
    rng = np.random.default_rng(6)
    for _ in range(replicas.cfg.window):
        for layer in range(n_layer):
            replicas.book.observe_wins(layer, [(e, f"w{e % 2}", float(rng.uniform(0.002, 0.004)))
                                               for e in range(n_expert)])
    loop = asyncio.new_event_loop()
    rounds = []
    try:
        for _ in range(5):
            t0 = time.thread_time()
            for i in range(calls):
                replicas.hedge_delay(i % n_layer, i % n_expert)
                loop.call_later(0.0, lambda: None)  # armed as the send arms it, fired at once below
            loop.run_until_complete(asyncio.sleep(0))
            rounds.append((time.thread_time() - t0) / calls)
    finally:
        loop.close()
    per_call = float(np.median(rounds))
    _say(f"balance mode: {1e6 * per_call:.0f} us per call on the bus thread (hedge delay and its timer)")
    return {"per_call_s": per_call, "rounds": rounds}


#: The swarms :func:`measure_fanout` times, by their workers, and the key of each one's walls.
FANOUT_KEYS = {1: "one_worker_s", 2: "two_workers_s", 4: "four_workers_s"}


def measure_fanout(engine, path: str, rows: list[int], steps: int, rounds: int = 3,
                   workers: tuple[int, ...] = (1, 2, 4)) -> dict:
    """Decode steps of ``rows`` rows against one worker holding every expert and, each on an
    embedded nats-server of its own, two and four workers that split them (two and four bundles a
    layer step), bundles on, in turns round by round (so that other programs' load, which drifts,
    falls on all alike): the wall time per step of each. What the workers past the first cost
    beyond the model's arithmetic (their wake-ups and nats-server's, on cores they share with the
    backbone) is fitted from them by :func:`fit_sharing`. Four workers are timed too since the
    fit on one and two alone extrapolated to four: the check's 4-worker configurations with no
    round trip came out 16-20% fast in some runs, within the goal in others."""
    from contextlib import ExitStack

    from backbone.audit import AuditConfig
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats
    from launch.swarm import spawn_worker, split_experts, wait_for_nodes

    cfg = engine.cfg
    fp = model_fingerprint(engine.reader)
    rng = np.random.default_rng(5)
    out = []
    shares = {n: split_experts(cfg.n_expert, n) for n in workers if n <= cfg.n_expert}
    workers = []
    with ExitStack() as stack:
        try:
            remotes = {}
            for n, ranges in shares.items():
                server = stack.enter_context(EmbeddedNats(procs=SHARED_MACHINE_PROCS))
                mine = [spawn_worker(server.url, f"calibrate-{n}-{i}", ["--model", path, "--layer", "all",
                                                                         "--experts", f"{lo}-{hi}"])
                        for i, (lo, hi) in enumerate(ranges)]
                workers += mine
                asyncio.run(wait_for_nodes(server.url, fp, {w.node for w in mine}, procs=mine, timeout=300))
                role = BackboneConfig(model_path=path, nats_url=server.url, serve_manifest=False,
                                      spool=os.path.join(tempfile.mkdtemp(prefix="kvasir-calibrate-"), "spool"),
                                      dispatch=DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=0.0)))
                remote = stack.enter_context(BackboneService(engine, role)).dispatch
                deadline = time.monotonic() + 30
                while remote.coverage.bundle_nodes < n and time.monotonic() < deadline:
                    time.sleep(0.05)
                remotes[n] = remote
            for b in rows:
                engine.use_experts(None)
                seqs = {n: _sequences(engine, b, 16, rng) for n in remotes}
                walls: dict[int, list[float]] = {n: [] for n in remotes}
                for k in range(rounds + 1):  # the first round warms both
                    for n, remote in remotes.items():
                        engine.use_experts(remote)
                        w0 = time.perf_counter()
                        for _ in range(steps):
                            _decode_step(engine, seqs[n], rng)
                        if k:
                            walls[n].append(time.perf_counter() - w0)
                engine.use_experts(None)
                out.append({"rows": b, "steps": steps, **{FANOUT_KEYS[n]: w for n, w in walls.items()}})
                _say(f"dispatch to {', '.join(map(str, walls))} workers in turns: {b} rows: "
                     f"{', '.join(f'{1e3 * min(w) / steps:.1f}' for w in walls.values())} ms per step")
        finally:
            engine.use_experts(None)
            for w in workers:
                w.stop()
    return {"runs": out}


def fit_fanout(profile: dict, fanout_runs: list[dict]) -> float:
    """CPU seconds per worker a layer step wakes past the first, on cores the workers share with
    the backbone (``Costs.fanout``): the value at which the model's step with two workers exceeds
    its step with one by what was measured (the median of the rounds' differences, the two
    measured in turns), found by bisection; the median over the row counts, at least 0. What it
    stands for: the wake-ups and cache refills of processes woken at once, which no other term
    counts."""
    from dataclasses import replace as with_

    from planner import profile as prof
    from planner.shapes import Shapes
    from planner.sim import Config, simulate

    shapes = Shapes.from_dict(profile["model"])
    costs = prof.costs_for(profile, shapes)
    cores = int(profile["machine"].get("cpus") or 2)

    def step(workers: int, rows: int, steps: int, fanout: float) -> float:
        cfg = Config(workers=workers, streams=rows, tokens=steps + 2, prompt_tokens=16, colocated_cores=cores,
                     race_confirm=0.0, max_active=rows, step_tokens=256)
        return simulate(shapes, with_(costs, fanout=fanout), cfg).itl_ms["p50"] / 1e3

    fits = []
    for run in fanout_runs:
        target = float(np.median([two - one for one, two in zip(run["one_worker_s"], run["two_workers_s"])])) \
            / run["steps"]
        single = step(1, run["rows"], run["steps"], 0.0)
        lo, hi = 0.0, 0.02
        if step(2, run["rows"], run["steps"], 0.0) - single >= target:
            fits.append(0.0)
            continue
        for _ in range(24):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(2, run["rows"], run["steps"], mid) - single < target else (lo, mid)
        fits.append((lo + hi) / 2)
    return max(0.0, float(np.median(fits))) if fits else 0.0


def fit_sharing(profile: dict, fanout_runs: list[dict]) -> tuple[float, float]:
    """``(fanout_s, core_efficiency)``: what the workers sharing the backbone's cores cost, fitted
    together on the one-, two- and four-worker runs (:func:`measure_fanout`; profiles calibrated
    before four were timed have one and two) at two row counts or more: per worker woken past the
    first in a layer step (``Costs.fanout``: a cost per layer step, which weighs most at one row),
    and a core's speed while both (all) cores run our work (``Costs.core_efficiency``: a share of
    all work, which a bigger step shows as much). The pair at which the model's steps come nearest
    (least squares of relative errors, one term per measured step) to the measured ones (each its
    quietest round, as the dispatch fit's), on a grid
    (efficiency 1 down to 0.5 by 0.05, fanout 0 to 1 ms by 50 us; ties to the higher efficiency,
    then the lower fanout). The one-worker steps count too: an efficiency below 1 slows them (the
    worker and nats-server beside the backbone for a moment of each layer step, the whole job
    slowed): fitted on the two / one ratios alone it put them 9-19% above the steps measured at 1
    row in 8 of the 13 kept profiles (docs/scale.md). With one row count: efficiency 1 and :func:`fit_fanout`."""
    from dataclasses import replace as with_

    from planner import profile as prof
    from planner.shapes import Shapes
    from planner.sim import Config, simulate

    if len({run["rows"] for run in fanout_runs}) < 2:
        return fit_fanout(profile, fanout_runs), 1.0
    shapes = Shapes.from_dict(profile["model"])
    costs = prof.costs_for(profile, shapes)
    cores = int(profile["machine"].get("cpus") or 2)

    def step(workers: int, run: dict, fanout: float, efficiency: float) -> float:
        cfg = Config(workers=workers, streams=run["rows"], tokens=run["steps"] + 2, prompt_tokens=16,
                     colocated_cores=cores, race_confirm=0.0, max_active=run["rows"], step_tokens=256)
        return simulate(shapes, with_(costs, fanout=fanout, core_efficiency=efficiency), cfg).itl_ms["p50"]

    # (workers, run, measured ms per step as step() gives it), each its quietest round
    measured = [(n, run, 1e3 * min(run[key]) / run["steps"])
                for run in fanout_runs for n, key in FANOUT_KEYS.items() if run.get(key)]
    best = None
    for efficiency in np.round(np.arange(1.0, 0.499, -0.05), 2):
        # one worker: no fanout, so its terms are worked out once per efficiency
        ones = sum((step(1, run, 0.0, efficiency) / ms - 1) ** 2 for n, run, ms in measured if n == 1)
        for fanout in np.arange(0.0, 1.0001e-3, 50e-6):
            loss = ones + sum((step(n, run, fanout, efficiency) / ms - 1) ** 2 for n, run, ms in measured if n > 1)
            if best is None or loss < best[0] - 1e-12:
                best = (loss, float(fanout), float(efficiency))
    return best[1], best[2]


def fit_dispatch_model(profile: dict, rounds: int = 3) -> dict:
    """The backbone's dispatch terms (``hop_s`` per layer step, ``backbone_per_call_s``,
    ``backbone_per_row_s``) fitted again through the model itself, so that its step with one
    worker is the step :func:`measure_dispatch` measured (bundled, on the engine thread's own
    connection, each row count; at the row counts :func:`measure_fanout`'s one worker times too,
    the quieter of the two): :func:`fit_dispatch` takes them from the serial chain's wall
    time less the other parts, a line clipped at zero, which the model with its overlaps (the
    shared expert and the worker on the other core, ``core_efficiency``) did not reproduce (the
    2026-12-05 run's profile: its own one-worker steps predicted 21% and 32% fast at 1 and 4 rows,
    18% slow at 32). Gauss-Newton on the three terms (the step is near linear in each, on the
    engine thread's serial chain), non-negative; the dispatch section with them."""
    from dataclasses import replace as with_

    from planner import profile as prof
    from planner.shapes import Shapes
    from planner.sim import Config, simulate

    disp = profile["backbone"]["dispatch"]
    runs = [r for r in disp.get("runs", ()) if r.get("bundles") and not r.get("via_bus") and r.get("steps")]
    if len(runs) < 3:
        return disp
    shapes = Shapes.from_dict(profile["model"])
    costs = prof.costs_for(profile, shapes)
    cores = int(profile["machine"].get("cpus") or 2)
    # The same step is timed again by measure_fanout's one worker (1 and 4 rows): the quieter of
    # the two counts, as each counts its quietest round. The dispatch runs' rounds are few and the
    # first on a fresh worker, nats-server and service, which run slower (docs/scale.md).
    step_s = {r["rows"]: r["wall_s"] / r["steps"] for r in runs}
    for f in disp.get("fanout_runs", ()):
        if f["rows"] in step_s and f.get("one_worker_s"):
            step_s[f["rows"]] = min(step_s[f["rows"]], min(f["one_worker_s"]) / f["steps"])
    rows = sorted(step_s)
    targets = np.array([step_s[b] for b in rows])

    def steps(x) -> np.ndarray:
        c = with_(costs, hop=x[0], backbone_per_call=x[1], backbone_per_row=x[2],
                  reply_per_call=min(costs.reply_per_call, x[1]))
        return np.array([simulate(shapes, c, Config(workers=1, streams=b, tokens=14, prompt_tokens=16,
                                                    colocated_cores=cores, race_confirm=0.0, max_active=b,
                                                    step_tokens=256)).itl_ms["p50"] / 1e3 for b in rows])

    x = np.array([costs.hop, costs.backbone_per_call, costs.backbone_per_row])
    scale = np.array([1e-4, 1e-5, 1e-6])  # a step of each, for the differences
    for _ in range(rounds):
        base = steps(x)
        J = np.stack([(steps(x + scale * np.eye(3)[i]) - base) / scale[i] for i in range(3)], axis=1)
        # relative errors: every row count weighs alike
        dx = np.asarray(fit((J / targets[:, None]).tolist(), ((targets - base) / targets + (J @ x) / targets).tolist()))
        x = np.maximum(0.0, dx)
    out = dict(disp)
    out["hop_s"], out["backbone_per_call_s"], out["backbone_per_row_s"] = (float(v) for v in x)
    out["through_model"] = {"rows": rows, "targets_s": targets.tolist(), "predicted_s": steps(x).tolist()}
    return out


def dense_step_s(dense: dict, n_layer: int, rows: int, ctx: int) -> float:
    """One decode step's dense path (every layer of the fitted kind, the head; ``rows`` sequences
    of one row) from :func:`measure_dense`."""
    total = 0.0
    for kind, n in (("attention", dense.get("n_attention", n_layer)), ("recurrent", dense.get("n_recurrent", 0))):
        if kind in dense and n:
            d = dense[kind]
            total += n * (d["c0_s"] + (d["c_row_s"] + d.get("c_seq_s", 0.0)) * rows + d["c_row_ctx_s"] * rows * ctx)
    h = dense["head"]
    return total + h["c0_s"] + h["c_row_s"] * rows


def fit_dispatch(runs: list[dict], kernel: dict, dense: dict | None = None, n_layer: int = 0) -> dict:
    """Per-message, per-call and per-row costs of the backbone, the worker and nats-server, and
    the wall time left over per layer step, from :func:`measure_dispatch`'s runs. ``dense``: the
    dense path's fit, whose prediction replaces a measured step without experts that came out
    slower (a burst of another process's work, or ggml's OpenMP team stalled beside it)."""
    via_bus = [r for r in runs if r.get("via_bus")]
    runs = [r for r in runs if not r.get("via_bus")]
    if dense is not None:
        for r in runs + via_bus:
            r["null_wall_s"] = min(r["null_wall_s"], r["steps"] * dense_step_s(dense, n_layer, r["rows"], 20))
    def kern(r):  # the worker's kernel seconds for these messages
        return r["messages"] * kernel["c0_s"] + r["calls"] * kernel["c_call_s"] + r["rows_sent"] * kernel["c_row_s"]

    # The worker as it runs in place (its process's CPU: the kernel on cold weights, decoding,
    # encoding, its event loop), fitted per message, per call and per row: the kernel timed in
    # this process alone (``kernel``) misses a third to a half of it.
    wfit = fit([[r["messages"], r["calls"], r["rows_sent"]] for r in runs], [r["worker_cpu_s"] for r in runs])
    messages = sum(r["messages"] for r in runs)
    worker_msg = max(0.0, sum(r["worker_cpu_s"] - kern(r) for r in runs)) / max(1, messages)
    nats_msg = sum(r["nats_cpu_s"] for r in runs) / max(1, 2 * messages)
    # The backbone's part from the wall clock of the quietest round: with one worker the chain of a
    # layer step is serial (backbone, nats-server, worker, nats-server, backbone), so it is the
    # step's wall time less the dense path's, the worker's CPU and nats-server's. Its threads' CPU
    # would not do: the process's counts ggml's OpenMP team spinning while it waits, and a
    # bundle's reply is taken on a thread of the bus client's. Fitted per layer step (``hop_s``:
    # wake-ups, the loopback), per message and per call.
    xs = [[r["messages"], r["calls"], r["rows_sent"]] for r in runs]
    ys = [max(0.0, r["wall_s"] - r["null_wall_s"] - r["worker_cpu_s"] - r["nats_cpu_s"]) for r in runs]
    per_msg, per_call, per_row = fit(xs, ys)
    hop = 0.0
    bb = [per_msg, per_call, per_row]
    cpu_fit = fit([[r["messages"], r["calls"]] for r in runs],
                  [r["engine_dispatch_cpu_s"] + r["bus_thread_cpu_s"] for r in runs])
    hops = [hop]
    # The bus thread's path: the same bundled steps handed to the loop thread and woken from it,
    # against the engine thread's own connection, per layer step.
    # Each round through the bus thread is set against a direct round just before it (the load
    # drifts: the variants' best rounds, minutes apart, differed by noise): the median of every
    # such pair, all row counts together (the hand-offs are per layer step, not per row).
    direct = {r["rows"]: r for r in runs if r["bundles"]}
    extra = [x / r["layer_steps"] for r in via_bus for x in r.get("paired_extra_s", ())] or \
        [(r["wall_s"] - direct[r["rows"]]["wall_s"]) / r["layer_steps"] for r in via_bus if r["rows"] in direct]
    bus_path = max(0.0, float(np.median(extra))) if extra else 0.0
    out_b = [r["bytes_out"] / max(1, r["messages"]) for r in runs]
    return {"backbone_per_message_s": bb[0], "backbone_per_call_s": bb[1], "backbone_per_row_s": bb[2],
            "worker_per_message_s": worker_msg, "nats_per_message_s": nats_msg,
            "worker_in_place": {"c0_s": wfit[0], "c_call_s": wfit[1], "c_row_s": wfit[2],
                                "note": "per message, call and row, the worker process's CPU in place"},
            "hop_s": float(np.median(hops)), "bus_path_s": bus_path, "backbone_cpu_per_message_s": cpu_fit[0],
            "backbone_cpu_per_call_s": cpu_fit[1], "backbone_cpu_note": "the engine and bus threads' CPU, for "
            "comparison (a bundle's reply is taken elsewhere)", "bytes_out_per_message_mean": float(np.mean(out_b)), "runs": runs + via_bus}


def _stream(url: str, max_tokens: int) -> tuple[float, float, int]:
    """One streaming completion of a 1-token prompt: (time to first token, total, tokens)."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(url)
    body = json.dumps({"model": "calibrate", "prompt": [1], "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, n = None, 0
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                n += 1
                first = first or time.perf_counter() - t0
    conn.close()
    return first or 0.0, time.perf_counter() - t0, n


def measure_serving(path: str, step_s, rounds: int = 5, streams: int = 8) -> dict:
    """What ``kvasir serve --http`` adds around the engine: per request (the HTTP exchange,
    admission, the first event) and per streamed token (its SSE event, the clients reading it),
    from one server with every expert local: a 1-token request's time to first token less one
    engine step, and ``streams`` concurrent 16-token requests' time per step past the first less
    one engine step of that many rows, per token. ``step_s(rows)``: the engine's step here."""
    from concurrent.futures import ThreadPoolExecutor

    import re
    import subprocess

    cmd = [sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", path, "--http", "127.0.0.1:0",
           "--model-name", "calibrate"]
    if os.environ.get("KVASIR_KERNEL_MODE") == "deterministic":
        cmd.append("--deterministic")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        match = re.search(r"(http://\S+)/v1", proc.stdout.readline())
        if not match:
            return {"request_s": 0.0, "token_s": 0.0, "note": "the server did not start"}
        url = match.group(1)
        _stream(url, 2)
        firsts, per_token = [], []
        with ThreadPoolExecutor(streams) as pool:
            for _ in range(rounds):
                first, _, _ = _stream(url, 1)
                firsts.append(first)
                runs = list(pool.map(lambda _: _stream(url, 16), range(streams)))
                gaps = [(total - f) / (n - 1) for f, total, n in runs if n > 1]
                if gaps:
                    per_token.append((float(np.median(gaps)) - step_s(streams)) / streams)
        request_s = max(0.0, min(firsts) - step_s(1))
        token_s = max(0.0, min(per_token)) if per_token else 0.0
        _say(f"serving: {1e3 * request_s:.2f} ms per request, {1e3 * token_s:.2f} ms per streamed token "
             "beyond the engine's step")
        return {"request_s": request_s, "token_s": token_s, "first_token_s": firsts, "per_token_s": per_token}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def calibrate(path: str, threads: int | None, role: str, quick: bool, worker_threads: int = 1) -> dict:
    """The profile of this machine for the model at ``path`` (module docstring)."""
    import kvasir_bus  # noqa: F401  (thread settings before ggml loads)
    from backbone.model import Engine
    from kernels.backend import backend_name, kernel_label
    from planner.shapes import from_gguf

    if threads:
        os.environ["KVASIR_THREADS"] = str(threads)
    shapes = from_gguf(path)
    t_start = time.perf_counter()
    _say(f"{shapes.name}: {shapes.n_layer} layers, {shapes.n_expert} experts of {shapes.expert_bytes} bytes, "
         f"top-{shapes.n_expert_used}; role {role}{' (quick)' if quick else ''}")
    engine = Engine(path, n_ctx=4096)
    profile = {"kind": PROFILE_KIND, "version": PROFILE_VERSION, "model": shapes.to_dict(), "role": role,
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "machine": platform.machine(),
                           "load_avg_1m_before": round(os.getloadavg()[0], 2),
                           "backbone_threads": threads or None, "worker_threads": worker_threads,
                           "kernel_mode": os.environ.get("KVASIR_KERNEL_MODE", "fast")},
               "quick": quick}
    # The label a worker started from here announces (its kernel mode is this process's): which
    # way a backbone audits its replies (kvasir plan --worker-kernel says otherwise).
    profile["worker"] = {"kernel": measure_kernel(engine, worker_threads, quick), "kernel_label": kernel_label()}
    tiled = measure_tiled(path, worker_threads, quick, profile["worker"]["kernel"])
    if tiled is not None:
        profile["worker"]["tiled"] = tiled
    if role in ("backbone", "both"):
        rows = [1, 4, 16] if quick else [1, 4, 16, 32]
        contexts = [16, 96] if quick else [16, 256]
        dense = measure_dense(engine, rows, contexts, steps=4 if quick else 6, rounds=2)
        local = measure_kernel(engine, threads or max(1, (os.cpu_count() or 2) // 2), quick)
        local_call = measure_local_call(engine, quick)
        audit = measure_audit(engine, path, quick)
        runs = measure_dispatch(engine, path, [1, 8] if quick else [1, 4, 16, 32], steps=6 if quick else 12,
                                rounds=3)["runs"]
        dense["n_attention"], dense["n_recurrent"] = shapes.n_attention_layers, shapes.n_recurrent_layers
        disp = fit_dispatch(runs, profile["worker"]["kernel"], dense, shapes.n_layer)
        def engine_step(rows: int) -> float:  # every expert local, as the server below runs
            E, k = shapes.n_expert, shapes.n_expert_used
            distinct = E * (1 - (1 - k / E) ** rows)
            return dense_step_s(dense, shapes.n_layer, rows, 24) + shapes.n_moe_layers * (
                local["c0_s"] + distinct * local["c_call_s"] + rows * k * local["c_row_s"])

        serving = measure_serving(path, engine_step)
        profile["routing"] = measure_routing(engine)
        profile["backbone"] = {"dense": dense, "local_kernel": local, "local_call": local_call, "audit": audit,
                               "dispatch": disp, "serving": serving, "backend": backend_name(),
                               "kernel_label": kernel_label()}
        profile["worker"]["per_message_s"] = disp["worker_per_message_s"]
        profile["worker"]["in_place"] = disp["worker_in_place"]
        profile["nats"] = {"per_message_s": disp["nats_per_message_s"]}
        disp["hedge_per_call_s"] = measure_hedge(shapes.n_layer, shapes.n_expert)["per_call_s"]
        # Seven rounds in turns (three quick): one worker against two differ by 5-15%, about what
        # one round's noise is on a shared VM, so the fit below takes the quietest of many. Four
        # workers too (not quick: one row count fits the fanout alone, on one and two).
        fanout = measure_fanout(engine, path, [1] if quick else [1, 2, 4], steps=6 if quick else 12,
                                rounds=3 if quick else 7, workers=(1, 2) if quick else (1, 2, 4))
        disp["fanout_runs"] = fanout["runs"]
        profile["wire"] = {"row_bytes": 4 * shapes.n_embd, "call_bytes": 96, "message_bytes": 1024}
        # The dispatch terms again through the model (its one-worker steps as measured), then
        # what a second worker on these cores costs, relative to those steps.
        disp["fanout_s"], disp["core_efficiency"] = 0.0, 1.0
        disp = profile["backbone"]["dispatch"] = fit_dispatch_model(profile)
        disp["fanout_s"], disp["core_efficiency"] = fit_sharing(profile, fanout["runs"])
        _say(f"a second worker on these cores: {1e6 * disp['fanout_s']:.0f} us more CPU per worker woken "
             f"past the first in a layer step; a core's speed while both run our work "
             f"{disp['core_efficiency']:.2f} of one alone")
        _say(f"backbone per message {1e6 * disp['backbone_per_message_s']:.0f} us, per call "
             f"{1e6 * disp['backbone_per_call_s']:.0f} us; "
             f"worker per message {1e6 * disp['worker_per_message_s']:.0f} us; nats-server per message "
             f"{1e6 * disp['nats_per_message_s']:.0f} us; through the bus thread "
             f"{1e6 * disp['bus_path_s']:.0f} us more per layer step")
    profile["wire"] = {"row_bytes": 4 * shapes.n_embd, "call_bytes": 96, "message_bytes": 1024,
                       "note": "f32 rows; a bundle carries its step's rows once (the union), "
                               "its reply every call's output rows"}
    profile["machine"]["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    profile["seconds"] = round(time.perf_counter() - t_start, 1)
    _say(f"done in {profile['seconds']} s")
    return profile
