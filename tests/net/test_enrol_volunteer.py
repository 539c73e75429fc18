"""The whole volunteer path from the command line: `kvasir worker --enrol LINK --budget 340MB
--source URL` (a process holding nothing but the join link) enrols, over the bus or over HTTPS
(a trustme certificate, trusted through $SSL_CERT_FILE), asks the market (a `kvasir market`
process under its JWT identity) for a range on its own volunteer subject, downloads only that
from the backbone's weights server, serves, and a generation is bit-identical to the
monolithic run; SIGTERM ends it with 0 and no traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvasir_bus import creds, enrol
from kvasir_bus.server import EmbeddedNats
from tests.net.enrol_procs import clean_env, enrol_service, kvasir, market, tls_files

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

TOKEN = "weights-token-e"
N_PROMPT, N_DECODE = 12, 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=23, layers=2)


def _wait(predicate, what, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling the backbone's view of the bus
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("over", ["bus", "https"])
def test_kvasir_worker_enrol_budget_source_serves_bit_identical(over, model, tmp_path, monkeypatch):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint

    pytest.importorskip("trustme")
    engine = Engine(model)
    fp = model_fingerprint(engine.reader)
    prompt = np.random.default_rng(4).integers(0, engine.cfg.n_vocab, N_PROMPT).tolist()
    mono = generate(Engine(model), prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                    keep_logits=True).logits_array()
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", [], auth="jwt")
    (cert, key), ca = tls_files(tmp_path)
    procs = []
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        svc, base = enrol_service(dep, url, tmp_path / "enrol.log", http=over == "https", tls=(cert, key))
        procs.append(svc)
        worker = None
        try:
            procs.append(market(dep, url, tmp_path / "m.db", tmp_path / "market.log", fp))
            monkeypatch.setenv("NATS_CREDS", str(dep / "backbone.creds"))
            cfg = BackboneConfig(model_path=engine.path, nats_url=url, serve_weights="127.0.0.1:0",
                                 tokens=(TOKEN,), market_interval_s=0.2)
            with BackboneService(engine, cfg) as backbone:
                made = kvasir("enrol", dep, "--token", "--url", base or url)  # the operator's join link
                assert made.returncode == 0, made.stderr
                link = made.stdout.strip()  # all the volunteer is given
                assert link.startswith(f"{base or url}#")
                log = tmp_path / "worker.log"
                worker = subprocess.Popen(
                    [sys.executable, "-m", "kvasir_bus.cli", "worker", "--enrol", link, "--budget", "340MB",
                     "--source", backbone.weights_url, "--token", TOKEN, "--heartbeat", "0.3",
                     "--cache-dir", str(tmp_path / "cache")],
                    stdout=open(log, "w"), stderr=subprocess.STDOUT,
                    env=clean_env(KVASIR_THREADS="1", SSL_CERT_FILE=ca))
                _wait(lambda: backbone.dispatch.coverage.bundle_nodes >= 1 or worker.poll() is not None,
                      "the backbone to hear the enrolled volunteer")
                assert worker.poll() is None, log.read_text()[-3000:]
                (name,) = [r["name"] for r in json.loads((dep / enrol.STATE).read_text())["keys"].values()]
                out = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                               keep_logits=True)
                assert np.array_equal(out.logits_array(), mono)
                stats = backbone.stats.to_dict()
                assert set(stats["per_node"]) == {name} and stats["per_node"][name]["calls"] > 0, stats["per_node"]
                # it downloaded what it was assigned, under the weights token, and no more than the model
                served = backbone.weights.served_to(name)
                assert 0 < served <= 1.05 * model.stat().st_size, served
                worker.send_signal(signal.SIGTERM)
                assert worker.wait(30) == 0, log.read_text()[-3000:]
                assert "Traceback" not in log.read_text()
        finally:
            if worker is not None and worker.poll() is None:
                worker.kill()
            for p in procs:
                p.stop()
