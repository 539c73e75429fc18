"""The market on the bus: coverage, demand, volunteering, ledger and status for every model.

``Market(nc, cfg)`` subscribes to the all-model wildcards of :mod:`kvasir_bus.subjects`:

=================================  =========================================================
``kvasir.*.coverage.*``            worker heartbeats -> the coverage map (with expiry)
``kvasir.*.routing``               backbone routing statistics -> usage -> targets, and
                                   each worker's reply latency (shown in status)
``kvasir.*.market.volunteer.*``    request: budget -> Assignment, or ErrorReply (no_fit,
                                   no_manifest, bad_request, wrong_model, quarantined); the
                                   subject's node must be the request's (under creds a
                                   worker may publish only on its own); the older
                                   ``kvasir.*.market.volunteer`` without a node too
``kvasir._enrol.revoked``          with ``revocations``: the enrolment service's revocations
                                   (listed in status; asked for at start)
``kvasir.*.market.status``         request: -> MarketStatus of that model
``kvasir.*.market.node.*``         request: -> NodeReport of that node (its credit, audits and
                                   quarantine: what a worker shows of itself)
``kvasir._market.status``          request: -> MarketOverview of every model
stream ``KVASIR_LEDGER``           durable consumer: routing (the bound, and the audits each
                                   node passed and failed), LedgerBatch (the credit),
                                   Quarantine (the verdict), in stream order
=================================  =========================================================

Trust nothing on the bus:

* Claims are not proof. Heartbeats and ledger events are checked against the model's geometry
  (layers with experts, experts per layer) from its manifest; an out-of-range claim is refused
  with one log line per sender per minute (:class:`~kvasir_bus.throttle.ThrottledLog`). An
  announced holding counts as a replica only once the node answered for one of its experts, as
  the backbone's credited ledger events say (:mod:`market.coverage`); pending assignments count
  only for the assigner, and only for ``assign_grace_s``.
* Rewards only for verified work. Ledger events are read only from the ledger stream (see
  :mod:`kvasir_bus.ledger_stream`), never taken by request; per (backbone, layer, expert) the
  rows credited never exceed the rows that backbone's routing statistics say workers' replies
  won there; a quarantined node earns nothing from its quarantine on, and its events so far are
  void. Who may publish on those subjects at all is the NATS permissions' job (the backbone's
  identity only, ``deploy/``); the market's checks bound what a forger can reach without them.
* Floods. Per-sender token buckets on the request subjects (the sender is the reply inbox of
  the asking connection), bounded subscription queues, bounded maps, throttled log lines.
  Status and overview requests have a connection of their own: a status flood never queues in
  front of heartbeats, volunteers or the ledger stream, and cannot queue for long in front of
  an honest status request either. nats-py parses every message a connection receives, one
  at a time (~20 us each here), so 80k queued requests cost seconds whatever the handler does;
  instead, once the status subscription has dropped ``STATUS_SHED_AFTER`` requests (its
  backlog is full), the market closes that connection and opens a new one: the flood still
  unread goes with the old one, unparsed. A request shed with it gets no answer; the client
  asks again (``market.cli.ask_market``, within its deadline).

and publishes each model's :class:`~kvasir_bus.market_codec.DemandMap` on
``kvasir.<model>.demand`` every ``demand_interval_s`` and as soon as any range's replicas or
target change.

A model becomes known from any message about it; the market then asks the backbone for its
manifest on ``kvasir.<model>.manifest``, retrying with exponential backoff until it gets one.
Until then volunteers get ``no_manifest`` (after waiting ``volunteer_wait_s`` for it) and the
ledger stream waits (``stream_manifest_wait_s`` at most per model, then such events are refused);
a quarantine verdict is applied at once (banning a node and voiding its rows needs no layout).
Manifests are kept in the ledger file, so a restarted market checks events with no backbone up.

The stream redelivers what a dead market took and never acked ``ack_wait`` later, behind what
the next market has read since: a batch can come before the routing statistics that back it.
A batch with an unbacked event is then stored not at all and asked for again
(``nak``, ``unbacked_retry_s`` later, ``unbacked_retries`` times); only its last delivery stores
what is backed and refuses the rest. A liar's batch costs that many reads, never more.

Nothing on the wire can stop the market: bad payloads are dropped with a warning line, or
answered with an ErrorReply when they were requests. A restart loses nothing that matters:
the coverage map is rebuilt from heartbeats within one expiry, the ledger, what each node has
served and the pending assignments are in the SQLite file, unread ledger events in the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import numpy as np
import structlog

from kvasir_bus import codec, ledger_stream, market_codec as mc, micro, subjects
from kvasir_bus.codec import CodecError, ErrorReply
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import RateLimiter, ThrottledLog
from market.assign import NoFit, choose
from market.coverage import CoverageMap
from market.demand import DEFAULT_RANGE_EXPERTS, Layout, Policy, RangeStats, UsageTracker, \
    range_stats
from market.ledger import DEFAULT_DB, Ledger

log = structlog.get_logger("kvasir.market")

ERR_QUARANTINED = "quarantined"
SUB_LIMITS = dict(pending_msgs_limit=20_000, pending_bytes_limit=8 * 1024 * 1024)
REQUEST_LIMITS = dict(pending_msgs_limit=100_000, pending_bytes_limit=16 * 1024 * 1024)
# Status and overview requests come on a connection of their own (see Market): a small backlog,
# and past STATUS_SHED_AFTER dropped requests the connection is closed and opened afresh, so
# the unread flood behind them (in our socket and the server's buffer) is shed unparsed.
STATUS_LIMITS = dict(pending_msgs_limit=128, pending_bytes_limit=1024 * 1024)
STATUS_SHED_AFTER = 256


@dataclass(frozen=True)
class MarketConfig:
    """Everything the market is tuned by, parsed once from the CLI."""

    node: str = "market"                      # its id on the bus (in error replies, status)
    db_path: str = DEFAULT_DB                 # SQLite ledger file
    expiry_s: float = 10.0                    # a node silent this long drops out of the map
    assign_grace_s: float = 60.0              # a pending assignment counts this long
    range_experts: int = DEFAULT_RANGE_EXPERTS  # experts per range
    demand_interval_s: float = 5.0            # periodic demand map
    usage_half_life_s: float = 300.0          # decay of routing statistics
    policy: Policy = field(default_factory=Policy)
    models: tuple[str, ...] = ()              # fetch these manifests at start
    manifest_timeout_s: float = 2.0           # one manifest request
    manifest_retry_s: float = 0.25            # first pause between manifest requests
    manifest_retry_max_s: float = 30.0        # longest pause
    volunteer_wait_s: float = 1.0             # a request waits this long for a manifest
    warmup_s: float | None = None             # after a restart: see Market (None: expiry_s)
    request_rate: float = 20.0                # status/volunteer/overview per sender per second
    request_burst: float = 40.0
    heartbeat_rate: float = 10.0              # heartbeats per node per second (workers: ~1)
    heartbeat_total_rate: float = 5000.0      # heartbeats of all nodes per second
    log_interval_s: float = 60.0              # one refusal line per sender per this
    stream_manifest_wait_s: float = 30.0      # ledger events of a model without a manifest
    unbacked_retries: int = 3                 # a batch with an unbacked event is read again ...
    unbacked_retry_s: float = ledger_stream.ACK_WAIT_S  # ... this much later (a redelivery's delay)
    trusted_backbones: tuple[str, ...] = ()  # public nkeys whose signed ledger/routing/quarantine count (none: any)
    #: Hear the enrolment service's revocations (kvasir._enrol.revoked) and list them in status:
    #: only on a bus whose permissions let the enrolment service alone publish them (kvasir
    #: creds; the CLI turns it on when the market's own --creds is a user JWT). Off: none listed.
    revocations: bool = False
    fold_after_s: float = 600.0               # events older than this are folded into totals ...
    keep_events: int = 100_000                # ... and all but this many newest (Ledger.fold)
    fold_interval_s: float = 10.0             # how often the ledger is folded

    def __post_init__(self) -> None:
        subjects.check_node(self.node)
        for name in ("expiry_s", "demand_interval_s", "usage_half_life_s",
                     "manifest_timeout_s", "manifest_retry_s", "manifest_retry_max_s",
                     "unbacked_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (self.fold_after_s >= 0 and self.keep_events >= 0 and self.fold_interval_s > 0):
            raise ValueError("fold_after_s and keep_events must be >= 0, fold_interval_s > 0")
        if self.unbacked_retries < 0:
            raise ValueError(f"unbacked_retries must be >= 0, got {self.unbacked_retries}")
        if self.assign_grace_s < 0 or self.volunteer_wait_s < 0 or self.range_experts < 1 \
                or (self.warmup_s is not None and self.warmup_s < 0):
            raise ValueError("assign_grace_s, volunteer_wait_s and warmup_s must be >= 0, "
                             "range_experts >= 1")
        for model in self.models:
            subjects.check_model(model)

    @property
    def tick_s(self) -> float:
        """How often expiry is checked and changes published."""
        return max(0.02, min(0.5, self.expiry_s / 5))


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


async def _cancel_all(tasks: set[asyncio.Task]) -> None:
    """Cancel tasks and wait until they are done, cancelling again if one swallowed it
    (``asyncio.wait_for`` before Python 3.12 can, when its inner future completes at the
    same moment, e.g. inside ``nc.request``)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=0.1)


class _Model:
    """Everything the market knows about one model."""

    def __init__(self, name: str, cfg: MarketConfig) -> None:
        self.name = name
        self.subjects = Subjects(name)
        self.manifest: mc.Manifest | None = None
        self.layout: Layout | None = None
        self.known = asyncio.Event()
        self.coverage = CoverageMap(cfg.expiry_s, cfg.assign_grace_s)
        self.usage = UsageTracker(cfg.usage_half_life_s)
        self.fallback: dict[str, tuple[float, float]] = {}  # backbone -> (rate, valid until)
        self.latency: dict[str, tuple[float, float]] = {}  # worker -> (mean ms, reported at)
        self.stats: RangeStats | None = None
        self.copies: np.ndarray | None = None      # verified replicas per expert
        self.assignable: np.ndarray | None = None  # ... and pending assignments
        self.usage_now: np.ndarray | None = None
        self.stale = True
        self.last_signature: tuple | None = None
        self.last_published = float("-inf")
        self.fetcher: asyncio.Task | None = None


class Market:
    """The market service. ``start()``/``stop()`` are idempotent; ``async with`` works too.

    ``clock``: Unix time source (tests may pass their own).

    Warm-up: a market restarted on an existing ledger file does not yet know the workers that
    are out there; their heartbeats tell it within one expiry. For ``warmup_s`` (default
    ``expiry_s``) after such a start, volunteer and ledger requests wait for the warm-up to
    end if that is within ``volunteer_wait_s``, and are otherwise answered ``warming_up``
    (ask again), so no hole is handed out twice and no event is priced on a half-known map.
    A market started on a new ledger file has no warm-up.
    """

    def __init__(self, nc: Any, cfg: MarketConfig | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.cfg = cfg or MarketConfig()
        self.clock = clock
        self.state = State.NEW
        self.ledger: Ledger | None = None
        self.models: dict[str, _Model] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._ready_at = 0.0  # loop time at which the warm-up ends
        self.tallies: dict[str, micro.Tally] = {}  # per subscribed subject, for $SRV.STATS
        self._service = None
        self.log = log.bind(market=self.cfg.node)
        self.refusals = ThrottledLog(self.log, self.cfg.log_interval_s)
        self.limits = RateLimiter(self.cfg.request_rate, self.cfg.request_burst)
        self.beats = RateLimiter(self.cfg.heartbeat_rate, 2 * self.cfg.heartbeat_rate,
                                 total_rate=self.cfg.heartbeat_total_rate, max_keys=65_536)
        self.stream_applied = 0  # stream messages applied since start (tests wait on it)
        from kvasir_bus.signing import Verifier

        self.verifier = Verifier(self.cfg.trusted_backbones)  # kvasir_bus.signing: who may credit and quarantine
        self.unsigned_refused = 0  # ledger, routing and quarantine records refused for their signature
        self._status_nc: Any = None       # the status connection (self.nc if none of its own)
        self._status_subs: list[Any] = []
        self._status_dropped = 0          # status requests dropped since that connection opened
        self._shedding = False
        self.status_sheds = 0             # times a flooded status connection was replaced
        self._status_cache: dict[str | None, tuple[float, bytes, dict]] = {}
        self.revoked: dict[str, mc.Revocation] = {}  # user key -> the enrolment service's revocation, oldest first

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> Market:
        if self.state is not State.NEW:
            return self
        self.state = State.RUNNING
        try:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="market-db")
            restarted = Path(self.cfg.db_path).exists()
            warmup = self.cfg.expiry_s if self.cfg.warmup_s is None else self.cfg.warmup_s
            self._ready_at = asyncio.get_running_loop().time() + (warmup if restarted else 0.0)
            self.ledger = await self._db(Ledger, self.cfg.db_path)
            await self._restore()
            served = []
            for name, wildcard, handler in (
                    ("coverage", subjects.ALL_COVERAGE, self._on_heartbeat),
                    ("routing", subjects.ALL_ROUTING, self._on_routing),
                    ("volunteer", subjects.ALL_VOLUNTEER, self._on_volunteer),
                    ("volunteer-node", subjects.ALL_VOLUNTEER_NODES, self._on_volunteer),
                    ("status", subjects.ALL_STATUS, self._on_status),
                    ("node", subjects.ALL_NODE_REPORTS, self._on_node_report),
                    ("overview", subjects.MARKET_OVERVIEW, self._on_overview)):
                tally = self.tallies[name] = micro.Tally()
                served.append(micro.Served(name, wildcard, stats=lambda t=tally: t))
                if name in ("status", "node", "overview"):
                    continue  # on the status connection, below
                limits = SUB_LIMITS if handler in (self._on_heartbeat, self._on_routing) \
                    else REQUEST_LIMITS  # a backlog a flood fills is dropped, never the probe behind it
                self._subs.append(await self.nc.subscribe(wildcard, cb=self._guard(handler, tally), **limits))
            if self.cfg.revocations:
                self._subs.append(await self.nc.subscribe(subjects.ENROL_REVOKED, cb=self._guard(self._on_revoked),
                                                          **SUB_LIMITS))
            await self.nc.flush()
            await self._open_status()
            self._service = await micro.start_service(self.nc, micro.Card(
                "market", self.cfg.node, ",".join(self.cfg.models) or "*"), served)
            for model in self.cfg.models:
                self._model(model)
            self._spawn(self._tick_loop(), "tick")
            self._spawn(self._stream_loop(), "ledger-stream")
            if self.cfg.revocations:
                self._spawn(self._fetch_revocations(), "revocations")
        except BaseException:
            await self.stop()
            raise
        self.log.info("market_started", db=str(self.cfg.db_path), expiry_s=self.cfg.expiry_s,
                      range_experts=self.cfg.range_experts)
        return self

    async def stop(self) -> None:
        if self.state is not State.RUNNING:
            self.state = State.STOPPED
            return
        self.state = State.STOPPED
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass
        self._subs.clear()
        await self._close_status()
        await micro.stop_service(self._service)
        await _cancel_all(self._tasks)
        if self.ledger is not None:
            await self._db(self.ledger.close)
            self.ledger = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.log.info("market_stopped")

    async def __aenter__(self) -> Market:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the status connection --------------------------------------------------------------
    async def _open_status(self, main: bool = False) -> None:
        """Subscribe status and overview on a connection of their own (to the server the main
        connection is on, with the same credentials); on the main one with ``main``, or if it
        has no URL to copy (a test double)."""
        url = getattr(self.nc, "connected_url", None)
        if url is None or main:
            snc = self.nc
        else:
            from kvasir_bus.connect import connect

            snc = await connect(url.geturl(), name=micro.connection_name("market-status", self.cfg.node),
                                error_cb=self._on_status_error)
        self._status_nc, self._status_dropped = snc, 0
        limits = STATUS_LIMITS if snc is not self.nc else REQUEST_LIMITS
        self._status_subs = [
            await snc.subscribe(subjects.ALL_STATUS, cb=self._guard(self._on_status, self.tallies["status"]), **limits),
            await snc.subscribe(subjects.MARKET_OVERVIEW, cb=self._guard(self._on_overview, self.tallies["overview"]),
                                **limits),
            await snc.subscribe(subjects.ALL_NODE_REPORTS, cb=self._guard(self._on_node_report, self.tallies["node"]),
                                **limits)]
        await snc.flush()

    async def _close_status(self) -> None:
        snc, self._status_nc = self._status_nc, None
        subs, self._status_subs = self._status_subs, []
        try:
            if snc is self.nc:
                for sub in subs:
                    await sub.unsubscribe()
            elif snc is not None:
                await snc.close()  # what it has not read yet goes with it, unparsed
        except Exception:  # the connection may be gone already
            pass

    async def _on_status_error(self, exc: Exception) -> None:
        """The status connection's error callback: called once per request it drops (when its
        backlog is full), so it only counts; past ``STATUS_SHED_AFTER`` the connection is
        replaced (once at a time)."""
        if isinstance(exc, nats.errors.SlowConsumerError):
            self._status_dropped += 1
            if self._status_dropped >= STATUS_SHED_AFTER and not self._shedding \
                    and self.state is State.RUNNING:
                self._shedding = True
                self._spawn(self._shed_status(), "status-shed")
            return
        self.refusals.warning(("status-connection", type(exc).__name__), "status_connection_error",
                              error=f"{type(exc).__name__}: {exc}")

    async def _shed_status(self) -> None:
        dropped = self._status_dropped
        try:
            await self._close_status()
            if self.state is State.RUNNING:
                await self._open_status()
            self.status_sheds += 1
            self.refusals.warning("status-flood", "status_flood_shed", dropped=dropped, sheds=self.status_sheds,
                                  note="a status flood: its unread backlog was dropped with the connection")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # status is answered on the main connection from now on
            self.log.error("status_connection_failed", error=f"{type(exc).__name__}: {exc}")
            if self.state is State.RUNNING and self._status_nc is None:
                await self._open_status(main=True)
        finally:
            self._shedding = False

    # -- plumbing ---------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(f"market-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _db(self, fn: Callable, *args: Any) -> Any:
        """Run a ledger call on the one database thread (the event loop never blocks on
        fsync)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _guard(self, handler: Callable[[Any], Awaitable[None]], tally: micro.Tally | None = None):
        tally = tally if tally is not None else micro.Tally()

        async def cb(msg: Any) -> None:
            try:
                with tally.timer():
                    await handler(msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the market never dies on input
                self.log.error("handler_failed", subject=msg.subject,
                               error=f"{type(exc).__name__}: {exc}")
                if msg.reply:
                    await self._reply_error(msg, mc.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
        return cb

    def _replier(self, msg: Any) -> Any:
        """The connection a request came in on answers it: under per-identity permissions
        (``allow_responses``) only that one may publish to its reply subject."""
        status = msg.subject == subjects.MARKET_OVERVIEW or msg.subject.endswith(".market.status") \
            or ".market.node." in msg.subject
        return self._status_nc if status and self._status_nc is not None else self.nc

    async def _reply(self, msg: Any, record: Any) -> None:
        try:
            await self._replier(msg).publish(msg.reply, record.encode(), headers=mc.headers_for(record))
        except Exception as exc:
            self.log.warning("reply_failed", subject=msg.subject, error=str(exc))

    async def _reply_error(self, msg: Any, code: str, message: str) -> None:
        await self._reply(msg, ErrorReply(request_id="", node=self.cfg.node, code=code,
                                          message=message[:codec.MAX_ERROR_MESSAGE]))

    async def _warm(self, msg: Any) -> bool:
        """True once the warm-up is over (waiting for it if it ends within
        ``volunteer_wait_s``); otherwise answer ``warming_up`` and return False."""
        remaining = self._ready_at - asyncio.get_running_loop().time()
        if remaining <= 0:
            return True
        if remaining <= self.cfg.volunteer_wait_s:
            await asyncio.sleep(remaining)
            return True
        await self._reply_error(msg, mc.ERR_WARMING_UP,
                                f"the market restarted and rebuilds its coverage map from "
                                f"heartbeats for {remaining:.1f} s more; ask again then")
        return False

    async def _restore(self) -> None:
        """What the ledger file knows: manifests, quarantined nodes, who served what, pending
        assignments."""
        for model, data in await self._db(self.ledger.manifests):
            try:
                self._set_manifest(self._model(model), mc.decode_manifest(data), save=False)
            except CodecError as exc:
                self.log.warning("stored_manifest_invalid", model=model, error=str(exc))
        for ms in list(self.models.values()):
            for node in await self._db(self.ledger.quarantined, ms.name):
                ms.coverage.ban(node)
        for model, node, layer, expert in await self._db(self.ledger.served):
            self._model(model).coverage.mark_served(node, layer, expert)
        now = self.clock()
        for model, node, holdings, budget, until in await self._db(self.ledger.assignments, now):
            self._model(model).coverage.assign(node, holdings, budget, now, until=until)

    @staticmethod
    def _sender(msg: Any) -> str:
        """Who asks: the reply inbox of its connection (``_INBOX.<per connection>.<token>``)."""
        return (msg.reply or "").rsplit(".", 1)[0]

    def _model(self, name: str) -> _Model:
        ms = self.models.get(name)
        if ms is None:
            ms = self.models[name] = _Model(name, self.cfg)
            ms.fetcher = self._spawn(self._fetch_manifest(ms), f"manifest-{name}")
            self.log.info("model_seen", model=name)
        return ms

    # -- manifests --------------------------------------------------------------------------
    async def _fetch_manifest(self, ms: _Model) -> None:
        delay = self.cfg.manifest_retry_s
        while ms.manifest is None and self.state is State.RUNNING:
            try:
                reply = await self.nc.request(ms.subjects.manifest(), b"",
                                              timeout=self.cfg.manifest_timeout_s)
                got = mc.decode_manifest_reply(reply.data)
                if isinstance(got, ErrorReply):
                    self.log.warning("manifest_refused", model=ms.name, code=got.code,
                                     error=got.message)
                elif got.model != ms.name:
                    self.log.warning("manifest_wrong_model", model=ms.name, got=got.model)
                else:
                    self._set_manifest(ms, got)
                    return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError,
                    asyncio.TimeoutError):
                self.log.debug("manifest_unavailable", model=ms.name, retry_s=delay)
            except CodecError as exc:
                self.log.warning("manifest_invalid", model=ms.name, error=str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("manifest_request_failed", model=ms.name,
                                 error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.cfg.manifest_retry_max_s)

    def _set_manifest(self, ms: _Model, manifest: mc.Manifest, save: bool = True) -> None:
        if save and self.ledger is not None:  # for a restart with no backbone on the bus
            self._spawn(self._db(self.ledger.save_manifest, ms.name, manifest.encode()),
                        f"save-manifest-{ms.name}")
        ms.manifest = manifest
        ms.layout = Layout.from_manifest(manifest, self.cfg.range_experts)
        ms.stale = True
        ms.known.set()
        self.log.info("manifest_received", model=ms.name, layers=len(ms.layout.layers),
                      experts=manifest.n_expert, ranges=len(ms.layout.ranges),
                      range_experts=ms.layout.range_experts)

    # -- derived state ----------------------------------------------------------------------
    def _refresh(self, ms: _Model, now: float) -> RangeStats | None:
        """The model's range statistics, recomputed if anything changed since last time."""
        if ms.layout is None:
            return None
        if ms.stale or ms.stats is None:
            lay = ms.layout
            ms.copies = ms.coverage.copies(lay.n_layer, lay.n_expert)
            ms.assignable = ms.coverage.copies(lay.n_layer, lay.n_expert, pending=True)
            ms.usage_now = ms.usage.matrix(lay.n_layer, lay.n_expert, now)
            ms.stats = range_stats(lay, ms.copies, ms.usage_now, self.cfg.policy)
            ms.stale = False
        return ms.stats

    def _expire(self, ms: _Model, now: float) -> None:
        for node in ms.coverage.expire(now):
            ms.stale = True
            if node not in ms.coverage:
                self.log.info("node_expired", model=ms.name, node=node)
        while ms.latency:  # in report order: the oldest first
            node, (_ms, at) = next(iter(ms.latency.items()))
            if now - at <= self.cfg.usage_half_life_s:
                break
            del ms.latency[node]

    def demand_map(self, model: str) -> mc.DemandMap | None:
        """The current demand map of ``model`` (None until its manifest is known)."""
        ms = self.models.get(model)
        if ms is None:
            return None
        now = self.clock()
        stats = self._refresh(ms, now)
        if stats is None:
            return None
        return mc.DemandMap(model=model, sent_at=now, entries=stats.entries(ms.layout))

    async def _publish_demand(self, ms: _Model, now: float, force: bool = False) -> None:
        stats = self._refresh(ms, now)
        if stats is None:
            return
        sig = (tuple(stats.replicas.tolist()), tuple(stats.target.tolist()))
        due = now - ms.last_published >= self.cfg.demand_interval_s
        if not force and not due and sig == ms.last_signature:
            return
        dm = mc.DemandMap(model=ms.name, sent_at=now, entries=stats.entries(ms.layout))
        try:
            await self.nc.publish(ms.subjects.demand(), dm.encode(), headers=mc.headers_for(dm))
        except Exception as exc:
            self.log.warning("demand_publish_failed", model=ms.name, error=str(exc))
            return
        if sig != ms.last_signature:
            self.log.debug("demand_changed", model=ms.name, holes=len(dm.holes))
        ms.last_signature, ms.last_published = sig, now

    async def _fold(self) -> None:
        """Fold the ledger (see :meth:`market.ledger.Ledger.fold`): its file stays the size of
        ``keep_events`` events plus one row per node and range."""
        t0 = time.perf_counter()
        folded = await self._db(self.ledger.fold, self.clock() - self.cfg.fold_after_s, self.cfg.keep_events)
        if folded:
            self.log.info("ledger_folded", events=folded, ms=round((time.perf_counter() - t0) * 1e3, 1))

    async def _tick_loop(self) -> None:
        next_fold = 0.0
        while self.state is State.RUNNING:
            now = self.clock()
            if time.monotonic() >= next_fold:
                next_fold = time.monotonic() + self.cfg.fold_interval_s
                try:
                    await self._fold()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the ledger stays correct unfolded; say so and go on
                    self.log.error("ledger_fold_failed", error=f"{type(exc).__name__}: {exc}"[:200])
            for ms in list(self.models.values()):
                try:
                    self._expire(ms, now)
                    await self._publish_demand(ms, now)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep ticking for the other models
                    self.log.error("tick_failed", model=ms.name,
                                   error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.cfg.tick_s)

    # -- handlers ---------------------------------------------------------------------------
    def _model_of(self, subject: str) -> str | None:
        try:
            return subjects.model_of(subject)
        except ValueError as exc:
            self.log.warning("bad_subject", subject=subject, error=str(exc))
            return None

    async def _on_heartbeat(self, msg: Any) -> None:
        # Before any decoding: a node's heartbeats beyond its budget are dropped unread, and
        # every heartbeat yields once, so a flood of them cannot starve the request handlers
        # (a subscription's task otherwise runs its whole backlog without yielding).
        await asyncio.sleep(0)
        if not self.beats.allow(msg.subject):
            return
        try:
            model, node = subjects.parse_coverage(msg.subject)
            hb = codec.decode_heartbeat(msg.data)
        except (ValueError, CodecError) as exc:
            self.refusals.warning(msg.subject, "heartbeat_dropped", subject=msg.subject,
                                  error=str(exc))
            return
        if hb.model != model or hb.node != node:
            self.refusals.warning(msg.subject, "heartbeat_dropped", subject=msg.subject,
                                  error=f"payload names model {hb.model} node {hb.node}")
            return
        ms = self._model(model)
        bad = self._out_of_range(ms, ((h.layer, h.lo, h.hi) for h in hb.holdings))
        if bad:
            self.refusals.warning(msg.subject, "heartbeat_refused", model=model, node=node,
                                  error=bad)
            return
        if ms.layout is not None and hb.budget_bytes > self._model_bytes(ms):
            hb = dataclasses.replace(hb, budget_bytes=self._model_bytes(ms))  # the word capped, as in _on_volunteer
        if ms.coverage.observe(hb, self.clock()):
            ms.stale = True

    @staticmethod
    def _not_subject_node(subject: str, node: str) -> str | None:
        """Why a volunteer request's payload names another node than its subject (None: it
        does not, or it came on the older subject without a node)."""
        try:
            named = subjects.volunteer_node(subject)
        except ValueError as exc:
            return str(exc)
        if named is None or named == node:
            return None
        return f"a volunteer asks for its own node only: the subject names {named}, the request {node}"

    @staticmethod
    def _not_own_node(reply: str | None, node: str) -> str | None:
        """Why a volunteer request names another node than its sender's (None: it does not, or
        the bus does not tell). Under ``kvasir creds`` a reply inbox is ``_INBOX_<the sender's
        key>``, and an enrolled node's name is made from its key (:func:`kvasir_bus.enrol.node_name`):
        an enrolled name asked for from another key is refused."""
        from kvasir_bus.attribution import ENROLLED_NAME
        from kvasir_bus.enrol import node_name

        if not reply or not reply.startswith("_INBOX_U") or not ENROLLED_NAME.fullmatch(node):
            return None
        key = reply.split(".", 1)[0][len("_INBOX_"):]
        own = node_name(key)
        if own == node:
            return None
        return f"a volunteer asks for its own node only: this connection's node is {own}, not {node}"

    @staticmethod
    def _model_bytes(ms: _Model) -> int:
        """Bytes of all the model's experts: more budget than this buys nothing."""
        return ms.layout.n_expert * sum(ms.layout.expert_bytes)

    def _out_of_range(self, ms: _Model, claims) -> str | None:
        """Why a claim of ``(layer, lo, hi)`` experts (half-open) is outside the model's
        geometry, or None. Before the manifest is known nothing can be checked: such claims
        are kept, but count for nothing until the node has served (nothing expands them)."""
        lay = ms.layout
        if lay is None:
            return None
        moe = set(lay.layers)
        for layer, lo, hi in claims:
            if layer not in moe:
                return f"layer {layer} has no experts (model: {sorted(moe)[:8]}...)" if moe else \
                    f"layer {layer}: the model has no expert layers"
            if hi > lay.n_expert or lo >= hi:
                return f"experts {lo}..{hi - 1} of layer {layer}: the model has {lay.n_expert}"
        return None

    def _signed(self, kind: str, msg: Any) -> bool:
        """Whether a ledger, routing or quarantine record may count: always while no backbone key
        is trusted (the bus's permissions decide who publishes), else only when a trusted key
        signed its exact payload (:mod:`kvasir_bus.signing`). A refusal: one line a minute per kind."""
        if not self.verifier.enforcing:
            return True
        from kvasir_bus.signing import SignatureError

        try:
            self.verifier.check(msg.data, msg.headers)
            return True
        except SignatureError as exc:
            self.unsigned_refused += 1
            self.refusals.warning(("unsigned", kind), f"{kind}_refused", subject=msg.subject, error=str(exc),
                                  refused=self.unsigned_refused,
                                  note="only records signed by a --trust-backbone key count")
            return False

    async def _on_routing(self, msg: Any) -> None:
        model = self._model_of(msg.subject)
        if model is None:
            return
        if not self._signed("routing", msg):
            return
        try:
            stats = mc.decode_routing(msg.data)
        except CodecError as exc:
            self.log.warning("routing_dropped", subject=msg.subject, error=str(exc))
            return
        if stats.model != model:
            self.log.warning("routing_dropped", subject=msg.subject,
                             error=f"payload names model {stats.model}")
            return
        ms = self._model(model)
        now = self.clock()
        ms.usage.add(stats, now)
        if stats.fallback_rate is not None:
            keep = max(3 * stats.window_s, self.cfg.expiry_s)
            ms.fallback[stats.node] = (stats.fallback_rate, now + keep)
        self._note_latency(ms, stats, now)
        ms.stale = True

    def _note_latency(self, ms: _Model, stats: mc.RoutingStats, now: float) -> None:
        """Each worker's latest mean reply latency (the last window a backbone reported it in;
        with several backbones, the latest report wins). Kept ``usage_half_life_s``, the
        horizon of the routing statistics themselves; bounded in number, since anyone may
        name any node; none for a quarantined node."""
        for node, _calls, mean_ms in stats.latency:
            if node in ms.coverage.banned:
                continue
            ms.latency.pop(node, None)  # re-inserted last: the dict stays in report order
            ms.latency[node] = (mean_ms, now)
        while len(ms.latency) > mc.MAX_NODES:
            del ms.latency[next(iter(ms.latency))]  # the oldest report

    async def _accept(self, msg: Any, decode, what: str) -> tuple[Any, str, Any] | None:
        """The common start of a request handler: a reply subject, the model from the subject,
        a payload that decodes and names that model, a warmed-up market, and (waiting a little
        for it) the model's manifest. Returns (model state, model, record), or None once the
        request has been answered with an error or dropped."""
        if not msg.reply:
            self.log.warning(f"{what}_without_reply_subject", subject=msg.subject)
            return None
        model = self._model_of(msg.subject)
        if model is None:
            await self._reply_error(msg, mc.ERR_BAD_REQUEST, f"bad subject {msg.subject!r}")
            return None
        try:
            record = decode(msg.data)
        except CodecError as exc:
            self.refusals.warning(self._sender(msg), f"{what}_refused", subject=msg.subject,
                                  error=str(exc))
            await self._reply_error(msg, mc.ERR_BAD_REQUEST, str(exc))
            return None
        if record.model != model:
            await self._reply_error(msg, mc.ERR_WRONG_MODEL,
                                    f"{what} names model {record.model}, subject {model}")
            return None
        ms = self._model(model)
        if not await self._warm(msg):
            return None
        if ms.layout is None:
            try:
                await asyncio.wait_for(ms.known.wait(), self.cfg.volunteer_wait_s)
            except asyncio.TimeoutError:
                pass
        return ms, model, record

    async def _on_volunteer(self, msg: Any) -> None:
        if not self.limits.allow(self._sender(msg)):
            return  # over its budget: no answer (an answer would cost what the flood costs)
        accepted = await self._accept(msg, mc.decode_volunteer, "volunteer")
        if accepted is None:
            return
        ms, model, req = accepted
        if not self.limits.allow(("volunteer", req.node)):
            return
        # On kvasir.<model>.market.volunteer.<node> the subject names the node, and under creds
        # the server lets a worker publish only on its own: the payload must agree with it.
        other = self._not_subject_node(msg.subject, req.node) or self._not_own_node(msg.reply, req.node)
        if other:
            await self._reply_error(msg, mc.ERR_BAD_REQUEST, other)
            return
        if req.node in ms.coverage.banned:
            await self._reply_error(msg, ERR_QUARANTINED,
                                    f"node {req.node} failed an audit of model {model}: it is "
                                    "quarantined and gets no assignment")
            return
        if ms.layout is None:
            await self._reply_error(msg, mc.ERR_NO_MANIFEST,
                                    f"the market has no manifest for model {model} yet (the "
                                    "backbone answers kvasir.<model>.manifest); try again")
            return
        # From here to the assignment being recorded there is no await: the next volunteer
        # sees this one's assignment as a (pending) replica.
        now = self.clock()
        self._expire(ms, now)
        if ms.coverage.forget(req.node):  # a volunteer starts afresh with what it is given
            ms.stale = True
        self._refresh(ms, now)
        # a budget past the model's experts buys nothing more: capped, so no volunteer's word
        # (2**63 bytes) reaches the books or the ledger file
        budget = min(req.budget_bytes, self._model_bytes(ms))
        try:
            got = choose(ms.layout, ms.assignable, ms.usage_now, self.cfg.policy, budget)
        except NoFit as exc:
            self.log.info("volunteer_no_fit", model=model, node=req.node, budget=budget)
            await self._reply_error(msg, mc.ERR_NO_FIT, str(exc))
            return
        ms.coverage.assign(req.node, got.holdings, budget, now)
        ms.stale = True
        reply = mc.Assignment(model=model, node=req.node, holdings=got.holdings,
                              bytes=got.bytes, reward_rate=got.reward_rate)
        self.log.info("volunteer_assigned", model=model, node=req.node,
                      holdings=[str(h) for h in got.holdings], bytes=got.bytes,
                      reward_rate=round(got.reward_rate, 4))
        try:
            await self._db(self.ledger.save_assignment, model, req.node, got.holdings,
                           budget, now + self.cfg.assign_grace_s)
        except Exception as exc:  # still valid in memory; only a restart would forget it
            self.log.warning("assignment_not_saved", node=req.node, error=str(exc))
        await self._reply(msg, reply)
        await self._publish_demand(ms, now, force=True)

    # -- the ledger stream ------------------------------------------------------------------
    async def _stream_loop(self) -> None:
        """Read the ledger stream with the durable consumer; ack each message once applied.
        Reconnects (throttled error line) if JetStream is missing or goes away."""
        from nats.js.errors import FetchTimeoutError

        delay = 0.2
        while self.state is State.RUNNING:
            try:
                js = self.nc.jetstream()
                await ledger_stream.ensure_stream(js)
                await js.add_consumer(ledger_stream.STREAM, ledger_stream.consumer_config())
                psub = await js.pull_subscribe_bind(durable=ledger_stream.CONSUMER,
                                                    stream=ledger_stream.STREAM)
                self._subs.append(psub)  # stop() unsubscribes it (a drain would wait for it)
                delay = 0.2
                while self.state is State.RUNNING:
                    remaining = self._ready_at - asyncio.get_running_loop().time()
                    if remaining > 0:  # no event is priced on a half-known coverage map
                        await asyncio.sleep(min(1.0, remaining))
                        continue
                    try:
                        msgs = await psub.fetch(64, timeout=1.0)
                    except (FetchTimeoutError, nats.errors.TimeoutError, asyncio.TimeoutError):
                        continue
                    for m in msgs:
                        try:
                            applied = await self._apply_stream(m)
                        except asyncio.CancelledError:
                            raise
                        except Exception as exc:  # a full disk, a bug: never acked, read again
                            self.refusals.error(m.subject, "ledger_stream_apply_failed",
                                                subject=m.subject, error=f"{type(exc).__name__}: {exc}",
                                                note=f"read again in {self.cfg.unbacked_retry_s:g} s")
                            applied = False
                        if applied:
                            await m.ack()
                            self.stream_applied += 1
                        else:  # held (its backing may come later: see the module's text) or failed
                            await m.nak(delay=self.cfg.unbacked_retry_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.refusals.error("stream", "ledger_stream_unavailable",
                                    error=f"{type(exc).__name__}: {exc}",
                                    note="is JetStream on? (nats-server -js)")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    async def _apply_stream(self, m: Any) -> bool:
        """Apply one stream message (waiting up to ``stream_manifest_wait_s`` for its model's
        manifest). Bad messages are refused: one line per sender a minute. False: a batch held
        for its backing, to be read again."""
        seq = m.metadata.sequence.stream
        parts = m.subject.split(".")
        if len(parts) != 3 or parts[2] not in ("ledger", "routing", "quarantine"):
            self.refusals.warning(m.subject, "stream_message_refused", subject=m.subject)
            return True
        model = self._model_of(m.subject)
        if model is None:
            return True
        if not self._signed(parts[2], m):
            return True
        decode = {"ledger": mc.decode_ledger, "routing": mc.decode_routing,
                  "quarantine": mc.decode_quarantine}[parts[2]]
        try:
            record = decode(m.data)
        except CodecError as exc:
            self.refusals.warning(m.subject, f"{parts[2]}_refused", subject=m.subject,
                                  error=str(exc))
            return True
        if record.model != model:
            self.refusals.warning(m.subject, f"{parts[2]}_refused", subject=m.subject,
                                  error=f"payload names model {record.model}")
            return True
        ms = self._model(model)
        if ms.layout is None and not isinstance(record, mc.Quarantine):
            # The stream is applied in order (the bound before the claim): wait here, a while.
            # A verdict needs no layout: it bans a node and voids its stored rows. Made to wait,
            # it was lost where the backbones that could send the manifest had gone (refused
            # after the wait), and it held back every message behind it.
            try:
                await asyncio.wait_for(ms.known.wait(), self.cfg.stream_manifest_wait_s)
            except asyncio.TimeoutError:
                self.refusals.warning(model, "stream_no_manifest", model=model, subject=m.subject,
                                      note="refused: no manifest for this model")
                return True
        stream = ledger_stream.STREAM
        if isinstance(record, mc.RoutingStats):
            remote = [(layer, e, min(rows, 1 << 40)) for layer, e, rows in record.remote
                      if not self._out_of_range(ms, ((layer, e, e + 1),))]
            msg_id = (m.headers or {}).get(ledger_stream.MSG_ID)
            await self._db(self.ledger.apply_routing, stream, seq, model, record.node, remote, msg_id, record.audits)
        elif isinstance(record, mc.Quarantine):
            voided = await self._db(self.ledger.apply_quarantine, stream, seq, model,
                                    record.node, record.at, record.since)
            if ms.coverage.ban(record.node):
                ms.stale = True
            ms.latency.pop(record.node, None)
            self.log.warning("node_quarantined", model=model, node=record.node,
                             layer=record.layer, expert=record.expert, error=record.error,
                             rows_voided=voided, since=record.since)
        else:
            last = m.metadata.num_delivered > self.cfg.unbacked_retries
            return await self._apply_batch(ms, seq, record, hold=not last)
        self._stale_status(model)
        return True

    async def _apply_batch(self, ms: _Model, seq: int, batch: mc.LedgerBatch,
                           hold: bool = False) -> bool:
        """False: ``hold`` and an event unbacked, nothing stored (read it again later)."""
        now = self.clock()
        self._expire(ms, now)
        stats = self._refresh(ms, now)
        priced, refused = [], 0
        for event in batch.events:
            index = None if self._out_of_range(ms, ((event.layer, event.expert,
                                                     event.expert + 1),)) \
                else ms.layout.range_index(event.layer, event.expert)
            if index is None:
                refused += 1
                continue
            priced.append((event, float(stats.reward_rate[index])))
        if refused:
            self.refusals.warning(batch.source, "ledger_events_out_of_range", model=ms.name,
                                  source=batch.source, batch=batch.batch_id, events=refused)
        got = await self._db(self.ledger.apply_batch, ledger_stream.STREAM, seq, ms.name,
                             batch.source, batch.batch_id, priced, now, hold)
        if got is None:
            self.log.debug("ledger_batch_held", model=ms.name, source=batch.source,
                           batch=batch.batch_id, retry_s=self.cfg.unbacked_retry_s)
            return False
        got, served = got
        if got["unbacked"] or got["quarantined"]:
            self.refusals.warning(batch.source, "ledger_events_refused", model=ms.name,
                                  source=batch.source, batch=batch.batch_id,
                                  unbacked=got["unbacked"], quarantined=got["quarantined"],
                                  note="more rows than the backbone's replies won, or a "
                                       "quarantined node")
        for event in served:
            changed, confirmed = ms.coverage.mark_served(event.node, event.layer, event.expert)
            ms.stale |= changed
            if confirmed:
                self.log.info("assignment_confirmed", model=ms.name, node=event.node)
                await self._db(self.ledger.drop_assignment, ms.name, event.node)
        self.log.info("ledger_batch", model=ms.name, source=batch.source, batch=batch.batch_id,
                      out_of_range=refused, **got)
        self._stale_status(ms.name)
        return True

    def _stale_status(self, model: str) -> None:
        """The ledger changed: a status asked after this moment must show it. A cached one (at
        most 0.2 s old) would not: `kvasir up` asks once the stream says its events are read, and
        got a status cached a moment before they were (empty totals, 2 fresh-clone CI runs)."""
        self._status_cache.pop(model, None)
        self._status_cache.pop(None, None)

    async def _on_status(self, msg: Any) -> None:
        if not msg.reply or not self.limits.allow(self._sender(msg)):
            return  # over its budget: dropped before any work
        model = self._model_of(msg.subject)
        if model is None or model not in self.models:
            await self._reply_error(msg, mc.ERR_UNKNOWN_MODEL,
                                    f"the market knows no model {model}; known: "
                                    f"{', '.join(sorted(self.models)[:20]) or 'none'}")
            return
        await self._reply_cached(msg, model)

    async def _on_node_report(self, msg: Any) -> None:
        """``kvasir.<model>.market.node.<node>``: that node's credit, audits and quarantine, two
        key lookups in the ledger file (a tab asks every few seconds; a status would be the
        whole swarm). Rate-limited per sender as status is."""
        if not msg.reply or not self.limits.allow(self._sender(msg)):
            return
        try:
            model, node = subjects.parse_node_report(msg.subject)
        except ValueError as exc:
            await self._reply_error(msg, mc.ERR_BAD_REQUEST, str(exc))
            return
        ms = self.models.get(model)
        if ms is None:
            await self._reply_error(msg, mc.ERR_UNKNOWN_MODEL, f"the market knows no model {model}")
            return
        totals, audits = await self._db(self.ledger.node, model, node)
        await self._reply(msg, mc.NodeReport(
            model=model, node=node, market=self.cfg.node, sent_at=self.clock(), events=totals.events,
            rows=totals.rows, reward=totals.reward, audits_passed=audits.passed, audits_failed=audits.failed,
            quarantined=node in ms.coverage.banned))

    async def _on_overview(self, msg: Any) -> None:
        if not msg.reply or not self.limits.allow(self._sender(msg)):
            return
        await self._reply_cached(msg, None)

    async def _reply_cached(self, msg: Any, model: str | None, max_age_s: float = 0.2) -> None:
        """Answer with a status (``model``) or overview (None) at most ``max_age_s`` old: many
        askers within the limits still cost one status a tick."""
        now = asyncio.get_running_loop().time()
        got = self._status_cache.get(model)
        if got is None or now - got[0] > max_age_s:
            if model is None:
                record = mc.MarketOverview(sent_at=self.clock(), models=tuple(
                    [await self.status(m) for m in sorted(self.models)]))
            else:
                record = await self.status(model)
            got = self._status_cache[model] = (now, record.encode(), mc.headers_for(record))
        try:
            await self._replier(msg).publish(msg.reply, got[1], headers=got[2])
        except Exception as exc:
            self.refusals.warning("reply", "reply_failed", subject=msg.subject, error=str(exc))

    # -- revocations ------------------------------------------------------------------------
    def _note_revocation(self, event: mc.Revocation) -> None:
        self.revoked.pop(event.key, None)
        self.revoked[event.key] = event
        while len(self.revoked) > mc.MAX_REVOKED_LISTED:
            del self.revoked[next(iter(self.revoked))]  # the oldest
        self._status_cache.clear()

    async def _on_revoked(self, msg: Any) -> None:
        """The enrolment service revoked a key (only it may publish here under creds)."""
        try:
            event = mc.decode_revocation(msg.data)
        except CodecError as exc:
            self.refusals.warning("revocation", "revocation_dropped", error=str(exc))
            return
        self._note_revocation(event)
        self.log.warning("node_revoked", node=event.node, why=event.why)

    async def _fetch_revocations(self) -> None:
        """The enrolment service's past revocations, asked once at start (again with back-off
        while nobody answers: the service may start after the market)."""
        delay = 0.5
        while self.state is State.RUNNING:
            try:
                msg = await self.nc.request(subjects.ENROL_REVOCATIONS, b"", timeout=2.0)
                got = mc.decode_revocation_list(msg.data)
                if isinstance(got, mc.RevocationList):
                    for event in got.revoked:
                        if event.key not in self.revoked:
                            self._note_revocation(event)
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no enrolment service (yet), or a bad answer
                self.log.debug("revocations_unavailable", error=f"{type(exc).__name__}: {exc}"[:160])
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)

    # -- status -----------------------------------------------------------------------------
    async def status(self, model: str) -> mc.MarketStatus:
        """The market's current view of one known model."""
        ms = self.models[model]
        now = self.clock()
        self._expire(ms, now)
        stats = self._refresh(ms, now)
        nodes = tuple(mc.NodeStatus(
            node=e.node, holdings=e.holdings, pending=e.pending, budget_bytes=e.budget_bytes,
            load=e.load, served=e.served,
            age_s=None if e.seen_at is None else max(0.0, now - e.seen_at),
            version=e.version, kernel=e.kernel,
            latency_ms=ms.latency[e.node][0] if e.node in ms.latency else None,
            oversubscribed=e.oversubscribed)
            for e in ms.coverage.nodes())
        totals = tuple(await self._db(self.ledger.totals, model))
        audits = tuple(await self._db(self.ledger.audits, model))
        rates = [rate for rate, until in ms.fallback.values() if until >= now]
        lay = ms.layout
        return mc.MarketStatus(
            model=model, market=self.cfg.node, sent_at=now, manifest_known=lay is not None,
            n_layer=lay.n_layer if lay else 0, n_expert=lay.n_expert if lay else 0,
            range_experts=lay.range_experts if lay else self.cfg.range_experts,
            expiry_s=self.cfg.expiry_s, nodes=nodes,
            demand=stats.entries(lay) if stats is not None else (), totals=totals,
            fallback_rate=sum(rates) / len(rates) if rates else None,
            quarantined=tuple(sorted(ms.coverage.banned))[:mc.MAX_QUARANTINED_LISTED], audits=audits,
            revoked=tuple(self.revoked.values()))
