"""Fakes for the market tests: a synthetic manifest, a fake backbone, fake workers.

No compute anywhere: the backbone only answers manifest requests and puts routing statistics
and ledger batches into the ledger stream; a worker only volunteers and then heartbeats what it
was assigned (it counts as a replica once the backbone reports it served: ``serve``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import time

from nats.js.errors import NotFoundError

from kvasir_bus import codec, ledger_stream, market_codec as mc
from kvasir_bus.wire import Holding
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects

FP = "feedc0ffee000001"


def make_manifest(model: str = FP, n_layer: int = 2, n_expert: int = 24,
                  slab_bytes: tuple[int, ...] = (1000, 1200), dense: tuple[int, ...] = ()
                  ) -> mc.Manifest:
    """A manifest with made-up slabs: each expert of layer L is 3 x ``slab_bytes[L]``."""
    slabs, offset = [], 4096
    for layer in range(n_layer):
        if layer in dense:
            continue
        size = slab_bytes[layer % len(slab_bytes)]
        for expert in range(n_expert):
            for kind in mc.KINDS:
                digest = hashlib.sha256(f"{model}/{layer}/{expert}/{kind}".encode()).hexdigest()
                slabs.append(mc.SlabRef(layer, expert, kind, offset, size, digest))
                offset += size
    return mc.Manifest(model=model, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert,
                       n_embd=16, n_ff=8, file_bytes=offset, data_offset=4096, source_url="",
                       slabs=tuple(slabs))


def heartbeat(model: str, node: str, holdings, budget: int = 0, served: int = 0
              ) -> codec.Heartbeat:
    return codec.Heartbeat(model=model, node=node, holdings=tuple(holdings),
                           budget_bytes=budget, load=0.0, served=served, version="0.1.0",
                           kernel="fake", sent_at=time.time())


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = ""):
    """Poll ``predicate`` (sync or async) until it returns something truthy; fail after
    ``timeout``. Readiness is always polled with a deadline, never slept for."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(interval)


async def stream_read(nc, timeout: float = 10.0, what: str = "the market reading the stream"):
    """Wait until the market's durable consumer has acked every message in the ledger stream:
    each one applied or refused, its effect in the ledger (the market acks after applying).
    Counting ``Market.stream_applied`` instead is fragile: the setup's own routing and join
    messages share the stream, and a held batch is read more than once."""
    js = nc.jetstream()

    async def all_acked() -> bool:
        try:
            stream = await js.stream_info(ledger_stream.STREAM)
            consumer = await js.consumer_info(ledger_stream.STREAM, ledger_stream.CONSUMER)
        except NotFoundError:  # the market has not made its consumer yet
            return False
        return consumer.ack_floor.stream_seq >= stream.state.last_seq

    await wait_for(all_acked, timeout=timeout, what=what)


class FakeBackbone:
    """Answers ``kvasir.<model>.manifest`` and publishes routing statistics on demand."""

    def __init__(self, url: str, manifest: mc.Manifest, node: str = "backbone") -> None:
        self.url, self.manifest, self.node = url, manifest, node
        self.subjects = Subjects(manifest.model)
        self.nc = None
        self.manifest_requests = 0
        self._ids = itertools.count()

    async def start(self) -> FakeBackbone:
        self.nc = await connect(self.url, name="fake-backbone")

        async def on_manifest(msg) -> None:
            self.manifest_requests += 1
            await self.nc.publish(msg.reply, self.manifest.encode(),
                                  headers=mc.headers_for(self.manifest))

        await self.nc.subscribe(self.subjects.manifest(), cb=on_manifest)
        await self.nc.flush()
        return self

    async def routing(self, hits, fallback_rate: float | None = None,
                      window_s: float = 1.0, remote=(), latency=(), tokens: int = 0, audits=()) -> None:
        """Routing statistics, into the ledger stream as the real backbone does (``remote``:
        the rows workers' replies won, the market's bound on credit; ``latency``: (node,
        calls, mean_ms) of the workers whose replies won; ``tokens``: the window's tokens;
        ``audits``: (node, passed, failed) judged in the window)."""
        stats = mc.RoutingStats(self.manifest.model, self.node, window_s, tuple(hits),
                                fallback_rate=fallback_rate, remote=tuple(remote),
                                latency=tuple(latency), tokens=tokens, audits=tuple(audits))
        await self._store(self.subjects.routing(), stats.encode(), f"r-{next(self._ids)}")

    async def _store(self, subject: str, data: bytes, msg_id: str):
        js = self.nc.jetstream()
        await ledger_stream.ensure_stream(js)
        return await js.publish(subject, data, headers={ledger_stream.MSG_ID: msg_id})

    async def ledger(self, batch: mc.LedgerBatch, backed: bool = True):
        """A ledger batch into the stream (after routing that backs every row, unless
        ``backed`` is False). Returns the stream's PubAck (``duplicate`` on a re-send)."""
        if backed:
            won = collections.Counter()
            for e in batch.events:
                won[(e.layer, e.expert)] += e.rows
            await self.routing((), remote=[(layer, e, r) for (layer, e), r in sorted(won.items())])
        return await self._store(self.subjects.ledger(), batch.encode(), batch.batch_id)

    async def serve(self, node: str, holdings) -> None:
        """``node`` won one reply for the first expert of each holding."""
        events = tuple(mc.LedgerEvent(f"served-{node}-{next(self._ids)}", node, h.layer, h.lo, 1,
                                      1.0) for h in holdings)
        await self.ledger(mc.LedgerBatch(self.manifest.model, self.node,
                                         f"serve-{next(self._ids)}", events))

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()


class FakeWorker:
    """Volunteers with a budget, then heartbeats its assignment every ``heartbeat_s``."""

    def __init__(self, url: str, model: str, node: str, budget: int,
                 heartbeat_s: float = 0.1) -> None:
        self.url, self.model, self.node, self.budget = url, model, node, budget
        self.heartbeat_s = heartbeat_s
        self.subjects = Subjects(model)
        self.nc = None
        self.assignment: mc.Assignment | None = None
        self._beat: asyncio.Task | None = None

    async def volunteer(self, budget: int | None = None):
        if self.nc is None:
            self.nc = await connect(self.url, name=f"fake-{self.node}")
        req = mc.VolunteerRequest(self.model, self.node, self.budget if budget is None
                                  else budget)
        msg = await self.nc.request(self.subjects.volunteer(), req.encode(), timeout=3.0)
        reply = mc.decode_volunteer_reply(msg.data)
        if isinstance(reply, mc.Assignment):
            self.assignment = reply
        return reply

    async def start(self) -> mc.Assignment:
        """Volunteer, then serve (heartbeat) the assignment."""
        reply = await self.volunteer()
        assert isinstance(reply, mc.Assignment), reply
        await self.beat()
        self._beat = asyncio.ensure_future(self._loop())
        return reply

    @property
    def holdings(self) -> tuple[Holding, ...]:
        return self.assignment.holdings if self.assignment else ()

    async def beat(self, flush: bool = True) -> None:
        hb = heartbeat(self.model, self.node, self.holdings, self.budget)
        await self.nc.publish(self.subjects.coverage(self.node), hb.encode(),
                              headers=codec.headers_for(hb))
        if flush:
            await self.nc.flush()

    async def _loop(self) -> None:
        while self._beat is not None:
            await asyncio.sleep(self.heartbeat_s)
            await self.beat(flush=False)  # like a worker: publish and go on

    async def kill(self) -> None:
        """Die without a word: heartbeats just stop."""
        beat, self._beat = self._beat, None
        while beat is not None and not beat.done():
            beat.cancel()  # again, should a wait_for inside have swallowed it (Python < 3.12)
            await asyncio.wait({beat}, timeout=0.1)
        if self.nc is not None:
            await self.nc.close()
            self.nc = None
