"""Aggregate generation throughput of `kvasir serve --http` (all experts local) against llama.cpp's
own batched speed on the same model, measured side by side in this run. Prints JSON.

For each concurrency C: C streaming clients (aiohttp, OpenAI's SSE format) each ask for the same
number of tokens (``ignore_eos``) after a prompt of their own; aggregate tokens/s is all generated
tokens over the wall time from the first request to the last [DONE]; time to first token and
inter-token latency are per client, p50/p95. The server runs in its own process
(``kvasir serve``), so the clients do not share its interpreter.

llama.cpp: one context with C sequences (llama-cpp-python's low-level API, unified KV cache,
flash attention off as in our engine): each sequence's prompt is evaluated, then every step
decodes C tokens, one per sequence, in one ``llama_decode`` (what llama-server's continuous
batching does once all slots are busy). The same token counts, timed the same way (prefill
included); with C = 16 this is the "16-token batch" bound of issue 11.

    python bench/throughput.py [--arch qwen3moe] [--type q4_k] [--concurrency 1 4 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from synth.model import synth_model  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(values, q)) * 1000, 1)  # ms


# -- ours: clients against `kvasir serve --http` --------------------------------------------------

def start_server(path: Path, max_active: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["KVASIR_THREADS"] = str(threads)
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", str(path),
                             "--http", "127.0.0.1:0", "--model-name", "bench", "--max-active", str(max_active),
                             "--step-tokens", str(max(256, max_active))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"(http://\S+)/v1", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, match.group(1)


async def one_client(session, url: str, prompt: list[int], n: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0 if stamps else None, "gaps": list(np.diff(stamps)), "tokens": tokens}


async def run_clients(url: str, batch: list[list[int]], n: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(session, url, p, n) for p in batch))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {"tokens": tokens, "seconds": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "ttft_ms": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)},
            "itl_ms": {"p50": pct(gaps, 50), "p95": pct(gaps, 95)}}


# -- llama.cpp: C sequences in one context, one llama_decode per step -----------------------------

class LlamaBatched:
    def __init__(self, path: Path, n_seq: int, n_ctx: int, threads: int):
        import llama_cpp.llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = False  # no repacking: the kernels our ggml path runs (see Reference)
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, max(512, n_seq), max(512, n_seq)
        cp.n_seq_max, cp.kv_unified = n_seq, True
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 0  # disabled
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max(512, n_seq), 0, n_seq)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def run(self, batch: list[list[int]], n: int) -> dict:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last = []
        for s, p in enumerate(batch):  # prompts one after another, as requests arrive
            self._decode([(t, i, s, i == len(p) - 1) for i, t in enumerate(p)])
            last.append(self._argmax(len(p) - 1))
        t1 = time.perf_counter()
        pos = [len(p) for p in batch]
        for _ in range(n - 1):
            self._decode([(last[s], pos[s], s, True) for s in range(len(batch))])
            last = [self._argmax(s) for s in range(len(batch))]
            pos = [q + 1 for q in pos]
        t2 = time.perf_counter()
        tokens = n * len(batch)
        return {"tokens": tokens, "seconds": round(t2 - t0, 3), "tok_s": round(tokens / (t2 - t0), 2),
                "decode_only_tok_s": round(len(batch) * (n - 1) / (t2 - t1), 2) if n > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=32, help="generated per client (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    args = ap.parse_args()

    path = Path(args.models) / f"{args.preset}-{args.arch}-{args.type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        synth_model(path, arch=args.arch, preset=args.preset, qtype=args.type, seed=0)
    threads = args.threads or os.cpu_count()
    top = max(args.concurrency)
    n_ctx = top * (args.prompt_tokens + args.tokens) + 256
    out = {"bench": "throughput", "model": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
           "experts": "all local", "tokens_per_client": args.tokens, "prompt_tokens": args.prompt_tokens,
           "threads": threads, "results": []}
    proc, url = start_server(path, max_active=top, threads=args.threads)
    ref = LlamaBatched(path, n_seq=top, n_ctx=n_ctx, threads=threads)
    try:
        asyncio.run(run_clients(url, prompts(1, args.prompt_tokens), 2))  # warm up both
        ref.run(prompts(1, args.prompt_tokens), 2)
        for c in args.concurrency:
            batch = prompts(c, args.prompt_tokens)
            ours = asyncio.run(run_clients(url, batch, args.tokens))
            theirs = ref.run(batch, args.tokens)
            out["results"].append({"concurrency": c, "kvasir_serve": ours, "llama_cpp_batched": theirs,
                                   "ratio": round(ours["tok_s"] / theirs["tok_s"], 3)})
    finally:
        ref.close()
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
