"""Every role is a NATS micro service: ``$SRV.PING``, ``$SRV.INFO``, ``$SRV.STATS`` answer.

Asked as ``nats micro list`` asks: a request to the ``$SRV`` subject, every instance's reply
collected until the bus is quiet. The replies are parsed with nats-py's own micro records
(``ServiceInfo.from_dict``...), so what we answer is what the protocol's clients read.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

from kvasir_bus import __version__, codec, micro
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from market.service import Market, MarketConfig
from tests.market.fakes import FakeBackbone, FakeWorker, make_manifest, wait_for


async def ask_all(nc, subject: str, want: int, timeout: float = 3.0) -> list[dict]:
    """Publish one request to ``subject`` and collect replies until ``want`` came (every
    instance answers on the same inbox, as with ``nats micro ls``)."""
    inbox = nc.new_inbox()
    replies: list[dict] = []
    got = asyncio.Event()

    async def on_reply(msg) -> None:
        replies.append(json.loads(msg.data))
        if len(replies) >= want:
            got.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    try:
        await asyncio.wait_for(got.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return replies


def test_connection_names_say_role_node_and_process():
    assert micro.connection_name("worker", "w1", pid=42) == "kvasir-worker-w1-42"
    assert micro.connection_name("worker", "host-42", pid=42) == "kvasir-worker-host-42"  # no -42-42
    market = micro.connection_name("market", "market", pid=7)
    assert market.startswith("kvasir-market-") and "market-market" not in market and market.endswith("-7")
    # kvasir serve and kvasir generate --nats on one node are two processes: two names
    assert micro.connection_name("backbone", "backbone", pid=1) != micro.connection_name("backbone", "backbone", pid=2)
    with pytest.raises(ValueError, match="role"):
        micro.Card(role="wizard", node="n", model="m")


def test_tally_counts_requests_errors_and_time():
    t = micro.Tally()
    with t.timer():
        pass
    with t.timer() as timer:
        timer.error = "refused"
    with pytest.raises(RuntimeError), t.timer():
        raise RuntimeError("boom")
    assert (t.requests, t.errors) == (3, 2) and t.last_error == "RuntimeError: boom"
    assert t.processing_ns >= 0


def test_worker_answers_srv_ping_info_and_stats_with_its_dispatch_counts(nats_server, arun, models):
    pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen3moe", "q8_0")
    out = write_slice(plan_slice(path, [(parse_span("0", "--layer"), parse_span("2-5", "--experts"))]),
                      f"{path}.ops-slice.gguf").path
    info = load_slice(out)
    rows = np.ones((3, info.n_embd), np.float32)
    seen: list[tuple[int, float]] = []

    async def go():
        nc = await connect(nats_server.url, micro.connection_name("worker", "w-ops"))
        worker = Worker(info, WorkerConfig(node="w-ops", heartbeat_s=60))
        worker.on_compute = lambda layer, s: seen.append((layer, s))
        await worker.start(nc)
        client = await connect(nats_server.url, "test-observer")
        subj = Subjects(info.fingerprint)
        for expert in (2, 3):
            req = codec.DispatchRequest(model=info.fingerprint, layer=0, expert=expert, rows=rows,
                                        request_id=f"r{expert}")
            await client.request(subj.dispatch(0, expert), req.encode(), timeout=5,
                                 headers=codec.headers_for(req))
        bad = await client.request(subj.dispatch(0, 4), b"garbage", timeout=5)
        assert isinstance(codec.decode_reply(bad.data), codec.ErrorReply)

        [ping] = await ask_all(client, "$SRV.PING", 1)
        [info_reply] = await ask_all(client, "$SRV.INFO.kvasir-worker", 1)
        [stats_reply] = await ask_all(client, "$SRV.STATS.kvasir-worker", 1)
        await worker.stop()
        # stopped: the service is gone from the bus
        with pytest.raises(asyncio.TimeoutError):
            await ask_all(client, "$SRV.PING", 1, timeout=0.3)
        await client.close()
        await nc.close()
        return ping, info_reply, stats_reply

    ping, info_reply, stats_reply = arun(go(), timeout=60)
    p = ServicePing.from_dict(ping)
    assert p.name == "kvasir-worker" and p.version == __version__
    i = ServiceInfo.from_dict(info_reply)
    assert i.metadata["node"] == "w-ops" and i.metadata["model"] == info.fingerprint
    assert i.metadata["role"] == "worker" and i.metadata["kernel"].startswith(("ggml-", "numpy-"))
    [ep] = i.endpoints
    assert ep.subject == f"kvasir.{info.fingerprint}.x.*.*" and ep.queue_group == ""  # replicas race
    assert ep.metadata["holdings"] == "L0:2-5"
    s = ServiceStats.from_dict(stats_reply)
    [es] = s.endpoints
    assert (es.num_requests, es.num_errors) == (3, 1)
    assert es.processing_time == sum(int(sec * 1e9) for _, sec in seen) or es.processing_time > 0
    assert es.data["rows"] == 6
    assert [layer for layer, _ in seen] == [0, 0]  # the metrics hook saw each computation


def test_market_answers_srv_with_one_entry_per_subject_it_serves(nats_server, arun, tmp_path):
    manifest = make_manifest()

    async def go():
        nc = await connect(nats_server.url, micro.connection_name("market", "market"))
        backbone = await FakeBackbone(nats_server.url, manifest).start()
        cfg = MarketConfig(db_path=str(tmp_path / "m.db"), expiry_s=2, manifest_retry_s=0.05,
                           models=(manifest.model,))
        async with Market(nc, cfg) as market:
            worker = FakeWorker(nats_server.url, manifest.model, "phone-1", budget=8 * 3600)
            await worker.start()
            await wait_for(lambda: market.tallies["coverage"].requests >= 1, what="a heartbeat")
            client = await connect(nats_server.url, "test-observer")
            [info_reply] = await ask_all(client, "$SRV.INFO.kvasir-market", 1)
            [stats_reply] = await ask_all(client, "$SRV.STATS", 1)
            await client.close()
            await worker.kill()
        await backbone.stop()
        await nc.close()
        return info_reply, stats_reply

    info_reply, stats_reply = arun(go(), timeout=30)
    i = ServiceInfo.from_dict(info_reply)
    assert i.name == "kvasir-market" and i.metadata["node"] == "market"
    assert i.metadata["model"] == make_manifest().model
    names = {e.name: e.subject for e in i.endpoints}
    # The ledger is not a subscription: the market reads it from the JetStream stream.
    assert names["volunteer"] == "kvasir.*.market.volunteer" and set(names) == {
        "coverage", "routing", "volunteer", "volunteer-node", "status", "node", "overview"}
    assert names["volunteer-node"] == "kvasir.*.market.volunteer.*" and names["node"] == "kvasir.*.market.node.*"
    stats = {e.name: e for e in ServiceStats.from_dict(stats_reply).endpoints}
    assert stats["volunteer"].num_requests >= 1 and stats["coverage"].num_requests >= 1
    assert stats["volunteer"].num_errors == 0


def test_backbone_answers_srv_with_dispatch_and_manifest_counts(nats_server, arun, models):
    pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus import market_codec as mc

    engine = Engine(models("qwen3moe", "q8_0"))
    cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False)

    async def observe(model: str):
        client = await connect(nats_server.url, "test-observer")
        got = await client.request(Subjects(model).manifest(), b"", timeout=5)
        assert isinstance(mc.decode_manifest(got.data), mc.Manifest)
        [info_reply] = await ask_all(client, "$SRV.INFO.kvasir-backbone", 1)
        [stats_reply] = await ask_all(client, "$SRV.STATS.kvasir-backbone", 1)
        await client.close()
        return info_reply, stats_reply

    with BackboneService(engine, cfg) as service:
        generate(engine, [1, 2, 3], 2, Sampler(SamplerConfig()))  # no worker: every expert call falls back
        info_reply, stats_reply = arun(observe(service.model), timeout=30)
        calls = service.stats.totals()
    i = ServiceInfo.from_dict(info_reply)
    assert i.metadata["role"] == "backbone" and i.metadata["model"] == service.model
    assert [e.name for e in i.endpoints] == ["dispatch", "manifest"]
    stats = {e.name: e for e in ServiceStats.from_dict(stats_reply).endpoints}
    assert stats["manifest"].num_requests == 1 and stats["manifest"].num_errors == 0
    assert stats["dispatch"].num_requests == calls.remote + calls.local
    assert stats["dispatch"].num_errors == calls.local  # no worker: every call fell back
