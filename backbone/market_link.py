"""The backbone's side of the market: routing statistics out, ledger events in safe hands.

* Routing: every expert call the router makes is counted (layer, expert, rows); every
  ``interval_s`` the counts of the window go out as :class:`RoutingStats` on
  ``kvasir.<model>.routing`` with the window's fallback rate. The market turns them into demand.
* Tokens: every token passes each MoE layer once and is routed to ``top_k`` experts there, so
  the rows recorded on the first MoE layer (the smallest layer seen) / ``top_k`` are the tokens
  the backbone ran; they travel in the routing statistics (``tokens``) for the dashboard's
  tokens/s. Rows of a layer that a window's cut splits carry over to the next window, so the
  counts add up to the true total. ``top_k=0``: not counted.
* Ledger: every reply that wins becomes a :class:`LedgerEvent` (node, layer, expert, rows) with
  an id unique for all time. Recording one is cheap, since the engine's thread does it for every
  won call (a decode step of 8 rows wins ~40 a layer): a plain tuple under the lock and its spool
  record; the event is built (and validated) when a batch is cut on the bus thread, and the loop
  is woken once per batch, not once per win (each wake-up made the bus thread take the GIL from
  the engine's: ~25 us a win in all, 22% of the engine thread in a race run). The debug line
  ``ledger_win`` is one per batch (its events, and the nodes in it).
  Events go in batches into the JetStream stream of :mod:`kvasir_bus.ledger_stream` on
  ``kvasir.<model>.ledger`` (``Nats-Msg-Id`` = the batch id, so a re-send is stored once), and
  are kept here until the stream acknowledges them: stored on disk by the server, they survive
  this process and the market; the market's durable consumer counts each once.
* The bound: the rows each worker's reply won per (layer, expert) travel in the routing
  statistics (``remote``), which go into the same stream *before* the batch that credits them;
  the market never credits more than that.
* Latency: each won reply's time (request to its last chunk, as the dispatch measured it) is
  summed per worker node; the window's ``(node, calls, mean_ms)`` travel in the routing
  statistics (``latency``) and the market shows them per worker. At most
  ``market_codec.MAX_LATENCY_NODES`` nodes a window: those with the most calls.
* Audits: each audit the dispatcher judges is counted per worker node, passed or failed; the
  window's ``(node, passed, failed)`` travel in the routing statistics (``audits``), signed
  and stored in the stream like the bound, so the market adds each window up once and shows
  every node its count (a browser tab its "audits passed"). At most
  ``market_codec.MAX_AUDIT_NODES`` nodes a window: the first audited; audits of the others in
  that window are counted in ``audits_dropped`` and not sent.
* ``void(node, since)``: an audit caught ``node`` lying: its wins not yet handed to the stream
  that it won at or after ``since`` (its last passed audit, as the verdict says) are dropped, as
  the market voids them; audited work before stays. Later wins of it are not recorded (nor
  their latency).

* Spool (:mod:`backbone.spool`): with one, every won event is also written to a local file the
  moment it is recorded, with the routing statistics and batch cuts that carry it and a record
  of each acknowledgement. A SIGKILL between a win and the stream's acknowledgement loses
  nothing: the next ``start()`` on the same spool (a restarted backbone, or
  ``kvasir ledger replay``) resends what was not acknowledged with the same ``Nats-Msg-Id``
  (stored once by the stream; the market also refuses an event id or routing id it applied
  before, past the stream's duplicate window), and wins never cut into a batch go out with
  their rows as a new bound. Without a spool, such a SIGKILL loses at most ``flush_s`` plus
  one round trip of wins. ``wait_acked`` tells the caller when everything recorded so far is
  safe in the market's hands.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import replace
from typing import NamedTuple

import structlog

from backbone import spool as spool_file
from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.codec import CodecError
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.market_link")


class _Win(NamedTuple):
    """A win as recorded on the engine's thread: a :class:`LedgerEvent`'s fields, not yet checked
    (the event is built when its batch is cut)."""

    event_id: str
    node: str
    layer: int
    expert: int
    rows: int
    at: float


def _latency_entries(latency: dict[str, list]) -> tuple[tuple[str, int, float], ...]:
    """node -> [calls, seconds] -> ``(node, calls, mean_ms)`` sorted by node, the busiest
    ``MAX_LATENCY_NODES`` only (the record's bound)."""
    busiest = sorted(latency.items(), key=lambda kv: (-kv[1][0], kv[0]))[:mc.MAX_LATENCY_NODES]
    return tuple((node, calls, 1000 * seconds / calls) for node, (calls, seconds) in sorted(busiest))


def _routing_record(msg_id: str, stats: mc.RoutingStats) -> list:
    """The spool's copy of routing statistics: the bound (``remote``) and the audits only. A
    replay resends it under the same id; usage and latency of that window are not worth counting
    twice on the market's live subscription, which no duplicate window guards (the market counts
    the bound and the audits from the stream, once per id)."""
    bound = replace(stats, hits=(), fallback_rate=None, latency=(), tokens=0)
    return ["R", msg_id, bound.encode()]


class MarketLink:
    def __init__(self, nc, model: str, node: str = "backbone", *, interval_s: float = 1.0,
                 batch_events: int = 5000, max_unacked: int = 200_000, ack_timeout_s: float = 2.0,
                 flush_s: float = 0.05, top_k: int = 0, spool: spool_file.Spool | None = None):
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: tokens not counted), got {top_k}")
        self.nc, self.model, self.node = nc, model, node
        self.top_k = top_k
        self.subjects = Subjects(model)
        self.interval_s, self.batch_events = interval_s, batch_events
        self.max_unacked, self.ack_timeout_s, self.flush_s = max_unacked, ack_timeout_s, flush_s
        self._remote: Counter = Counter()  # rows won by workers' replies, not yet published
        self._latency: dict[str, list] = {}  # node -> [calls, seconds] won in this window
        self._audits: dict[str, list] = {}  # node -> [passed, failed] judged in this window
        self._audited: OrderedDict[str, list] = OrderedDict()  # the same since start, least recent first
        self.audits_dropped = 0  # audits past a window's node bound, never sent
        self._routing: deque[tuple[str, mc.RoutingStats]] = deque()  # published, not yet stored by the stream
        self._void: set[str] = set()
        self._last_seq = 0                 # the stream sequence of our last stored message
        self._wake: asyncio.Event | None = None
        self._loop = None
        self._lock = threading.Lock()  # hits are counted from the engine's thread
        self._spool_loaded = False  # compacting a spool whose backlog is not in memory would lose it
        self._hits: Counter = Counter()
        self._published: Counter = Counter()  # every routing count handed to the bus, for all time
        self._calls = 0
        self._local = 0
        self._first_layer: int | None = None  # the smallest layer seen: the first MoE layer
        self._first_rows = 0  # rows recorded there, not yet counted as whole tokens
        self._events: deque[mc.LedgerEvent | _Win] = deque()  # wins not yet cut into a batch
        self._woken = False  # a wake-up of the loop is on its way (one per batch, not per win)
        self.invalid_events = 0  # wins whose event did not validate when cut: dropped, said
        self._unacked: OrderedDict[str, mc.LedgerBatch] = OrderedDict()
        self._boot = os.urandom(4).hex()
        self._seq = itertools.count()
        self._batches = itertools.count()
        self._task: asyncio.Task | None = None
        self.acked_events = 0
        self.dropped_events = 0
        self._no_market = False
        self._settled = asyncio.Event()  # set by a flush that left nothing unacknowledged
        self.signer = None  # kvasir_bus.signing.Signer: every stored record carries its signature
        self.spool = spool
        self._spool_floor = 0        # the spool's size after its last compaction
        self.replayed_events = 0     # events this start found in the spool, not yet stored
        self.spool_refused = 0       # records the spool's size bound refused (or the disk did)
        self._spool_log = ThrottledLog(log, 60.0)

    # -- recording (any thread) -----------------------------------------------------------------

    def record_call(self, layer: int, expert: int, rows: int, remote: bool) -> None:
        with self._lock:
            self._hits[(layer, expert)] += rows
            if self._first_layer is None or layer < self._first_layer:
                self._first_layer, self._first_rows = layer, 0  # count from the first layer only
            if layer == self._first_layer:
                self._first_rows += rows
            self._calls += 1
            self._local += not remote

    def record_win(self, node: str, layer: int, expert: int, rows: int,
                   latency_s: float | None = None, at: float | None = None) -> None:
        """A worker's reply won; ``latency_s``: how long it took (None: not measured); ``at``: when
        it was won (``time.time()``; None: now). The dispatcher passes the time it took the reply,
        before judging its audit, so an audited win is older than the pass it earned. Called on the
        engine's thread for every won call: a tuple and its spool record, no more (module doc)."""
        with self._lock:
            self._remote[(layer, expert)] += rows  # the bound, whoever is paid for it
            if node in self._void:
                return
            win = _Win(f"{self.node}:{self._boot}:{next(self._seq):x}", node, layer, expert, rows,
                       time.time() if at is None else at)
            self._events.append(win)
            if self.spool is not None:
                self._spool([spool_file.event_record(win)])
            if latency_s is not None and latency_s >= 0 and latency_s != float("inf"):
                acc = self._latency.get(node)
                if acc is None:
                    acc = self._latency[node] = [0, 0.0]
                acc[0] += 1
                acc[1] += latency_s
            wake, self._woken = not self._woken, True
        if wake and self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: stop() flushes what is left
                pass

    def record_audit(self, node: str, passed: bool) -> None:
        """The dispatcher judged an audit of ``node``'s reply. Thread-safe."""
        with self._lock:
            counts = self._audits.get(node)
            if counts is None:
                if len(self._audits) >= mc.MAX_AUDIT_NODES:
                    self.audits_dropped += 1
                    return
                counts = self._audits[node] = [0, 0]
            counts[0 if passed else 1] += 1
            total = self._audited.pop(node, None) or [0, 0]
            total[0 if passed else 1] += 1
            self._audited[node] = total
            while len(self._audited) > mc.MAX_NODES:
                self._audited.popitem(last=False)

    def audited(self, node: str) -> tuple[int, int]:
        """Audits of ``node`` judged here since start: (passed, failed)."""
        with self._lock:
            passed, failed = self._audited.get(node, (0, 0))
            return passed, failed

    def void(self, node: str, since: float = 0.0) -> int:
        """``node`` failed an audit: drop its wins not yet handed to the stream that it won at or
        after ``since`` (its last passed audit, ``time.time()``; 0: all of them), record none of its
        later ones. The wins before ``since`` were vouched for by that audit and stay, as the
        market keeps them (``Quarantine.since``). Returns the events dropped. Thread-safe."""
        with self._lock:
            self._void.add(node)
            self._spool([["V", node, since]])
            kept = deque(e for e in self._events if e.node != node or e.at < since)
            dropped = len(self._events) - len(kept)
            self._events = kept
            self._latency.pop(node, None)
        log.warning("ledger_node_void", node=node, events_dropped=dropped, since=since)
        return dropped

    @property
    def pending_hits(self) -> int:
        """Routing counts recorded but not yet published."""
        with self._lock:
            return len(self._hits)

    @property
    def published_hits(self) -> dict[tuple[int, int], int]:
        """Rows per (layer, expert) sent on the routing subject since start (a copy)."""
        with self._lock:
            return dict(self._published)

    @property
    def unacked_events(self) -> int:
        with self._lock:
            return len(self._events) + sum(len(b.events) for b in self._unacked.values()) \
                + len(self._routing)

    async def wait_acked(self, timeout_s: float) -> bool:
        """Wait until every event recorded so far is stored by the stream and read (acked) by
        the market's durable consumer; False if that did not happen within ``timeout_s``.
        The first part is woken by the link's own flushes; the second asks the server for the
        consumer's ack floor every 50 ms."""
        deadline = time.monotonic() + timeout_s
        while self.unacked_events:  # events recorded meanwhile need the next flush too
            self._settled.clear()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
        target = self._last_seq
        js = self.nc.jetstream()
        while True:
            try:
                info = await js.consumer_info(ledger_stream.STREAM, ledger_stream.CONSUMER,
                                              timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                if info.ack_floor.stream_seq >= target:
                    return True
            except asyncio.CancelledError:
                raise
            except Exception:  # no market consumer yet, or a slow answer: ask again
                pass
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    # -- the loop -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take the spool (if any) and resend what it holds; then run. Raises KvasirError if
        the spool is another process's or another model's."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            if self.spool is not None:
                self._load(self.spool.open(self.model, self.node))
                self._spool_loaded = True
            self._task = asyncio.create_task(self._run())
            if self.unacked_events:
                self._wake.set()

    def _load(self, backlog: spool_file.Backlog) -> None:
        """What a spool held, back in the queues it left: routing and batches to resend under
        their own ids, wins never cut (their rows become the bound of a new cut)."""
        routing = 0
        with self._lock:
            for msg_id, data in backlog.routing:
                try:
                    self._routing.append((msg_id, mc.decode_routing(data)))
                    routing += 1
                except CodecError as exc:
                    log.warning("ledger_spool_record_invalid", msg_id=msg_id, error=str(exc))
            for batch_id, events in backlog.batches:
                if events:
                    self._unacked[batch_id] = mc.LedgerBatch(self.model, self.node, batch_id, events)
            for event in backlog.pending:
                self._events.append(event)
                self._remote[(event.layer, event.expert)] += event.rows
            self.replayed_events = backlog.events
            self._compact()
        if backlog.events or routing or backlog.torn:
            log.log(30 if backlog.torn else 20, "ledger_spool_replay", spool=str(self.spool.dir),
                    events=backlog.events, batches=len(backlog.batches), routing=routing,
                    torn_tail=backlog.torn)

    # -- the spool (under self._lock) ------------------------------------------------------------

    def _spool(self, records: list[list]) -> None:
        """Append records to the spool; compact it when it has grown past ``compact_bytes``
        and twice its live size; refuse (loudly, once a minute) what would pass ``max_bytes``
        even then, or what the disk refuses: the event itself is still sent, only not safe
        from a SIGKILL."""
        sp = self.spool
        if sp is None or not records or sp.closed:
            return
        data = b"".join(spool_file.frame(r) for r in records)
        try:
            if sp.size + len(data) > max(sp.compact_bytes, 2 * self._spool_floor) or not sp.fits(len(data)):
                self._compact()
            if not sp.fits(len(data)):
                raise OSError(f"the spool holds {sp.size} bytes; its bound is {sp.max_bytes}")
            sp.append(data)
        except OSError as exc:
            self.spool_refused += len(records)
            self._spool_log.error("spool", "ledger_spool_refused", spool=str(sp.dir), refused=self.spool_refused,
                                  error=str(exc), note="these wins are sent, but a SIGKILL now would lose them")

    def _compact(self) -> None:
        """Rewrite the spool as what is not yet acknowledged: routing, batches, uncut wins."""
        records = [_routing_record(msg_id, stats) for msg_id, stats in self._routing if stats.remote or stats.audits]
        for batch in self._unacked.values():
            records += [spool_file.event_record(e) for e in batch.events]
            records.append(["B", batch.batch_id, [e.event_id for e in batch.events]])
        records += [spool_file.event_record(e) for e in self._events]
        self.spool.rewrite(records)
        self._spool_floor = self.spool.size

    def report(self) -> dict:
        """For ``--json``: what the spool replayed at start, what the stream stored, what is
        left unsent (spooled for the next start, if there is a spool)."""
        return {"spool": str(self.spool.dir) if self.spool else None, "replayed": self.replayed_events,
                "stored": self.acked_events, "unsent": self.unacked_events,
                "spool_refused": self.spool_refused, "dropped": self.dropped_events}

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Stop the loop, send what the stream has not stored for up to ``flush_timeout_s``, then
        compact and let go of the spool. The spool is let go also when the flush is cancelled
        (a shutdown out of time): the next backbone of this node must be able to take it."""
        try:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                self._task = None
                try:
                    await asyncio.wait_for(self._flush_all(), flush_timeout_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.release_spool()
        if self.unacked_events:
            log.log(30 if self.acked_events else 20, "ledger_events_unsent", model=self.model,
                    events=self.unacked_events, spool=str(self.spool.dir) if self.spool else None,
                    reason="no market on the bus" if self._no_market else "no acknowledgement before shutdown",
                    note="kept in the spool: sent on the next start, or by kvasir ledger replay"
                    if self.spool else "lost: no spool")

    async def _flush_all(self) -> None:
        await self._publish_routing()
        while self.unacked_events:
            await self._publish_routing()
            if await self._flush_ledger():
                continue
            if self._no_market:
                break  # nobody listens: waiting cannot help
            await asyncio.sleep(0.2)

    def release_spool(self) -> None:
        """Compact the spool to what is unacknowledged and close it (its lock with it). Safe
        from any thread and more than once: the service calls it again after its bus thread
        ended, in case the stop never got that far."""
        if self.spool is None:
            return
        with self._lock:
            if self.spool.closed or not self._spool_loaded:
                self.spool.close()
                return
            try:
                self._compact()
            except OSError as exc:
                log.error("ledger_spool_not_compacted", spool=str(self.spool.dir), error=str(exc))
            self.spool.close()

    async def _run(self) -> None:
        next_routing = time.monotonic() + self.interval_s
        while True:
            # A win wakes the loop (after flush_s, to batch its neighbours); routing goes out
            # every interval_s and before every ledger flush (it carries the bound).
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_routing - time.monotonic()))
                await asyncio.sleep(self.flush_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            with self._lock:  # wins from now on wake the loop again
                self._woken = False
            if time.monotonic() >= next_routing:
                next_routing = time.monotonic() + self.interval_s
            try:
                await self._publish_routing()
                await self._flush_ledger()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus may be down for a moment; keep everything
                log.warning("market_link_error", error=f"{type(exc).__name__}: {exc}")

    def _cut(self) -> None:
        """Under the lock, at once: the window's routing counts become a RoutingStats, and the
        events recorded so far become batches. Their wins' rows are all in that RoutingStats
        or an earlier one, which the stream stores first: the market has the bound before the
        claim."""
        with self._lock:
            hits, calls, local, remote = self._hits, self._calls, self._local, self._remote
            self._hits, self._calls, self._local, self._remote = Counter(), 0, 0, Counter()
            latency, self._latency = self._latency, {}
            audits, self._audits = self._audits, {}
            tokens, self._first_rows = divmod(self._first_rows, self.top_k) if self.top_k else (0, 0)
            self._published.update(hits)
            spooled = []
            if hits or remote or audits:
                msg_id = f"{self.node}:{self._boot}:r{next(self._batches):x}"
                stats = mc.RoutingStats(
                    model=self.model, node=self.node, window_s=self.interval_s,
                    hits=tuple((layer, e, rows) for (layer, e), rows in sorted(hits.items())),
                    fallback_rate=local / calls if calls else None,
                    remote=tuple((layer, e, rows) for (layer, e), rows in sorted(remote.items())),
                    latency=_latency_entries(latency), tokens=min(tokens, 1 << 40),
                    audits=tuple((node, passed, failed) for node, (passed, failed) in sorted(audits.items())))
                self._routing.append((msg_id, stats))
                if remote or audits:  # the bound of the batches below: spooled before them
                    spooled.append(_routing_record(msg_id, stats))
            wins = self._events
            self._events = deque()
            events_all = self._checked(wins)
            for start in range(0, len(events_all), self.batch_events):
                events = tuple(events_all[start:start + self.batch_events])
                batch = mc.LedgerBatch(model=self.model, source=self.node,
                                       batch_id=f"{self.node}:{self._boot}:b{next(self._batches):x}", events=events)
                self._unacked[batch.batch_id] = batch
                spooled.append(["B", batch.batch_id, [e.event_id for e in events]])
            self._spool(spooled)
            while sum(len(b.events) for b in self._unacked.values()) > self.max_unacked:
                _, oldest = self._unacked.popitem(last=False)  # bounded memory: say so loudly
                self.dropped_events += len(oldest.events)
                log.error("ledger_events_dropped", events=len(oldest.events), reason="no stream for too long")

    def _checked(self, wins) -> list[mc.LedgerEvent]:
        """The wins recorded since the last cut as checked events (under the lock). One that does
        not validate (a dispatcher's bug: its node, layer and rows come from decoded replies) is
        dropped with an error line, never sent; its rows stay in the bound."""
        events = []
        for win in wins:
            if isinstance(win, mc.LedgerEvent):  # from a spool's backlog: checked when read
                events.append(win)
                continue
            try:
                events.append(mc.LedgerEvent(*win))
            except (CodecError, ValueError, TypeError) as exc:
                self.invalid_events += 1
                log.error("ledger_event_invalid", event_id=win.event_id, node=win.node, error=str(exc))
        if events:
            log.debug("ledger_win", events=len(events), first=events[0].event_id, last=events[-1].event_id,
                      nodes=sorted({e.node for e in events})[:8])
        return events

    async def _publish_routing(self) -> None:
        """Cut, then hand the routing statistics to the stream in order; kept until stored."""
        self._cut()
        with self._lock:
            pending = list(self._routing)
        js = self.nc.jetstream()
        for item in pending:
            msg_id, stats = item
            if await self._store(js, self.subjects.routing(), stats, msg_id) is None:
                return
            with self._lock:
                if self._routing and self._routing[0] is item:
                    self._routing.popleft()
                if item[1].remote or item[1].audits:
                    self._spool([["A", msg_id]])

    async def _store(self, js, subject: str, record, msg_id: str):
        """Publish ``record`` into the stream (with its readable headers and the id the stream
        dedupes by) and wait for its acknowledgement; None if not stored."""
        try:
            # msgpack encodes a record to the same bytes every time: the signature covers what is sent
            signed = self.signer.headers(record.encode()) if self.signer is not None else {}
            ack = await js.publish(subject, record.encode(), timeout=self.ack_timeout_s,
                                   headers={**mc.headers_for(record), ledger_stream.MSG_ID: msg_id, **signed})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no JetStream, no stream yet, a timeout: keep it for later
            self._no_market = type(exc).__name__ in ("NoRespondersError", "NoStreamResponseError")
            log.debug("ledger_not_stored", msg_id=msg_id, error=f"{type(exc).__name__}: {exc}")
            if self._no_market:
                try:
                    await ledger_stream.ensure_stream(js)
                except Exception:
                    pass
            return None
        self._no_market = False
        self._last_seq = max(self._last_seq, ack.seq)
        return ack

    async def _flush_ledger(self) -> bool:
        """(Re)send every batch the stream has not stored, once the routing statistics before
        them are stored. True if nothing is left."""
        with self._lock:
            batches = list(self._unacked.values())
        if self._routing:  # the bound must be stored before the batches it backs
            return False
        js = self.nc.jetstream()
        for batch in batches:
            if await self._store(js, self.subjects.ledger(), batch, batch.batch_id) is None:
                return False
            with self._lock:
                self._unacked.pop(batch.batch_id, None)
                self._spool([["A", batch.batch_id]])
            self.acked_events += len(batch.events)
            log.debug("ledger_stored", batch=batch.batch_id, events=len(batch.events))
        if not self.unacked_events:
            self._settled.set()
        return True


async def replay(nc, directory, timeout_s: float = 30.0) -> dict:
    """``kvasir ledger replay``: hand what a (dead) backbone's spool holds to the ledger stream,
    under the ids it was first sent with, and wait up to ``timeout_s`` for the stream to store
    it. The spool's header says whose it is; a spool a live backbone holds is refused."""
    from kvasir_bus.errors import UsageError

    backlog = spool_file.read(directory)
    if not backlog.model:
        raise UsageError(f"{directory}: not a ledger spool (no header record)")
    link = MarketLink(nc, backlog.model, backlog.node, spool=spool_file.Spool(directory))
    await link.start()
    deadline = time.monotonic() + timeout_s
    while link.unacked_events and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await link.stop(flush_timeout_s=max(0.0, deadline - time.monotonic()))
    return {"model": backlog.model, "node": backlog.node, **link.report()}
