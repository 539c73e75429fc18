"""The ledger stream redelivers what a dead market took and never acked, after the consumer's
ack wait, behind messages the next market has read since: nothing may be lost to that order.

A market killed between a fetch and its acks (or one whose pull request the server still held
when it stopped) leaves messages "ack pending". The next market reads newer messages first
and gets the old ones ``ack_wait`` later. Two ways that used to lose credit:

* the ledger took "stream sequence <= the highest applied" for "applied before", so the
  redelivered routing and batch were skipped for good;
* a batch read before the routing statistics that back it (the routing was the redelivered
  one) was refused as unbacked, for good.

A raw pull subscription on the market's durable consumer plays the dead market: it fetches
and never acks. Every wait polls with a deadline (the redelivery comes ``ack_wait`` later).
"""

from __future__ import annotations

import sqlite3

from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.connect import connect
from market.service import Market, MarketConfig
from tests.market.fakes import FP, FakeBackbone, make_manifest, wait_for

HANG_S = 40.0  # the redelivery comes ack_wait (5 s) later; this only tells a hang from a slow machine


def config(db, **kw) -> MarketConfig:
    return MarketConfig(db_path=str(db), expiry_s=0.6, range_experts=8, warmup_s=0,
                        manifest_retry_s=0.05, manifest_retry_max_s=0.2, models=(FP,), **kw)


def batch(bid: str, n: int, expert0: int = 0) -> mc.LedgerBatch:
    return mc.LedgerBatch(FP, "backbone", bid, tuple(
        mc.LedgerEvent(f"{bid}:{i}", "w", 0, expert0 + i, 3, 1.0) for i in range(n)))


def ledger_ids(db) -> set[str]:
    with sqlite3.connect(db) as con:
        return {r[0] for r in con.execute("SELECT event_id FROM events")}


async def dead_market_takes(url: str, n: int) -> None:
    """Fetch ``n`` messages on the market's durable consumer, never ack them, disconnect."""
    nc = await connect(url, name="dead-market")
    js = nc.jetstream()
    await ledger_stream.ensure_stream(js)
    await js.add_consumer(ledger_stream.STREAM, ledger_stream.consumer_config())
    psub = await js.pull_subscribe_bind(durable=ledger_stream.CONSUMER, stream=ledger_stream.STREAM)
    got = await psub.fetch(n, timeout=5)
    assert len(got) == n
    await nc.close()


def run_after_a_dead_market(nats_server, arun, tmp_path, taken: int):
    db = tmp_path / "m.db"

    async def go():
        bb = await FakeBackbone(nats_server.url, make_manifest()).start()
        nc = market = None
        try:
            await bb.ledger(batch("b1", 4))             # routing r-0, then batch b1
            await dead_market_takes(nats_server.url, taken)
            nc = await connect(nats_server.url, name="market")
            market = await Market(nc, config(db)).start()
            await bb.ledger(batch("b2", 3, expert0=8))  # read first, ahead of the redelivery
            want = {f"b1:{i}" for i in range(4)} | {f"b2:{i}" for i in range(3)}
            try:
                await wait_for(lambda: ledger_ids(db) == want, timeout=HANG_S, interval=0.1,
                               what="every event in the ledger")
            finally:
                print("ledger holds", sorted(ledger_ids(db)))
            totals = {t.node: t.rows for t in (await market.status(FP)).totals}
            assert totals == {"w": 7 * 3}
        finally:
            await bb.stop()
            if market is not None:
                await market.stop()
            if nc is not None:
                await nc.close()

    arun(go(), timeout=HANG_S + 20)


def test_a_routing_and_batch_redelivered_behind_newer_ones_are_still_credited(nats_server, arun, tmp_path):
    run_after_a_dead_market(nats_server, arun, tmp_path, taken=2)


def test_a_batch_read_before_its_redelivered_routing_waits_for_it(nats_server, arun, tmp_path):
    run_after_a_dead_market(nats_server, arun, tmp_path, taken=1)


def test_a_batch_the_ledger_failed_to_store_is_read_again_not_lost(nats_server, arun, tmp_path):
    """A disk full for a moment: the batch is left unacked, an error line says so, and the
    next delivery stores it."""
    import sqlite3 as sq

    from kvasir_bus.logs import capture

    db = tmp_path / "m.db"

    async def go():
        bb = await FakeBackbone(nats_server.url, make_manifest()).start()
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(db, unbacked_retry_s=0.2)).start()
        real, failures = market.ledger.apply_batch, []

        def failing_once(*args):
            if not failures:
                failures.append(1)
                raise sq.OperationalError("database or disk is full")
            return real(*args)

        market.ledger.apply_batch = failing_once
        try:
            with capture() as lines:
                await bb.ledger(batch("b1", 2))
                await wait_for(lambda: ledger_ids(db) == {"b1:0", "b1:1"}, timeout=HANG_S,
                               interval=0.05, what="the batch stored on its next delivery")
            failed = [line for line in lines if line["event"] == "ledger_stream_apply_failed"]
            assert len(failed) == 1 and "disk is full" in failed[0]["error"]
        finally:
            await bb.stop()
            await market.stop()
            await nc.close()

    arun(go(), timeout=HANG_S + 20)
