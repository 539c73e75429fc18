"""The market on a real embedded NATS, with a fake backbone and fake workers (no compute).

Expiry is short (0.6 s) and every wait polls the demand map or the market's answers with a
deadline; nothing sleeps for readiness.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import nats.errors

from kvasir_bus import market_codec as mc
from kvasir_bus.cli import main
from kvasir_bus.codec import ErrorReply, Holding
from kvasir_bus.connect import connect
from kvasir_bus.logs import capture, configure
from kvasir_bus.subjects import MARKET_OVERVIEW, Subjects
from backbone.market_link import MarketLink
from market.dashboard import Dashboard, DashboardConfig
from market.ledger import Ledger
from market.show import status_json
from market.service import Market, MarketConfig
from tests.market.fakes import (FP, FakeBackbone, FakeWorker, heartbeat, make_manifest,
                                stream_read, wait_for)

EXPIRY = 0.6
ONE_RANGE = 8 * 3600 + 1000          # fits one range of either layer, never two
RANGES = [Holding(0, 0, 8), Holding(0, 8, 16), Holding(0, 16, 24),
          Holding(1, 0, 8), Holding(1, 8, 16), Holding(1, 16, 24)]
HOT, WARM = Holding(1, 8, 16), Holding(0, 16, 24)


def config(db, **kw) -> MarketConfig:
    fields = dict(db_path=str(db), expiry_s=EXPIRY, assign_grace_s=30.0, range_experts=8,
                  demand_interval_s=0.5, manifest_retry_s=0.05, manifest_retry_max_s=0.2,
                  volunteer_wait_s=1.0)
    fields.update(kw)
    return MarketConfig(**fields)


def routing_hits(hot: dict[Holding, int], base: int = 10):
    """``base`` rows for every expert, ``base x factor`` for the experts of hot ranges."""
    hits = []
    for r in RANGES:
        for e in range(r.lo, r.hi):
            hits.append((r.layer, e, base * hot.get(r, 1)))
    return hits


class DemandWatcher:
    """Keeps the latest demand map published on ``kvasir.<model>.demand``."""

    def __init__(self) -> None:
        self.latest: mc.DemandMap | None = None
        self.count = 0

    async def start(self, url: str) -> DemandWatcher:
        self.nc = await connect(url, name="demand-watcher")

        async def on_demand(msg) -> None:
            self.latest = mc.decode_demand(msg.data)
            self.count += 1

        await self.nc.subscribe(Subjects(FP).demand(), cb=on_demand)
        await self.nc.flush()
        return self

    def holes(self) -> set[Holding] | None:
        return None if self.latest is None else {e.holding for e in self.latest.holes}

    def entry(self, r: Holding) -> mc.DemandEntry | None:
        return None if self.latest is None else self.latest.entry(r.layer, r.lo)

    async def stop(self) -> None:
        await self.nc.close()


class Swarm:
    """A market, a fake backbone, a demand watcher and fake workers on one bus."""

    def __init__(self, url: str, db, **cfg) -> None:
        self.url, self.db, self.cfg = url, db, cfg
        self.workers: list[FakeWorker] = []

    async def start(self, hot: dict[Holding, int] | None = None) -> Swarm:
        self.watch = await DemandWatcher().start(self.url)
        self.market_nc = await connect(self.url, name="market")
        self.market = await Market(self.market_nc, config(self.db, **self.cfg)).start()
        self.backbone = await FakeBackbone(self.url, make_manifest()).start()
        await self.backbone.routing(routing_hits(hot or {}), fallback_rate=0.25)
        if hot:  # ready once the market weighs the hot range
            first = max(hot, key=hot.get)
            await wait_for(lambda: (e := self.watch.entry(first)) and e.target > 1,
                           what="the hot range's target in the demand map")
        else:
            await wait_for(lambda: self.watch.latest, what="a demand map")
        return self

    async def worker(self, name: str, budget: int = ONE_RANGE, serve: bool = True) -> FakeWorker:
        """A volunteer that heartbeats its assignment and (``serve``) wins a reply for it."""
        w = FakeWorker(self.url, FP, name, budget)
        await w.start()
        self.workers.append(w)
        if serve:
            await self.backbone.serve(name, w.holdings)
        return w

    async def restart_market(self) -> None:
        await self.market.stop()
        await self.market_nc.close()
        self.market_nc = await connect(self.url, name="market-2")
        self.market = await Market(self.market_nc, config(self.db, **self.cfg)).start()

    async def stop(self) -> None:
        for w in self.workers:
            await w.kill()
        await self.market.stop()
        await self.market_nc.close()
        await self.backbone.stop()
        await self.watch.stop()


async def request(url: str, subject: str, payload: bytes, decode):
    nc = await connect(url, name="asker")
    try:
        msg = await nc.request(subject, payload, timeout=3.0)
        return decode(msg.data)
    finally:
        await nc.close()


# -- volunteering, self-healing, replicas ---------------------------------------------------

def test_six_volunteers_take_distinct_ranges_scarcest_first_until_covered(nats_server, arun,
                                                                          tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start(hot={HOT: 5})
        try:
            got = []
            for i in range(6):
                w = await swarm.worker(f"w-{i}")
                assert len(w.holdings) == 1, w.assignment
                got.append(w.holdings[0])
                assert w.assignment.bytes <= ONE_RANGE
            assert got[0] == HOT                     # the hottest hole first
            assert sorted(got) == RANGES              # each a distinct range: all covered
            await wait_for(lambda: swarm.watch.holes() == set(), what="full coverage")
            assert swarm.market.demand_map(FP).holes == ()
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


def test_dead_workers_leave_holes_that_the_next_volunteers_take_first(nats_server, arun,
                                                                      tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start(hot={HOT: 5})
        try:
            workers = [await swarm.worker(f"w-{i}") for i in range(6)]
            await wait_for(lambda: swarm.watch.holes() == set(), what="full coverage")
            dead = [workers[0], workers[3]]          # the hot range's holder among them
            lost = {w.holdings[0] for w in dead}
            t0 = time.monotonic()
            for w in dead:
                await w.kill()
            await wait_for(lambda: swarm.watch.holes() == lost, timeout=EXPIRY + 3,
                           what="the dead workers' ranges as holes")
            assert time.monotonic() - t0 < EXPIRY + 1.5  # within one expiry (and a tick)
            # the hot range still wants a second replica, but holes come first
            new = [await swarm.worker(f"new-{i}") for i in range(2)]
            assert {w.holdings[0] for w in new} == lost
            assert all(len(w.holdings) == 1 for w in new)
            await wait_for(lambda: swarm.watch.holes() == set(), what="coverage healed")
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


def test_twice_as_many_volunteers_as_ranges_give_hot_ranges_replicas_first(nats_server, arun,
                                                                           tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start(hot={HOT: 5, WARM: 3})
        try:
            got = [(await swarm.worker(f"w-{i}")).holdings[0] for i in range(12)]
            assert sorted(got[:6]) == RANGES          # first every hole
            assert got[6] == HOT                      # the first second replica: the hottest
            assert got[6:9].count(HOT) == 2 and WARM in got[6:9]
            def replicas():  # once the market read every volunteer's first served reply
                rep = {e.holding: e.replicas for e in swarm.market.demand_map(FP).entries}
                return rep if sum(rep.values()) == 12 else None

            rep = await wait_for(replicas, what="12 served replicas")
            cold = [rep[r] for r in RANGES if r not in (HOT, WARM)]
            assert rep[HOT] > rep[WARM] > max(cold) >= min(cold) >= 1
            assert sum(rep.values()) == 12
        finally:
            await swarm.stop()

    arun(go(), timeout=25)


def test_a_pending_assignment_blocks_its_range_until_confirmed_or_restarted(nats_server, arun,
                                                                          tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        try:
            silent = FakeWorker(nats_server.url, FP, "downloading", ONE_RANGE)
            first = await silent.volunteer()          # never heartbeats: still downloading
            w = await swarm.worker("w-1")
            assert w.holdings != first.holdings       # the pending range is taken
            await swarm.restart_market()              # the pending assignment is in the db
            w2 = await swarm.worker("w-2")
            assert w2.holdings[0] not in (first.holdings[0], w.holdings[0])
            # coverage comes back from heartbeats within one expiry after the restart
            await wait_for(lambda: {n.node for n in
                                    swarm.market.models[FP].coverage.nodes()} >=
                           {"downloading", "w-1", "w-2"}, timeout=EXPIRY + 2)
            await silent.kill()
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


def test_a_restarted_market_warms_up_before_it_assigns_or_prices(nats_server, arun, tmp_path):
    db = tmp_path / "m.db"
    Ledger(db).close()                               # an existing ledger: this is a restart

    async def go():
        bb = await FakeBackbone(nats_server.url, make_manifest()).start()
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(db, warmup_s=30.0, volunteer_wait_s=0.1)).start()
        w = FakeWorker(nats_server.url, FP, "eager", ONE_RANGE)
        try:
            reply = await w.volunteer()
            assert isinstance(reply, ErrorReply) and reply.code == mc.ERR_WARMING_UP
            assert "ask again" in reply.message
            batch = mc.LedgerBatch(FP, "backbone", "b-1",
                                   (mc.LedgerEvent("e-1", "eager", 0, 0, 1, 1.0),))
            await bb.ledger(batch)                   # kept in the stream, not priced yet
            await asyncio.sleep(0.3)  # a chance to (wrongly) apply it: nothing to wait for
            assert market.stream_applied == 0
            assert (await market.status(FP)).totals == ()
        finally:
            await w.kill()
            await market.stop()
            await nc.close()
            await bb.stop()

    arun(go())


def test_a_volunteer_before_the_manifest_gets_no_manifest_then_an_assignment(nats_server, arun,
                                                                           tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(tmp_path / "m.db", volunteer_wait_s=0.2)).start()
        w = FakeWorker(nats_server.url, FP, "early", ONE_RANGE)
        bb = None
        try:
            reply = await w.volunteer()
            assert isinstance(reply, ErrorReply) and reply.code == mc.ERR_NO_MANIFEST
            bb = FakeBackbone(nats_server.url, make_manifest())
            bb.nc = await connect(nats_server.url, name="backbone-without-manifest")
            ledger = mc.LedgerBatch(FP, "backbone", "b-0",
                                    (mc.LedgerEvent("e-0", "early", 0, 0, 1, 1.0),))
            await bb.ledger(ledger)                  # waits in the stream for the manifest
            await bb.nc.close()
            bb = await FakeBackbone(nats_server.url, make_manifest()).start()
            reply = await wait_for(lambda: _assigned(w), timeout=5, what="an assignment")
            assert reply.holdings == (Holding(0, 0, 8),)
            assert bb.manifest_requests >= 1
            await stream_read(bb.nc, what="the stream applied")
            assert [(t.node, t.rows) for t in (await market.status(FP)).totals] == [("early", 1)]
        finally:
            await w.kill()
            await market.stop()
            await nc.close()
            if bb:
                await bb.stop()

    arun(go(), timeout=20)


async def _assigned(w: FakeWorker):
    reply = await w.volunteer()
    return reply if isinstance(reply, mc.Assignment) else None


# -- ledger ---------------------------------------------------------------------------------

def test_ledger_totals_equal_rows_served_and_survive_a_market_restart(nats_server, arun,
                                                                      tmp_path, capsys):
    db = tmp_path / "ledger.db"

    def events(lo, hi):
        return tuple(mc.LedgerEvent(f"bb:1:{i}", f"w-{i % 3}", i % 2, i % 24, 1 + i % 5,
                                    1.7e9 + i) for i in range(lo, hi))

    sent = events(0, 60)
    rows = {f"w-{n}": sum(e.rows for e in sent if e.node == f"w-{n}") for n in range(3)}

    async def go():
        swarm = await Swarm(nats_server.url, db).start()
        try:
            bb = swarm.backbone
            market = swarm.market
            assert not (await bb.ledger(mc.LedgerBatch(FP, "backbone", "b-1", events(0, 40)))).duplicate
            # a re-send of the same batch: stored once (Nats-Msg-Id), counted once
            assert (await bb.ledger(mc.LedgerBatch(FP, "backbone", "b-1", events(0, 40)),
                                    backed=False)).duplicate
            # overlapping events in another batch: the ids already counted are duplicates
            await bb.ledger(mc.LedgerBatch(FP, "backbone", "b-2", events(30, 60)))
            await stream_read(bb.nc)
            st = await market.status(FP)
            assert {t.node: t.rows for t in st.totals} == rows
            # priced by scarcity: nothing is covered, target 1 -> 1.0 per row
            assert {t.node: t.reward for t in st.totals} == {n: float(r) for n, r in
                                                             rows.items()}
            await swarm.restart_market()
            # a batch stored while the market is away is read by the restarted one
            await bb.ledger(mc.LedgerBatch(FP, "backbone", "b-3", events(0, 60)))
            await stream_read(bb.nc, what="the restarted market reading the stream")
            st = await swarm.market.status(FP)
            assert {t.node: t.rows for t in st.totals} == rows      # nothing counted twice
        finally:
            await swarm.stop()

    arun(go(), timeout=20)
    capsys.readouterr()
    assert main(["rewards", "--json", "--db", str(db)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {n["node"]: n["rows"] for n in report["nodes"]} == rows
    assert report["total"]["rows"] == sum(e.rows for e in sent) == sum(rows.values())
    assert report["total"]["events"] == 60
    assert main(["rewards", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "w-0" in text and f"{sum(rows.values())}" in text


def test_a_status_asked_once_the_stream_is_read_shows_what_it_read(nats_server, arun, tmp_path):
    """The market answers status requests from a cache (at most 0.2 s old: a flood costs one
    status a tick), but a ledger batch it applies makes the cached one stale: `kvasir up` asks
    as soon as the stream says its events were read, a moment after another status request
    (the backbone's quarantine list) had filled the cache, and showed empty totals."""
    events = tuple(mc.LedgerEvent(f"bb:1:{i}", "w-0", 0, i, 2, 1.7e9 + i) for i in range(4))

    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "ledger.db").start()
        try:
            def totals(st):
                return {t.node: t.rows for t in st.totals}
            subject = Subjects(FP).status()
            assert totals(await request(nats_server.url, subject, b"", mc.decode_status_reply)) == {}
            await swarm.backbone.ledger(mc.LedgerBatch(FP, "backbone", "b-1", events))
            await stream_read(swarm.backbone.nc)
            assert totals(await request(nats_server.url, subject, b"", mc.decode_status_reply)) == {"w-0": 8}
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


def test_a_scarce_range_pays_more_per_row(nats_server, arun, tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start(hot={HOT: 20})
        try:
            w = await swarm.worker("w-0")            # takes HOT: target 3, 1 replica
            assert w.holdings == (HOT,)
            assert w.assignment.reward_rate == 3.0
            bb = swarm.backbone
            batch = mc.LedgerBatch(FP, "backbone", "b-1", (
                mc.LedgerEvent("e-1", "w-0", HOT.layer, HOT.lo, 10, 1.0),   # 3.0 per row
                mc.LedgerEvent("e-2", "w-0", 0, 0, 10, 1.0),                # hole: 1.0
                mc.LedgerEvent("e-3", "w-0", 7, 0, 10, 1.0)))               # no such layer
            with capture() as lines:
                await bb.ledger(batch)
                await stream_read(bb.nc, what="routing and batch applied")
            assert any(line["event"] == "ledger_events_out_of_range" for line in lines)
            st = await swarm.market.status(FP)
            # + the 1 row of HOT it served when it joined (3.0); layer 7 is refused: no pay
            assert [(t.node, t.rows, t.reward) for t in st.totals] == [("w-0", 21, 43.0)]
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


# -- bad input ------------------------------------------------------------------------------

def test_malformed_messages_are_dropped_or_refused_and_the_market_keeps_running(
        nats_server, arun, tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        s = Subjects(FP)
        nc = await connect(nats_server.url, name="vandal")
        try:
            with capture() as lines:
                await nc.publish(s.coverage("w-x"), b"\x93garbage")
                await nc.publish(s.coverage("w-x"), heartbeat(FP, "other", [(0, 0, 8)]).encode())
                await nc.publish(s.coverage("w-x"), heartbeat("abc", "w-x", [(0, 0, 8)]).encode())
                await nc.publish(s.routing(), msgpack.packb({"v": 1, "t": "rs"}))
                await nc.publish(s.routing(), b"")
                await nc.publish("kvasir._bad.routing", b"")
                await nc.flush()

                async def ask(subject, payload):
                    msg = await nc.request(subject, payload, timeout=3.0)
                    return mc.decode_volunteer_reply(msg.data)

                for payload in (b"", b"\xc1", msgpack.packb({"v": 1, "t": "vq", "model": FP}),
                                msgpack.packb({"v": 9, "t": "vq"}),
                                mc.VolunteerRequest(FP, "n", 1).encode()[:-2]):
                    reply = await ask(s.volunteer(), payload)
                    assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
                    assert reply.node == "market"
                reply = await ask(s.volunteer(), mc.VolunteerRequest("abc", "n", 10**6).encode())
                assert reply.code == "wrong_model"
                reply = await ask(s.volunteer(), mc.VolunteerRequest(FP, "tiny", 100).encode())
                assert reply.code == "no_fit" and "3,000 bytes" in reply.message
                for payload in (b"junk", mc.VolunteerRequest(FP, "n", 1).encode()):
                    await nc.publish(s.ledger(), payload)  # into the stream: read, refused
                await nc.publish(s.volunteer(), mc.VolunteerRequest(FP, "n", 1).encode())
                await nc.flush()
                await stream_read(nc, what="the stream's garbage read")
            events = [line["event"] for line in lines]
            assert events.count("heartbeat_dropped") == 1   # one line per sender a minute
            assert events.count("ledger_refused") == 1
            assert events.count("routing_dropped") == 2
            assert "bad_subject" in events
            # still alive: a good volunteer gets a range, status answers, no ghost node
            w = await swarm.worker("good", ONE_RANGE)
            assert w.holdings == (Holding(0, 0, 8),)
            st = await swarm.market.status(FP)
            assert [n.node for n in st.nodes] == ["good"]
            assert swarm.market.state.value == "running"
        finally:
            await nc.close()
            await swarm.stop()

    arun(go(), timeout=20)


def test_start_and_stop_are_idempotent(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="market")
        market = Market(nc, config(tmp_path / "m.db"))
        await market.stop()                          # never started: fine
        market = Market(nc, config(tmp_path / "m.db"))
        async with market:
            assert await market.start() is market
            assert market.state.value == "running"
        await market.stop()
        assert market.state.value == "stopped" and not market._tasks
        await nc.close()

    arun(go())


# -- seeing it ------------------------------------------------------------------------------

def test_status_and_tap_work_against_the_running_market(nats_server, arun, tmp_path, capsys):
    configure("info")  # log lines on stderr: stdout is the commands' report

    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start(hot={HOT: 5})
        try:
            for i in range(3):
                await swarm.worker(f"w-{i}")
            await wait_for(lambda: len(swarm.watch.holes() or ()) == 3, what="3 holes")

            capsys.readouterr()
            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url,
                                                  "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
            (st,) = report["models"]
            assert st["model"] == FP and st["n_layer"] == 2 and st["n_expert"] == 24
            assert st["holes"] == 3 and not st["covered"]
            assert st["fallback_rate"] == 0.25
            assert {n["node"] for n in st["nodes"]} == {"w-0", "w-1", "w-2"}
            assert all(n["age_s"] is not None and n["age_s"] < EXPIRY for n in st["nodes"])
            assert len(st["demand"]) == 6

            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url,
                                                  "--model", FP]) == 0
            text = capsys.readouterr().out
            assert "coverage: replicas per range" in text and "w-1" in text
            assert "fallback rate: 25.0%" in text
            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url,
                                                  "--model", "abc"]) == 2
            assert "knows no model abc" in capsys.readouterr().err

            # tap: workers heartbeat every 0.1 s; add garbage and a volunteer exchange
            tap = asyncio.ensure_future(asyncio.to_thread(
                main, ["tap", "--nats", nats_server.url, "--count", "12", "--duration", "5"]))
            nc = await connect(nats_server.url, name="noise")
            while not tap.done():
                await nc.publish(Subjects(FP).coverage("junk"), b"\x00\x01\x02garbage")
                await asyncio.sleep(0.05)
            await nc.close()
            assert await tap == 0
            out = capsys.readouterr().out.splitlines()
            assert len(out) == 12
            assert any("heartbeat node=w-" in line and f"kvasir.{FP}.coverage.w-" in line
                       for line in out)
            assert any("{node=w-" in line for line in out)
            assert any("coverage.junk" in line and "bytes 000102" in line for line in out)
        finally:
            await swarm.stop()

    arun(go(), timeout=25)


def test_each_workers_reply_latency_from_the_backbones_link_shows_in_status(
        nats_server, arun, tmp_path, capsys):
    """The real backbone side (MarketLink) measures, the market keeps the latest mean per
    worker, ``kvasir status`` prints it; a voided (audit-caught) node gets none."""
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        nc = await connect(nats_server.url, name="backbone-link")
        link = MarketLink(nc, FP, "bb", interval_s=0.05)
        try:
            for name in ("fast", "liar", "idle"):
                await swarm.worker(name, serve=False)
            holding = {w.node: w.holdings[0] for w in swarm.workers}
            for name, seconds in (("fast", 0.004), ("fast", 0.006), ("liar", 0.5)):
                h = holding[name]
                link.record_call(h.layer, h.lo, 2, remote=True)
                link.record_win(name, h.layer, h.lo, 2, latency_s=seconds)
            link.void("liar")
            await link.start()

            async def latencies():
                st = await swarm.market.status(FP)
                return {n.node: n.latency_ms for n in st.nodes}
            await wait_for(lambda: _has(latencies(), "fast"), what="fast's latency in status")
            got = await latencies()
            assert abs(got["fast"] - 5.0) < 1e-9 and got["liar"] is None and got["idle"] is None

            # A later window replaces it (a fake backbone's report, as any backbone's would).
            await swarm.backbone.routing((), latency=[("fast", 1, 2.5), ("idle", 4, 12.0)])
            await wait_for(lambda: _has(latencies(), "idle"), what="idle's latency in status")
            assert (await latencies())["fast"] == 2.5

            capsys.readouterr()
            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url, "--json"]) == 0
            (st,) = json.loads(capsys.readouterr().out)["models"]
            assert {n["node"]: n["latency_ms"] for n in st["nodes"]} == \
                {"fast": 2.5, "liar": None, "idle": 12.0}
            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url,
                                                  "--model", FP]) == 0
            lines = capsys.readouterr().out.splitlines()
            header = next(x for x in lines if x.strip().startswith("node "))
            assert "latency" in header.split()
            row = {x.split()[0]: x for x in lines if x.strip().split()[:1] in (["fast"], ["liar"])}
            assert "2.5 ms" in row["fast"] and " ms" not in row["liar"]
        finally:
            await link.stop(flush_timeout_s=1.0)
            await nc.close()
            await swarm.stop()

    arun(go(), timeout=25)


def test_each_nodes_audits_from_the_backbones_link_show_in_status_once(nats_server, arun, tmp_path, capsys):
    """The backbone's link sends the audits it judged per node (passes too) in its routing
    statistics, through the ledger stream; the market adds them up per node, exactly what the
    link counted, shows them in status (``kvasir status``) and in the node's own report
    (``kvasir.<model>.market.node.<node>``); a restart of the market keeps them."""
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        nc = await connect(nats_server.url, name="backbone-link")
        link = MarketLink(nc, FP, "bb", interval_s=0.05)
        try:
            await swarm.worker("tab-a", serve=False)
            await link.start()
            for _ in range(16):
                link.record_audit("tab-a", True)
            link.record_audit("liar", False)

            async def audits():
                return {a.node: (a.passed, a.failed) for a in (await swarm.market.status(FP)).audits}
            await wait_for(lambda: _equal(audits(), {"tab-a": (16, 0), "liar": (0, 1)}), what="the audits in status")
            for _ in range(3):  # a later window adds to them
                link.record_audit("tab-a", True)
            await wait_for(lambda: _equal(audits(), {"tab-a": (19, 0), "liar": (0, 1)}), what="the next window's")
            assert link.audited("tab-a") == (19, 0) and link.audited("liar") == (0, 1) and link.audited("x") == (0, 0)

            assert status_json(await swarm.market.status(FP))["audits"] == \
                {"tab-a": {"passed": 19, "failed": 0}, "liar": {"passed": 0, "failed": 1}}  # kvasir status --json
            capsys.readouterr()
            assert await asyncio.to_thread(main, ["status", "--nats", nats_server.url, "--model", FP]) == 0
            row = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("tab-a"))
            assert row.split()[-1] == "19/0", row

            # A node asks for its own report: a few dozen bytes, not the whole status.
            rep = await request(nats_server.url, Subjects(FP).node_report("tab-a"), b"", mc.decode_node_report_reply)
            assert (rep.node, rep.audits_passed, rep.audits_failed, rep.quarantined, rep.events) == \
                ("tab-a", 19, 0, False, 0)
            none = await request(nats_server.url, Subjects(FP).node_report("nobody"), b"", mc.decode_node_report_reply)
            assert (none.audits_passed, none.audits_failed, none.rows, none.reward) == (0, 0, 0, 0.0)
            bad = await request(nats_server.url, f"kvasir.{FP}.market.node.{'x' * 65}", b"",
                                mc.decode_node_report_reply)
            assert isinstance(bad, ErrorReply) and bad.code == "bad_request", bad
            other = await request(nats_server.url, Subjects("feedc0ffee00ffff").node_report("tab-a"), b"",
                                  mc.decode_node_report_reply)
            assert isinstance(other, ErrorReply) and other.code == mc.ERR_UNKNOWN_MODEL, other

            await swarm.restart_market()
            assert await audits() == {"tab-a": (19, 0), "liar": (0, 1)}
        finally:
            await link.stop(flush_timeout_s=1.0)
            await nc.close()
            await swarm.stop()

    arun(go(), timeout=25)


async def _equal(got, want) -> bool:
    return (await got) == want


def test_tokens_counted_by_the_backbones_link_show_as_tokens_per_s_on_the_dashboard(
        nats_server, arun, tmp_path):
    """MarketLink counts tokens as rows on the first MoE layer / top-k; rows of a layer that a
    window's cut splits count in the next window, so the total is exact; the dashboard's
    history shows the window's tokens/s beside its rows/s per MoE layer."""
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        dash = await Dashboard(swarm.market, DashboardConfig(port=0, interval_s=60)).start()
        nc = await connect(nats_server.url, name="backbone-link")
        seen: list[mc.RoutingStats] = []

        async def keep(msg):
            stats = mc.decode_routing(msg.data)
            if stats.node == "bb":
                seen.append(stats)
        sub = await nc.subscribe(Subjects(FP).routing(), cb=keep)
        await nc.flush()
        link = MarketLink(nc, FP, "bb", interval_s=0.25, top_k=2)
        try:
            # Window 1: 3 tokens x top-2 on layer 0 is 6 rows; the cut comes after 5 of them.
            link.record_call(0, 1, 3, remote=False)
            link.record_call(0, 2, 2, remote=False)
            link.record_call(1, 0, 5, remote=False)
            await link.start()
            await wait_for(lambda: seen, what="the first routing window")
            assert seen[0].tokens == 2  # 5 rows // 2, one row carried over
            # Window 2: the split layer's last row, then 30 more tokens on both layers.
            link.record_call(0, 3, 1, remote=False)
            link.record_call(1, 0, 1, remote=False)
            for layer in (0, 1):
                for e in range(6):
                    link.record_call(layer, e, 10, remote=True)
            await wait_for(lambda: len(seen) > 1, what="the second routing window")
            assert [s.tokens for s in seen] == [2, 31]  # 33 = 66 rows on layer 0 / 2

            await wait_for(lambda: dash.throughput.tokens(FP, time.time()) == 31 / 0.25,
                           what="the dashboard to hear the second window")
            point = (await dash.take_snapshot())["models"][0]["history"][-1]
            assert point["tokens_per_s"] == 124.0  # 31 tokens in 0.25 s
            assert point["rows_per_s"] == 61 * 2 / 2 / 0.25  # rows per MoE layer per second
        finally:
            await link.stop(flush_timeout_s=1.0)
            await sub.unsubscribe()
            await nc.close()
            await dash.stop()
            await swarm.stop()

    arun(go(), timeout=25)


async def _has(latencies, node: str) -> bool:
    return (await latencies).get(node) is not None


def test_overview_of_every_model_and_status_of_an_unknown_one(nats_server, arun, tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        try:
            got = await request(nats_server.url, MARKET_OVERVIEW, b"", mc.decode_status_reply)
            assert isinstance(got, mc.MarketOverview) and [m.model for m in got.models] == [FP]
            got = await request(nats_server.url, Subjects("abc").status(), b"",
                                mc.decode_status_reply)
            assert isinstance(got, ErrorReply) and got.code == mc.ERR_UNKNOWN_MODEL
        finally:
            await swarm.stop()

    arun(go())


def test_cli_reports_a_missing_market_or_ledger_in_one_line(nats_server, tmp_path, capsys):
    assert main(["status", "--nats", nats_server.url]) == 2
    assert "no market is running" in capsys.readouterr().err
    assert main(["rewards", "--db", str(tmp_path / "none.db")]) == 2
    assert "no ledger at" in capsys.readouterr().err


def test_a_volunteer_budget_past_the_model_is_capped_at_the_models_size(nats_server, arun, tmp_path):
    async def go():
        swarm = await Swarm(nats_server.url, tmp_path / "m.db").start()
        try:
            w = await swarm.worker("greedy", budget=1 << 62)  # "I have 4 EiB to give"
            lay = swarm.market.models[FP].layout
            model_bytes = lay.n_expert * sum(lay.expert_bytes)
            assert w.assignment.bytes <= model_bytes
            node = next(n for n in (await swarm.market.status(FP)).nodes if n.node == "greedy")
            assert node.budget_bytes == model_bytes  # the books keep the cap, not the word
        finally:
            await swarm.stop()

    arun(go(), timeout=20)


def test_an_enrolled_volunteer_may_ask_only_for_its_own_node():
    from kvasir_bus.enrol import node_name

    key = "U" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCDEFGHIJKLMNOPQRSTUV"
    own = node_name(key)
    inbox = f"_INBOX_{key}.abc"
    assert Market._not_own_node(inbox, own) is None
    assert "its own node only" in Market._not_own_node(inbox, "vaaaaaaaaaaaa")
    assert Market._not_own_node("_INBOX.xyz", "vaaaaaaaaaaaa") is None  # an open bus does not say who asks
    assert Market._not_own_node(inbox, "worker-0") is None  # a fixed identity's name: its creds decide
