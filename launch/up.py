"""``kvasir up``: the whole swarm on this machine with one command; ``kvasir serve``: the
backbone alone, as a long-running service on an existing bus.

``up`` starts an embedded nats-server (unless ``--nats`` names one), the coverage market, the
backbone (answering manifest requests, optionally serving its weights) and N worker processes
that split every layer's experts between them. With ``--prompt`` it generates, reports which
worker computed how many expert calls and what the ledger paid them, optionally checks the
result against the monolithic run (``--check``), and stops everything; without it, it keeps the
swarm up until Ctrl-C so that volunteers and ``kvasir generate --nats URL`` can join.
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
from dataclasses import replace
from pathlib import Path

import numpy as np
import structlog

from backbone.cli import (add_audit_flags, add_http_flags, add_replica_flags, add_spool_flag, cmd_serve_http,
                          http_config, run_http)
from backbone.service import BackboneConfig, BackboneService
from backbone.generate import generate
from backbone.model import Engine
from launch.supervise import Supervisor
from launch.swarm import WorkerProcess, spawn_worker, split_experts, wait_for_nodes
from kernels.backend import apply_kernel_flags
from kvasir_bus.connect import ConnectOptions, add_connection_flags
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.progress import LogProgress

log = structlog.get_logger("kvasir.up")


def register(sub) -> None:
    p = sub.add_parser(
        "up", help="run the whole swarm here: NATS, the market, N expert workers and the backbone",
        description="Start an embedded nats-server (unless --nats is given), the coverage market, "
        "the backbone, and N worker processes that split every layer's experts between them "
        "(--workers 0: none; volunteers can join). With --prompt, generate, report who computed "
        "what and what the ledger paid, and exit; otherwise keep the swarm up until Ctrl-C.",
        epilog="example (make demo): kvasir up --model models/small-qwen3moe-q4_k.gguf --workers 4 "
        "--prompt 'Once upon a time' -n 24 --check")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF model")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="worker processes splitting the experts (default 2; 0: none, only volunteers)")
    p.add_argument("--nats", metavar="URL", default=None,
                   help="use this NATS server instead of starting one (default: embedded, or $NATS_URL; "
                   "the embedded one runs on one Go thread, GOMAXPROCS=1, unless GOMAXPROCS is set: it "
                   "shares this machine's cores with the backbone and the workers)")
    add_connection_flags(p)
    p.add_argument("--secure", nargs="?", const="", default=None, metavar="DIR",
                   help="embedded server only: one identity per node (kvasir creds init: an operator, an "
                   "account, a user JWT per role and worker) in DIR (default: a temporary one), anonymous "
                   "connections refused, each role only its own rights")
    p.add_argument("--prompt", metavar="TEXT", default=None, help="generate from this prompt, then exit")
    p.add_argument("-n", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--check", action="store_true",
                   help="also run the model monolithically and compare tokens and logits bit for bit")
    add_audit_flags(p)
    add_replica_flags(p)
    add_spool_flag(p)
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS",
                   help="per-expert reply timeout (default: adaptive)")
    p.add_argument("--no-market", action="store_true", help="do not start the coverage market")
    p.add_argument("--db", metavar="FILE", default=None,
                   help="the market's ledger file (default: a temporary one, gone at exit)")
    add_weights_flags(p)
    add_http_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--logs", metavar="DIR", default=None,
                   help="keep the market's and each worker's log here (default: a temporary "
                   "directory, removed at exit)")
    p.add_argument("--restart-backoff", type=float, default=1.0, metavar="S",
                   help="a worker or the market that dies is started again after S seconds, doubled "
                   "at each restart up to 30 s (default 1; 0: never restart)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "serve", help="run the backbone as a service on a bus: manifest, weights, dispatch",
        description="Run the backbone on an existing NATS bus until Ctrl-C: answer manifest "
        "requests for the model (the market and volunteers need them) and, with --serve-weights, "
        "serve the GGUF over HTTP with Range support so volunteers can download their experts.",
        epilog="example: kvasir serve --model m.gguf --http 127.0.0.1:8000 --nats nats://host:4222   "
        "(without --nats every expert is local)")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF model")
    p.add_argument("--nats", metavar="URL", default=None,
                   help="NATS server URL (default: $NATS_URL, else nats://127.0.0.1:4222)")
    add_connection_flags(p)
    add_http_flags(p)  # the flags most runs of serve give come first in --help
    add_weights_flags(p)
    add_audit_flags(p)
    add_replica_flags(p)
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS",
                   help="per-expert reply timeout (default: adaptive)")
    add_spool_flag(p)
    p.set_defaults(func=cmd_serve)


def add_weights_flags(p) -> None:
    p.add_argument("--serve-weights", metavar="[HOST:]PORT", default=None,
                   help="serve the model file over HTTP with Range support (port 0: any free port)")
    p.add_argument("--token", action="append", default=[], metavar="TOKEN",
                   help="node token required for weight downloads (repeatable; default "
                   "$KVASIR_NODE_TOKEN if set; none: downloads are open)")
    p.add_argument("--advertise-host", metavar="HOST", default=None,
                   help="host name volunteers should use in the weights URL (default: the bound host)")


def cmd_serve(args) -> int:
    from kvasir_bus.logs import configure

    if args.http is not None:  # the OpenAI-compatible server, every expert local
        return cmd_serve_http(args)

    configure("info")
    cfg = BackboneConfig.from_args(args)
    apply_kernel_flags(args, share=True)
    engine = Engine(cfg.model_path)
    # Until serving, SIGTERM/SIGINT abandon the start (connecting to an unreachable bus, say)
    # and exit 0; once serving, _wait_for_interrupt turns them into a drained stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stopped)
    try:
        log.info("backbone_connecting", nats=cfg.nats_url)
        with BackboneService(engine, cfg) as backbone:
            print(f"backbone serving model {backbone.model} ({engine.cfg.arch}, {engine.cfg.n_layer} layers x "
                  f"{engine.cfg.n_expert} experts)" + (f"; weights at {backbone.weights_url}" if backbone.weights_url else ""),
                  flush=True)
            _wait_for_interrupt([])
    except _Stopped:
        pass
    return 0


class _Stopped(Exception):
    """Raised by the signal handler while ``kvasir serve`` is starting."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def cmd_up(args) -> int:
    import os

    from backbone.sampling import Sampler, SamplerConfig
    from backbone.tokenizer import Tokenizer
    from kvasir_bus.logs import configure
    from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats

    # With a prompt the report is the output; while serving, the logs are. Not on a terminal
    # (CI, a pipe, a log file) the start-up says how far it got, as info lines, either way.
    quiet = args.json or args.prompt is not None
    configure("warning" if quiet and sys.stderr.isatty() else "info")
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    if not 0 <= args.restart_backoff <= 30:
        raise UsageError(f"--restart-backoff must be between 0 and 30 seconds, got {args.restart_backoff:g}")
    if args.db is not None and not args.no_market:
        from market.cli import check_db_dir

        check_db_dir(args.db)  # the market it spawns would refuse it, out of sight in its log
    cfg = BackboneConfig.from_args(args, nats_url=None, market=not args.no_market, market_interval_s=0.5)
    http = None
    if args.http is not None:  # the swarm behind an OpenAI-compatible server and the bus API
        if args.prompt is not None:
            raise UsageError("--http serves until Ctrl-C; leave out --prompt")
        http = http_config(args)
    # The workers started here inherit the mode and share the cores with the backbone.
    apply_kernel_flags(args, local_processes=args.workers + 1, share=True)
    engine = Engine(cfg.model_path, n_ctx=cfg.n_ctx)
    fp = model_fingerprint(engine.reader)
    ranges = split_experts(engine.cfg.n_expert, args.workers) if args.workers else []
    tok = Tokenizer(args.model) if args.prompt is not None else None
    prompt = tok.encode(args.prompt) if tok else []
    if args.prompt is not None and len(prompt) + args.n > engine.n_ctx:
        raise UsageError(f"the prompt is {len(prompt)} tokens; with -n {args.n} that exceeds the context "
                         f"of {engine.n_ctx}")
    out = sys.stderr if args.json else sys.stdout

    with ExitStack() as stack:
        url = args.nats or os.environ.get("NATS_URL")
        if args.logs is not None:
            logdir = Path(args.logs)
            try:
                logdir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--logs {args.logs}: {exc.strerror or exc}") from None
        else:
            logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvasir-up-")))
        creds = None  # role -> credentials file, with --secure
        if args.secure is not None:
            if url:
                raise UsageError("--secure starts its own server: leave out --nats and $NATS_URL "
                                 "(for a server of your own, give each command --creds)")
            creds = _secure_deployment(Path(args.secure or logdir / "creds"), len(ranges))
            if not cfg.dispatch.reply_secret:  # every worker's creds file holds its reply key: check them
                from kvasir_bus import creds as creds_mod

                secret = creds_mod.reply_secret(Path(args.secure or logdir / "creds"))
                cfg = replace(cfg, dispatch=replace(cfg.dispatch, reply_secret=secret))
            # the generated nats.conf runs JetStream for the ledger stream itself
            server = stack.enter_context(EmbeddedNats(config=creds["nats.conf"], port=None, host=None,
                                                          procs=SHARED_MACHINE_PROCS))
            url = server.url
            ConnectOptions(creds=creds["backbone"]).install()  # this process is the backbone
        elif not url:
            server = stack.enter_context(EmbeddedNats(procs=SHARED_MACHINE_PROCS))
            url = server.url
        cfg = replace(cfg, nats_url=url)
        workers: list[WorkerProcess] = []
        stack.callback(lambda: [w.stop() for w in workers])
        t0 = time.perf_counter()
        market = None
        if not args.no_market:
            from kvasir_bus.signing import Signer

            # The market counts ledger, routing and quarantine records only when this backbone signed
            # them: its key is the --sign-key given, or the backbone identity's (--secure), or a fresh one.
            signer = Signer.load(cfg.sign_key or (creds["backbone"] if creds else None))
            if cfg.sign_key is None and not os.environ.get("KVASIR_BACKBONE_SEED"):
                keydir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvasir-key-")))
                cfg = replace(cfg, sign_key=str(signer.write(keydir / "backbone-sign.nk")))
            db = args.db or str(logdir / "market.db")
            logf = stack.enter_context(open(logdir / "market.log", "w"))
            market_args = [*(["--creds", creds["market"]] if creds else []), "--trust-backbone", signer.public_key]
            market = _spawn_market(url, fp, db, logf, market_args)
            stack.callback(lambda: market.stop())  # the one running now (the supervisor may restart it)
        backbone = stack.enter_context(BackboneService(engine, cfg))
        def start_worker(i: int, lo: int, hi: int, mode: str = "w") -> WorkerProcess:
            logf = stack.enter_context(open(logdir / f"worker-{i}.log", mode))
            return spawn_worker(url, f"worker-{i}", ["--model", args.model, "--layer", "all",
                                                     "--experts", f"{lo}-{hi}"], log_file=logf,
                                extra=["--replicas", cfg.replicas.mode,
                                       "--fast-paths", getattr(args, "fast_paths", "on"),
                                       *(["--creds", creds[f"worker-{i}"]] if creds else [])])

        for i, (lo, hi) in enumerate(ranges):
            workers.append(start_worker(i, lo, hi))
        # Workers load their experts before their first heartbeat: on a big model that is
        # minutes, so a log file hears how many are ready every 10 s (a terminal waits quietly).
        ready = None if sys.stderr.isatty() else LogProgress("up_workers_ready", unit="workers", model=fp)
        log.info("up_starting", nats=url, model=fp, workers=len(workers), market=market is not None,
                 logs=str(logdir))
        try:
            if workers:
                asyncio.run(wait_for_nodes(url, fp, {w.node for w in workers}, procs=workers, timeout=300,
                                           progress=ready))
        except KvasirError as exc:
            raise KvasirError(f"{exc}; worker logs: {_tails(workers)}") from None
        # From here on a worker or the market that dies is restarted with back-off (its experts run
        # on the backbone meanwhile); the supervisor stops first at exit, then every child.
        supervisor = Supervisor(backoff_s=max(args.restart_backoff, 0.001))
        for i, ((lo, hi), w) in enumerate(zip(ranges, workers)):
            supervisor.add(w.node, lambda i=i, lo=lo, hi=hi: start_worker(i, lo, hi, "a"), child=w,
                           on_start=lambda child, i=i: workers.__setitem__(i, child))
        if market is not None:
            def start_market() -> _MarketProcess:
                return _spawn_market(url, fp, db, stack.enter_context(open(logdir / "market.log", "a")),
                                     market_args)

            def market_started(child: _MarketProcess) -> None:
                nonlocal market
                market = child

            supervisor.add("market", start_market, child=market, on_start=market_started)
        if args.restart_backoff > 0:
            supervisor.start()
        stack.callback(supervisor.stop)
        print(f"swarm up: {url}, model {fp} ({engine.cfg.arch}, {engine.cfg.n_layer} layers x "
              f"{engine.cfg.n_expert} experts), {len(workers)} workers in {time.perf_counter() - t0:.1f} s: "
              + ", ".join(f"{w.node} experts {lo}-{hi}" for w, (lo, hi) in zip(workers, ranges)), file=out)
        if market is not None:
            ledger = args.db or (logdir / "market.db" if args.logs is not None else "in a temporary file")
            print(f"market: kvasir status --nats {url}   (ledger {ledger})", file=out)
        kept = "kept" if args.logs is not None else "removed at exit; keep them with --logs DIR"
        print(f"logs ({kept}): " + ", ".join(
            [str(logdir / "market.log")] * (market is not None)
            + [f"{w.node} {logdir / f'worker-{i}.log'}" for i, w in enumerate(workers)]), file=out)
        if backbone.weights_url:
            print(f"weights: {backbone.weights_url}; volunteers: kvasir worker --nats {url} --budget 64MB "
                  f"--source {backbone.weights_url}" + (" --token TOKEN" if cfg.tokens else ""), file=out)

        if http is not None:
            run_http(engine, args, http, bus_model=fp, bus_url=url, node=cfg.node)
            print("stopping the swarm", file=out)
            return 0
        if args.prompt is None:
            print(f"serving until Ctrl-C; try: kvasir generate --nats {url} --model {args.model} "
                  f"--prompt 'Hello' -n 16", file=out, flush=True)
            _wait_for_interrupt(workers)
            print("stopping the swarm", file=out)
            return 0

        gen = generate(engine, prompt, args.n, Sampler(SamplerConfig()), stop_on_eos=True, keep_logits=args.check)
        stats = backbone.stats.to_dict()
        result = {"nats": url, "model": fp, "text": tok.decode(gen.tokens), "tokens": gen.tokens,
                  # a kvasir synth model: the text is noise, the report below is the point
                  "random_weights": engine.reader.fields.get("kvasir.synth.seed") is not None,
                  "workers": served_by(stats["per_node"], {w.node: f"{lo}-{hi}" for w, (lo, hi) in zip(workers, ranges)}),
                  "dispatch": stats["totals"],
                  "decode_tokens_per_s": round((len(gen.tokens) - 1) / gen.decode_s, 2)
                  if len(gen.tokens) > 1 and gen.decode_s else None}
        if market is not None:
            result["rewards"] = _rewards(backbone, fp)
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


def served_by(per_node: dict, started: dict[str, str]) -> dict[str, dict]:
    """Every node that served (``per_node`` of the dispatch statistics) and every worker this
    command started (``started``: node -> its inclusive expert range): a volunteer or a
    worker started elsewhere is listed too, with experts ``-`` (the market knows them)."""
    nodes = list(started) + sorted(n for n in per_node if n not in started)
    return {n: {"experts": started.get(n, "-"), **per_node.get(n, {"calls": 0, "rows": 0})} for n in nodes}


def demo_note(result: dict) -> str | None:
    """The line printed before the text of a model with random weights (``kvasir synth``): its
    text is noise, so say what the run shows instead."""
    if not result.get("random_weights"):
        return None
    shows = ["which node computed which experts"]
    if "check" in result:
        shows.insert(0, "whether the logits are bit-identical to the monolithic run's (the last line)")
    if result.get("rewards"):
        shows.append("what the ledger paid each")
    listed = shows[0] if len(shows) == 1 else ", ".join(shows[:-1]) + " and " + shows[-1]
    return (f"random weights (a kvasir synth model), so the text below is noise; the run shows {listed} "
            "(kvasir verify compares the engine with llama.cpp)")


def _print_report(result: dict, n_prompt: int) -> None:
    t = result["dispatch"]
    note = demo_note(result)
    print(f"\n{note}" if note else "")
    print(f"{result['text']}\n")
    print(f"expert calls ({n_prompt} prompt tokens, {len(result['tokens'])} generated, "
          f"{result['decode_tokens_per_s']} tokens/s):")
    for node, w in result["workers"].items():
        print(f"  {node:<10} experts {w['experts']:<8} {w['calls']:>6} calls {w['rows']:>8} rows")
    print(f"  {'backbone':<10} {'fallback':<16} {t['local']:>6} calls {t['rows_local']:>8} rows "
          f"(no responders {t['no_responders']}, timeouts {t['timeouts']}, invalid {t['invalid']})")
    if result.get("rewards"):
        paid = ", ".join(f"{n['node']} {n['rows']} rows {n['reward']:.1f}" for n in result["rewards"]["nodes"])
        print(f"ledger (market): {paid}")
    if "check" in result:
        c = result["check"]
        verdict = "bit-identical" if c["bit_identical"] else "DIFFERENT"
        print(f"check against the monolithic run: tokens {'equal' if c['tokens_equal'] else 'DIFFER'}; "
              f"logits of {c['positions']} positions max |diff| = {c['max_abs_diff']:g} ({verdict})")


class _MarketProcess:
    def __init__(self, proc):
        self.proc = proc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()


def _secure_deployment(directory: Path, n_workers: int) -> dict[str, str]:
    """``kvasir creds init`` for a local swarm (any free port): NATS decentralised auth, an
    operator, an account and one user JWT per role and worker, as ``kvasir creds init`` writes
    by default (so ``kvasir enrol DIR`` can admit volunteers to it); role/worker name -> file."""
    from kvasir_bus import creds

    dep = creds.init(directory, "127.0.0.1:0", [f"worker-{i}" for i in range(n_workers)], auth="jwt")
    files = {i.name: str(directory / f"{i.name}.creds") for i in dep.identities}
    files["nats.conf"] = str(directory / "nats.conf")
    return files


def _spawn_market(url: str, model: str, db: str, log_file, extra: list[str] = ()) -> _MarketProcess:
    import subprocess

    cmd = [sys.executable, "-m", "kvasir_bus.cli", "market", "--nats", url, "--db", db, "--model", model,
           "--expiry", "5", "--demand-interval", "2", *extra]
    return _MarketProcess(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                           stderr=subprocess.STDOUT))


def _rewards(backbone: BackboneService, model: str, timeout_s: float = 30.0) -> dict | None:
    """Wait until the market acknowledged this run's ledger events, then ask it for the totals.
    The wait ends as soon as they are acknowledged; its bound is generous because the market
    holds back events their routing statistics do not yet back (read again a little later), and
    on a loaded machine that can take seconds (a CI run got empty totals with a 10 s bound)."""
    from kvasir_bus import market_codec as mc
    from kvasir_bus.subjects import Subjects
    from market.show import totals_json

    if not backbone.wait_ledger_acked(timeout_s):
        log.warning("ledger_not_acknowledged", timeout_s=timeout_s)
    try:
        status = mc.decode_status_reply(backbone.request(Subjects(model).status(), b"", timeout_s=3))
    except Exception as exc:
        log.warning("market_status_unavailable", error=f"{type(exc).__name__}: {exc}")
        return None
    return totals_json(status.totals) if isinstance(status, mc.MarketStatus) else None


def _tails(workers: list[WorkerProcess]) -> str:
    parts = []
    for w in workers:
        if w.log_path:
            lines = Path(w.log_path).read_text(errors="replace").strip().splitlines()
            if lines:
                parts.append(f"{w.node}: {lines[-1][:300]}")
    return "; ".join(parts) or "(empty)"


def _wait_for_interrupt(workers: list[WorkerProcess]) -> None:
    """Until Ctrl-C or SIGTERM; dead children are the supervisor's (launch/supervise.py)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
