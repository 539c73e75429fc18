"""The backbone's side of the market: routing statistics out, ledger events in safe hands.

* Routing: every expert call the router makes is counted (layer, expert, rows); every
  ``interval_s`` the counts of the window go out as :class:`RoutingStats` on
  ``kvasir.<model>.routing`` with the window's fallback rate. The market turns them into demand.
* Ledger: every reply that wins becomes a :class:`LedgerEvent` (node, layer, expert, rows) with
  an id unique for all time. Events are sent in batches by request on ``kvasir.<model>.ledger``
  and kept until the market acknowledges them (it acknowledges only once they are durable and
  ignores ids it has seen), so none is lost while the market restarts and none counts twice.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import Counter, OrderedDict, deque

import structlog

from kvasir_bus import market_codec as mc
from kvasir_bus.subjects import Subjects

log = structlog.get_logger("kvasir.market_link")


class MarketLink:
    def __init__(self, nc, model: str, node: str = "backbone", *, interval_s: float = 1.0,
                 batch_events: int = 5000, max_unacked: int = 200_000, ack_timeout_s: float = 2.0):
        self.nc, self.model, self.node = nc, model, node
        self.subjects = Subjects(model)
        self.interval_s, self.batch_events = interval_s, batch_events
        self.max_unacked, self.ack_timeout_s = max_unacked, ack_timeout_s
        self._lock = threading.Lock()  # hits are counted from the engine's thread
        self._hits: Counter = Counter()
        self._published: Counter = Counter()  # every routing count handed to the bus, for all time
        self._calls = 0
        self._local = 0
        self._events: deque[mc.LedgerEvent] = deque()
        self._unacked: OrderedDict[str, mc.LedgerBatch] = OrderedDict()
        self._boot = os.urandom(4).hex()
        self._seq = itertools.count()
        self._batches = itertools.count()
        self._task: asyncio.Task | None = None
        self.acked_events = 0
        self.dropped_events = 0
        self._no_market = False
        self._settled = asyncio.Event()  # set by a flush that left nothing unacknowledged

    # -- recording (any thread) -----------------------------------------------------------------

    def record_call(self, layer: int, expert: int, rows: int, remote: bool) -> None:
        with self._lock:
            self._hits[(layer, expert)] += rows
            self._calls += 1
            self._local += not remote

    def record_win(self, node: str, layer: int, expert: int, rows: int) -> None:
        event = mc.LedgerEvent(event_id=f"{self.node}:{self._boot}:{next(self._seq):x}", node=node,
                               layer=layer, expert=expert, rows=rows, at=time.time())
        with self._lock:
            self._events.append(event)

    def void(self, node: str) -> None:
        """``node`` was caught lying: its wins not yet handed to the market are never paid."""
        with self._lock:
            kept = deque(e for e in self._events if e.node != node)
            self.voided_events = getattr(self, "voided_events", 0) + len(self._events) - len(kept)
            self._events = kept

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
            return len(self._events) + sum(len(b.events) for b in self._unacked.values())

    async def wait_acked(self, timeout_s: float) -> bool:
        """Wait until every event recorded so far is acknowledged by the market (or refused
        for good); False if that did not happen within ``timeout_s``. Woken by the flushes of
        the link's own loop, every ``interval_s``: no polling here."""
        deadline = time.monotonic() + timeout_s
        while self.unacked_events:  # events recorded meanwhile need the next flush too
            self._settled.clear()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
        return True

    # -- the loop -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        deadline = time.monotonic() + flush_timeout_s
        await self._publish_routing()
        while self.unacked_events and time.monotonic() < deadline:
            if await self._flush_ledger():
                continue
            if self._no_market:
                break  # nobody listens: waiting cannot help
            await asyncio.sleep(0.2)
        if self.unacked_events:
            log.log(30 if self.acked_events else 20, "ledger_events_unsent", model=self.model,
                    events=self.unacked_events,
                    reason="no market on the bus" if self._no_market else "no acknowledgement before shutdown")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._publish_routing()
                await self._flush_ledger()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus may be down for a moment; keep everything
                log.warning("market_link_error", error=f"{type(exc).__name__}: {exc}")

    async def _publish_routing(self) -> None:
        with self._lock:
            hits, calls, local = self._hits, self._calls, self._local
            self._hits, self._calls, self._local = Counter(), 0, 0
            self._published.update(hits)
        if not hits:
            return
        stats = mc.RoutingStats(model=self.model, node=self.node, window_s=self.interval_s,
                                hits=tuple((layer, e, rows) for (layer, e), rows in sorted(hits.items())),
                                fallback_rate=local / calls if calls else None)
        await self.nc.publish(self.subjects.routing(), stats.encode(), headers=mc.headers_for(stats))

    async def _flush_ledger(self) -> bool:
        """Batch new events, then (re)send every unacknowledged batch. True if all were acked."""
        with self._lock:
            while self._events:
                n = min(self.batch_events, len(self._events))
                events = tuple(self._events.popleft() for _ in range(n))
                batch = mc.LedgerBatch(model=self.model, source=self.node,
                                       batch_id=f"{self.node}:{self._boot}:b{next(self._batches):x}", events=events)
                self._unacked[batch.batch_id] = batch
            while sum(len(b.events) for b in self._unacked.values()) > self.max_unacked:
                _, oldest = self._unacked.popitem(last=False)  # bounded memory: say so loudly
                self.dropped_events += len(oldest.events)
                log.error("ledger_events_dropped", events=len(oldest.events), reason="no market for too long")
            batches = list(self._unacked.values())
        all_acked = True
        for batch in batches:
            try:
                msg = await self.nc.request(self.subjects.ledger(), batch.encode(), timeout=self.ack_timeout_s,
                                            headers=mc.headers_for(batch))
                reply = mc.decode_ledger_reply(msg.data)
            except Exception as exc:  # no market, timeout, garbage: keep the batch for later
                self._no_market = type(exc).__name__ == "NoRespondersError"
                log.debug("ledger_not_acked", batch=batch.batch_id, error=type(exc).__name__)
                return False
            self._no_market = False
            if isinstance(reply, mc.LedgerAck) and reply.batch_id == batch.batch_id:
                with self._lock:
                    self._unacked.pop(batch.batch_id, None)
                self.acked_events += len(batch.events)
            elif mc.should_retry(reply):  # "not yet" (warming up after a restart...): keep it
                log.info("ledger_not_yet", batch=batch.batch_id, code=getattr(reply, "code", "?"))
                return False
            else:  # the market read the batch and refused it: re-sending cannot help
                with self._lock:
                    self._unacked.pop(batch.batch_id, None)
                self.dropped_events += len(batch.events)
                all_acked = False
                log.error("ledger_refused", batch=batch.batch_id, reply=str(reply)[:200])
        if not self.unacked_events:
            self._settled.set()
        return all_acked
