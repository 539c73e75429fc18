"""Aggregate generation throughput of `kvasir serve --http`: (a) all experts local, against
llama.cpp's own batched speed on the same model; (b) sharded over a loopback NATS bus with 2 and
4 worker processes; (c) sharded with an injected round trip r (20 and 50 ms) between the workers
and the bus, with the latency bound S / (L x r) beside it. All measured in this run; prints JSON.

For each concurrency C: C streaming clients (aiohttp, OpenAI's SSE format) each ask for the same
number of tokens (``ignore_eos``) after a prompt of their own; aggregate tokens/s is all generated
tokens over the wall time from the first request to the last [DONE]; time to first token and
inter-token latency are per client, p50/p95; for each server, the CPU per generated token of
its process and of each of its threads, and of the clients (``cpu_ms_per_token``, Linux). The
server runs in its own process (``kvasir serve``), so the clients do not share its interpreter.
(a)'s sides (ours, ``llama-server -np 16`` and the batched decode below) are started once and
take turns in ``--rounds`` rounds per concurrency; each side's figure is its best round (every
round is kept under ``rounds``).

llama.cpp: one context with C sequences (llama-cpp-python's low-level API, unified KV cache,
flash attention as our engine's fast mode: on unless ``KVASIR_FLASH_ATTN=0``): each sequence's prompt is evaluated, then every step
decodes C tokens, one per sequence, in one ``llama_decode`` (what llama-server's continuous
batching does once all slots are busy). The same token counts, timed the same way (prefill
included); with C = 16 this is the "16-token batch" bound of issue 11.

(b) and (c): an embedded nats-server on loopback, N ``kvasir worker`` processes splitting every
layer's experts (1 ggml thread each), and ``kvasir serve --http --nats URL`` dispatching to them
(every MoE layer step sends one request per selected expert carrying the rows of every stream).
For (c) the workers connect through :class:`DelayProxy`, a TCP proxy in this script (asyncio,
loopback only) that holds every chunk r/2 in each direction, so each expert call waits r more;
the bound is what S streams can reach if every token costs its L serial round trips and nothing
else: S / (L x r) tokens/s.

    python bench/throughput.py [--arch qwen3moe] [--type q4_k] [--concurrency 1 4 16 32] [--tokens 16]
        [--sharded 2 4] [--rtt-ms 20 50] [--skip-local] [--rounds 3]
        [--micro-batches] [--replicas] [--mix-rtt-ms 20 50] [--mix-concurrency 4 16]

Serving mix (``--micro-batches``, ``--replicas``; each measured side by side on one swarm):
with an injected round trip, 1 vs 2 micro-batches in flight (``--micro-batches``) and 2 with
hot experts (``--hot auto``), against the latency bound; and 2 workers that both hold every
expert, ``--replicas race`` vs ``balance``: tokens/s and the CPU seconds the workers spent
(race computes every request on both).
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
from bench import record  # noqa: E402


def prompts(n: int, length: int, salt: int = 1) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, the same for every server (seeded by ``salt``, ``n``
    and ``length``), different between concurrencies and from the warm-up's (``salt`` 0): a
    server that keeps finished prompts' caches (llama-server's ``cache_prompt``, on by default)
    would otherwise answer a repeated prompt from its cache and time no prefill at all."""
    rng = np.random.default_rng([salt, n, length])
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(values, q)) * 1000, 1)  # ms


# -- ours: clients against `kvasir serve --http` --------------------------------------------------

def start_server(path: Path, max_active: int, threads: int | None, nats: str | None = None,
                 extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["KVASIR_THREADS"] = str(threads)
    bus = ["--nats", nats, "--deterministic"] if nats else []
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", str(path),
                             "--http", "127.0.0.1:0", "--model-name", "bench", "--max-active", str(max_active),
                             "--step-tokens", str(max(256, max_active)), *bus, *extra],
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

    connector = aiohttp.TCPConnector(limit=0)  # aiohttp's default 100 would cap the streams at 100
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:
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
        from kernels.ggml import flash_attn_setting  # (reads the environment; loads nothing)

        cp.flash_attn_type = 1 if flash_attn_setting() else 0  # as our fast mode attends
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


# -- (b), (c): the swarm behind the server ------------------------------------------------------

class DelayProxy:
    """A loopback TCP proxy that delays every chunk by ``delay_s`` in each direction (a round
    trip of 2 x ``delay_s``), keeping order. Bounded: at most ``max_chunks`` chunks wait per
    direction (the reader stops reading beyond, as a real link's window would), and the whole
    proxy stops by itself after ``lifetime_s`` or at :meth:`close`. Runs on its own thread."""

    def __init__(self, upstream: tuple[str, int], delay_s: float, lifetime_s: float = 3600.0,
                 max_chunks: int = 1024):
        import threading

        self.upstream, self.delay_s, self.max_chunks = upstream, delay_s, max_chunks
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(lifetime_s),),
                                        name="delay-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    async def _main(self, lifetime_s: float) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await asyncio.wait_for(self._stop.wait(), lifetime_s)
        except asyncio.TimeoutError:
            pass
        server.close()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()

    async def _client(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue(self.max_chunks)

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                await queue.put((time.monotonic() + self.delay_s, data))
        finally:
            await queue.put((0.0, None))
            await sender

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)


def moe_layers(path: Path) -> int:
    from backbone.model import Engine

    return Engine(path).cfg.n_layer  # every block of the synthetic presets is MoE


def run_sharded(path: Path, n_workers: int, rtt_ms: float, args, threads: int | None) -> dict:
    """One sharded configuration: bus, workers (through the delay proxy when rtt_ms > 0),
    server; every concurrency; everything stopped after."""
    from backbone.model import Engine
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats
    from launch.swarm import spawn_worker, split_experts, wait_for_nodes

    engine = Engine(path)
    fp, n_expert = model_fingerprint(engine.reader), engine.cfg.n_expert
    del engine
    top = max(args.concurrency)
    out = {"workers": n_workers, "rtt_ms": rtt_ms, "results": []}
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as nats:
        proxy = None
        if rtt_ms:
            host, port = nats.url.rsplit("//", 1)[1].rsplit(":", 1)
            proxy = DelayProxy((host, int(port)), rtt_ms / 2000.0)
        workers = [spawn_worker(proxy.url if proxy else nats.url, f"bench-{i}",
                                ["--model", str(path), "--layer", "all", "--experts", f"{lo}-{hi}"])
                   for i, (lo, hi) in enumerate(split_experts(n_expert, n_workers))]
        proc = None
        try:
            asyncio.run(wait_for_nodes(nats.url, fp, {w.node for w in workers}, procs=workers, timeout=300))
            proc, url = start_server(path, max_active=top, threads=threads, nats=nats.url)
            asyncio.run(run_clients(url, prompts(1, args.prompt_tokens, salt=0), 2))  # warm up
            for c in args.concurrency:
                res = asyncio.run(run_clients(url, prompts(c, args.prompt_tokens), args.tokens))
                if rtt_ms:
                    res["latency_bound_tok_s"] = round(c / (args.layers * rtt_ms / 1000.0), 2)
                out["results"].append({"concurrency": c, **res})
                print(f"# sharded {n_workers} workers, rtt {rtt_ms} ms, {c} streams: {res['tok_s']} tok/s",
                      file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
            for w in workers:
                w.stop()
            if proxy is not None:
                proxy.close()
    return out


def run_handstarted(path: Path, args) -> dict:
    """Three workers started as a user starts them by hand (no KVASIR_THREADS from a launcher),
    experts split three ways, ``kvasir serve --nats --http`` with its defaults; the workers'
    default threads against ``--threads 1`` on each, and against every worker on every core (the
    oversubscription a worker's default avoids), at ``--hand-concurrency`` streams."""
    from backbone.model import Engine
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats
    from launch.swarm import spawn_worker, split_experts, wait_for_nodes

    engine = Engine(path)
    fp, n_expert = model_fingerprint(engine.reader), engine.cfg.n_expert
    del engine
    os.environ.pop("KVASIR_THREADS", None)  # the workers inherit this environment, as from a shell
    out = {"workers": 3, "rounds": args.hand_rounds, "results": {}, "rounds_tok_s": []}
    modes = (("default", []), ("threads_1", ["--threads", "1"]),
             ("all_cores", ["--threads", str(os.cpu_count() or 1)]))  # every worker on every core
    # On a shared machine the load comes in bursts: the modes alternate (reversed every other
    # round) and each keeps its best round, so that a burst does not land on one mode alone.
    order = [m for r in range(args.hand_rounds) for m in (modes if r % 2 == 0 else modes[::-1])]
    for mode, extra in order:
        rows = []
        out["rounds_tok_s"].append({"mode": mode, "tok_s": rows})
        with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as nats:
            workers = [spawn_worker(nats.url, f"hand-{i}", ["--model", str(path), "--layer", "all",
                                                            "--experts", f"{lo}-{hi}"], threads=None, extra=extra)
                       for i, (lo, hi) in enumerate(split_experts(n_expert, 3))]
            proc = None
            try:
                asyncio.run(wait_for_nodes(nats.url, fp, {w.node for w in workers}, procs=workers, timeout=300))
                proc, url = start_server(path, max_active=max(args.hand_concurrency), threads=None, nats=nats.url)
                time.sleep(2.5)  # a worker re-counts its machine's kvasir processes every 2 s: the server too
                asyncio.run(run_clients(url, prompts(1, args.prompt_tokens, salt=0), 2))  # warm up
                for c in args.hand_concurrency:
                    res = asyncio.run(run_clients(url, prompts(c, args.prompt_tokens), args.tokens))
                    rows.append({"concurrency": c, **res})
                    print(f"# hand-started 3 workers ({mode}), {c} streams: {res['tok_s']} tok/s",
                          file=sys.stderr, flush=True)
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
                for w in workers:
                    w.stop()
    for entry in out["rounds_tok_s"]:
        best = out["results"].setdefault(entry["mode"], {})
        for r in entry["tok_s"]:
            if r["tok_s"] > best.get(r["concurrency"], {"tok_s": -1})["tok_s"]:
                best[r["concurrency"]] = r
    out["results"] = {m: [best[c] for c in sorted(best)] for m, best in out["results"].items()}
    base = {r["concurrency"]: r["tok_s"] for r in out["results"]["threads_1"]}
    for mode in ("default", "all_cores"):
        out[f"{mode}_over_threads_1"] = {str(r["concurrency"]): round(r["tok_s"] / base[r["concurrency"]], 3)
                                         for r in out["results"][mode] if base.get(r["concurrency"])}
    return out


# -- the reference server: llama-server -np 16, built from the same vendored llama.cpp -------------
#
# llama-cpp-python's sdist carries the llama.cpp it was built from (vendor/llama.cpp). The bench
# builds that tree's llama-server once (Release, GGML_NATIVE, only that target) into
# ~/.cache/kvasir/llama-server-<version>/build and runs it with its defaults plus
# -np <slots> -c <enough> -t <threads>, driven by the same client code as ours.

REFERENCE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF",
                   "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                   "-DLLAMA_USE_PREBUILT_UI=OFF"]  # no download at build time: the bench's API only


def _cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# As make install builds llama-cpp-python (Makefile): where the CPU has AMX, without ggml's AMX
# matmul, which segfaults on the synthetic Q4_K models at llama.cpp's defaults.
if _cpu_has_amx():
    _NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    REFERENCE_FLAGS += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]


class ReferenceUnavailable(Exception):
    """llama-server cannot be had here; the message is one line saying why."""


def llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        raise ReferenceUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from None


def reference_cache(version: str) -> Path:
    variant = "-noamx" if _cpu_has_amx() else ""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvasir" / f"llama-server-{version}{variant}"


def _vendored_source(version: str, cache: Path, src: str | None) -> Path:
    """The llama.cpp tree to build: ``src`` if given, else the sdist's vendor/llama.cpp, from
    pip's cache (or the index) with ``pip download --no-binary :all: --no-deps``."""
    import glob
    import tarfile

    if src:
        tree = Path(src)
        if not (tree / "tools" / "server").is_dir():
            raise ReferenceUnavailable(f"--llama-src {src}: not a llama.cpp tree (no tools/server)")
        return tree
    tree = cache / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    sdists = cache / "sdist"
    found = glob.glob(str(sdists / f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        print(f"# llama-server: fetching the llama-cpp-python {version} sdist (pip download)", file=sys.stderr,
              flush=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                              f"llama-cpp-python=={version}", "-d", str(sdists)],
                             capture_output=True, text=True)
        found = glob.glob(str(sdists / f"llama_cpp_python-{version}.tar.gz"))
        if not found:
            last = (got.stderr.strip().splitlines() or ["no output"])[-1]
            raise ReferenceUnavailable(f"cannot get the llama-cpp-python {version} sdist ({last}); "
                                       "pass --llama-src DIR (a llama.cpp tree)")
    with tarfile.open(found[0]) as tar:
        tar.extractall(cache / "src", filter="data")
    if not (tree / "CMakeLists.txt").exists():
        raise ReferenceUnavailable(f"{found[0]} carries no vendor/llama.cpp")
    return tree


def llama_server_binary(src: str | None = None) -> Path:
    """The cached llama-server of the installed llama-cpp-python's llama.cpp, built on first use
    (minutes; progress on stderr). Raises :class:`ReferenceUnavailable`."""
    import shutil

    version = llama_cpp_version()
    cache = reference_cache(version)
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    missing = [tool for tool, names in (("cmake", ["cmake"]), ("a C++ compiler", ["c++", "g++", "clang++"]))
               if not any(shutil.which(n) for n in names)]
    if missing:
        raise ReferenceUnavailable(f"{' and '.join(missing)} missing: cannot build llama-server")
    tree = _vendored_source(version, cache, src)
    build, log_path = cache / "build", cache / "build.log"
    cache.mkdir(parents=True, exist_ok=True)
    print(f"# llama-server: building {tree} into {build} (once; log {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        steps = [["cmake", "-S", str(tree), "-B", str(build), *REFERENCE_FLAGS],
                 ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)]]
        for cmd in steps:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            shown = -10
            for out_line in proc.stdout:
                log.write(out_line)
                m = re.match(r"\[\s*(\d+)%\]", out_line)
                if m and int(m.group(1)) >= shown + 10:
                    shown = int(m.group(1))
                    print(f"# llama-server: {shown}% built", file=sys.stderr, flush=True)
            if proc.wait() != 0:
                raise ReferenceUnavailable(f"`{' '.join(cmd[:2])} ...` failed (exit {proc.returncode}); see {log_path}")
    if not binary.exists():
        raise ReferenceUnavailable(f"the build made no {binary}; see {log_path}")
    return binary


def start_llama_server(binary: Path, path: Path, slots: int, n_ctx: int, threads: int
                       ) -> tuple[subprocess.Popen, str]:
    """llama-server on a free loopback port, once /health says it is ready."""
    import socket
    import tempfile
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
                             "-np", str(slots), "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().strip().splitlines()[-3:]
            raise ReferenceUnavailable(f"llama-server exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise ReferenceUnavailable("llama-server was not ready after 300 s")


def start_reference(path: Path, args, n_ctx: int, threads: int, out: dict) -> tuple[subprocess.Popen, str] | None:
    """llama-server -np <slots> on the model, ready; its binary and flags go to ``out["llama_server"]``.
    Where it cannot be had: one line on stderr, ``out["llama_server"]["unavailable"]`` and None
    (the reference is then ``llama_cpp_batched``, llama.cpp's own batched decode)."""
    try:
        binary = Path(args.llama_server) if args.llama_server else llama_server_binary(args.llama_src)
        proc, url = start_llama_server(binary, path, args.llama_slots, n_ctx, threads)
    except ReferenceUnavailable as exc:
        print(f"# llama-server unavailable: {exc}; the reference is llama.cpp's batched decode "
              "(llama_cpp_batched)", file=sys.stderr, flush=True)
        out["llama_server"] = {"unavailable": str(exc)}
        return None
    out["llama_server"] = {"binary": str(binary), "llama_cpp_python": llama_cpp_version(),
                           "flags": f"-np {args.llama_slots} -c {n_ctx} -t {threads} -tb {threads}"}
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=int, default=16, help="generated per client (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--sharded", type=int, nargs="*", default=[2, 4], metavar="N",
                    help="(b): worker counts over loopback NATS (default 2 4; none: skip)")
    ap.add_argument("--rtt-ms", type=float, nargs="*", default=[20, 50], metavar="MS",
                    help="(c): injected round trips between the workers and the bus (default 20 50)")
    ap.add_argument("--rtt-workers", type=int, default=2, help="workers for (c) (default 2)")
    ap.add_argument("--skip-local", action="store_true", help="skip (a)")
    ap.add_argument("--rounds", type=int, default=3, metavar="N",
                    help="(a): rounds per concurrency, the sides taking turns; each keeps its best (default 3)")
    ap.add_argument("--micro-batches", action="store_true",
                    help="with each --mix-rtt-ms: 1 vs 2 micro-batches in flight, and 2 with --hot auto")
    ap.add_argument("--mix-rtt-ms", type=float, nargs="+", default=[20, 50], metavar="MS",
                    help="round trips of --micro-batches (default 20 50)")
    ap.add_argument("--replicas", action="store_true",
                    help="2 workers holding every expert: race vs balance, tokens/s and the workers' CPU")
    ap.add_argument("--mix-timeout-ms", type=float, default=2000, metavar="MS",
                    help="the servers' per-expert timeout in --micro-batches and --replicas (default 2000: "
                    "compare the modes, not adaptive timeouts firing on a loaded machine; 0: adaptive)")
    ap.add_argument("--mix-concurrency", type=int, nargs="+", default=[4, 16], metavar="C",
                    help="concurrencies of --micro-batches and --replicas (default 4 16)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    ap.add_argument("--handstarted", action="store_true",
                    help="3 workers started as by hand (default threads) vs the same with --threads 1")
    ap.add_argument("--hand-concurrency", type=int, nargs="+", default=[1, 8], metavar="C",
                    help="streams for --handstarted (default 1 8)")
    ap.add_argument("--hand-rounds", type=int, default=2, metavar="N",
                    help="rounds of the three --handstarted modes, alternating order; each keeps its best (default 2)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    ap.add_argument("--no-llama-server", action="store_true", help="skip the llama-server reference of (a)")
    ap.add_argument("--llama-server", metavar="BIN", default=None,
                    help="use this llama-server binary (default: build the vendored one, cached)")
    ap.add_argument("--llama-src", metavar="DIR", default=None,
                    help="llama.cpp tree to build llama-server from (default: llama-cpp-python's sdist)")
    ap.add_argument("--llama-slots", type=int, default=16, help="llama-server -np (default 16)")
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from kvasir_bus.logs import configure

    configure("warning")  # the swarm's logs on stderr: stdout is the JSON alone

    path = Path(args.models) / f"{args.preset}-{args.arch}-{args.type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        synth_model(path, arch=args.arch, preset=args.preset, qtype=args.type, seed=0)
    threads = args.threads or os.cpu_count()
    top = max(args.concurrency)
    n_ctx = top * (args.prompt_tokens + args.tokens) + 256
    args.layers = moe_layers(path)
    out = {"bench": "throughput", "model": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
           "moe_layers": args.layers, "tokens_per_client": args.tokens, "prompt_tokens": args.prompt_tokens,
           "threads": threads, "cpus": os.cpu_count(), "results": [], "sharded": []}
    if not args.skip_local:
        run_local(path, args, top, n_ctx, threads, out)
    for n in args.sharded:
        out["sharded"].append(run_sharded(path, n, 0.0, args, args.threads))
    for rtt in args.rtt_ms:
        out["sharded"].append(run_sharded(path, args.rtt_workers, rtt, args, args.threads))
    if args.micro_batches:
        out["micro_batches"] = [run_micro_batches(path, rtt, args) for rtt in args.mix_rtt_ms]
    if args.replicas:
        out["replicas"] = run_replicas(path, args)
    if args.handstarted:
        out["handstarted"] = run_handstarted(path, args)
    print(json.dumps(out, indent=2))
    record.save(args, "throughput", out)


#: Idle seconds before each side's round: ``kvasir serve`` looks at the other processes' load every
#: 0.25 s (kvasir_bus/threads.py, CoreShare) and gives up a thread while the previous side's
#: burst is still in its window; every side starts on a machine left idle this long.
SETTLE_S = 0.6


def run_local(path: Path, args, top: int, n_ctx: int, threads: int, out: dict) -> None:
    """(a): all experts local. ``kvasir serve``, ``llama-server -np <slots>`` and llama.cpp's
    batched decode (in this process) are each started once; then for each concurrency,
    ``--rounds`` rounds in which the sides take turns (their order reversed every other round),
    each round on prompts of its own (llama-server keeps a finished prompt's cache). A shared
    machine's load comes in bursts: each side's figure is its best round, the ratios are of the
    bests, and every round is kept (``rounds``)."""
    ours, ref, theirs = None, None, None
    try:
        ours = start_server(path, max_active=top, threads=args.threads)
        ref = LlamaBatched(path, n_seq=top, n_ctx=n_ctx, threads=threads)
        theirs = None if args.no_llama_server else start_reference(path, args, n_ctx, threads, out)
        sides = {"kvasir_serve": lambda batch: with_cpu(ours[0].pid, lambda: asyncio.run(
                     run_clients(ours[1], batch, args.tokens))),
                 "llama_cpp_batched": lambda batch: ref.run(batch, args.tokens)}
        if theirs is not None:
            sides["llama_server"] = lambda batch: with_cpu(theirs[0].pid, lambda: asyncio.run(
                run_clients(theirs[1], batch, args.tokens)))
        for run in sides.values():  # warm up each (salt 0: prompts no measured round asks)
            run(prompts(1, args.prompt_tokens, salt=0))
        out["rounds"] = args.rounds
        for c in args.concurrency:
            rounds: dict[str, list[dict]] = {name: [] for name in sides}
            for r in range(args.rounds):
                batch = prompts(c, args.prompt_tokens, salt=1 + r)
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    time.sleep(SETTLE_S)
                    rounds[name].append(sides[name](batch))
            row = {"concurrency": c, **{name: max(rs, key=lambda x: x["tok_s"]) for name, rs in rounds.items()}}
            row["ratio"] = round(row["kvasir_serve"]["tok_s"] / row["llama_cpp_batched"]["tok_s"], 3)
            if "llama_server" in row:
                row["ratio_vs_llama_server"] = round(row["kvasir_serve"]["tok_s"] / row["llama_server"]["tok_s"], 3)
            row["rounds"] = rounds
            out["results"].append(row)
            print(f"# local, {c} streams, best of {args.rounds}: kvasir serve {row['kvasir_serve']['tok_s']} tok/s"
                  + (f", llama-server {row['llama_server']['tok_s']}" if "llama_server" in row else "")
                  + f", llama.cpp batched {row['llama_cpp_batched']['tok_s']}", file=sys.stderr, flush=True)
    finally:
        for side in (ours, theirs):
            if side is not None:
                side[0].terminate()
                side[0].wait(timeout=30)
        if ref is not None:
            ref.close()


# -- serving mix: micro-batches, hot experts, replica modes ----------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has spent so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float] | None:
    """Each live thread's CPU seconds so far (Linux /proc), or None: the time on a CPU that
    ``schedstat`` gives in nanoseconds (``stat``'s clock ticks, 10 ms, would be most of a
    one-stream round's CPU per token), else ``stat``'s."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            try:
                out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            except (FileNotFoundError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended meanwhile
            continue
    return out


def with_cpu(pid: int, run) -> dict:
    """``run()`` (a round of streaming clients, in this process) with the CPU it cost per
    generated token, in ms: the server's (``server``: every thread of process ``pid``), its
    threads' from the busiest (``server_threads``: whoever computes, and what serving costs
    beside it: an event loop, an HTTP thread) and the clients' (``clients``: this process).
    Where a server keeps every core busy, its pace is set by this CPU, not by its compute alone."""
    before, t0 = thread_cpu_seconds(pid), time.process_time()
    out = run()
    after, t1 = thread_cpu_seconds(pid), time.process_time()
    tokens = out.get("tokens") or 0
    if before is None or after is None or not tokens:
        return out
    per = sorted(((after[t] - before.get(t, 0.0)) * 1e3 / tokens for t in after), reverse=True)
    out["cpu_ms_per_token"] = {"server": round(sum(per), 3), "server_threads": [round(v, 3) for v in per if v >= 0.005],
                               "clients": round((t1 - t0) * 1e3 / tokens, 3)}
    return out


class Swarm:
    """An embedded nats-server, ``n_workers`` workers (through a :class:`DelayProxy` when
    ``rtt_ms`` > 0) and, per :meth:`serve`, a ``kvasir serve --http --nats`` in front of them.
    ``replicate``: every worker holds every expert (replicas) instead of a share."""

    def __init__(self, path: Path, n_workers: int, rtt_ms: float, *, replicas: str = "race",
                 replicate: bool = False):
        from backbone.model import Engine
        from kvasir_bus.fingerprint import model_fingerprint
        from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats
        from launch.swarm import spawn_worker, split_experts, wait_for_nodes

        engine = Engine(path)
        fp, n_expert = model_fingerprint(engine.reader), engine.cfg.n_expert
        del engine
        self.path, self.nats, self.proxy = path, EmbeddedNats(procs=SHARED_MACHINE_PROCS).__enter__(), None
        if rtt_ms:
            host, port = self.nats.url.rsplit("//", 1)[1].rsplit(":", 1)
            self.proxy = DelayProxy((host, int(port)), rtt_ms / 2000.0)
        url = self.proxy.url if self.proxy else self.nats.url
        ranges = [(0, n_expert - 1)] * n_workers if replicate else split_experts(n_expert, n_workers)
        self.workers = [spawn_worker(url, f"bench-{i}", ["--model", str(path), "--layer", "all",
                                                         "--experts", f"{lo}-{hi}"], extra=["--replicas", replicas])
                        for i, (lo, hi) in enumerate(ranges)]
        try:
            asyncio.run(wait_for_nodes(self.nats.url, fp, {w.node for w in self.workers}, procs=self.workers,
                                       timeout=300))
        except BaseException:
            self.close()
            raise

    def serve(self, max_active: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
        proc, url = start_server(self.path, max_active=max_active, threads=None, nats=self.nats.url, extra=extra)
        asyncio.run(run_clients(url, prompts(1, 16, salt=0), 2))  # warm up
        return proc, url

    def worker_cpu_s(self) -> float:
        return sum(cpu_seconds(w.proc.pid) for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        if self.proxy is not None:
            self.proxy.close()
        self.nats.__exit__(None, None, None)


def dispatch_counts(url: str) -> dict:
    """The server's expert calls so far, from its ``$SRV.STATS`` (remote, local, timeouts,
    hedges, hot)."""
    from kvasir_bus.connect import connect

    async def ask() -> dict:
        nc = await connect(url, "bench-stats")
        try:
            msg = await nc.request("$SRV.STATS.kvasir-backbone", b"", timeout=10)
        finally:
            await nc.close()
        data = next(e["data"] for e in json.loads(msg.data)["endpoints"] if e["name"] == "dispatch")
        return {"remote": data["remote"], "local": data["local"], "timeouts": data["timeouts"],
                "hedges": data["replicas"]["hedges"], "hot_calls": data["hot"].get("hot_calls", 0)}

    return asyncio.run(ask())


def _measure(swarm: Swarm, extra: list[str], args, label: str, rtt_ms: float = 0.0) -> list[dict]:
    top = max(args.mix_concurrency)
    if args.mix_timeout_ms:
        extra = [*extra, "--timeout-ms", str(args.mix_timeout_ms)]
    proc, url = swarm.serve(top, extra)
    rows = []
    try:
        for c in args.mix_concurrency:
            cpu0, calls0 = swarm.worker_cpu_s(), dispatch_counts(swarm.nats.url)
            res = asyncio.run(run_clients(url, prompts(c, args.prompt_tokens), args.tokens))
            res["worker_cpu_s"] = round(swarm.worker_cpu_s() - cpu0, 2)
            res["expert_calls"] = {k: v - calls0[k] for k, v in dispatch_counts(swarm.nats.url).items()}
            res["worker_cpu_ms_per_token"] = round(1000 * res["worker_cpu_s"] / res["tokens"], 2)
            if rtt_ms:
                bound = c / (args.layers * rtt_ms / 1000.0)
                res["latency_bound_tok_s"] = round(bound, 2)
                res["of_bound"] = round(res["tok_s"] / bound, 3)
            rows.append({"config": label, "concurrency": c, **res})
            print(f"# {label}, {c} streams: {res['tok_s']} tok/s, workers' CPU {res['worker_cpu_s']} s",
                  file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def run_micro_batches(path: Path, rtt_ms: float, args) -> dict:
    """Sharded over 2 workers with an injected round trip: 1 vs 2 micro-batches in flight, and
    2 with hot experts, on the same swarm, side by side."""
    swarm = Swarm(path, args.rtt_workers, rtt_ms)
    try:
        rows = []
        for label, extra in (("1 micro-batch", ["--micro-batches", "1"]),
                             ("2 micro-batches", ["--micro-batches", "2"]),
                             ("2 micro-batches, --hot auto", ["--micro-batches", "2", "--hot", "auto"])):
            rows += _measure(swarm, extra, args, label, rtt_ms)
    finally:
        swarm.close()
    return {"workers": args.rtt_workers, "rtt_ms": rtt_ms, "results": rows}


def run_replicas(path: Path, args) -> dict:
    """2 workers that both hold every expert, over loopback NATS: race (both compute every
    request) vs balance (a queue group: one computes, hedged), tokens/s and the workers' CPU."""
    rows = []
    for mode in ("race", "balance"):
        swarm = Swarm(path, 2, 0.0, replicas=mode, replicate=True)
        try:
            rows += _measure(swarm, ["--replicas", mode], args, mode)
        finally:
            swarm.close()
    return {"workers": 2, "replicas_per_expert": 2, "results": rows}


if __name__ == "__main__":
    main()
