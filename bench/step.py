"""The engine's CPU time per step for a batch of decoding sequences, one graph per step against
the per-layer path, and the ggml graph launches each takes.

``kvasir serve`` runs one engine step (``backbone.model.Engine.forward``) for all its active
sequences. A batch of several sequences used to run per layer: one graph for the attention
projections, one attention graph per sequence, one for the output projection and router, one
for the experts, (3 + S) launches per layer, each waking ggml's thread team and waiting at a
barrier per node. Now the whole step is one graph (``Engine._batch_graphs``, ``kernels.fused.
step_graph`` with ``StepShape.streams``). Both paths run here in one process, on the same
engine and GGUF, each on its own ``--streams`` sequences (the same prompts), alternating in
``--rounds`` rounds of ``--steps`` decode steps so that the load of a shared machine falls on
both alike; greedy tokens, so both sets see the same tokens and lengths. Reported per path: the
median (and p10/p90) of ``time.process_time`` around ``Engine.forward`` (CPU time of this
process: with ``KVASIR_THREADS=1``, the default here, what one step costs whatever else the
machine runs), the wall time, and the graph launches per step (``kernels.ggml.Graph.run``
calls). ``same_logits``: whether every step's logits of the two paths were equal bit for bit.

Each kernel mode (``--modes``, ggml fixes it when it loads) runs in a child process.

    python bench/step.py [--streams 16] [--prompt-tokens 16] [--steps 32] [--rounds 4]
                         [--modes fast deterministic] [--threads 1] [--model PATH] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402  (bench/record.py: --save)

PATHS = ("per_layer", "one_graph")


def _quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": round(statistics.median(ordered), 3), "p10": round(pick(0.1), 3),
            "p90": round(pick(0.9), 3)}


def child(path: str, streams: int, prompt_tokens: int, steps: int, rounds: int) -> dict:
    """Both paths in this (child) process, in the kernel mode of its environment."""
    import numpy as np

    from backbone.model import Engine
    from kernels import ggml

    launches = [0]
    real_run = ggml.Graph.run

    def counted(self, arrays):
        launches[0] += 1
        return real_run(self, arrays)

    ggml.Graph.run = counted
    try:
        return _measure(Engine(path), launches, streams, prompt_tokens, steps, rounds)
    finally:
        ggml.Graph.run = real_run


def _measure(engine, launches: list[int], streams: int, prompt_tokens: int, steps: int, rounds: int) -> dict:
    import numpy as np

    from kernels import ggml

    path = engine.path
    if not engine.batch_graphs:
        raise SystemExit(f"{path}: this model's batches have no one-graph step (see Engine.step_graphs)")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.cfg.n_vocab, prompt_tokens) for _ in range(streams)]
    state = {}
    for name in PATHS:  # each path's sequences, prompts read one by one, first tokens greedy
        seqs = [engine.new_sequence() for _ in prompts]
        nxt = [int(engine.forward([(s, p)], all_logits=False)[0][-1].argmax()) for s, p in zip(seqs, prompts)]
        state[name] = (seqs, nxt)
    cpu = {name: [] for name in PATHS}
    wall = {name: [] for name in PATHS}
    per_step = {name: [] for name in PATHS}
    logits = {name: [] for name in PATHS}
    for _ in range(rounds):
        for name in PATHS:
            engine.batch_graphs = name == "one_graph"
            seqs, nxt = state[name]
            for _ in range(steps):
                batch = [(s, np.array([t])) for s, t in zip(seqs, nxt)]
                n0 = launches[0]
                c0, w0 = time.process_time(), time.perf_counter()
                out = engine.forward(batch, all_logits=False)
                c1, w1 = time.process_time(), time.perf_counter()
                cpu[name].append(1e3 * (c1 - c0))
                wall[name].append(1e3 * (w1 - w0))
                per_step[name].append(launches[0] - n0)
                rows = np.concatenate(out)
                logits[name].append(rows)
                nxt[:] = rows.argmax(axis=1).tolist()
    same = all(np.array_equal(a, b) for a, b in zip(logits["per_layer"], logits["one_graph"]))
    result = {"mode": ggml.loaded_mode(), "threads": ggml.n_threads(), "n_layer": engine.cfg.n_layer,
              "same_logits": same, "paths": {}}
    for name in PATHS:
        result["paths"][name] = {"cpu_ms_per_step": _quantiles(cpu[name]), "wall_ms_per_step": _quantiles(wall[name]),
                                 "graph_launches_per_step": _quantiles(per_step[name])["median"],
                                 "steps": len(cpu[name])}
    a, b = (result["paths"][n]["cpu_ms_per_step"]["median"] for n in PATHS)
    result["cpu_speedup"] = round(a / b, 2) if b else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16, help="sequences decoding together (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per path and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["fast", "deterministic"], choices=["fast", "deterministic"])
    ap.add_argument("--threads", type=int, default=1, help="KVASIR_THREADS of the children (default 1)")
    ap.add_argument("--model", default=None, help="a GGUF (default: the small qwen3moe Q4_K, made if missing)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    record.add_save_flag(ap)
    args = ap.parse_args()
    if min(args.streams, args.steps, args.rounds, args.prompt_tokens, args.threads) < 1 or args.streams < 2:
        print("step.py: --streams needs 2 or more; --steps, --rounds, --prompt-tokens, --threads 1 or more",
              file=sys.stderr)
        raise SystemExit(2)
    if args.child:
        print(json.dumps(child(args.model, args.streams, args.prompt_tokens, args.steps, args.rounds)))
        return
    path = args.model
    if path is None:
        from synth.model import synth_model

        models = Path(args.models)
        models.mkdir(parents=True, exist_ok=True)
        path = str(models / "small-qwen3moe-q4_k.gguf")
        if not Path(path).exists():
            synth_model(path, arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
    out = {"bench": "step", "model": os.path.basename(path), "streams": args.streams,
           "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
           "load_average_before": [round(v, 2) for v in os.getloadavg()], "modes": []}
    for mode in args.modes:
        env = dict(os.environ, KVASIR_KERNEL_MODE=mode, KVASIR_THREADS=str(args.threads))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", path,
               "--streams", str(args.streams), "--prompt-tokens", str(args.prompt_tokens),
               "--steps", str(args.steps), "--rounds", str(args.rounds)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            raise SystemExit(f"step.py: the {mode} child failed ({done.returncode})")
        out["modes"].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out, indent=2))
    record.save(args, "step", out)


if __name__ == "__main__":
    main()
