"""The worker role's ``kvasir`` subcommands.

``register`` adds each subcommand through its own ``_add_*`` function (listed in
``_COMMANDS``); command functions import their heavy modules themselves so that
``kvasir --help`` stays fast.

``kvasir slice FILE --layer L --experts A-B [--layer L --experts A-B ...] -o SLICE.gguf``
cuts the listed experts out of an MoE GGUF into a mini-GGUF a worker can serve
(layout: :mod:`modelfile.slice_file`). Ranges are inclusive: ``--experts 0-7`` is eight experts,
``--experts 5`` is one; ``--layer`` also takes a range (``0-3``) or ``all`` (every layer that
has expert tensors), and so does ``--experts`` (``all``). Each ``--layer`` pairs with the
``--experts`` at the same position.
"""

from __future__ import annotations

import argparse
import sys

from kvasir_bus.connect import add_connection_flags
from kvasir_bus.threads import add_kernel_flags, share_cores
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.subjects import BALANCE_QUEUE



def register(subparsers: argparse._SubParsersAction) -> None:
    for add in _COMMANDS:
        add(subparsers)


def _add_slice(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "slice",
        help="cut chosen experts out of an MoE GGUF into a mini-GGUF (byte-range copy)",
        description="Cut the gate/up/down weights of chosen experts out of an MoE GGUF into a "
        "small GGUF a worker serves. The bytes are copied as they are (no dequantising), "
        "streaming through a small buffer, so files larger than memory slice fine. Ranges are "
        "inclusive; each --layer pairs with the --experts at the same position.",
        epilog="example: kvasir slice model.gguf --layer 0-3 --experts 0-7 --layer 5 --experts 12 "
        "-o part.gguf",
    )
    p.add_argument("file", metavar="FILE", help="source MoE GGUF")
    p.add_argument("--layer", action="append", default=[], metavar="L",
                   help="layer index, inclusive range A-B, or 'all' (repeatable)")
    p.add_argument("--experts", action="append", default=[], metavar="A-B",
                   help="inclusive expert range A-B, a single expert A, or 'all' (repeatable)")
    p.add_argument("-o", "--output", required=True, metavar="SLICE.gguf", help="slice file to write")
    p.set_defaults(func=_cmd_slice)


def _cmd_slice(args: argparse.Namespace) -> int:
    from workers.download import TerminalProgress
    from modelfile.slicer import describe_holdings, parse_span, plan_slice, write_slice

    if not args.layer and not args.experts:
        raise UsageError("give at least one --layer L --experts A-B pair")
    if len(args.layer) != len(args.experts):
        raise UsageError(f"each --layer needs its own --experts (got {len(args.layer)} --layer, "
                         f"{len(args.experts)} --experts)")
    requests = [(parse_span(layer, "--layer"), parse_span(experts, "--experts"))
                for layer, experts in zip(args.layer, args.experts)]
    plan = plan_slice(args.file, requests)
    progress = TerminalProgress(sys.stderr, 'slicing') if sys.stderr.isatty() else None
    try:
        result = write_slice(plan, args.output, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    rate = result.nbytes / 1e6 / max(result.seconds, 1e-9)
    print(f"{result.path}: {result.n_held} experts ({describe_holdings(result.holdings)}), "
          f"{result.nbytes} bytes, {result.seconds:.2f} s ({rate:.0f} MB/s)")
    return 0


def _add_worker(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="serve a slice of a model's experts on a NATS bus",
        description="Serve experts on the bus: subscribe to the dispatch subject of every expert "
        "held, answer each request with the expert function, and heartbeat the holdings on "
        "kvasir.<model>.coverage.<node>. Give a slice (--slice) or a model plus the experts to "
        "cut from it at start (--model --layer --experts), or volunteer (--budget --source): get the "
        "scarcest range that fits from the market and download only those experts, each slab "
        "checked against the backbone's SHA-256 manifest. The worker only dials out. SIGTERM "
        "or Ctrl-C drains: requests in flight are answered, then it exits.",
        epilog="examples: kvasir worker --nats nats://host:4222 --slice part.gguf\n"
        "          kvasir worker --model model.gguf --layer all --experts 0-31\n"
        "          kvasir worker --nats nats://host:4222 --budget 340MB --source http://host:8090/model.gguf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nats", metavar="URL", default=None,
                   help="NATS server URL (default: $NATS_URL, else nats://127.0.0.1:4222)")
    add_connection_flags(p)
    # the most used first: volunteering (ask the market for the scarcest range that fits,
    # download only that), then a fixed slice, then tuning
    v = p.add_argument_group("volunteering (instead of --slice/--model)")
    v.add_argument("--budget", metavar="SIZE", default=None,
                   help="memory to offer for experts, e.g. 340MB, 1.5GiB, 5308416; the market "
                   "assigns the scarcest range that fits")
    v.add_argument("--source", metavar="PATH_OR_URL", default=None,
                   help="where to download the assigned experts from: a GGUF path or an http(s) "
                   "URL that supports Range requests (a HuggingFace resolve/main URL works)")
    v.add_argument("--token", metavar="TOKEN", default=None,
                   help="node token for the weights server (default: $KVASIR_NODE_TOKEN)")
    v.add_argument("--enrol", metavar="LINK", default=None,
                   help="get this node's identity from the deployment's enrolment service (kvasir "
                   "enrol): LINK is the join link nats://HOST:PORT#TOKEN (over the bus) or "
                   "https://HOST:PORT/enrol#TOKEN (over HTTPS, whose answer names the bus; a private "
                   "CA: $SSL_CERT_FILE), or give the token in $KVASIR_ENROL_TOKEN; a fresh key, a "
                   "node name the service assigns, renewed while serving; no --creds, no --node")
    v.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="where downloads and slices are kept (default: $KVASIR_CACHE_DIR, else "
                   "~/.cache/kvasir); an interrupted download resumes from here")
    f = p.add_argument_group("a fixed slice (instead of volunteering)")
    f.add_argument("--slice", metavar="SLICE.gguf", help="the mini-GGUF to serve (from kvasir slice)")
    f.add_argument("--model", metavar="FILE", help="a whole GGUF to slice at start (with --layer/--experts)")
    f.add_argument("--layer", action="append", default=[], metavar="L",
                   help="with --model: layer index, range A-B, or 'all' (repeatable)")
    f.add_argument("--experts", action="append", default=[], metavar="A-B",
                   help="with --model: inclusive expert range, or 'all' (repeatable)")
    t = p.add_argument_group("tuning")
    t.add_argument("--node", metavar="NAME", default=None,
                   help="node id on the bus, letters/digits/-/_ (default: the name of the --creds "
                   "identity, else the self-certifying name of this node's key, see --node-key). A "
                   "chosen name is only a word on an open bus: anyone may answer under it")
    t.add_argument("--node-key", metavar="FILE|fresh", default=None,
                   help="the key that names this node (k + 26 base32 characters of its hash) and proves "
                   "its replies, so nobody else can answer under its name: an nkey seed file, created "
                   "if missing; 'fresh': a new key (and name) for this process only (default without "
                   "--node/--creds/--enrol: the first free slot of $XDG_STATE_HOME/kvasir/node-keys/, "
                   "kept across restarts)")
    t.add_argument("--heartbeat", type=float, default=2.0, metavar="S",
                   help="seconds between coverage heartbeats (default 2)")
    t.add_argument("--replicas", choices=("race", "balance"), default="race",
                   help="race: every replica of an expert computes each request, the first reply wins; "
                   f"balance: the replicas share each expert subject in the NATS queue group {BALANCE_QUEUE} "
                   "(one computes; NATS prefers a nearby member); give the backbone the same --replicas "
                   "so that it hedges (default race)")
    t.add_argument("--queue-group", metavar="NAME", default=None,
                   help="load-balance in this queue group instead of racing (overrides --replicas)")
    t.add_argument("--bundles", choices=("on", "off"), default="on",
                   help="on: also take a backbone's bundles (a layer step's calls for this node in one "
                   "message) on this node's subject, and say so in the heartbeat; off: only per-expert "
                   "requests, as workers before bundles (default on)")
    t.add_argument("--fast-paths", choices=("on", "off"), default="on",
                   help="on: requests are handled where nats.py parses them and replies written to the "
                   "socket directly, wherever the connection allows it (never over WebSocket); off: "
                   "nats.py's ordinary path for both (the same answers, more CPU per call) (default on)")
    t.add_argument("--max-rows", type=int, default=16384, metavar="N", help="largest request in rows")
    t.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, metavar="B",
                   help="largest request in bytes (default 8 MiB, the max_payload of deploy/nats.conf)")
    t.add_argument("--metrics", metavar="[HOST:]PORT", default=None,
                   help="serve Prometheus /metrics here (host 127.0.0.1 unless given; port 0: any free port)")
    t.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_kernel_flags(t)  # the backbone's mode: a worker's replies are exact only in the same mode
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    import tempfile

    from kvasir_bus.connect import ConnectOptions, node_for
    from kvasir_bus.loopthread import run as run_loop
    from kvasir_bus.logs import configure
    from kvasir_bus.subjects import check_node
    from workers.runtime import WorkerConfig, default_node_id
    from modelfile.slice_file import load_slice

    configure(args.log_level)
    volunteering = args.budget is not None or args.source is not None
    if volunteering and (args.slice or args.model or args.layer or args.experts):
        raise UsageError("--budget/--source ask the market for experts: leave out --slice, --model, "
                         "--layer and --experts")
    if volunteering and (args.budget is None or args.source is None):
        raise UsageError("volunteering needs both --budget SIZE and --source PATH_OR_URL")
    if not volunteering and bool(args.slice) == bool(args.model):
        raise UsageError("give either --slice SLICE.gguf or --model FILE with --layer/--experts")
    if args.slice and (args.layer or args.experts):
        raise UsageError("--layer/--experts go with --model, not with --slice")
    for name, value in (("--heartbeat", args.heartbeat), ("--max-rows", args.max_rows),
                        ("--max-request-bytes", args.max_request_bytes)):
        if not value > 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if args.enrol is not None and (args.node or args.creds or args.nats):
        raise UsageError("--enrol gives this node its identity and bus: leave out --node, --creds and --nats")
    if args.enrol is not None:
        from kvasir_bus.enrol import link_base, split_link

        link_base(split_link(args.enrol)[0])  # a bad link is one line now, not after dialling
    if args.metrics is not None:
        from kvasir_bus.metrics import parse_listen

        parse_listen(args.metrics)  # a bad address is one line now, not after connecting or claiming a key
    options = ConnectOptions.from_args(args)
    node = node_for(args.node, options) if args.enrol is None else "enrolling"
    node_key = _node_key(args, node)
    reply_key = _creds_reply_key(options.creds) if args.enrol is None and options.creds else b""
    node = node or (node_key.name if node_key is not None else default_node_id())
    try:
        check_node(node)
    except ValueError as exc:
        raise UsageError(f"--node: {exc}") from None
    from kernels.backend import apply_kernel_flags

    apply_kernel_flags(args)  # before the slice is read: ggml loads once, in this mode
    if args.threads is None:
        share_cores()  # workers started by hand beside each other split the cores, not spin on them
    cfg = WorkerConfig(node=node, heartbeat_s=args.heartbeat, max_rows=args.max_rows,
                       max_bytes=args.max_request_bytes, queue_group=args.queue_group or (BALANCE_QUEUE if args.replicas == "balance" else None),
                       metrics=args.metrics, bundles=args.bundles == "on",
                       inline_delivery=args.fast_paths == "on", direct_reply=args.fast_paths == "on",
                       node_key=node_key, reply_key=reply_key)
    if volunteering:
        import os

        from workers.volunteer import TOKEN_ENV, VolunteerConfig, parse_size, volunteer_and_serve

        vcfg = VolunteerConfig(source=args.source, budget_bytes=parse_size(args.budget), node=node,
                               token=args.token or os.environ.get(TOKEN_ENV) or None,
                               cache_dir=args.cache_dir or "")
        if args.enrol is not None:
            from workers.enrolled import enrol_and_serve

            return run_loop(enrol_and_serve(args.enrol, os.environ.get("KVASIR_ENROL_TOKEN") or None,
                                            args.cache_dir or "", cfg, volunteer_cfg=vcfg))
        return run_loop(volunteer_and_serve(vcfg, cfg, args.nats))
    with tempfile.TemporaryDirectory(prefix="kvasir-worker-") as tmp:
        path = args.slice
        if args.model:
            from modelfile.slicer import parse_span, plan_slice, write_slice

            if not args.layer or len(args.layer) != len(args.experts):
                raise UsageError("with --model, give --layer L --experts A-B pairs")
            requests = [(parse_span(la, "--layer"), parse_span(ex, "--experts"))
                        for la, ex in zip(args.layer, args.experts)]
            path = write_slice(plan_slice(args.model, requests), f"{tmp}/slice.gguf").path
        info = load_slice(path)
        if args.enrol is not None:
            import os

            from workers.enrolled import enrol_and_serve

            return run_loop(enrol_and_serve(args.enrol, os.environ.get("KVASIR_ENROL_TOKEN") or None,
                                            args.cache_dir or "", cfg, slice_info=info))
        return run_loop(_serve(info, cfg, args.nats))


def _creds_reply_key(path) -> bytes:
    """The reply key ``kvasir creds`` wrote into a worker's credentials file (b"" if none: the
    replies then carry no proof, and a backbone holding the reply secret drops them)."""
    from kvasir_bus.attribution import reply_key_in

    try:
        return reply_key_in(path)
    except ValueError as exc:
        raise UsageError(f"--creds: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--creds {path}: {exc.strerror or exc}") from None


def _node_key(args: argparse.Namespace, named: str | None):
    """The node's own key (workers.identity), or None where the name comes from elsewhere (a
    chosen ``--node``, a ``--creds`` identity, enrolment). A self-certifying ``--node`` must be the
    name of the key given with it."""
    from kvasir_bus.attribution import is_self_name
    from workers import identity

    if args.enrol is not None:
        if args.node_key is not None:
            raise UsageError("--enrol gives this node its identity: leave out --node-key")
        return None
    if args.node_key is not None and args.creds:
        raise UsageError("--creds names this node: leave out --node-key")
    if named is not None and args.node_key is None:
        if is_self_name(named):
            raise UsageError(f"--node {named} is a self-certifying name: give its key with --node-key FILE")
        return None
    if args.node_key is not None:
        key, where = identity.from_flag(args.node_key), args.node_key
    else:
        key, where = identity.claim_slot()
    if named is not None and named != key.name:
        raise UsageError(f"--node {named} is not the name of the key in --node-key ({key.name}): leave "
                         "out --node")
    import structlog

    structlog.get_logger("kvasir.worker").info("node_key", node=key.name, key=str(where),
                                               note="replies under this name carry its proof")
    return key


async def _serve(info, cfg, url) -> int:
    import asyncio
    import signal

    from kvasir_bus.connect import connect_or_stop, shutdown
    from kvasir_bus.micro import connection_name
    from workers.runtime import Worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nc = await connect_or_stop(stop, url, name=connection_name("worker", cfg.node))
    if nc is None:  # SIGTERM before the bus answered
        return 0
    worker = Worker(info, cfg)
    try:
        verified = await verify_at_start(nc, info)  # KvasirError: a slab differs, refuse to serve
        await worker.start(nc)
        watch = None if verified else asyncio.create_task(verify_later(nc, info, stop))
        await stop.wait()
        if watch is not None:
            watch.cancel()
            if not watch.cancelled() and watch.done() and watch.exception() is not None:
                raise watch.exception()
    finally:
        await worker.stop()
        await shutdown(nc)
    return 0


async def verify_at_start(nc, info) -> bool:
    """Check every held slab against the backbone's manifest. True: checked and intact; False: no
    backbone answers yet (serve, and check when one does); KvasirError: a slab differs."""
    import structlog

    from workers.verify import check_slabs, describe, manifest_if_served

    manifest = await manifest_if_served(nc, info.fingerprint)
    if manifest is None:
        structlog.get_logger("kvasir.worker").warning(
            "slabs_unverified", model=info.fingerprint,
            reason="no backbone serves the manifest yet; checking when one does")
        return False
    bad = check_slabs(info, manifest)
    if bad:
        raise KvasirError(f"{info.path}: {describe(bad)}; refusing to serve them")
    structlog.get_logger("kvasir.worker").info("slabs_verified", model=info.fingerprint, experts=info.n_held)
    return True


async def verify_later(nc, info, stop, every_s: float = 5.0) -> None:
    """Ask for the manifest until a backbone serves it; a slab that differs stops the worker."""
    import asyncio

    while not stop.is_set():
        await asyncio.sleep(every_s)
        try:
            if await verify_at_start(nc, info):
                return
        except KvasirError:
            stop.set()
            raise


_COMMANDS = (_add_slice, _add_worker)
