"""A quarantine outlives the process that made it: a fresh backbone loads the market's list at
start, and a running one follows the verdicts its own key (or a trusted one) signed on the bus;
a forged verdict makes no backbone drop an honest node."""

from __future__ import annotations

import asyncio

import pytest

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kvasir_bus import market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.signing import SEED_ENV, Signer
from kvasir_bus.subjects import Subjects
from market.service import Market
from tests.polling import until
from tests.trust import liars
from tests.trust.test_market_attacks import config

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")


@pytest.fixture(scope="module")
def model(models):
    return models("qwen3moe", "q4_k")


def backbone_cfg(model, url, **kw):
    return BackboneConfig(model_path=str(model), nats_url=url, spool="off", market_interval_s=0.2, **kw)


def test_a_fresh_backbone_distrusts_what_an_earlier_one_caught(model, nats_server, tmp_path, monkeypatch):
    monkeypatch.setenv(SEED_ENV, Signer.fresh()._seed.decode())  # the operator's backbones share one key
    bus = LoopThread("market")
    nc = bus.run(connect(nats_server.url, name="market"))
    market = bus.run(Market(nc, config(tmp_path / "m.db")).start())
    fp = model_fingerprint(Engine(model).reader)
    prompt = list(range(1, 9))
    try:
        with liars.BusLiar(model, nats_server.url, liars.zeros, node="liar", bundles=False) as liar:
            engine = Engine(model)
            with BackboneService(engine, backbone_cfg(model, nats_server.url)) as first, \
                    BackboneService(Engine(model), backbone_cfg(model, nats_server.url, node="second")) as second:
                generate(engine, prompt, 2, Sampler(SamplerConfig()), stop_on_eos=False)
                assert first.stats.to_dict()["quarantined"] == ["liar"]
                # the second backbone, running beside it, follows the signed verdict on the bus
                asyncio.run(until(lambda: second.dispatch.auditor.is_quarantined("liar"), "the second follows", 10))
                assert second.stats.to_dict()["quarantined"] == []  # not caught there: told
            asyncio.run(until(lambda: "liar" in market.models[fp].coverage.banned, "the market's verdict", 20))
            sent = liar.sent
            # a fresh process: distrusts the liar from its first step
            engine = Engine(model)
            with BackboneService(engine, backbone_cfg(model, nats_server.url, node="third")) as third:
                asyncio.run(until(lambda: third.dispatch.auditor.is_quarantined("liar"), "the list loaded", 10))
                generate(engine, prompt, 2, Sampler(SamplerConfig()), stop_on_eos=False)
                stats = third.stats.to_dict()
            assert "liar" not in stats["per_node"] and stats["audit_failures"] == 0
            assert liar.sent > sent  # it was still asked (per-expert subjects) and went unheard
    finally:
        bus.run(market.stop())
        bus.run(nc.close())
        bus.stop()


def test_a_forged_verdict_on_the_bus_drops_no_honest_node(model, nats_server):
    engine = Engine(model)
    fp = model_fingerprint(engine.reader)
    with BackboneService(engine, backbone_cfg(model, nats_server.url, market=False)) as backbone:
        async def forge():
            nc = await connect(nats_server.url, name="forger")
            q = mc.Quarantine(fp, "honest", 0, 0, "ggml", True, 1.0, 1.0)
            await nc.publish(Subjects(fp).quarantine(), q.encode())  # unsigned
            await nc.publish(Subjects(fp).quarantine(), q.encode(), headers=Signer.fresh().headers(q.encode()))
            await nc.flush()
            await nc.close()
        asyncio.run(forge())
        quarantines = backbone._run.quarantines
        asyncio.run(until(lambda: quarantines.ignored == 2, "both forgeries heard", 10))
        assert not backbone.dispatch.auditor.is_quarantined("honest")


def test_a_backbone_started_before_its_market_still_loads_the_list(model, nats_server):
    """No market when the backbone starts (or one too busy to answer in time): it asks again with
    back-off, and the list a market gives later is taken."""
    engine = Engine(model)
    fp = model_fingerprint(engine.reader)
    with BackboneService(engine, backbone_cfg(model, nats_server.url)) as backbone:
        quarantines = backbone._run.quarantines
        assert not backbone.dispatch.auditor.is_quarantined("liar")

        async def market_answers():
            nc = await connect(nats_server.url, name="late-market")
            status = mc.MarketStatus(model=fp, market="m", sent_at=1.0, manifest_known=False, n_layer=0,
                                     n_expert=0, range_experts=4, expiry_s=2.0, nodes=(), demand=(), totals=(),
                                     quarantined=("liar",))

            async def answer(msg):
                await msg.respond(status.encode())
            await nc.subscribe(Subjects(fp).status(), cb=answer)
            await nc.flush()
            await until(lambda: backbone.dispatch.auditor.is_quarantined("liar"), "the list loaded late", 20)
            await nc.close()
        asyncio.run(market_answers())
        assert quarantines.loaded == 1
