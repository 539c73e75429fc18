"""Expert FFN throughput: our ggml path vs the best raw ggml graph, and the numpy backend.

Measures ``kernels.expert.expert_ffn`` (validation + a cached ggml graph rebound per call, the
function a worker and the backbone's fallback run) against the minimum-overhead ways to run the
same ops: one ggml context and graph built once, then only ``ggml_graph_compute`` timed, on the
weights' plain bytes (``raw_plain``) and on the same weights in ggml's CPU repack buffer
(``raw_repacked``, llama.cpp's default layout on CPU). ``ours_over_best`` is ours against the
quicker of the two. Shape: one expert of the 122b layer (n_embd 3072, n_ff 1024), routed
(``ggml_mul_mat_id``), Q4_K and Q8_0 weights, 1/8/64/512 rows, in the fast and the
deterministic kernel modes (each in a child process: ggml fixes its mode as it loads). The three
kernels are timed in interleaved rounds, each figure the least call of all rounds (the machine
may be shared: see :func:`interleaved`). Also times the numpy backend (cached float64 weights), reports the repacked bytes a
worker's expert slabs would cost (``expert_memory``), and checks that alternating numpy
(OpenBLAS) and ggml (OpenMP) calls does not slow ggml's 1-row call down.

``--calls`` measures only what one call costs around ``ggml_graph_compute`` (issue 10): µs per
``expert_ffn`` call (routed, as a worker computes it) for a trivial expert (64x32 F32, 1 row),
a small-model expert (512x256 Q4_K, 1 and 8 rows) and a 122b expert (3072x1024 Q4_K, 1 row),
and the decode rate of the small Q4_K model (64-token prompt, 100 decode steps). Each figure is
the least and the median of several timing loops: on a shared machine the least is the cost.

Prints one JSON object (``--save``: also into bench/results/). ``python bench/kernel.py [--quick |
--calls] [--mode fast|deterministic|both]``; about three minutes on 2 cores for both modes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import kernels  # noqa: F401  (thread settings before numpy loads)

import numpy as np
from gguf import GGMLQuantizationType as T

from bench import record
from kernels import backend, ggml
from kernels.expert import expert_ffn
from kernels.tensors import QTensor

N_EMBD, N_FF = 3072, 1024
ROWS = (1, 8, 64, 512)


def timed(fn, budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds per call of fn() over repeats filling about budget_s (after one warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_expert(qtype: T, seed: int) -> tuple[QTensor, QTensor, QTensor]:
    rng = np.random.default_rng(seed)

    def weight(name: str, rows: int, cols: int) -> QTensor:
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return QTensor(f"blk.0.ffn_{name}_exps.weight[0]", qtype, (cols, rows), ggml.quantize(w, qtype))

    return weight("gate", N_FF, N_EMBD), weight("up", N_FF, N_EMBD), weight("down", N_EMBD, N_FF)


class RawGraph:
    """The expert FFN as one prebuilt ggml graph for a fixed n: only compute is left per call."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, rps=(None, None, None)):
        """``rps``: the weights in the repack buffer (``ggml.repack_weight``), or None each."""
        lib = ggml.load()
        self.lib = lib
        n = x.shape[0]
        self.keep = [x, np.zeros(n, np.int32), np.empty((n, N_EMBD), np.float32),
                     np.empty((3, n, N_FF), np.float32), gate.data, up.data, down.data, rps]
        x, ids_buf, self.out, scratch = self.keep[:4]
        params = ggml.InitParams(lib.tensor_overhead * 12 + lib.graph_overhead + 1024, None, True)
        self.ctx = lib.ggml_init(params)
        ctx = self.ctx

        def new(t, ne, buf, rp=None):
            tensor = lib.ggml_new_tensor_3d(ctx, int(t), *ne) if len(ne) == 3 else lib.ggml_new_tensor_2d(ctx, int(t), *ne)
            tensor.contents.data = buf.ctypes.data if rp is None else rp.ptr
            if rp is not None:  # what ggml's CPU backend dispatches the repacked kernel on
                tensor.contents.buffer, tensor.contents.extra = ggml._repack_anchor(lib), rp.extra
            return tensor

        ids = new(T.I32, (1, n), ids_buf)
        xt = new(T.F32, (N_EMBD, 1, n), x)
        gw = new(gate.ggml_type, (N_EMBD, N_FF, 1), gate.data, rps[0])
        uw = new(up.ggml_type, (N_EMBD, N_FF, 1), up.data, rps[1])
        dw = new(down.ggml_type, (N_FF, N_EMBD, 1), down.data, rps[2])
        g = lib.ggml_mul_mat_id(ctx, gw, xt, ids)
        g.contents.data = scratch[0].ctypes.data
        u = lib.ggml_mul_mat_id(ctx, uw, xt, ids)
        u.contents.data = scratch[1].ctypes.data
        h = lib.ggml_swiglu_split(ctx, g, u)
        h.contents.data = scratch[2].ctypes.data
        y = lib.ggml_mul_mat_id(ctx, dw, h, ids)
        y.contents.data = self.out.ctypes.data
        self.graph = lib.ggml_new_graph_custom(ctx, ggml.GRAPH_NODES, False)
        lib.ggml_build_forward_expand(self.graph, y)
        self.plan = lib.ggml_graph_plan(self.graph, ggml.n_threads(), None)
        self.work = np.empty(max(self.plan.work_size, 1), np.uint8)
        self.plan.work_data = self.work.ctypes.data
        self.plan_ref = ctypes.byref(self.plan)

    def __call__(self) -> np.ndarray:
        self.lib.ggml_graph_compute(self.graph, self.plan_ref)
        return self.out

    def close(self) -> None:
        self.lib.ggml_free(self.ctx)


CALL_SHAPES = (  # (label, type, n_embd, n_ff, rows, calls per timing loop)
    ("trivial_64x32_f32_1row", T.F32, 64, 32, 1, 3000),
    ("small_512x256_q4_k_1row", T.Q4_K, 512, 256, 1, 1000),
    ("small_512x256_q4_k_8rows", T.Q4_K, 512, 256, 8, 300),
    ("122b_3072x1024_q4_k_1row", T.Q4_K, 3072, 1024, 1, 100),
)


def us_per_call(fn, calls: int, loops: int = 5) -> dict:
    """The least and median wall-clock µs per call of fn() over ``loops`` loops of ``calls``
    calls, and the least process CPU µs per call (on a shared machine the wall clock counts
    other processes' time slices; the CPU time counts this one's, OpenMP spinning included)."""
    fn()
    per, cpu = [], []
    for _ in range(loops):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        per.append(1e6 * (time.perf_counter() - t0) / calls)
        cpu.append(1e6 * (time.process_time() - c0) / calls)
    return {"min": round(min(per), 1), "median": round(statistics.median(per), 1), "cpu_min": round(min(cpu), 1)}


def bench_calls(decode_model: str | None) -> dict:
    """µs per expert_ffn call for CALL_SHAPES, and the small model's decode tokens/s."""
    result: dict = {"us_per_call": {}}
    for label, qtype, n_embd, n_ff, rows, calls in CALL_SHAPES:
        rng = np.random.default_rng(1)

        def weight(name: str, out: int, inp: int) -> QTensor:
            w = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
            return QTensor(f"blk.0.ffn_{name}_exps.weight[0]", qtype, (inp, out), ggml.quantize(w, qtype))

        gate, up, down = weight("gate", n_ff, n_embd), weight("up", n_ff, n_embd), weight("down", n_embd, n_ff)
        x = rng.standard_normal((rows, n_embd)).astype(np.float32)
        result["us_per_call"][label] = us_per_call(lambda: expert_ffn(gate, up, down, x, routed=True), calls)
    if decode_model:
        from backbone.model import Engine
        from kvasir_bus.logs import configure

        configure("warning")
        engine = Engine(decode_model)
        prompt = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, 64)
        rates = []
        for _ in range(3):
            seq = engine.new_sequence()
            (logits,) = engine.forward([(seq, prompt)], all_logits=False)
            t0 = time.perf_counter()
            for _ in range(100):
                (logits,) = engine.forward([(seq, np.array([int(logits[-1].argmax())]))], all_logits=False)
            rates.append(100 / (time.perf_counter() - t0))
        result["decode_tok_s"] = {"model": os.path.basename(decode_model), "max": round(max(rates), 1),
                                  "median": round(statistics.median(rates), 1)}
    return result


def interleaved(fns: dict, budget_s: float, rounds: int = 8) -> dict:
    """Seconds per call of each fn: the least single call over ``rounds`` rounds that take every
    fn in turn, each for about ``budget_s / rounds`` (at least two calls). On a machine shared
    with other busy processes a call's time is its own cost plus whatever of the other
    processes' time slices fell into it: the least call is the nearest to its own cost, and
    interleaving gives every fn the same chances at a quiet moment."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            calls, start = 0, time.perf_counter()
            while calls < 2 or (time.perf_counter() - start < budget_s / rounds and calls < 200):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                calls += 1
    return best


def rss_mb() -> float:
    """This process's resident memory now, MiB (Linux /proc; the peak where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def expert_memory() -> dict:
    """What ``kernels.expert.prepare`` lays out anew for a worker's slabs of 8 experts of this
    shape (Q4_K: the type ggml repacks here), and the resident memory around it: the repacked
    copy the routed experts' calls use (every call in the deterministic mode, calls under 8
    rows in the fast mode: ``kernels.ggml.expert_layout``). These slabs live in memory, not in a
    mapped file, so the plain bytes stay beside the copy: a slice mapped from its file lets
    its pages go (tests/kernels/test_expert_layout.py measures that)."""
    from kernels.expert import prepare

    slabs = []
    for name, ne in (("gate", (N_EMBD, N_FF, 8)), ("up", (N_EMBD, N_FF, 8)), ("down", (N_FF, N_EMBD, 8))):
        rows = np.random.default_rng(5).standard_normal((ne[1] * ne[2], ne[0])).astype(np.float32) * 0.02
        slabs.append(QTensor(f"blk.0.ffn_{name}_exps.weight", T.Q4_K, ne, ggml.quantize(rows, T.Q4_K)))
    before = rss_mb()
    laid_out = prepare(slabs)
    return {"slab_bytes": sum(w.nbytes for w in slabs), "repacked_bytes": laid_out, "rss_mb_before": before,
            "rss_mb_after": rss_mb(), "repack_enabled_for_dense": ggml.repack_enabled()}


def bench_mode(budget: float) -> dict:
    """Every row count and type in this process's kernel mode."""
    result: dict = {"ggml": ggml.info(), "load_avg_start": os.getloadavg()[0], "rows_per_s": {}}
    numpy_backend = backend.get_backend("numpy")
    rng = np.random.default_rng(0)
    for qtype in (T.Q4_K, T.Q8_0):
        gate, up, down = make_expert(qtype, seed=int(qtype))
        rps = tuple(ggml.repack_weight(w) for w in (gate, up, down))
        if any(rp is None for rp in rps):
            rps = None  # no repacked kernel for this type on this CPU
        per_type = {}
        for n in ROWS:
            x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
            raws = {"raw_plain": RawGraph(gate, up, down, x)}
            if rps is not None:
                raws["raw_repacked"] = RawGraph(gate, up, down, x, rps)
            ours = expert_ffn(gate, up, down, x, routed=True, backend="ggml")
            same = {name: bool(np.array_equal(raw(), ours)) for name, raw in raws.items()}
            fns = {"ours": lambda: expert_ffn(gate, up, down, x, routed=True, backend="ggml"), **raws}
            t = interleaved(fns, budget * len(fns))
            for raw in raws.values():
                raw.close()
            t_np = timed(lambda: expert_ffn(gate, up, down, x, routed=True, backend="numpy"), budget / 2, min_reps=2)
            best = min((name for name in raws), key=t.__getitem__)
            per_type[str(n)] = {
                "ours": round(n / t["ours"], 1),
                **{name: round(n / t[name], 1) for name in raws},
                "best_raw": best,
                "ours_over_best": round(t[best] / t["ours"], 3),  # rows/s ratio: 1.0 = the best raw graph's speed
                "ours_over_raw_plain": round(t["raw_plain"] / t["ours"], 3),
                "numpy": round(n / t_np, 1),
                "ms_per_call": {**{name: round(v * 1e3, 3) for name, v in t.items()}, "numpy": round(t_np * 1e3, 3)},
                "ours_bit_identical_to": same,
            }
        result["rows_per_s"][qtype.name.lower()] = per_type
        numpy_backend.cache.clear()
    result["expert_memory"] = expert_memory()

    # Alternating numpy (OpenBLAS threads) and ggml (OpenMP threads) at 1 row.
    gate, up, down = make_expert(T.Q4_K, seed=99)
    x1 = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 512)).astype(np.float32)
    alone = timed(lambda: expert_ffn(gate, up, down, x1, routed=True, backend="ggml"), budget)

    def alternating():
        a @ b  # a multi-threaded BLAS call between two ggml calls
        t0 = time.perf_counter()
        expert_ffn(gate, up, down, x1, routed=True, backend="ggml")
        return time.perf_counter() - t0

    alternating()
    inter = statistics.median(alternating() for _ in range(max(5, int(budget * 200))))
    result["alternating_numpy_ggml_1row"] = {
        "ggml_alone_ms": round(alone * 1e3, 3),
        "ggml_after_blas_call_ms": round(inter * 1e3, 3),
        "slowdown": round(inter / alone, 2),
    }
    result["load_avg_end"] = os.getloadavg()[0]
    return result


def _child(mode: str, quick: bool) -> dict:
    """bench_mode in a fresh process of kernel mode ``mode``."""
    env = dict(os.environ, KVASIR_KERNEL_MODE=mode)
    env.pop("GGML_CPU_TILED_MM", None)  # the mode sets it
    cmd = [sys.executable, os.path.abspath(__file__), "--child"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-500:]}"}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets (a smoke run)")
    parser.add_argument("--calls", action="store_true",
                        help="only the per-call cost: µs per expert call of four shapes, small-model decode tok/s")
    parser.add_argument("--mode", choices=("fast", "deterministic", "both"), default="both",
                        help="the kernel modes to measure, each in a child process (default both)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-model", default=None,
                        help="--calls: the small Q4_K GGUF to decode (default: models/small-qwen3moe-q4_k.gguf, "
                             "made if missing; 'none' skips decode)")
    record.add_save_flag(parser)
    args = parser.parse_args(argv)
    budget = 0.25 if args.quick else 1.0

    if not ggml.available():
        print(json.dumps({"error": "ggml libraries not available (llama-cpp-python not installed)"}))
        return 1
    started = time.perf_counter()
    if args.child:
        json.dump(bench_mode(budget), sys.stdout)
        print()
        return 0
    if args.calls:
        result = {"ggml": ggml.info(), "load_avg_start": os.getloadavg()[0]}
        result.update(bench_calls(_decode_model(args.decode_model)))
        result["load_avg_end"] = os.getloadavg()[0]
        result["bench_seconds"] = round(time.perf_counter() - started, 1)
        json.dump(result, sys.stdout, indent=1)
        print()
        record.save(args, "kernel_calls", result)
        return 0
    result: dict = {
        "shape": {"n_embd": N_EMBD, "n_ff": N_FF, "op": "mul_mat_id (routed expert)"},
        "cpu_count": os.cpu_count(),
        "env": {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY",
                                                "OPENBLAS_NUM_THREADS", "KVASIR_THREADS", "KVASIR_REPACK")},
        "load_avg_start": os.getloadavg()[0],
        "modes": {},
    }
    for mode in (("fast", "deterministic") if args.mode == "both" else (args.mode,)):
        print(f"kernel bench: {mode} mode", file=sys.stderr)
        result["modes"][mode] = _child(mode, args.quick)
    ratios = [v["ours_over_best"] for m in result["modes"].values() for t in m.get("rows_per_s", {}).values()
              for v in t.values()]
    result["min_ours_over_best"] = min(ratios) if ratios else None
    result["load_avg_end"] = os.getloadavg()[0]
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=1)
    print()
    record.save(args, "kernel", result)
    return 0 if all("error" not in m for m in result["modes"].values()) else 1


def _decode_model(given: str | None) -> str | None:
    if given == "none":
        return None
    if given:
        return given
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "models" / "small-qwen3moe-q4_k.gguf"
    if not path.exists():
        from synth.model import synth_model

        path.parent.mkdir(exist_ok=True)
        synth_model(path, arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
