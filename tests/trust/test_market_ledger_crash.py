"""A backbone killed with SIGKILL mid-generation and a market restarted meanwhile: the ledger
holds exactly the events the backbone's own log says the stream stored, none twice.

The backbone here is a subprocess running the real :class:`backbone.market_link.MarketLink`
that records a win every millisecond (as the dispatcher does for each reply that won), with
debug logging on: one ``ledger_win`` line per won reply, one ``ledger_stored`` line per batch
the stream acknowledged (with its event count). Counted from those lines: what the stream
acknowledged must all be in the ledger after the kill and the restart. Wins after the last
acknowledged batch (at most ``flush_s`` of them plus one round trip) die with the process: the
test states that bound too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

from kvasir_bus import ledger_stream
from kvasir_bus.connect import connect
from market.service import Market, MarketConfig
from tests.market.fakes import FP, FakeBackbone, make_manifest, wait_for

BACKBONE = r"""
import asyncio, itertools, sys
from kvasir_bus.logs import configure
from kvasir_bus.connect import connect
from backbone.market_link import MarketLink

async def main(url):
    configure("debug", json=True)
    nc = await connect(url, "crash-backbone")
    link = MarketLink(nc, sys.argv[2], "backbone", interval_s=0.2)
    await link.start()
    for i in itertools.count():          # a generation that never ends: killed mid-way
        link.record_win(f"w-{i % 3}", i % 2, i % 24, 1 + i % 4)
        await asyncio.sleep(0.001)

asyncio.run(main(sys.argv[1]))
"""


def config(db):
    return MarketConfig(db_path=str(db), expiry_s=0.6, range_experts=8, warmup_s=0,
                        models=(FP,), manifest_retry_s=0.05, manifest_retry_max_s=0.2)


def lines_of(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_sigkill_of_the_backbone_and_a_market_restart_lose_no_stored_event(nats_server, arun,
                                                                          tmp_path):
    log_path = tmp_path / "backbone.log"
    db = tmp_path / "m.db"

    async def go():
        bb = await FakeBackbone(nats_server.url, make_manifest()).start()  # serves the manifest
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(db)).start()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", BACKBONE, nats_server.url, FP],
                                    stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            stored = lambda: sum(1 for e in lines_of(log_path) if e.get("event") == "ledger_stored")
            await wait_for(lambda: stored() >= 5, timeout=20, what="5 stored batches")
            await market.stop()                       # the market restarts mid-generation
            await nc.close()
            await wait_for(lambda: stored() >= 10, timeout=20, what="5 more, market away")
            nc = await connect(nats_server.url, name="market-2")
            market = await Market(nc, config(db)).start()
            await wait_for(lambda: stored() >= 15, timeout=20, what="5 more")
            os.kill(proc.pid, signal.SIGKILL)          # mid-generation
            proc.wait()
            js = nc.jetstream()

            async def drained():
                info = await js.consumer_info(ledger_stream.STREAM, ledger_stream.CONSUMER)
                return info.num_pending == 0 and info.num_ack_pending == 0

            await wait_for(drained, timeout=20, what="the market to read the whole stream")
            lines = lines_of(log_path)
            wins = sum(1 for e in lines if e.get("event") == "ledger_win")
            in_stream = sum(e["events"] for e in lines if e.get("event") == "ledger_stored")
            st = await market.status(FP)
            assert sum(t.events for t in st.totals) == in_stream > 0
            # what died with the process: the wins after its last acknowledged batch
            assert 0 <= wins - in_stream < 1000, (wins, in_stream)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            await market.stop()
            await nc.close()
            await bb.stop()

    arun(go(), timeout=90)
