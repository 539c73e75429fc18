"""Prefill and decode tokens/s of our engine and of llama.cpp on the same `small` GGUF.

Both engines run in this process, one after the other, on the same prompt and the same number
of greedy steps, so the ratio compares like with like on this (noisy) machine. Prints JSON.

    python bench/engine.py [--types f16 q4_k] [--prompt-tokens 64] [--decode 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
import numpy as np  # noqa: E402

from backbone.model import Engine  # noqa: E402
from backbone.reference import Reference  # noqa: E402
from synth.model import synth_model  # noqa: E402
from kernels.backend import backend_name  # noqa: E402


def ours(path: Path, prompt: np.ndarray, n: int) -> tuple[float, float]:
    engine = Engine(path)
    seq = engine.new_sequence()
    t0 = time.perf_counter()
    (logits,) = engine.forward([(seq, prompt)], all_logits=False)
    t1 = time.perf_counter()
    for _ in range(n):
        (logits,) = engine.forward([(seq, np.array([int(logits[-1].argmax())]))], all_logits=False)
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--types", nargs="+", default=["f16", "q4_k"])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the best is reported")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    args = ap.parse_args()
    from kvasir_bus.logs import configure

    configure("warning")  # logs on stderr; stdout is the JSON

    out = {"bench": "engine", "arch": args.arch, "preset": "small", "kernel": backend_name(),
           "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode, "results": []}
    for qtype in args.types:
        path = Path(args.models) / f"small-{args.arch}-{qtype}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            synth_model(path, arch=args.arch, preset="small", qtype=qtype, seed=0)
        prompt = np.random.default_rng(0).integers(0, 256, args.prompt_tokens)
        ref = Reference(path, n_ctx=args.prompt_tokens + args.decode + 8)
        ours_runs = [ours(path, prompt, args.decode) for _ in range(args.repeat)]
        ref_runs = [ref.decode_tokens_per_s(prompt.tolist(), args.decode) for _ in range(args.repeat)]
        o_pre, o_dec = max(r[0] for r in ours_runs), max(r[1] for r in ours_runs)
        r_pre, r_dec = max(r[0] for r in ref_runs), max(r[1] for r in ref_runs)
        out["results"].append({
            "type": qtype,
            "file_mb": round(path.stat().st_size / 2**20, 1),
            "ours": {"prefill_tok_s": round(o_pre, 1), "decode_tok_s": round(o_dec, 2)},
            "llama_cpp": {"prefill_tok_s": round(r_pre, 1), "decode_tok_s": round(r_dec, 2)},
            "ratio_ours_over_llama_cpp": {"prefill": round(o_pre / r_pre, 3), "decode": round(o_dec / r_dec, 3)},
        })
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
