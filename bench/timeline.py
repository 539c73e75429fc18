"""Where a sharded decode token's time goes: a timeline of the 122b-layer model's layer step
(or, with ``--model small``, of the first of the small model's 8 layer steps; with ``--model
issue``, of the first of the 2 layer steps of issue 10's configuration: the 122B's expert
shapes, top-8 of 32 experts a layer, on 4 worker processes).

    python bench/timeline.py [--models DIR] [--model 122b-layer|small|issue] [--decode 60] [--workers N] [--experts-122b 16]

Stamps (``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process) are taken around
the backbone's steps (the step graph up to the router, the plan, the hand-over to the bus
thread, the publish, the shared expert and the audits computed while replies travel, each
reply's arrival, the engine's wake, the combine graph and head) in this process, and in each
worker process (message delivered, kernel start and end, reply published) by
``bench/timeline_hook/sitecustomize.py``. Nothing in the project carries a stamp: the functions
are wrapped from here, and a worker loads the hook only from this script's PYTHONPATH.

Prints JSON: per stage, milliseconds per token (median, 25th percentile, least) and where it
runs. The stages A..O follow one token's critical path through the worker whose reply came
last; the lines marked "beside" run alongside it, among them every worker's kernel time of the
step added up (with more workers than cores, set it against the cores and the step's F..J).
Stamps cost a few µs each; a monolithic decode of the same prompt is timed beside it, unstamped.
A "published" stamp is taken once its write has returned: when the process it wakes preempts the
writer first, the hop after it comes out short, now and then below 0 (the least of "J" on 2 cores).
The prompt's step is stamped but left out (``timeline``'s ``skip``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import glob
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)
import numpy as np  # noqa: E402

import backbone.model as model  # noqa: E402
from backbone.dispatch import DispatchConfig, RemoteExperts  # noqa: E402
from backbone.service import BackboneConfig, BackboneService  # noqa: E402
from dispatch import decode, wait_for_bundle_nodes  # noqa: E402  (bench/ is on the path as a script)
from kernels import fused  # noqa: E402
from kvasir_bus.direct import DirectConnection  # noqa: E402
from kvasir_bus.fingerprint import model_fingerprint  # noqa: E402
from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats  # noqa: E402
from launch.swarm import spawn_worker, split_experts, wait_for_nodes  # noqa: E402
from synth.model import synth_model  # noqa: E402

HOOK = Path(__file__).resolve().parent / "timeline_hook"
_on = False
_events: list[tuple[int, int, int, str]] = []


def _stamp(event: str) -> None:
    if _on:
        _events.append((time.perf_counter_ns(), os.getpid(), threading.get_native_id(), event))


def _wrap(owner, name: str, tag: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def stamped(*a, **kw):
        _stamp(tag + "0")
        try:
            return fn(*a, **kw)
        finally:
            _stamp(tag + "1")

    setattr(owner, name, stamped)


def _wrap_backbone() -> None:
    _wrap(fused, "step_graph", "graph")
    _wrap(RemoteExperts, "_plan", "plan")
    _wrap(RemoteExperts, "_send", "send")
    _wrap(RemoteExperts, "_audit_ahead", "audit")
    _wrap(RemoteExperts, "_book_wins", "wake")
    _wrap(RemoteExperts, "run_layer", "layer")
    _wrap(RemoteExperts, "_on_bundle_reply", "reply")  # a reply on the bus thread's connection
    _wrap(RemoteExperts, "_take_direct", "reply")  # one on the engine thread's own (the usual path)
    _wrap(model.Engine, "_shared_remote", "shared")
    publish = RemoteExperts._publish_step

    async def publish_step(self, step):
        await publish(self, step)
        _stamp("published")

    RemoteExperts._publish_step = publish_step
    send = DirectConnection.send

    def direct_send(self, data):  # the engine thread's own connection writes a step itself
        _stamp("send0")
        send(self, data)
        _stamp("published")

    DirectConnection.send = direct_send


# stage: (from, to, where); an event is (process, name, first or last), process "b" the
# backbone, "w" the worker whose reply came last
STAGES = {
    "A graph up to the router": (("b", "graph0", 0), ("b", "graph1", 0), "backbone engine thread"),
    "B to the plan": (("b", "graph1", 0), ("b", "plan0", 0), "backbone engine thread"),
    "C plan and encode": (("b", "plan0", 0), ("b", "plan1", 0), "backbone engine thread"),
    "D to the send": (("b", "plan1", 0), ("b", "send0", 0), "engine thread (its own connection), or -> bus thread"),
    "E publish": (("b", "send0", 0), ("b", "published", 0), "the same thread"),
    "F hop to the last worker": (("b", "published", 0), ("w", "w_msg", 0), "nats-server, worker loop"),
    "G message to kernel": (("w", "w_msg", 0), ("w", "w_k0", 0), "worker loop"),
    "H kernels": (("w", "w_k0", 0), ("w", "w_k1", -1), "worker loop (ggml)"),
    "I kernel to reply published": (("w", "w_k1", -1), ("w", "w_sent", -1), "worker loop"),
    "J hop back": (("w", "w_sent", -1), ("b", "reply0", -1), "nats-server, backbone engine thread (or bus thread)"),
    "K last reply taken, to the books": (("b", "reply0", -1), ("b", "wake0", 0), "engine thread (or bus -> engine)"),
    "L accept (audits compared)": (("b", "wake0", 0), ("b", "layer1", 0), "backbone engine thread"),
    "M to the combine graph": (("b", "layer1", 0), ("b", "graph0", 1), "backbone engine thread"),
    "N combine and head": (("b", "graph0", 1), ("b", "graph1", 1), "backbone engine thread"),
    "beside: shared expert": (("b", "shared0", 0), ("b", "shared1", 0), "backbone engine thread"),
    "beside: audits ahead": (("b", "audit0", 0), ("b", "audit1", 0), "backbone engine thread"),
    "beside: the other workers' kernels": (("o", "w_k0", 0), ("o", "w_k1", -1), "worker loop (ggml)"),
}


SUMMED = "beside: every worker's kernels, summed"


def timeline(events: list[tuple[int, int, int, str]], backbone: int, graphs_per_token: int = 2,
             skip: int = 1) -> dict:
    """Per token (from its first step graph's start to the next token's), each stage's
    milliseconds. Meant for a one-layer model (two graphs a token: the layer up to its router,
    then the combine and head); with more layers every stage is the first layer's (its
    events up to the end of its ``run_layer``), and "N" is its combine with the next layer's
    graph up to the router. ``skip``: steps left out at the start: the stamped decode begins
    with its prompt's step, whose multi-row bundles the first workers get while the send of
    the others still runs (its "hop" would come out negative), and is no decode token."""
    starts = [i for i, e in enumerate(events) if e[1] == backbone and e[3] == "graph0"][::graphs_per_token][skip:]
    per_stage: dict[str, list[float]] = {name: [] for name in STAGES}
    per_stage[SUMMED] = []
    per_stage["token"] = []
    for a, b in zip(starts, starts[1:]):
        token = events[a:b]
        at: dict[tuple[int, str], list[int]] = {}
        for ns, pid, _, name in token:
            at.setdefault((pid, name), []).append(ns)
        if (backbone, "layer1") not in at:
            continue
        cut = at[(backbone, "layer1")][0]  # the first layer step's end: its events come before
        first = {key: [t for t in ts if t <= cut] for key, ts in at.items()}
        first = {key: ts for key, ts in first.items() if ts}
        workers = [p for p in {e[1] for e in token}
                   if p != backbone and (p, "w_sent") in first and (p, "w_k0") in first]
        if not workers or (backbone, "reply0") not in first:
            continue
        last = max(workers, key=lambda p: first[(p, "w_sent")][-1])
        others = [p for p in workers if p != last]
        per_stage["token"].append((events[b][0] - events[a][0]) / 1e6)
        per_stage[SUMMED].append(sum(t1 - t0 for p in workers
                                     for t0, t1 in zip(first[(p, "w_k0")], first.get((p, "w_k1"), ()))) / 1e6)
        for name, ((p0, e0, i0), (p1, e1, i1), _) in STAGES.items():
            pid = {"b": backbone, "w": last, "o": others[0] if others else None}
            t0 = (at if e0.startswith("graph") else first).get((pid[p0], e0))
            t1 = (at if e1.startswith("graph") else first).get((pid[p1], e1))
            if t0 and t1 and (len(t0) <= i0 or len(t1) <= i1):
                continue
            if t0 and t1:
                per_stage[name].append((t1[i1] - t0[i0]) / 1e6)
    where = {name: stage[2] for name, stage in STAGES.items()}
    where[SUMMED] = "every worker (on a shared machine: against the cores, with F..J)"
    return {name: {"median_ms": round(statistics.median(v), 3), "p25_ms": round(sorted(v)[len(v) // 4], 3),
                   "min_ms": round(min(v), 3), "tokens": len(v), "where": where.get(name, "one decode step")}
            for name, v in per_stage.items() if v}


def run(path: Path, workers: int, n_decode: int) -> dict:
    global _on
    engine = model.Engine(path)
    cfg = engine.cfg
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, 16)
    decode(engine, prompt, 2)
    _, mono_tps, _ = decode(engine, prompt, n_decode)
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server, tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "w")
        env = {"KVASIR_TIMELINE": prefix, "PYTHONPATH": os.pathsep.join([str(HOOK), str(HOOK.parents[1])])}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # spawn_worker passes this process's environment on
        try:
            procs = [spawn_worker(server.url, f"timeline-{i}", ["--model", str(path), "--layer", "all",
                                                                 "--experts", f"{lo}-{hi}"])
                     for i, (lo, hi) in enumerate(split_experts(cfg.n_expert, workers))]
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        try:
            asyncio.run(wait_for_nodes(server.url, model_fingerprint(engine.reader), {p.node for p in procs},
                                       procs=procs, timeout=600))
            role = BackboneConfig(model_path=str(path), nats_url=server.url, dispatch=DispatchConfig(timeout_s=5.0),
                                  market=False, serve_manifest=False)
            with BackboneService(engine, role) as backbone:
                remote = backbone.dispatch
                wait_for_bundle_nodes(remote, len(procs))
                engine.use_experts(remote)
                decode(engine, prompt, 8, remote)  # past the probation's audits of every reply
                _wrap_backbone()
                _on = True
                t0 = time.perf_counter_ns()
                _, sharded_tps, _ = decode(engine, prompt, n_decode, remote)
                t1 = time.perf_counter_ns()
                _on = False
        finally:
            for p in procs:
                p.stop()
        events = list(_events)
        for name in glob.glob(prefix + ".*"):
            for line in open(name):
                ns, pid, tid, event = line.split()
                if t0 <= int(ns) <= t1:
                    events.append((int(ns), int(pid), int(tid), event))
    events.sort()
    return {"model": path.name, "workers": workers, "decode_tokens": n_decode,
            "monolithic_tok_s": round(mono_tps, 1), "sharded_tok_s_stamped": round(sharded_tps, 1),
            "stages": timeline(events, os.getpid(), cfg.n_layer + 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("KVASIR_BENCH_MODELS", "models"))
    ap.add_argument("--decode", type=int, default=60)
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default 2; 4 with --model issue)")
    ap.add_argument("--experts-122b", type=int, default=16)
    ap.add_argument("--model", choices=("122b-layer", "small", "issue"), default="122b-layer",
                    help="the model whose decode is stamped (small, issue: its first layer step's stages)")
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.workers is None:
        args.workers = 4 if args.model == "issue" else 2
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    from kvasir_bus.logs import configure

    configure("warning")
    models = Path(args.models)
    models.mkdir(parents=True, exist_ok=True)
    if args.model == "small":
        big = models / "small-qwen3moe-q4_k.gguf"
        if not big.exists():
            synth_model(big, arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
    elif args.model == "issue":  # the file bench/engine.py and bench/dispatch.py use for it
        big = models / "122b-layer-qwen3moe-q4_k-2x32.gguf"
        if not big.exists():
            synth_model(big, arch="qwen3moe", preset="122b-layer", qtype="q4_k", seed=0, layers=2, experts=32)
    else:
        big = models / f"122b-layer-qwen2moe-q4_k-{args.experts_122b}x.gguf"
        if not big.exists():
            synth_model(big, arch="qwen2moe", preset="122b-layer", qtype="q4_k", seed=0, experts=args.experts_122b)
    out = {"bench": "timeline", "model": args.model, "result": run(big, args.workers, args.decode)}
    print(json.dumps(out, indent=2))
    record.save(args, "timeline", out)


if __name__ == "__main__":
    main()
