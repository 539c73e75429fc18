"""Decode tokens/s monolithic vs sharded over loopback NATS with every expert remote.

For the `small` model, a `122b-layer` model (the real per-expert shapes of the 122B MoE:
hidden 3072, expert FFN 1024, Q4_K; one layer of fewer experts by default so that the file
builds in seconds) and issue 10's configuration of those shapes (2 layers of 32 experts, top-8,
on ``--issue-model-workers`` = 4 worker processes), in one run: decode tokens/s of the same engine with all experts local and with all
experts computed by worker processes on an embedded nats-server, their ratio, the dispatch
round trips per token (requests, and the serial waits: one per MoE layer), the messages the
backbone sends per token, the bytes on the wire per token per layer, and the CPU milliseconds per
token of each process (backbone, workers, nats-server: /proc, the least over the rounds): whether
the machine's cores, not the wait, bound the sharded decode (``cores_busy``: that CPU over the wall
time times the cores, the median of the rounds); and the backbone's engine thread's
own CPU per token, with the part of it spent inside the dispatch (``run_layer``: planning,
sending, taking the replies and booking them), against the engine thread of the monolithic
decode. Monolithic and sharded
decodes alternate on one warm swarm, so both see the same load; the best round of each counts.
Sharded runs with bundles (one message per worker per layer step, the default) and, with
``--bundles both`` (the default here), also without (one message per expert), on the same
swarm in the same rounds. All must produce the same tokens; the JSON says whether they did.

    python bench/dispatch.py [--workers 2] [--decode 32] [--rounds-ratio 3] [--experts-122b 16] [--bundles both]
    python bench/dispatch.py --overhead [--overhead-decode 200] [--rounds 10] [--bundles both] [--overhead-top-k 2 8]

``--overhead`` measures only what a remote call costs besides its kernel: a ``tiny`` model
(hidden 64, 2 layers, top-2, expert FFN 32: a trivial expert, microseconds of compute) decoded
monolithically and with one worker process holding every expert, ``rounds`` sequences of
``overhead-decode`` tokens (800 remote calls a round: /proc counts CPU in 10 ms ticks); then
the same with the routing of the 122B (``--overhead-top-k``, default ``2 8``: top-8 of 32
trivial experts), whose layer step sends its 8 calls in one bundle: what a call costs depends
on how many share a message, and top-2 is the least that do.
Backbone CPU per remote call = (process CPU of the sharded decode - that of the monolithic one)
/ remote calls; worker CPU per call = the worker process's CPU (from /proc) / requests, and the
trivial kernel's own time (the least of many timings, in this process) beside it; the kernel
time the worker itself counted (``$SRV.STATS``, in place: cold caches, other experts between
calls) is a second estimate. Beside them, the floor: what nats.py itself costs per call in the same
run (a requester and an echo responder with no work at all, :func:`bench_floor`), and the same loop on
blocking sockets speaking the NATS protocol directly (``bench/raw_floor.py``: the socket and the
loopback TCP stack, which any client pays). Each figure is the least over
the rounds, the median beside it: CPU time grows too when other processes share the cores, and
the quietest round is the closest to the cost itself. Measured twice: with audits off (the bus
alone) and with the default audits (their local recomputes count on the backbone). The codec's
part of each (encode, validate, decode) is timed in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)
import numpy as np  # noqa: E402

from backbone.dispatch import DispatchConfig  # noqa: E402
from backbone.model import Engine  # noqa: E402
from backbone.service import BackboneConfig, BackboneService  # noqa: E402
from launch.swarm import spawn_worker, split_experts, wait_for_nodes  # noqa: E402
from synth.model import synth_model  # noqa: E402
from kvasir_bus.fingerprint import model_fingerprint  # noqa: E402
from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats  # noqa: E402
from raw_floor import bench_raw_floor  # noqa: E402  (bench/ is on the path when run as a script)


_COUNTED = ("calls", "remote", "local", "bytes_out", "bytes_in", "bundles", "bundled_calls")


def decode(engine: Engine, prompt: np.ndarray, n: int, remote=None, cpu=None) -> tuple[list[int], float, dict | None]:
    """``n`` tokens decoded after ``prompt``: (tokens, tokens/s, the dispatch counters' change).
    ``cpu``: (a function returning CPU-second counters, a list that gets their change over the
    decode loop alone, without the prompt)."""
    seq = engine.new_sequence()
    (logits,) = engine.forward([(seq, prompt)], all_logits=False)
    before = remote.stats.to_dict()["totals"] if remote else None
    tokens = []
    c0 = cpu[0]() if cpu else None
    t0 = time.perf_counter()
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = engine.forward([(seq, np.array(tokens[-1:]))], all_logits=False)
    dt = time.perf_counter() - t0
    if cpu:
        cpu[1].append(tuple(b - a for a, b in zip(c0, cpu[0]())))
    delta = None
    if remote:
        after = remote.stats.to_dict()["totals"]
        delta = {k: after[k] - before[k] for k in _COUNTED}
    return tokens, n / dt, delta


def _messages(d: dict) -> int:
    """Messages the backbone sent: one per bundle, one per call outside a bundle."""
    return d["bundles"] + d["calls"] - d["local"] - d["bundled_calls"]


def bench_model(path: Path, workers: int, n_decode: int, n_prompt: int, rounds: int = 3,
                bundles: str = "both", audit_rate: float | None = None) -> dict:
    """Monolithic and sharded decode of the same prompt, alternated ``rounds`` times on one
    warm swarm (the engine is handed its local experts and the remote ones in turn), so both
    see the same load on a shared machine; the best round of each counts, the median beside.
    ``bundles``: "on", "off", or "both" (sharded with bundles, then without, each round).
    ``audit_rate``: the backbone's audit rate (None: its default, as users run it)."""
    from backbone.audit import AuditConfig

    modes = {"on": (True,), "off": (False,), "both": (True, False)}[bundles]
    engine = Engine(path)
    cfg = engine.cfg
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, n_prompt)
    decode(engine, prompt, 2)  # warm the graph caches
    fp = model_fingerprint(engine.reader)
    mono, same = [], True
    sharded = {mode: [] for mode in modes}
    cpu = {"monolithic": [], **{mode: [] for mode in modes}}  # per round: (backbone, workers, nats) CPU s
    counted = {mode: None for mode in modes}
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server, tempfile.TemporaryDirectory() as logdir:
        procs = []
        try:
            for i, (lo, hi) in enumerate(split_experts(cfg.n_expert, workers)):
                log = open(os.path.join(logdir, f"w{i}.log"), "w")
                procs.append(spawn_worker(server.url, f"bench-{i}", ["--model", str(path), "--layer", "all",
                                                                    "--experts", f"{lo}-{hi}"], log_file=log))
            asyncio.run(wait_for_nodes(server.url, fp, {p.node for p in procs}, procs=procs, timeout=600))
            audits = AuditConfig() if audit_rate is None else AuditConfig(rate=audit_rate)
            role = BackboneConfig(model_path=str(path), nats_url=server.url,
                                  dispatch=DispatchConfig(timeout_s=5.0, audit=audits), market=False,
                                  serve_manifest=False)
            with BackboneService(engine, role) as backbone:
                remote = backbone.dispatch
                wait_for_bundle_nodes(remote, len(procs) if True in modes else 0)
                decode(engine, prompt, 2, remote)  # warm the workers' caches and the connection
                pids = ([p.proc.pid for p in procs], [server.pid])
                in_dispatch = _DispatchClock(remote)

                def cpu_now() -> tuple[float, ...]:
                    return (time.process_time(), *(sum(_proc_cpu_s(pid) for pid in group) for group in pids),
                            time.thread_time(), in_dispatch.cpu_s)

                for _ in range(rounds):
                    engine.use_experts(None)
                    mono_tokens, mono_tps, _ = decode(engine, prompt, n_decode, cpu=(cpu_now, cpu["monolithic"]))
                    mono.append(mono_tps)
                    engine.use_experts(remote)
                    for mode in modes:
                        remote.bundles = mode
                        sh_tokens, sh_tps, dr = decode(engine, prompt, n_decode, remote, cpu=(cpu_now, cpu[mode]))
                        sharded[mode].append(sh_tps)
                        same = same and sh_tokens == mono_tokens
                        d = counted[mode]
                        counted[mode] = dr if d is None else {k: d[k] + dr[k] for k in d}
                audit = role.dispatch.audit
        finally:
            for p in procs:
                p.stop()
    n_all = n_decode * rounds
    out = {
        "model": path.name,
        "arch": cfg.arch, "layers": cfg.n_layer, "experts": cfg.n_expert, "experts_used": cfg.n_expert_used,
        "hidden": cfg.n_embd, "expert_ffn": cfg.n_ff_exp,
        "workers": workers,
        "decode_tokens": n_decode, "rounds": rounds,
        "audit_rate": audit.rate, "audit_probation": audit.probation,
        "monolithic_tok_s": round(max(mono), 2),
        "same_tokens": same,
        "serial_round_trips_per_token": cfg.n_layer,  # one wait per MoE layer per step
        "monolithic_cpu_ms_per_token": _cpu_ms_per_token(cpu["monolithic"], n_decode)["backbone"],
        "monolithic_engine_thread_cpu_ms_per_token": _cpu_ms_per_token(cpu["monolithic"], n_decode)["engine_thread"],
        "cores": _cores(),
        "monolithic_cores_busy": cores_busy(cpu["monolithic"], mono, n_decode),
    }
    for mode in modes:
        tag, d, sh = ("" if mode else "no_bundles_"), counted[mode], sharded[mode]
        out.update({
            f"sharded_{tag}tok_s": round(max(sh), 2),
            f"ratio_sharded_{tag}over_monolithic": round(max(sh) / max(mono), 3),
            f"ratio_{tag}median_of_rounds": round(float(np.median([s / m for s, m in zip(sh, mono)])), 3),
            f"{tag}requests_per_token": round(d["calls"] / n_all, 2),
            f"{tag}messages_out_per_token": round(_messages(d) / n_all, 2),
            f"{tag}remote_fraction": round(d["remote"] / d["calls"], 3) if d["calls"] else None,
            f"{tag}wire_bytes_per_token_per_layer": round((d["bytes_out"] + d["bytes_in"]) / n_all / cfg.n_layer),
            f"sharded_{tag}cpu_ms_per_token": _cpu_ms_per_token(cpu[mode], n_decode),
            f"sharded_{tag}cores_busy": cores_busy(cpu[mode], sh, n_decode),
        })
    return out


class _DispatchClock:
    """The engine thread's CPU seconds inside ``remote.run_layer`` (planning, sending, taking
    the replies, the books; not the waiting, which costs no CPU), summed: two clock reads per
    layer step."""

    def __init__(self, remote):
        self.cpu_s = 0.0
        run_layer = remote.run_layer

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return run_layer(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - t0

        remote.run_layer = timed  # the engine calls it through the instance


def _cpu_ms_per_token(rounds: list[tuple[float, ...]], n_decode: int) -> dict:
    """CPU milliseconds per token of each process group, the least over the rounds (CPU time
    grows too when other processes share the cores): backbone (this process, its bus thread
    included), the workers together, nats-server; /proc counts in 10 ms ticks, so a round of
    32 tokens resolves about 0.3 ms per token. Then the engine thread's own CPU (the decode
    runs on it), and of that the part inside the dispatch's ``run_layer``."""
    names = ("backbone", "workers", "nats_server", "engine_thread", "engine_thread_in_dispatch")
    best = [min(r[i] for r in rounds) for i in range(len(rounds[0]))]
    return {name: round(1e3 * s / n_decode, 2) for name, s in zip(names, best)}


def _cores() -> int:
    """The cores this process may run on (the bench's processes share them)."""
    return len(os.sched_getaffinity(0))


def cores_busy(rounds: list[tuple[float, ...]], tok_s: list[float], n_decode: int, cores: int | None = None) -> float:
    """How much of the machine the decode kept busy, the median over the rounds: the CPU seconds
    of every process of a round (backbone, workers, nats-server) over its wall time times the
    cores. Near 1, the cores bound the decode; well below, its serial waits do (the backbone's
    dense graphs while the workers idle, messages queued behind another process)."""
    cores = cores or _cores()
    busy = [sum(r[:3]) / (n_decode / tps * cores) for r, tps in zip(rounds, tok_s)]
    return round(float(np.median(busy)), 3)


def wait_for_bundle_nodes(remote, n: int, timeout_s: float = 60.0) -> None:
    """Until the backbone has heard ``n`` workers announce bundles (their next heartbeat)."""
    async def heard() -> None:
        deadline = time.monotonic() + timeout_s
        while remote.coverage.bundle_nodes < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {remote.coverage.bundle_nodes} of {n} workers announced bundles")
            await asyncio.sleep(0.02)

    remote.bus.run(heard())


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc; 10 ms resolution)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_call_us(fn, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return round(1e6 * (time.perf_counter() - t0) / n, 1)


def codec_costs(n_embd: int, rows: int = 1) -> dict:
    """Microseconds per call of each codec step of one remote call, in this process (the least
    of many timings): what the backbone and the worker run per request."""
    from kvasir_bus import codec

    x = np.random.default_rng(0).standard_normal((rows, n_embd)).astype(np.float32)
    requests, replies = codec.RequestEncoder("0" * 16), codec.ReplyEncoder("bench-0", "ggml-x86_64")
    payload = requests.encode(3, 17, "1a2b", x)
    reply_payload = replies.encode("1a2b", x)
    return {
        "rows": rows, "n_embd": n_embd,
        "backbone_encode_request_us": _min_us_per_call(lambda: requests.encode(3, 17, "1a2b", x)),
        "backbone_decode_reply_us": _min_us_per_call(lambda: codec.decode_reply(reply_payload, n_embd=n_embd)),
        "worker_decode_request_us": _min_us_per_call(lambda: codec.decode_request(payload, n_embd=n_embd)),
        "worker_encode_reply_us": _min_us_per_call(lambda: replies.encode("1a2b", x)),
    }


def _decode_rounds(engine: Engine, prompt: np.ndarray, n: int, rounds: int, remote=None, worker_pid=None):
    """``rounds`` sequences of ``n`` decoded tokens each: (tokens of every round, tokens/s, summed
    dispatch counters, and per round the CPU seconds of this process, of its bus loop thread
    (with ``remote``) and of the worker process)."""
    tokens, seconds, total, cpu, loop_cpu, worker_cpu = [], 0.0, None, [], [], []

    async def loop_thread_time() -> float:
        return time.thread_time()

    for _ in range(rounds):
        c0 = time.process_time()
        l0 = remote.bus.run(loop_thread_time()) if remote else 0.0
        w0 = _proc_cpu_s(worker_pid) if worker_pid else 0.0
        t, tps, d = decode(engine, prompt, n, remote)
        cpu.append(time.process_time() - c0)
        loop_cpu.append(remote.bus.run(loop_thread_time()) - l0 if remote else 0.0)
        worker_cpu.append(_proc_cpu_s(worker_pid) - w0 if worker_pid else 0.0)
        tokens.append(t)
        seconds += n / tps
        total = d if total is None else {k: total[k] + d[k] for k in d} if d else None
    return tokens, rounds * n / seconds, total, cpu, loop_cpu, worker_cpu


def _worker_kernel_s(url: str) -> float:
    """The kernel time the (one) worker counted, from its ``$SRV.STATS`` (wall clock around each
    expert call, as it computes them: between requests, with cold caches)."""
    import json as _json

    from kvasir_bus.connect import connect

    async def ask() -> float:
        nc = await connect(url, name="bench-stats")
        try:
            msg = await nc.request("$SRV.STATS.kvasir-worker", b"", timeout=5)
            return sum(ep["processing_time"] for ep in _json.loads(msg.data)["endpoints"]) / 1e9
        finally:
            await nc.close()

    return asyncio.run(ask())


def _min_us_per_call(fn, n: int = 20, repeat: int = 100) -> float:
    """The fastest of ``repeat`` timings of ``n`` calls: what the call costs when nothing else runs."""
    best = min(timeit.repeat(fn, number=n, repeat=repeat))
    return round(1e6 * best / n, 1)


async def _echo(url: str, subjects: int) -> None:
    """The floor's responder: answer every request with its own bytes, nothing else."""
    import nats

    nc = await nats.connect(url)

    async def cb(msg) -> None:
        await nc.publish(msg.reply, msg.data)

    for i in range(subjects):
        await nc.subscribe(f"floor.{i}", cb=cb)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


def bench_floor(steps: int = 2000, per_step: int = 2, size: int = 300) -> dict:
    """What nats.py itself costs per call on this machine now: a requester that publishes
    ``per_step`` requests and waits for all their replies (one wildcard inbox, as the backbone),
    an echo responder in another process (as a worker with no work at all). No codec, no model,
    no second thread: the floor under the dispatch's per-call figures."""
    import subprocess

    import nats

    async def requester(url: str) -> tuple[float, float]:
        nc = await nats.connect(url)
        inbox, loop = nc.new_inbox(), asyncio.get_running_loop()
        state = {"left": 0, "done": None}

        async def on_reply(msg) -> None:
            state["left"] -= 1
            if state["left"] == 0:
                state["done"].set_result(None)

        await nc.subscribe(inbox + ".*", cb=on_reply)
        payload = bytes(size)
        for n in (200, steps):  # warm, then measure
            c0, t0 = time.process_time(), time.perf_counter()
            for step in range(n):
                state["left"], state["done"] = per_step, loop.create_future()
                for k in range(per_step):
                    await nc.publish(f"floor.{(step + k) % 8}", payload, reply=f"{inbox}.{step}_{k}")
                await state["done"]
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        await nc.close()
        return cpu, wall

    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server:
        echo = subprocess.Popen([sys.executable, __file__, "--echo", server.url], stdout=subprocess.PIPE)
        try:
            echo.stdout.readline()
            w0 = _proc_cpu_s(echo.pid)
            cpu, wall = asyncio.run(requester(server.url))
            w_cpu = _proc_cpu_s(echo.pid) - w0  # the warm-up counts here: a slight overestimate
        finally:
            echo.kill()
            echo.wait()
    calls = steps * per_step
    return {"calls": calls, "per_step": per_step, "payload_bytes": size,
            "requester_cpu_us_per_call": round(1e6 * cpu / calls, 1),
            "responder_cpu_us_per_call": round(1e6 * w_cpu / (calls + 200 * per_step), 1),
            "calls_per_s": round(calls / wall)}


def bench_overhead(path: Path, n_decode: int, n_prompt: int, rounds: int, bundles: str = "both") -> dict:
    """Per-call CPU besides the kernel, on both sides. Every figure is the least over ``rounds``
    equal rounds (CPU time still grows when other processes share the cores; the quietest round
    is the closest to the cost itself), the median beside it."""
    from backbone.audit import AuditConfig
    from kernels.expert import expert_ffn
    from kernels.tensors import tensor_from_reader

    engine = Engine(path)
    cfg = engine.cfg
    n_decode = min(n_decode, cfg.n_ctx_train - n_prompt - 1)
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, n_prompt)
    decode(engine, prompt, 4)  # warm the graph caches
    mono_tokens, mono_tps, _, mono_cpu, _, _ = _decode_rounds(engine, prompt, n_decode, rounds)
    fp = model_fingerprint(engine.reader)
    gate, up, down = (tensor_from_reader(engine.reader, f"blk.0.ffn_{k}_exps.weight").expert(0)
                      for k in ("gate", "up", "down"))
    x1 = np.random.default_rng(1).standard_normal((1, cfg.n_embd)).astype(np.float32)
    kernel_us = _min_us_per_call(lambda: expert_ffn(gate, up, down, x1, routed=True))
    runs = {}
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server, tempfile.TemporaryDirectory() as logdir:
        log = open(os.path.join(logdir, "w.log"), "w")
        proc = spawn_worker(server.url, "bench-0", ["--model", str(path), "--layer", "all", "--experts", "all"],
                            log_file=log)
        try:
            asyncio.run(wait_for_nodes(server.url, fp, {proc.node}, procs=[proc], timeout=600))
            # Audits off first: the overhead of the bus alone; then the default audits, whose local
            # recomputes (every reply of a node's probation, then one in ten) count on the backbone.
            # With "both", the bus alone once more without bundles: one message per call, as before them.
            off, default, first = AuditConfig(rate=0.0), AuditConfig(), bundles != "off"
            plan = [("audits_off", off, first), ("audits_default", default, first)]
            if bundles == "both":
                plan.append(("audits_off_no_bundles", off, False))
            for name, audit, mode in plan:
                role = BackboneConfig(model_path=str(path), nats_url=server.url,
                                      dispatch=DispatchConfig(timeout_s=5.0, audit=audit, bundles=mode),
                                      market=False, serve_manifest=False)
                with BackboneService(engine, role) as backbone:
                    remote = backbone.dispatch
                    wait_for_bundle_nodes(remote, 1 if mode else 0)
                    decode(engine, prompt, 32, remote)  # warm the worker and the connection
                    k0 = _worker_kernel_s(server.url)
                    sh_tokens, sh_tps, d, sh_cpu, loop_cpu, w_cpu = _decode_rounds(engine, prompt, n_decode,
                                                                                   rounds, remote, proc.proc.pid)
                    in_worker_kernel_us = 1e6 * (_worker_kernel_s(server.url) - k0) / d["remote"]
                    audits = remote.stats.to_dict()["audits"]
                calls = d["remote"] / rounds  # per round
                backbone_us = [1e6 * (s - m) / calls for s, m in zip(sorted(sh_cpu), sorted(mono_cpu))]
                worker_us = sorted(1e6 * w / calls for w in w_cpu)
                runs[name] = {
                    "bundles": mode, "audit_rate": audit.rate, "audits": audits,
                    "messages_out_per_remote_call": round(_messages(d) / d["remote"], 3),
                    "remote_calls": d["remote"], "same_tokens": sh_tokens == mono_tokens,
                    "sharded_tok_s": round(sh_tps, 1),
                    "backbone_cpu_us_per_remote_call": round(backbone_us[0], 1),
                    "backbone_cpu_us_per_remote_call_median": round(float(np.median(backbone_us)), 1),
                    # Of which the bus loop thread (nats.py, decode, bookkeeping); the rest is the
                    # engine's thread (planning, encoding, waiting) less the local kernels it saves.
                    "backbone_loop_thread_cpu_us_per_remote_call": round(1e6 * min(loop_cpu) / calls, 1),
                    "worker_cpu_us_per_call": round(worker_us[0], 1),
                    "worker_cpu_us_per_call_outside_kernel": round(worker_us[0] - kernel_us, 1),
                    "worker_cpu_us_per_call_outside_kernel_median": round(float(np.median(worker_us)) - kernel_us, 1),
                    # The kernel as the worker times it in place (wall clock: preemption counts too).
                    "worker_kernel_us_per_call_in_place": round(in_worker_kernel_us, 1),
                    "worker_cpu_us_per_call_outside_kernel_in_place": round(worker_us[0] - in_worker_kernel_us, 1),
                }
        finally:
            proc.stop()
    return {
        "model": path.name, "hidden": cfg.n_embd, "expert_ffn": cfg.n_ff_exp,
        "decode_tokens": n_decode * rounds, "rounds": rounds,
        "monolithic_tok_s": round(mono_tps, 1),
        "trivial_kernel_us_per_call": kernel_us,
        **runs,
        "codec": codec_costs(cfg.n_embd),
        "nats_py_floor": bench_floor(),
        "raw_socket_floor": bench_raw_floor(steps=2000),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--overhead-decode", type=int, default=200,
                    help="--overhead: tokens per round (the tiny model's context holds 256)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--experts-122b", type=int, default=16,
                    help="experts per layer of the 122b-layer model (the real model has 256)")
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    ap.add_argument("--audit-rate", type=float, default=None, metavar="R",
                    help="the backbone's audit rate for the decode runs (default: the backbone's own "
                    "default, as users run it; 0 measures the bus without the audits' recomputes)")
    ap.add_argument("--issue-model-workers", type=int, default=4, metavar="N",
                    help="also the 2-layer 122b-layer model (top-8 of 32 experts per layer, issue 10's "
                    "configuration) on N worker processes (default 4; 0 leaves it out)")
    ap.add_argument("--rounds-ratio", type=int, default=3,
                    help="monolithic and sharded decodes, alternated this many times per model")
    ap.add_argument("--rounds", type=int, default=10, help="--overhead: sequences of --overhead-decode tokens each")
    ap.add_argument("--overhead", action="store_true",
                    help="only the per-call overhead, with a trivial expert (tiny model, one worker)")
    ap.add_argument("--overhead-top-k", type=int, nargs="+", default=[2, 8], metavar="K",
                    help="--overhead: the experts each token selects per layer, one measurement each "
                    "(default 2 8: the tiny preset's routing, and the 122B's, whose layer step bundles 8 calls)")
    ap.add_argument("--bundles", choices=("on", "off", "both"), default="both",
                    help="sharded with bundles (one message per worker per layer step), without (one per "
                    "expert), or both in the same run (default both)")
    ap.add_argument("--echo", metavar="URL", help=argparse.SUPPRESS)  # the floor's responder process
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.audit_rate is not None and not 0.0 <= args.audit_rate <= 1.0:
        ap.error(f"--audit-rate must be between 0 and 1, got {args.audit_rate}")
    if not all(1 <= k <= 64 for k in args.overhead_top_k):
        ap.error(f"--overhead-top-k: each K must be in 1..64, got {args.overhead_top_k}")
    if args.issue_model_workers < 0:
        ap.error(f"--issue-model-workers must be >= 0, got {args.issue_model_workers}")
    if args.echo:
        asyncio.run(_echo(args.echo, 8))
        return
    from kvasir_bus.logs import configure

    configure("warning")  # logs on stderr; stdout is the JSON
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    if args.overhead:
        results = {}
        for k in args.overhead_top_k:
            # top-2 is the tiny preset itself; a wider routing keeps its trivial experts, four
            # times as many as it selects (the 122B selects 8 of 256)
            name = "tiny-qwen3moe-f32.gguf" if k == 2 else f"tiny-qwen3moe-f32-top{k}.gguf"
            tiny = models / name
            if not tiny.exists():
                extra = {} if k == 2 else {"experts": 4 * k, "experts_used": k}
                synth_model(tiny, arch="qwen3moe", preset="tiny", qtype="f32", seed=0, **extra)
            results[f"top-{k}"] = bench_overhead(tiny, args.overhead_decode, args.prompt_tokens, args.rounds,
                                                 args.bundles)
        out = {"bench": "dispatch-overhead", "transport": "loopback NATS (embedded nats-server)",
               "kernel_mode": os.environ.get("KVASIR_KERNEL_MODE", "fast"), "results": results}
        print(json.dumps(out, indent=2))
        record.save(args, "dispatch_overhead", out)
        return
    small = models / "small-qwen3moe-q4_k.gguf"
    if not small.exists():
        synth_model(small, arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
    big = models / f"122b-layer-qwen2moe-q4_k-{args.experts_122b}x.gguf"
    if not big.exists():
        synth_model(big, arch="qwen2moe", preset="122b-layer", qtype="q4_k", seed=0, experts=args.experts_122b)
    results = [
        bench_model(small, args.workers, args.decode, args.prompt_tokens, args.rounds_ratio, args.bundles, args.audit_rate),
        bench_model(big, args.workers, args.decode, args.prompt_tokens, args.rounds_ratio, args.bundles, args.audit_rate),
    ]
    if args.issue_model_workers:
        # issue 10's own configuration: the 122B's expert shapes, top-8 of 32 experts in each of
        # 2 layers (the file bench/engine.py compares with llama.cpp), on 4 worker processes
        two = models / "122b-layer-qwen3moe-q4_k-2x32.gguf"
        if not two.exists():
            synth_model(two, arch="qwen3moe", preset="122b-layer", qtype="q4_k", seed=0, layers=2, experts=32)
        results.append(bench_model(two, args.issue_model_workers, args.decode, args.prompt_tokens,
                                   args.rounds_ratio, args.bundles, args.audit_rate))
    out = {"bench": "dispatch", "transport": "loopback NATS (embedded nats-server)", "results": results}
    print(json.dumps(out, indent=2))
    record.save(args, "dispatch", out)


if __name__ == "__main__":
    main()
