"""The dashboard hears the backbones' quarantine events on the bus (no browser needed here;
tests/see/test_dashboard.py checks the page marks the node)."""

from __future__ import annotations

import json

import aiohttp

from kvasir_bus import market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from market.dashboard import Dashboard, DashboardConfig
from market.service import Market, MarketConfig
from tests.market.fakes import FP, FakeBackbone, make_manifest, wait_for

OTHER = "0123456789abcdef"


def caught(node: str, model: str = FP, error: float = 0.5, at: float = 10.0) -> mc.Quarantine:
    return mc.Quarantine(model=model, node=node, layer=1, expert=3, kernel="ggml-x86_64", exact=True,
                         error=error, at=at)


def test_dashboard_lists_quarantined_nodes_once_and_ignores_bad_events(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, MarketConfig(db_path=str(tmp_path / "m.db"), manifest_retry_s=0.05,
                                               manifest_retry_max_s=0.2)).start()
        backbone = await FakeBackbone(nats_server.url, make_manifest()).start()
        dash = await Dashboard(market, DashboardConfig(port=0, interval_s=0.05)).start()
        try:
            await backbone.routing([(0, 0, 1)])  # the market learns the model
            await wait_for(lambda: FP in market.models, what="the market knows the model")
            subject = Subjects(FP).quarantine()
            for event in (caught("liar-1", at=20.0), caught("liar-2", error=float("inf"), at=10.0),
                          caught("liar-1", at=30.0)):  # caught again: the first catch stays
                await backbone.nc.publish(subject, event.encode(), headers=mc.headers_for(event))
            await backbone.nc.publish(subject, b"\x00junk")
            await backbone.nc.publish(subject, caught("elsewhere", model=OTHER).encode())  # wrong subject
            last = caught("liar-3", at=40.0)  # one subscription delivers in order: after it, all seen
            await backbone.nc.publish(subject, last.encode(), headers=mc.headers_for(last))
            await backbone.nc.flush()
            await wait_for(lambda: "liar-3" in dash.quarantined.get(FP, {}), what="the last quarantine")
            assert set(dash.quarantined) == {FP} and set(dash.quarantined[FP]) == {"liar-1", "liar-2", "liar-3"}
            await dash.take_snapshot()
            async with aiohttp.ClientSession() as http:
                async with http.get(dash.url + "/api/state") as resp:
                    text = await resp.text()
            return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        finally:
            await dash.stop()
            await backbone.stop()
            await market.stop()
            await nc.close()

    state = arun(go(), timeout=30)
    (doc,) = state["models"]
    assert [(q["node"], q["at"], q["error"]) for q in doc["quarantined"]] == [
        ("liar-2", 10.0, None),  # inf is no JSON number: shown as "bad reply"
        ("liar-1", 20.0, 0.5), ("liar-3", 40.0, 0.5)]
    assert doc["quarantined"][1] == {"node": "liar-1", "layer": 1, "expert": 3, "kernel": "ggml-x86_64",
                                     "exact": True, "error": 0.5, "at": 20.0}
