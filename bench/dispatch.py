"""Decode tokens/s monolithic vs sharded over loopback NATS with every expert remote.

For the `small` model and a `122b-layer` model (the real per-expert shapes of the 122B MoE:
hidden 3072, expert FFN 1024, Q4_K; fewer experts per layer by default so that the file builds
in seconds), in one run: decode tokens/s of the same engine with all experts local and with all
experts computed by worker processes on an embedded nats-server, their ratio, the dispatch
round trips per token (requests, and the serial waits: one per MoE layer), and the bytes on the
wire per token per layer. Both runs must produce the same tokens; the JSON says whether they did.

    python bench/dispatch.py [--workers 2] [--decode 16] [--experts-122b 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
import numpy as np  # noqa: E402

from backbone.dispatch import DispatchConfig  # noqa: E402
from backbone.model import Engine  # noqa: E402
from backbone.service import BackboneConfig, BackboneService  # noqa: E402
from launch.swarm import spawn_worker, split_experts, wait_for_nodes  # noqa: E402
from synth.model import synth_model  # noqa: E402
from kvasir_bus.fingerprint import model_fingerprint  # noqa: E402
from kvasir_bus.server import EmbeddedNats  # noqa: E402


def decode(engine: Engine, prompt: np.ndarray, n: int, remote=None) -> tuple[list[int], float, dict | None]:
    seq = engine.new_sequence()
    (logits,) = engine.forward([(seq, prompt)], all_logits=False)
    before = remote.stats.to_dict()["totals"] if remote else None
    tokens = []
    t0 = time.perf_counter()
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = engine.forward([(seq, np.array(tokens[-1:]))], all_logits=False)
    dt = time.perf_counter() - t0
    delta = None
    if remote:
        after = remote.stats.to_dict()["totals"]
        delta = {k: after[k] - before[k] for k in ("calls", "remote", "local", "bytes_out", "bytes_in")}
    return tokens, n / dt, delta


def bench_model(path: Path, workers: int, n_decode: int, n_prompt: int) -> dict:
    engine = Engine(path)
    cfg = engine.cfg
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, n_prompt)
    mono_tokens, mono_tps, _ = decode(engine, prompt, n_decode)
    fp = model_fingerprint(engine.reader)
    with EmbeddedNats() as server, tempfile.TemporaryDirectory() as logdir:
        procs = []
        try:
            for i, (lo, hi) in enumerate(split_experts(cfg.n_expert, workers)):
                log = open(os.path.join(logdir, f"w{i}.log"), "w")
                procs.append(spawn_worker(server.url, f"bench-{i}", ["--model", str(path), "--layer", "all",
                                                                    "--experts", f"{lo}-{hi}"], log_file=log))
            asyncio.run(wait_for_nodes(server.url, fp, {p.node for p in procs}, procs=procs, timeout=600))
            role = BackboneConfig(model_path=str(path), nats_url=server.url, dispatch=DispatchConfig(timeout_s=5.0),
                                  market=False, serve_manifest=False)
            with BackboneService(engine, role) as backbone:
                remote = backbone.dispatch
                decode(engine, prompt, 2, remote)  # warm the workers' caches and the connection
                sh_tokens, sh_tps, d = decode(engine, prompt, n_decode, remote)
        finally:
            for p in procs:
                p.stop()
    return {
        "model": path.name,
        "arch": cfg.arch, "layers": cfg.n_layer, "experts": cfg.n_expert, "experts_used": cfg.n_expert_used,
        "hidden": cfg.n_embd, "expert_ffn": cfg.n_ff_exp,
        "workers": workers,
        "decode_tokens": n_decode,
        "monolithic_tok_s": round(mono_tps, 2),
        "sharded_tok_s": round(sh_tps, 2),
        "ratio_sharded_over_monolithic": round(sh_tps / mono_tps, 3),
        "same_tokens": sh_tokens == mono_tokens,
        "requests_per_token": round(d["calls"] / n_decode, 2),
        "serial_round_trips_per_token": cfg.n_layer,  # one wait per MoE layer per step
        "remote_fraction": round(d["remote"] / d["calls"], 3) if d["calls"] else None,
        "wire_bytes_per_token_per_layer": round((d["bytes_out"] + d["bytes_in"]) / n_decode / cfg.n_layer),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--experts-122b", type=int, default=16,
                    help="experts per layer of the 122b-layer model (the real model has 256)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    args = ap.parse_args()
    from kvasir_bus.logs import configure

    configure("warning")  # logs on stderr; stdout is the JSON
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    small = models / "small-qwen3moe-q4_k.gguf"
    if not small.exists():
        synth_model(small, arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
    big = models / f"122b-layer-qwen2moe-q4_k-{args.experts_122b}x.gguf"
    if not big.exists():
        synth_model(big, arch="qwen2moe", preset="122b-layer", qtype="q4_k", seed=0, experts=args.experts_122b)
    out = {"bench": "dispatch", "transport": "loopback NATS (embedded nats-server)", "results": [
        bench_model(small, args.workers, args.decode, args.prompt_tokens),
        bench_model(big, args.workers, args.decode, args.prompt_tokens),
    ]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
