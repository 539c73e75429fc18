"""Quarantine locks the door: a liar serving under its own enrolled identity is caught by the
backbone's audit, its key is revoked (the enrolment service hears the signed verdict and pushes
the account JWT), and the server drops its connection within 5 s and refuses it from then on;
the generation stays bit-identical to the monolithic run throughout."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import numpy as np
import pytest

from kvasir_bus import creds, enrol
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=19, layers=2)


class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __call__(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _enrolled_liar(model, url, identity_path, node):
    """tests/trust/liars.BusLiar under an enrolled worker's rights: it subscribes only to what a
    worker may (every per-expert subject, its own bundle subject)."""
    from tests.trust.liars import BusLiar, noise

    class EnrolledLiar(BusLiar):
        def __enter__(self):
            async def quiet(exc):
                pass
            self.nc = self.bus.run(connect(self.url, name=f"kvasir-test-{self.node}",
                                           options=ConnectOptions(creds=str(identity_path)),
                                           error_cb=quiet, reconnect_time_wait=0.1))
            self.bus.run(self._listen())
            self._beat = self.bus.submit(self._heartbeats())
            return self

        async def _listen(self):
            await self.nc.subscribe(f"{self.subjects.root}.x.*.*", cb=self._answer)
            await self.nc.subscribe(self.subjects.node(self.node), cb=self._answer_bundle)
            await self.nc.flush()

    return EnrolledLiar(model, url, noise, node=node)


def test_an_enrolled_liar_is_quarantined_revoked_and_dropped_within_5_s(model, tmp_path, monkeypatch):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService

    engine = Engine(model)
    prompt = np.random.default_rng(5).integers(0, engine.cfg.n_vocab, 10).tolist()
    mono = generate(Engine(model), prompt, 4, Sampler(SamplerConfig()), stop_on_eos=False,
                    keep_logits=True).logits_array()
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", [], auth="jwt")
    loop = Loop()
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        service = loop(enrol.EnrolService(enrol.EnrolConfig(str(dep))).start(url))
        token = enrol.make_token(dep)
        me = loop(enrol.enrol(url, token))
        path = me.write(tmp_path / "liar.creds")
        try:
            monkeypatch.setenv("NATS_CREDS", str(dep / "backbone.creds"))
            cfg = BackboneConfig(model_path=engine.path, nats_url=url, market=False,
                                 sign_key=str(dep / "backbone.creds"))  # the key the service trusts
            with BackboneService(engine, cfg) as backbone, _enrolled_liar(model, url, path, me.name) as liar:
                deadline = time.monotonic() + 30
                while backbone.dispatch.coverage.bundle_nodes < 1:
                    assert time.monotonic() < deadline, "the backbone never heard the liar"
                    time.sleep(0.05)  # polling the backbone's view of the bus
                out = generate(engine, prompt, 4, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
                assert np.array_equal(out.logits_array(), mono)  # its lies changed nothing
                assert backbone.stats.to_dict()["quarantined"] == [me.name]
                caught = time.monotonic()  # the verdict is out (published before generate returned)
                while liar.nc.is_connected:
                    assert time.monotonic() - caught < 5, "still connected 5 s after the verdict"
                    time.sleep(0.02)
                assert service.revoked_nodes == [me.name]
                assert me.jwt and creds.revocations(dep).keys() == {enrol.jwt.public_of(me.seed)}

                async def refused():
                    with pytest.raises(Exception):
                        await nats.connect(url, user_credentials=str(path), allow_reconnect=False,
                                           max_reconnect_attempts=0, connect_timeout=2)
                loop(refused())
                with pytest.raises(enrol.EnrolError):  # and it cannot come back with its token
                    loop(enrol.enrol(url, token, seed=me.seed))
                assert liar.lies > 0
        finally:
            loop(service.stop())
            loop.close()
