"""Prefill and decode tokens/s of our engine against llama.cpp as its users run it.

The reference is llama.cpp through llama-cpp-python with its defaults: weight repacking into
the CPU's extra buffer types on, flash attention as llama-cpp-python sets it by default (off),
``n_threads`` = cores / 2 for decode and all cores for prefill, ggml's default tiled matmul.
Beside it, labelled, the *matched* reference: llama.cpp with flash attention as ours (on in the
fast mode unless ``KVASIR_FLASH_ATTN=0``, as llama-server's default), every core and
weight repacking exactly as ours (on unless ``KVASIR_REPACK=0``), the settings ``kvasir verify``
compares against. Our engine runs in
both kernel modes: ``fast`` (the default) and ``deterministic`` (batch-invariant); the cost of
the latter is reported as its slowdown. A fifth child runs ours fast without weight repacking
(``KVASIR_REPACK=0``), labelled: what repacking gains (``repacking_gain``).

Our engine's defaults follow llama.cpp's: a decode step's graphs run on half the cores, a
prompt's on all of them (``kernels.ggml.decode_threads``); weights are repacked as llama.cpp's
(dense ones and the routed experts' slabs; ``KVASIR_REPACK=0`` turns it off, see
``kernels.ggml.repack_enabled``). The JSON records the load average before and
after: on a shared machine the ratios are only as good as the load was steady.

Every configuration runs in its own child process (ggml reads its kernel switches once, when it
loads), on the same GGUF, prompt and number of greedy steps, one after the other, so the ratios
compare like with like on this (noisy) machine: ``--rounds`` child processes per configuration,
interleaved with the other configurations' (default 2), ``--repeat`` runs in each; the best run
is reported.
Models: ``small`` f16 and q4_k (qwen3moe), a 2-layer ``122b-layer`` q4_k (the 122B's expert
shapes, ``--experts-122b`` experts per layer) and a 4-layer qwen35moe ``122b-layer`` q4_k (three
gated delta-net layers and one gated-attention layer, the same experts per layer;
``--no-qwen35moe`` leaves it out). Prints JSON on stdout, with each child's resident memory after its runs (``rss_mb``).

What the users' reference gains, setting by setting (prefill of 64 tokens, llama.cpp alone in
a child, one setting changed from its defaults; issue 10, measured on this 2-core machine):

- ``logits_all``: llama.cpp computes the last layer's FFN (the routed experts) only for the
  rows whose logits are asked for. With every position's logits asked for, as ``kvasir verify``
  needs, the 2-layer 122b-layer model's prefill drops from 314-353 to 182-195 tok/s: half of
  its expert work is the last layer. This was most of the earlier "matched" gap (292 vs 166);
  the matched child now asks for the last position only, like ours and the users' run.
  Our engine prunes the same way (``backbone.model.Engine.forward``: after the last layer's
  attention output projection only each sequence's last row goes on, on every path, the
  sharded one included; deterministic logits unchanged bit for bit). A prototype of it took
  our 122b-layer prefill from 155-166 to 232-256 tok/s.
- ``GOMP_SPINCOUNT``: libgomp's default spin (300000) against the 10000 ``kvasir_bus.threads``
  set: equal on an idle machine, but with one other busy process on the 2 cores, ggml's
  per-node ``omp barrier`` sleeps and waits for the scheduler: users' llama.cpp F16 prefill
  302-382 tok/s, the same with 10000 178-214 (5 paired runs). The matched child imported
  kvasir_bus and so ran with 10000: that was the F16 and Q4_K gap of a run under load
  (load average 1.6: 748 vs 477); on an idle machine users and matched are within noise.
- weight repacking (``use_extra_bufts``): nothing measurable on F16 (no repacked kernel for it
  on AVX2); about +10% on Q4_K (122b-layer 280-298 without, 314-353 with).
- threads (users: ``n_threads`` = cores / 2 for decode, all cores for prefill), the tiled-mm
  switch (on by default) and flash attention (off by default in llama-cpp-python): no
  measurable prefill difference.

    python bench/engine.py [--types f16 q4_k] [--prompt-tokens 64] [--decode 32] [--repeat 3] [--rounds 2]
                           [--experts-122b 32] [--no-122b] [--no-qwen35moe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402  (bench/record.py: --save)

# llama.cpp's own default for the tiled kernel is on; the child for "as users run it" gets an
# environment without our switches so that llama.cpp decides.
OUR_ENV = ("KVASIR_KERNEL_MODE", "GGML_CPU_TILED_MM", "KVASIR_THREADS", "KVASIR_REPACK")


def child(kind: str, path: str, n_prompt: int, n_decode: int, repeat: int) -> dict:
    """One configuration in this (child) process: best prefill and decode tokens/s."""
    sys.path.insert(0, str(ROOT))
    if kind.startswith("ours"):
        os.environ["KVASIR_KERNEL_MODE"] = "deterministic" if kind == "ours-deterministic" else "fast"
        import numpy as np

        from backbone.model import Engine
        from kernels.backend import kernel_settings
        from kvasir_bus.logs import configure

        configure("warning")
        engine = Engine(path)
        prompt = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, n_prompt)
        runs = []
        for _ in range(repeat):
            seq = engine.new_sequence()
            t0 = time.perf_counter()
            (logits,) = engine.forward([(seq, prompt)], all_logits=False)
            t1 = time.perf_counter()
            for _ in range(n_decode):
                (logits,) = engine.forward([(seq, np.array([int(logits[-1].argmax())]))], all_logits=False)
            t2 = time.perf_counter()
            runs.append((n_prompt / (t1 - t0), n_decode / (t2 - t1)))
        settings = kernel_settings()
    else:
        if kind == "llama-users":
            # No project import here: kvasir_bus would set ggml's switches; llama.cpp decides.
            import llama_cpp

            llm = llama_cpp.Llama(model_path=path, n_ctx=n_prompt + n_decode + 8, verbose=False)  # defaults
            settings = {"repack": True, "flash_attn": bool(llm.context_params.flash_attn_type == 1),
                        "n_threads": llm.n_threads, "n_threads_batch": llm.n_threads_batch,
                        "tiled_mm": os.environ.get("GGML_CPU_TILED_MM", "unset: llama.cpp's default")}
        else:  # matched: what kvasir verify compares against
            from backbone.reference import Reference

            # the last position's logits only, as ours and the users' run: with all of them
            # llama.cpp also runs the last layer's experts on every row (see above)
            repack = os.environ.get("KVASIR_REPACK", "1") != "0"  # as our fast child repacks
            ref = Reference(path, n_ctx=n_prompt + n_decode + 8, logits_all=False, repack=repack)
            llm = ref.llm  # flash attention as ours (kernels.dense.flash_attn)
            settings = {"repack": repack, "flash_attn": ref.flash_attn, "n_threads": llm.n_threads,
                        "n_threads_batch": llm.n_threads_batch, "tiled_mm": os.environ.get("GGML_CPU_TILED_MM")}
        import llama_cpp
        import numpy as np

        n_vocab = llm.n_vocab()

        def next_token() -> int:  # llm.scores holds nothing without logits_all: read the last row
            return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

        prompt = np.random.default_rng(0).integers(0, n_vocab, n_prompt).tolist()
        runs = []
        for _ in range(repeat):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            token = next_token()
            for _ in range(n_decode):
                llm.eval([token])
                token = next_token()
            t2 = time.perf_counter()
            runs.append((n_prompt / (t1 - t0), n_decode / (t2 - t1)))
    settings["GOMP_SPINCOUNT"] = os.environ.get("GOMP_SPINCOUNT", "unset: libgomp's default")
    return {"prefill_tok_s": round(max(r[0] for r in runs), 1), "decode_tok_s": round(max(r[1] for r in runs), 2),
            "rss_mb": _rss_mb(), "settings": settings}


def _rss_mb() -> float | None:
    """This process's resident memory after its runs (Linux /proc; None elsewhere): the weights,
    their repacked copy, caches and scratch, as each engine holds them."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kb / 1024, 1)


def run_child(kind: str, path: Path, args) -> dict:
    # llama.cpp's children get none of our switches; ours keep the ones a caller may set to
    # measure them (KVASIR_REPACK, KVASIR_THREADS: both recorded in the child's settings), and
    # the matched one our repack switch (it repacks as ours does).
    kept = ("KVASIR_REPACK", "KVASIR_THREADS") if kind.startswith("ours") else \
        ("KVASIR_REPACK",) if kind == "llama-matched" else ()
    env = {k: v for k, v in os.environ.items() if k not in OUR_ENV or k in kept}
    if kind == "ours-fast-unrepacked":
        env["KVASIR_REPACK"] = "0"
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--model", str(path),
           "--prompt-tokens", str(args.prompt_tokens), "--decode", str(args.decode), "--repeat", str(args.repeat)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench child {kind} on {path.name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


KINDS = ("ours-fast", "ours-deterministic", "ours-fast-unrepacked", "llama-users", "llama-matched")


def bench_model(path: Path, label: str, args) -> dict:
    """Every configuration ``--rounds`` times, the rounds interleaved (all five children, then
    all five again): on this machine the speed of the same child drifts by half from one
    minute to the next, and interleaving lets each configuration meet the same drift. The best
    prefill and the best decode of each over its rounds count."""
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            runs[kind].append(run_child(kind, path, args))
    got = {kind: {"prefill_tok_s": max(r["prefill_tok_s"] for r in rs), "decode_tok_s": max(r["decode_tok_s"] for r in rs),
                  "rss_mb": rs[-1]["rss_mb"], "settings": rs[0]["settings"]} for kind, rs in runs.items()}
    fast, det, plain, users, matched = (got[k] for k in KINDS)
    return {
        "model": label, "file": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
        "ours_fast": fast, "ours_deterministic": det, "ours_fast_without_repacking": plain,
        "llama_cpp_as_users_run_it": users, "llama_cpp_matched_settings": matched,
        "ratio_ours_fast_over_llama_cpp_users": {
            "prefill": ratio(fast["prefill_tok_s"], users["prefill_tok_s"]),
            "decode": ratio(fast["decode_tok_s"], users["decode_tok_s"])},
        "ratio_ours_fast_over_llama_cpp_matched": {
            "prefill": ratio(fast["prefill_tok_s"], matched["prefill_tok_s"]),
            "decode": ratio(fast["decode_tok_s"], matched["decode_tok_s"])},
        "repacking_gain": {  # fast/unrepacked - 1: what llama.cpp's weight repacking gives ours
            "prefill": round(fast["prefill_tok_s"] / plain["prefill_tok_s"] - 1, 3),
            "decode": round(fast["decode_tok_s"] / plain["decode_tok_s"] - 1, 3)},
        "deterministic_cost": {  # 1 - det/fast: the fraction of speed batch invariance costs
            "prefill": round(1 - det["prefill_tok_s"] / fast["prefill_tok_s"], 3),
            "decode": round(1 - det["decode_tok_s"] / fast["decode_tok_s"], 3)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--types", nargs="+", default=["f16", "q4_k"])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration in each child process")
    ap.add_argument("--rounds", type=int, default=2, help="child processes per configuration, interleaved "
                    "with the others'; the best run over them is reported (default 2)")
    ap.add_argument("--experts-122b", type=int, default=32, help="experts per layer of the 2-layer 122b model")
    ap.add_argument("--no-122b", action="store_true", help="leave out the 122b-layer model")
    ap.add_argument("--no-qwen35moe", action="store_true", help="leave out the 4-layer qwen35moe 122b-layer model "
                    "(3 gated delta-net layers, 1 gated-attention layer: the seeds' model family)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.prompt_tokens, args.decode, args.repeat)))
        return

    sys.path.insert(0, str(ROOT))
    from synth.model import synth_model

    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    todo = []
    for qtype in args.types:
        path = models / f"small-{args.arch}-{qtype}.gguf"
        if not path.exists():
            synth_model(path, arch=args.arch, preset="small", qtype=qtype, seed=0)
        todo.append((path, f"small {args.arch} {qtype}"))
    if not args.no_122b:
        path = models / f"122b-layer-{args.arch}-q4_k-2x{args.experts_122b}.gguf"
        if not path.exists():
            synth_model(path, arch=args.arch, preset="122b-layer", qtype="q4_k", seed=0, layers=2,
                        experts=args.experts_122b)
        todo.append((path, f"122b-layer {args.arch} q4_k, 2 layers x {args.experts_122b} experts"))
    if not args.no_qwen35moe:  # one full period of Qwen3.5-122B-A10B's layers at its shapes
        path = models / f"122b-layer-qwen35moe-q4_k-4x{args.experts_122b}.gguf"
        if not path.exists():
            synth_model(path, arch="qwen35moe", preset="122b-layer", qtype="q4_k", seed=0, layers=4,
                        experts=args.experts_122b)
        todo.append((path, f"122b-layer qwen35moe q4_k, 4 layers (3 delta-net, 1 gated attention) x "
                           f"{args.experts_122b} experts"))
    if args.rounds < 1 or args.repeat < 1:
        raise SystemExit("--rounds and --repeat must be >= 1")
    out = {"bench": "engine", "cores": os.cpu_count(), "prompt_tokens": args.prompt_tokens,
           "decode_tokens": args.decode, "repeat": args.repeat, "rounds": args.rounds,
           "reference": "llama.cpp via llama-cpp-python defaults (repacking on, its default flash "
                        "attention and threads); 'matched' = flash attention as ours, all cores, repacking and "
                        "the tiled-matmul switch as ours: the kernels kvasir verify compares against "
                        "(here with the last position's logits only, as ours)",
           "load_average_before": [round(v, 2) for v in os.getloadavg()],
           "results": [bench_model(path, label, args) for path, label in todo]}
    # The ratios compare runs made one after the other: on a machine shared with other work
    # they are only as good as the load was steady (2-thread runs suffer most from it).
    out["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out, indent=2))
    record.save(args, "engine", out)


if __name__ == "__main__":
    main()
