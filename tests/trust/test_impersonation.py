"""Self-certifying names on an open bus: a liar answering per-expert requests and bundles under an
honest node's name changes no token, never gets the honest node quarantined, and its replies are
counted as forged. The honest node is a real ``kvasir worker`` named by its key (``--node-key``);
the liar is tests/trust/liars.BusLiar under that name, subscribed to every expert subject and to
the honest node's own bundle subject (on an open bus anyone may), heartbeating as it."""

from __future__ import annotations

import asyncio

import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kvasir_bus import codec
from kvasir_bus.attribution import NodeKey
from kvasir_bus.fingerprint import model_fingerprint
from launch.swarm import spawn_worker, wait_for_nodes
from tests.polling import until
from tests.trust import liars
from tests.trust.test_audit_bound import bus, model, monolithic, prompt, N_DECODE  # noqa: F401

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")


@pytest.fixture(scope="module")
def honest_key(tmp_path_factory):
    key = NodeKey.fresh()
    return key, key.write(tmp_path_factory.mktemp("key") / "honest.seed")


@pytest.fixture(scope="module")
def honest_worker(model, bus, honest_key, tmp_path_factory):
    """A real worker process named by its key, holding every expert."""
    key, path = honest_key
    log = open(tmp_path_factory.mktemp("honest") / "worker.log", "w")
    cfg = Engine(model).cfg
    worker = spawn_worker(bus.url, key.name, ["--model", str(model), "--layer", "all",
                                              "--experts", f"0-{cfg.n_expert - 1}"],
                          log_file=log, heartbeat_s=0.2, extra=["--node-key", str(path)])
    try:
        asyncio.run(wait_for_nodes(bus.url, model_fingerprint(Engine(model).reader), {key.name}, procs=[worker]))
        yield worker
    finally:
        worker.stop()


class OwnKeyLiar(liars.BusLiar):
    """Seals its lies with a key of its own: a valid proof, but of a key whose name is not the
    honest node's."""

    own = NodeKey.fresh()

    async def _answer(self, msg) -> None:
        req = codec.decode_request(msg.data)
        out = self._out(req.layer, req.expert, req.rows)
        reply = codec.DispatchReply(request_id=req.request_id, node=self.node, rows=out, kernel=self.kernel)
        await self.nc.publish(msg.reply, self.own.seal(reply.encode(), req.box, msg.data))

    async def _answer_bundle(self, msg) -> None:
        import numpy as np

        bundle = codec.decode_bundle(msg.data)
        outs = [self._out(bundle.layer, expert, bundle.rows[bundle.call_index(i)])
                for i, expert in enumerate(bundle.experts)]
        payload = codec.BundleReplyEncoder(self.node, self.kernel).encode_answers(bundle, np.concatenate(outs))
        await self.nc.publish(msg.reply, self.own.seal(payload, bundle.box, msg.data))


@pytest.mark.parametrize("bundles", [False, True], ids=["per-expert", "bundles"])
@pytest.mark.parametrize("liar_cls", [liars.BusLiar, OwnKeyLiar], ids=["no-proof", "own-key-proof"])
def test_an_impersonator_on_an_open_bus_changes_no_token_and_never_gets_the_honest_node_quarantined(
        bundles, liar_cls, model, prompt, monolithic, honest_key, honest_worker, bus):
    """Race mode, the default audit, a fixed timeout (every call waits for the replies). The
    liar answers fast (noise needs no compute), so it wins races; each of its replies names the
    honest node and lacks that node's proof, so the backbone drops it and waits for the real one."""
    key, _ = honest_key
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=bus.url, market=False, serve_manifest=False, spool="off",
                         dispatch=DispatchConfig(timeout_s=10.0, bundles=bundles))
    with liar_cls(model, bus.url, liars.noise, node=key.name, bundles=bundles) as liar:
        with BackboneService(engine, cfg) as backbone:
            if bundles:
                asyncio.run(until(lambda: key.name in backbone.dispatch.coverage.bundle_holders(0, 0),
                                  "the backbone hears the honest node's bundles", 20))
            tokens = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False).tokens
            stats = backbone.stats.to_dict()
    assert liar.sent > 0, "the impersonator was never asked"
    assert tokens == monolithic
    assert stats["quarantined"] == []
    assert stats["totals"]["forged"] >= 1
    assert stats["per_node"].get(key.name, {}).get("calls", 0) > 0, stats["per_node"]  # its wins still count
