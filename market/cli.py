"""``kvasir market``, ``kvasir rewards``, ``kvasir status`` and ``kvasir tap``.

``register`` adds each subcommand through its own ``_add_*`` function; heavy imports stay
inside the command functions so ``kvasir --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json

from kvasir_bus.connect import add_connection_flags
from kvasir_bus.micro import connection_name
from kvasir_bus.errors import KvasirError, UsageError
from market import DEFAULT_DB

_NATS_HELP = "NATS server URL (default: $NATS_URL, else nats://127.0.0.1:4222)"


def register(subparsers: argparse._SubParsersAction) -> None:
    for add in _COMMANDS:
        add(subparsers)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UsageError(f"{name} must be positive, got {value}")


def _model_arg(value: str | None) -> str | None:
    if value is None:
        return None
    from kvasir_bus.subjects import check_model

    try:
        return check_model(value)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def check_db_dir(db: str, flag: str = "--db") -> None:
    """Refuse a ledger file whose directory is missing: a typo in a path should not quietly
    start a fresh ledger somewhere new (the ledger holds what nodes earned)."""
    from pathlib import Path

    parent = Path(db).expanduser().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else \
            "does not exist (create it first; the market does not create directories)"
        raise UsageError(f"{flag} {db}: directory {parent} {what}")


# -- kvasir market --------------------------------------------------------------------------

def _add_market(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "market", help="run the coverage market: coverage, demand, volunteering, rewards",
        description="Run the coverage market for every model on the bus: build the coverage "
        "map from worker heartbeats, weigh demand by the backbone's routing statistics, "
        "assign volunteers the scarcest range that fits their budget, publish the demand map "
        "on kvasir.<model>.demand, and keep the rewards ledger in SQLite. SIGTERM or Ctrl-C "
        "stops it; a restart keeps the ledger and rebuilds coverage within one expiry.",
        epilog="example: kvasir market --nats nats://host:4222 --db /var/lib/kvasir/market.db")
    p.add_argument("--nats", metavar="URL", default=None, help=_NATS_HELP)
    add_connection_flags(p)
    p.add_argument("--db", metavar="FILE", default=DEFAULT_DB,
                   help=f"ledger database, created if missing; its directory must exist "
                   f"(default: {DEFAULT_DB})")
    p.add_argument("--expiry", type=float, default=10.0, metavar="S",
                   help="a worker silent this long drops out of the coverage map (default 10)")
    p.add_argument("--range-experts", type=int, default=32, metavar="N",
                   help="experts per range: the unit of demand and assignment (default 32, "
                   "170 MB of the 122B model)")
    p.add_argument("--demand-interval", type=float, default=5.0, metavar="S",
                   help="publish the demand map this often, and on every change (default 5)")
    p.add_argument("--grace", type=float, default=60.0, metavar="S",
                   help="an assignment counts as a replica this long before the worker "
                   "heartbeats it (its download time; default 60)")
    p.add_argument("--max-replicas", type=int, default=3, metavar="N",
                   help="replica target of the hottest ranges (default 3)")
    p.add_argument("--model", action="append", default=[], metavar="FP",
                   help="ask the backbone for this model's manifest at start (repeatable; "
                   "models are also learned from traffic)")
    p.add_argument("--node", metavar="NAME", default="market", help="the market's id on the bus")
    p.add_argument("--trust-backbone", action="append", default=[], metavar="KEY",
                   help="a backbone's public nkey (U..., logged by the backbone as signing_key): ledger "
                   "batches, routing statistics and quarantine events count only when signed by a "
                   "trusted key (repeatable; `kvasir up` wires it). None given: unsigned records are "
                   "accepted, as on a bus whose permissions alone say who may publish them")
    p.add_argument("--http", "--metrics", dest="http", metavar="[HOST:]PORT", default=None,
                   help="serve the live dashboard (/) and Prometheus metrics (/metrics) here "
                   "(host default 127.0.0.1; 0.0.0.0:PORT for every interface)")
    p.add_argument("--keep-events", type=int, default=100_000, metavar="N",
                   help="ledger events kept one by one (default 100000, about 25 MB); older ones, and "
                   "any older than --fold-after, are folded into per node and range totals, so the "
                   "file grows with nodes and ranges, not with calls")
    p.add_argument("--fold-after", type=float, default=600.0, metavar="S",
                   help="fold ledger events older than S seconds (default 600, the ledger stream's "
                   "duplicate window); a folded event can no longer be voided by a quarantine")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_cmd_market)


def _cmd_market(args: argparse.Namespace) -> int:
    import asyncio

    from kvasir_bus.logs import configure
    from market.demand import Policy
    from market.service import MarketConfig
    from kvasir_bus.signing import check_public_key

    configure(args.log_level)
    for name, value in (("--expiry", args.expiry), ("--range-experts", args.range_experts),
                        ("--demand-interval", args.demand_interval),
                        ("--max-replicas", args.max_replicas)):
        _positive(name, value)
    if args.grace < 0:
        raise UsageError(f"--grace must be >= 0, got {args.grace}")
    if args.keep_events < 0 or args.fold_after < 0:
        raise UsageError(f"--keep-events and --fold-after must be >= 0, got {args.keep_events} and "
                         f"{args.fold_after:g}")
    check_db_dir(args.db)
    from kvasir_bus.connect import ConnectOptions
    from kvasir_bus.jwt import read_creds_jwt

    # Under a JWT deployment (kvasir creds init) only the enrolment service may publish
    # revocations, so the market lists what it hears; on an open bus anyone could.
    own = ConnectOptions.from_args(args).creds
    try:
        cfg = MarketConfig(node=args.node, db_path=args.db, expiry_s=args.expiry,
                           revocations=bool(own and read_creds_jwt(own)),
                           assign_grace_s=args.grace, range_experts=args.range_experts,
                           demand_interval_s=args.demand_interval,
                           policy=Policy(max_replicas=args.max_replicas),
                           models=tuple(_model_arg(m) for m in args.model),
                           trusted_backbones=tuple(check_public_key(k) for k in args.trust_backbone),
                           keep_events=args.keep_events, fold_after_s=args.fold_after)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    http = None
    if args.http is not None:
        from kvasir_bus.metrics import parse_listen

        http = parse_listen(args.http)
    return asyncio.run(_serve(cfg, args.nats, http))


async def _serve(cfg, url, http=None) -> int:
    import asyncio
    import signal

    from kvasir_bus.connect import connect_or_stop, shutdown
    from market.service import Market

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nc = await connect_or_stop(stop, url, name=connection_name("market", cfg.node))
    if nc is None:  # SIGTERM before the bus answered
        return 0
    market = Market(nc, cfg)
    dashboard = None
    try:
        await market.start()
        if http is not None:
            from market.dashboard import Dashboard, DashboardConfig

            dashboard = await Dashboard(market, DashboardConfig(*http)).start()
            print(f"dashboard {dashboard.url}/  metrics {dashboard.url}/metrics", flush=True)
        await stop.wait()
    finally:
        if dashboard is not None:
            await dashboard.stop()
        await market.stop()
        await shutdown(nc)
    return 0


# -- kvasir status / rewards: asking the market ---------------------------------------------

async def ask_market(nc, subject: str, timeout: float, attempt_s: float = 0.25):
    """A request to the market that waits for its answer up to ``timeout`` on one inbox, and asks
    again on that same inbox every ``attempt_s`` (doubling each time): under a status flood the
    market sheds whole backlogs unread (see :mod:`market.service`), a request among them with
    them, while a slow answer (a big ledger) to an earlier ask still counts when it comes.
    Raises the last failure: ``NoRespondersError`` (no market, or one reconnecting its status
    connection) or ``TimeoutError``."""
    import asyncio
    import time

    import nats.errors

    answers: asyncio.Queue = asyncio.Queue()

    async def on_answer(msg):
        answers.put_nowait(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_answer)
    deadline = time.monotonic() + timeout
    try:
        next_ask, wait = 0.0, attempt_s
        nobody = False  # the last answer was the server's "no responders"
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise nats.errors.NoRespondersError if nobody else nats.errors.TimeoutError
            if now >= next_ask:
                await nc.publish(subject, b"", reply=inbox)
                next_ask, wait = now + wait, min(2 * wait, 4.0)
            try:
                msg = await asyncio.wait_for(answers.get(), max(0.01, min(next_ask, deadline) - time.monotonic()))
            except (asyncio.TimeoutError, TimeoutError):
                continue
            if msg.headers and msg.headers.get("Status") == "503":  # nobody on the subject (yet)
                nobody = True
                if deadline - time.monotonic() <= 0.05:
                    raise nats.errors.NoRespondersError
                await asyncio.sleep(0.05)
                next_ask = 0.0
                continue
            return msg
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass


async def _ask(url: str | None, subject: str, timeout: float):
    import nats.errors

    from kvasir_bus.codec import CodecError
    from kvasir_bus.connect import connect
    from kvasir_bus.market_codec import decode_status_reply

    nc = await connect(url, name=connection_name("status"))
    try:
        try:
            msg = await ask_market(nc, subject, timeout)
        except nats.errors.NoRespondersError:
            raise KvasirError("no market is running on this bus (start one with "
                              "kvasir market)") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise KvasirError(f"the market did not answer within {timeout:g} s") from None
        try:
            return decode_status_reply(msg.data)
        except CodecError as exc:
            raise KvasirError(f"the market's answer is not valid: {exc}") from None
    finally:
        await nc.close()


def _quiet_logs() -> None:
    """Only warnings, and on stderr: stdout carries the report (JSON must stay parseable)."""
    from kvasir_bus.logs import configure

    configure("warning")


def _statuses(url: str | None, model: str | None, timeout: float) -> list:
    import asyncio

    from kvasir_bus.codec import ErrorReply
    from kvasir_bus.subjects import MARKET_OVERVIEW, Subjects

    subject = Subjects(model).status() if model else MARKET_OVERVIEW
    got = asyncio.run(_ask(url, subject, timeout))
    if isinstance(got, ErrorReply):
        raise KvasirError(f"market: {got.message} ({got.code})")
    return [got] if model else list(got.models)


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show the coverage map, demand and workers, as the market sees them",
        description="Ask the running market for its view: per model, the coverage grid "
        "(layers x expert ranges, replicas per cell), demand, each worker with its holdings, "
        "budget, load and last heartbeat, rewards, and the backbone's fallback rate.",
        epilog="example: kvasir status --nats nats://127.0.0.1:4222")
    p.add_argument("--nats", metavar="URL", default=None, help=_NATS_HELP)
    add_connection_flags(p)
    p.add_argument("--model", metavar="FP", default=None,
                   help="only this model (default: every model the market knows)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="wait this long for the market's answer (default 3)")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from market.show import status_json, status_text

    _positive("--timeout", args.timeout)
    _quiet_logs()
    statuses = _statuses(args.nats, _model_arg(args.model), args.timeout)
    if args.json:
        print(json.dumps({"models": [status_json(s) for s in statuses]}, indent=2))
    elif not statuses:
        print("the market knows no model yet (no heartbeat, routing or volunteer seen)")
    else:
        print("\n\n".join(status_text(s) for s in statuses))
    return 0


def _add_rewards(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rewards", help="rows served and reward earned per node (from the market's ledger)",
        description="Print rows served and reward per node: read from the ledger file "
        f"(--db, default {DEFAULT_DB}) or asked of the running market (--nats).",
        epilog="example: kvasir rewards --nats nats://127.0.0.1:4222")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="FILE", default=None,
                       help=f"the market's ledger file (default: {DEFAULT_DB})")
    where.add_argument("--nats", metavar="URL", default=None,
                       help="ask the running market on this bus instead")
    add_connection_flags(p)
    p.add_argument("--model", metavar="FP", default=None, help="only this model")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="with --nats: wait this long for the market (default 3)")
    p.set_defaults(func=_cmd_rewards)


def _cmd_rewards(args: argparse.Namespace) -> int:
    from kvasir_bus.market_codec import NodeTotals
    from market.ledger import Ledger
    from market.show import rewards_text, totals_json

    model = _model_arg(args.model)
    _quiet_logs()
    if args.nats:
        merged: dict[str, list] = {}
        for st in _statuses(args.nats, model, args.timeout):
            for t in st.totals:
                acc = merged.setdefault(t.node, [0, 0, 0.0])
                acc[0] += t.events
                acc[1] += t.rows
                acc[2] += t.reward
        totals = [NodeTotals(n, *merged[n]) for n in sorted(merged)]
    else:
        with Ledger(args.db or DEFAULT_DB, readonly=True) as ledger:
            totals = ledger.totals(model)
    if args.json:
        print(json.dumps({"model": model, **totals_json(totals)}, indent=2))
    else:
        print(rewards_text(totals, model))
    return 0


# -- kvasir tap -----------------------------------------------------------------------------

def _add_tap(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tap", help="show the bus traffic, one decoded line per message",
        description="Subscribe to SUBJECT (default kvasir.>) and print one line per message: "
        "time, subject, Kvasir headers, and a summary of the decoded payload. What "
        "nats sub 'kvasir.>' shows, made readable. Replies to requests travel on _INBOX "
        "subjects: tap '>' to see them too.",
        epilog="examples: kvasir tap\n          kvasir tap 'kvasir.*.coverage.*' --count 10",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("subject", nargs="?", default="kvasir.>", metavar="SUBJECT",
                   help="subject or wildcard to watch (default: kvasir.>)")
    p.add_argument("--nats", metavar="URL", default=None, help=_NATS_HELP)
    add_connection_flags(p)
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="stop after N messages")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop after S seconds")
    p.set_defaults(func=_cmd_tap)


def _cmd_tap(args: argparse.Namespace) -> int:
    import asyncio

    if args.count is not None:
        _positive("--count", args.count)
    if args.duration is not None:
        _positive("--duration", args.duration)
    subject = args.subject.strip()
    if not subject or " " in subject or ".." in subject or subject.startswith(".") \
            or subject.endswith("."):
        raise UsageError(f"SUBJECT {args.subject!r} is not a valid NATS subject")
    _quiet_logs()
    asyncio.run(_tap(args.nats, subject, args.count, args.duration))
    return 0


async def _tap(url, subject, count, duration) -> None:
    import asyncio
    import signal

    from kvasir_bus.connect import connect
    from market.tap import tap

    def emit(text: str) -> None:
        print(text, flush=True)

    nc = await connect(url, name=connection_name("tap"))
    task = asyncio.ensure_future(tap(nc, subject, emit, count=count, duration=duration))
    loop = asyncio.get_running_loop()
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
    except (RuntimeError, ValueError):  # not the main thread (tests): no signal handlers
        pass
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        except (RuntimeError, ValueError):
            pass
        await nc.close()


_COMMANDS = (_add_market, _add_rewards, _add_status, _add_tap)
