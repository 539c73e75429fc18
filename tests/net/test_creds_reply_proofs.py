"""Under `kvasir creds` a worker cannot answer per expert under another worker's name: each
worker's credentials file holds its reply key (derived from the deployment's reply secret and its
name), its replies carry the proof, and a backbone given the secret drops a reply naming w1 that
w2 sent (counted as forged), so w1 is never quarantined. Real nats-server with the deployment's
config, a real `kvasir worker --creds w1.creds`, and w2 answering every per-expert request as w1."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvasir_bus import creds
from kvasir_bus.attribution import REPLY_KEY_LINE, reply_key, reply_key_in
from kvasir_bus.server import EmbeddedNats

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=23, layers=2)


@pytest.mark.parametrize("auth", ["nkey", "jwt"])
def test_every_worker_identity_gets_its_reply_key_in_its_credentials_file(auth, tmp_path):
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", ["w1", "w2"], auth=auth)
    secret = creds.reply_secret(dep)
    assert (dep / creds.REPLY_SECRET).stat().st_mode & 0o777 == 0o600
    for name in ("w1", "w2"):
        assert reply_key_in(dep / f"{name}.creds") == reply_key(secret, name)
    assert REPLY_KEY_LINE not in (dep / "backbone.creds").read_text()
    creds.add_worker(dep, "w3")
    assert reply_key_in(dep / "w3.creds") == reply_key(secret, "w3")


@pytest.mark.parametrize("proofs", [True, False], ids=["reply-secret", "no-secret"])
def test_a_worker_answering_as_another_under_creds_is_dropped_and_never_gets_it_quarantined(
        proofs, model, tmp_path, monkeypatch):
    """With the reply secret the backbone drops w2's replies naming w1 (no proof of w1's key).
    Without it the same attack gets w1 quarantined: pinned down as what a backbone without the
    secret allows, not as a wish."""
    from backbone.dispatch import DispatchConfig
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import spawn_worker, wait_for_nodes
    from tests.net.test_enrol_liar import _impersonator

    engine = Engine(model)
    prompt = np.random.default_rng(7).integers(0, engine.cfg.n_vocab, 10).tolist()
    mono = generate(Engine(model), prompt, 4, Sampler(SamplerConfig()), stop_on_eos=False,
                    keep_logits=True).logits_array()
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", ["w1", "w2"])
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        log = open(tmp_path / "w1.log", "w")
        honest = spawn_worker(url, "w1", ["--model", str(model), "--layer", "all", "--experts", "all"],
                              log_file=log, heartbeat_s=0.3, extra=["--creds", str(dep / "w1.creds"),
                                                                    "--bundles", "off"])
        try:
            monkeypatch.setenv("NATS_CREDS", str(dep / "backbone.creds"))
            asyncio.run(wait_for_nodes(url, model_fingerprint(engine.reader), {"w1"}, procs=[honest]))
            dcfg = DispatchConfig(timeout_s=5.0, bundles=False,
                                  reply_secret=creds.reply_secret(dep) if proofs else b"")
            cfg = BackboneConfig(model_path=engine.path, nats_url=url, market=False, serve_manifest=False,
                                 spool="off", dispatch=dcfg, sign_key=str(dep / "backbone.creds"))
            with BackboneService(engine, cfg) as backbone, \
                    _impersonator(model, url, dep / "w2.creds", "w1") as liar:
                out = generate(engine, prompt, 4, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
                stats = backbone.stats.to_dict()
            assert liar.sent > 0
            assert np.array_equal(out.logits_array(), mono)
            if proofs:
                assert stats["quarantined"] == [], stats["quarantined"]
                assert stats["totals"]["forged"] > 0
                assert stats["per_node"].get("w1", {}).get("calls", 0) > 0, stats["per_node"]
            else:
                assert stats["quarantined"] == ["w1"]  # what a backbone without the secret allows
        finally:
            honest.stop()
