"""Every role under its own generated identity, on a server that refuses anonymous clients:
a fixed ``--slice`` worker and a volunteer (partial download of only its range) serve a
generation bit-identical to the monolithic run; ``kvasir status`` and ``kvasir tap`` run as the
observer; each worker's ``--node`` is its identity's name; SIGTERM ends both workers with 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvasir_bus import creds
from kvasir_bus.server import EmbeddedNats

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

TOKEN = "node-token-s"
RANGE = 4
N_PROMPT, N_DECODE = 16, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=13, layers=2)


def _kvasir(*argv, **kw):
    """`kvasir ARGV` in a child whose only identity is the one on its command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return subprocess.run([sys.executable, "-m", "kvasir_bus.cli", *argv], capture_output=True,
                          text=True, env=env, timeout=kw.pop("timeout", 120), **kw)


def _worker(url, cred, *args, log):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["KVASIR_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "worker", "--nats", url,
                             "--creds", str(cred), "--heartbeat", "0.3", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling the market's answer, not guessing readiness
    raise AssertionError(f"timed out waiting for {what}")


def _term(proc, log_path):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_path.read_text()[-2000:]
    assert "Traceback" not in log_path.read_text()


def test_slice_worker_volunteer_status_and_tap_under_generated_credentials(model, tmp_path, monkeypatch):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import wait_for_nodes

    engine = Engine(model)
    fp = model_fingerprint(engine.reader)
    prompt = np.random.default_rng(2).integers(0, engine.cfg.n_vocab, N_PROMPT).tolist()
    mono = generate(Engine(model), prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                    keep_logits=True).logits_array()

    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", ["slice1", "vol1"])
    slice_path = tmp_path / "s.gguf"
    done = _kvasir("slice", str(model), "--layer", "all", "--experts", f"0-{RANGE - 1}", "-o", str(slice_path))
    assert done.returncode == 0, done.stderr

    procs: list[subprocess.Popen] = []
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        try:
            market_log = open(tmp_path / "market.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvasir_bus.cli", "market", "--nats", url, "--creds",
                 str(dep / "market.creds"), "--db", str(tmp_path / "l.db"), "--model", fp,
                 "--range-experts", str(RANGE), "--expiry", "5", "--demand-interval", "0.5"],
                stdout=market_log, stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if not k.startswith("NATS_")}))
            monkeypatch.setenv("NATS_CREDS", str(dep / "backbone.creds"))
            cfg = BackboneConfig(model_path=engine.path, nats_url=url, serve_weights="127.0.0.1:0",
                                 tokens=(TOKEN,), market_interval_s=0.2)
            with BackboneService(engine, cfg) as backbone:
                monkeypatch.setenv("NATS_CREDS", str(dep / "observer.creds"))  # watching, below

                def status():
                    out = _kvasir("status", "--nats", url, "--creds", str(dep / "observer.creds"),
                                  "--model", fp, "--json")
                    if out.returncode == 2 and ("no market is running" in out.stderr
                                                or "(unknown_model)" in out.stderr):
                        return {"manifest_known": False, "nodes": []}  # still starting: ask again
                    assert out.returncode == 0, out.stderr
                    return json.loads(out.stdout)["models"][0]

                _wait(lambda: status()["manifest_known"], "the market to learn the model")

                # The fixed worker: a slice of experts 0-3 of every layer, no --node.
                slice_log = tmp_path / "slice1.log"
                procs.append(_worker(url, dep / "slice1.creds", "--slice", str(slice_path),
                                     log=open(slice_log, "w")))
                asyncio.run(wait_for_nodes(url, fp, {"slice1"}, timeout=60))

                # The volunteer: a budget for one range, no --node; it gets one range and downloads
                # only that. (Which one: slice1 counts as coverage only once it has served.)
                range_bytes = RANGE * backbone.manifest.expert_bytes(0)
                vol_log = tmp_path / "vol1.log"
                vol = _worker(url, dep / "vol1.creds", "--budget", str(int(range_bytes * 1.3)),
                              "--source", backbone.weights_url, "--token", TOKEN,
                              "--cache-dir", str(tmp_path / "cache"), log=open(vol_log, "w"))
                procs.append(vol)
                beats = asyncio.run(wait_for_nodes(url, fp, {"vol1"}, timeout=120))
                (held,) = beats["vol1"].holdings
                assert held.hi - held.lo == RANGE and held.lo % RANGE == 0
                served = backbone.weights.served_to("vol1")
                assert 0 < served <= 1.05 * (range_bytes + backbone.manifest.data_offset)

                # the backbone's own view must hold both, or vol1 may be heard after the generation
                _wait(lambda: backbone.dispatch.coverage.bundle_nodes >= 2,
                      "the backbone to hear both workers' heartbeats")
                engine_out = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()),
                                      stop_on_eos=False, keep_logits=True)
                assert np.array_equal(engine_out.logits_array(), mono)
                stats = backbone.stats.to_dict()
                calls = {node: v["calls"] for node, v in stats["per_node"].items()}
                assert calls.get("slice1", 0) > 0, calls
                # vol1 holds either a hole (then it wins those calls) or slice1's range (slice1 had
                # not served yet when the market assigned it): then the two race and the loser's
                # replies are counted as duplicates. Either way it answered under its identity.
                assert calls.get("vol1", 0) > 0 or stats["totals"]["duplicates"] > 0, stats

                _wait(lambda: {"slice1", "vol1"} <= {n["node"] for n in status()["nodes"]},
                      "the observer's status to show both workers")
                tap = _kvasir("tap", f"kvasir.{fp}.coverage.*", "--nats", url, "--creds",
                              str(dep / "observer.creds"), "--count", "2", "--duration", "30")
                assert tap.returncode == 0, tap.stderr
                assert len(tap.stdout.strip().splitlines()) == 2 and "coverage" in tap.stdout

                _term(vol, vol_log)
                _term(procs[1], slice_log)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
    assert "permissions violation" not in (tmp_path / "market.log").read_text().lower()


def test_a_node_name_that_is_not_the_identitys_is_refused_before_connecting(model, tmp_path):
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", ["w1"])
    out = _kvasir("worker", "--nats", "nats://127.0.0.1:1", "--creds", str(dep / "w1.creds"),
                  "--node", "w2", "--model", str(model), "--layer", "0", "--experts", "0")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "does not match the identity" in out.stderr, out.stderr
