"""``kvasir up``: the whole swarm on this machine with one command.

Starts an embedded nats-server (unless ``--nats`` names one), N worker processes that split
every layer's experts between them, and the backbone. With ``--prompt`` it generates, reports
which worker computed how many expert calls, optionally checks the result against the
monolithic run (``--check``), and stops everything; without it, it keeps the swarm up until
Ctrl-C so that ``kvasir generate --nats URL`` can use it from another terminal.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import structlog

from backbone.dispatch import BusExperts, DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.swarm import WorkerProcess, spawn_worker, split_experts, wait_for_nodes
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.fingerprint import model_fingerprint

log = structlog.get_logger("kvasir.up")


def register(sub) -> None:
    p = sub.add_parser(
        "up", help="run the whole swarm here: NATS, N expert workers and the backbone",
        description="Start an embedded nats-server (unless --nats is given), N worker processes "
        "that split every layer's experts between them, and the backbone. With --prompt, generate "
        "and exit; otherwise keep the swarm up until Ctrl-C.")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF model")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="worker processes (default 2)")
    p.add_argument("--nats", metavar="URL", default=None,
                   help="use this NATS server instead of starting one (default: embedded, or $NATS_URL)")
    p.add_argument("--prompt", metavar="TEXT", default=None, help="generate from this prompt, then exit")
    p.add_argument("-n", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--check", action="store_true",
                   help="also run the model monolithically and compare tokens and logits bit for bit")
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS",
                   help="per-expert reply timeout (default: adaptive)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_up)


def cmd_up(args) -> int:
    import os

    from backbone.sampling import Sampler, SamplerConfig
    from backbone.tokenizer import Tokenizer
    from kvasir_bus.logs import configure
    from kvasir_bus.server import EmbeddedNats

    configure("warning" if args.json else "info")
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    engine = Engine(args.model)
    fp = model_fingerprint(engine.reader)
    ranges = split_experts(engine.cfg.n_expert, args.workers)
    tok = Tokenizer(args.model) if args.prompt is not None else None
    prompt = tok.encode(args.prompt) if tok else []
    if args.prompt is not None and len(prompt) + args.n > engine.n_ctx:
        raise UsageError(f"the prompt is {len(prompt)} tokens; with -n {args.n} that exceeds the context "
                         f"of {engine.n_ctx}")
    out = sys.stderr if args.json else sys.stdout

    with ExitStack() as stack:
        url = args.nats or os.environ.get("NATS_URL")
        if not url:
            server = stack.enter_context(EmbeddedNats())
            url = server.url
        logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvasir-up-")))
        workers: list[WorkerProcess] = []
        stack.callback(lambda: [w.stop() for w in workers])
        t0 = time.perf_counter()
        for i, (lo, hi) in enumerate(ranges):
            logf = stack.enter_context(open(logdir / f"worker-{i}.log", "w"))
            workers.append(spawn_worker(url, f"worker-{i}", ["--model", args.model, "--layer", "all",
                                                            "--experts", f"{lo}-{hi}"], log_file=logf))
        try:
            asyncio.run(wait_for_nodes(url, fp, {w.node for w in workers}, procs=workers, timeout=300))
        except KvasirError as exc:
            raise KvasirError(f"{exc}; worker logs: {_tails(workers)}") from None
        print(f"swarm up: {url}, model {fp} ({engine.cfg.arch}, {engine.cfg.n_layer} layers x "
              f"{engine.cfg.n_expert} experts), {len(workers)} workers in {time.perf_counter() - t0:.1f} s: "
              + ", ".join(f"{w.node} experts {lo}-{hi}" for w, (lo, hi) in zip(workers, ranges)), file=out)

        if args.prompt is None:
            print(f"serving until Ctrl-C; try: kvasir generate --nats {url} --model {args.model} "
                  f"--prompt 'Hello' -n 16", file=out, flush=True)
            _wait_for_interrupt(workers)
            print("stopping the swarm", file=out)
            return 0

        cfg = DispatchConfig(timeout_s=args.timeout_ms / 1000 if args.timeout_ms else None)
        with BusExperts(engine, url, cfg) as remote:
            gen = generate(engine, prompt, args.n, Sampler(SamplerConfig()), stop_on_eos=True,
                           keep_logits=args.check)
            stats = remote.stats.to_dict()
        result = {"nats": url, "model": fp, "text": tok.decode(gen.tokens), "tokens": gen.tokens,
                  "workers": {w.node: {"experts": f"{lo}-{hi}", **stats["per_node"].get(w.node, {"calls": 0, "rows": 0})}
                              for w, (lo, hi) in zip(workers, ranges)},
                  "dispatch": stats["totals"],
                  "decode_tokens_per_s": round((len(gen.tokens) - 1) / gen.decode_s, 2)
                  if len(gen.tokens) > 1 and gen.decode_s else None}
        if args.check:
            mono_engine = Engine(args.model)
            mono = generate(mono_engine, prompt, args.n, Sampler(SamplerConfig()), stop_on_eos=True, keep_logits=True)
            a, b = gen.logits_array(), mono.logits_array()
            same_shape = a.shape == b.shape
            result["check"] = {
                "tokens_equal": gen.tokens == mono.tokens,
                "positions": int(a.shape[0]),
                "max_abs_diff": float(np.abs(a - b).max()) if same_shape else None,
                "bit_identical": bool(same_shape and np.array_equal(a, b)),
            }
    if args.json:
        print(json.dumps(result))
    else:
        _print_report(result, len(prompt))
    if args.check and not result["check"]["bit_identical"]:
        print("kvasir up: error: the sharded run differs from the monolithic run", file=sys.stderr)
        return 1
    return 0


def _print_report(result: dict, n_prompt: int) -> None:
    t = result["dispatch"]
    print(f"\n{result['text']}\n")
    print(f"expert calls ({n_prompt} prompt tokens, {len(result['tokens'])} generated, "
          f"{result['decode_tokens_per_s']} tokens/s):")
    for node, w in result["workers"].items():
        print(f"  {node:<10} experts {w['experts']:<8} {w['calls']:>6} calls {w['rows']:>8} rows")
    print(f"  {'backbone':<10} {'fallback':<16} {t['local']:>6} calls {t['rows_local']:>8} rows "
          f"(no responders {t['no_responders']}, timeouts {t['timeouts']}, invalid {t['invalid']})")
    if "check" in result:
        c = result["check"]
        verdict = "bit-identical" if c["bit_identical"] else "DIFFERENT"
        print(f"check against the monolithic run: tokens {'equal' if c['tokens_equal'] else 'DIFFER'}; "
              f"logits of {c['positions']} positions max |diff| = {c['max_abs_diff']:g} ({verdict})")


def _tails(workers: list[WorkerProcess]) -> str:
    parts = []
    for w in workers:
        if w.log_path:
            lines = Path(w.log_path).read_text(errors="replace").strip().splitlines()
            if lines:
                parts.append(f"{w.node}: {lines[-1][:300]}")
    return "; ".join(parts) or "(empty)"


def _wait_for_interrupt(workers: list[WorkerProcess]) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        dead = [w.node for w in workers if not w.alive()]
        if dead:
            log.warning("worker_exited", nodes=dead)
            workers[:] = [w for w in workers if w.alive()]
