"""Volunteers enrol one after another against one running server (no reload, no file copied
from the operator: each holds only the join link and a key it made itself), serve, and a
generation is bit-identical to the monolithic run; their short-lived JWTs are renewed while
calls flow and no call is dropped; `kvasir worker --enrol LINK` (a process) does the same.

KVASIR_ENROL_VOLUNTEERS sets how many enrol (default 12; the issue's 50 runs too, slower)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvasir_bus import creds, enrol
from kvasir_bus.server import EmbeddedNats
from tests.net.steps import Loop

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

N_VOLUNTEERS = int(os.environ.get("KVASIR_ENROL_VOLUNTEERS", "12"))
N_PROMPT, N_DECODE = 12, 6
# short: every volunteer renews (make-before-break) during the test; longer with many volunteers,
# whose enrolment alone takes seconds on a small box
TTL_S = max(4, N_VOLUNTEERS // 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=17, layers=2)


def _wait(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)  # polling the backbone's view of the bus
    raise AssertionError(f"timed out waiting for {what}")


def test_volunteers_enrol_serve_bit_identical_and_renew_without_dropping_a_call(model, tmp_path, monkeypatch):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService
    from modelfile.slice_file import load_slice
    from modelfile.slicer import plan_slice, write_slice
    from workers.enrolled import EnrolledServing
    from workers.runtime import WorkerConfig

    engine = Engine(model)
    n_experts = engine.cfg.n_expert
    prompt = np.random.default_rng(3).integers(0, engine.cfg.n_vocab, N_PROMPT).tolist()
    mono = generate(Engine(model), prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                    keep_logits=True).logits_array()
    from modelfile.slicer import parse_span

    every = parse_span("all", "--layer")
    slices = [load_slice(write_slice(plan_slice(str(model), [(every, parse_span(str(e), "--experts"))]),
                                     tmp_path / f"s{e}.gguf").path) for e in range(n_experts)]

    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", [], auth="jwt")
    loop = Loop()
    servings = []
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        service = loop(enrol.EnrolService(enrol.EnrolConfig(str(dep), ttl_s=TTL_S, allow_open=True,
                                                            per_token_burst=N_VOLUNTEERS + 8)).start(url))
        link = f"{url}#{enrol.make_token(dep, open_=True)}"  # all a volunteer is given
        try:
            monkeypatch.setenv("NATS_CREDS", str(dep / "backbone.creds"))
            # A fixed, generous timeout: on a loaded 2-core box the adaptive one (floor 50 ms) times
            # out slow-but-served calls; a call lost in a renewal would still time out (or find
            # no responders, at once), and the assertion below would catch it.
            cfg = BackboneConfig(model_path=engine.path, nats_url=url, market=False,
                                 dispatch=DispatchConfig(timeout_s=5.0))
            with BackboneService(engine, cfg) as backbone:
                for i in range(N_VOLUNTEERS):  # one after another, the server never reloaded
                    async def join(i=i):
                        u, token = enrol.split_link(link)
                        me = await enrol.enrol(u, token)
                        return await EnrolledServing(u, me, tmp_path / f"v{i}.creds", slices[i % n_experts],
                                                     WorkerConfig(node=me.name, heartbeat_s=0.3)).start()
                    servings.append(loop(join()))
                names = {s.identity.name for s in servings}
                assert len(names) == N_VOLUNTEERS
                _wait(lambda: backbone.dispatch.coverage.bundle_nodes >= N_VOLUNTEERS,
                      "the backbone to hear every volunteer")
                out = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                               keep_logits=True)
                assert np.array_equal(out.logits_array(), mono)

                # Calls keep flowing while every JWT is renewed (at half its TTL_S life) twice.
                before = {id(s): s.renewals for s in servings}
                rounds = 0
                while min(s.renewals - before[id(s)] for s in servings) < 2:
                    out = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                                   keep_logits=True)
                    assert np.array_equal(out.logits_array(), mono)
                    rounds += 1
                    assert rounds < 200, "renewals did not happen"
                stats = backbone.stats.to_dict()
                totals = stats["totals"]
                dropped = {k: totals[k] for k in ("timeouts", "no_responders", "bus_errors", "silent", "invalid")}
                assert dropped == dict.fromkeys(dropped, 0), (dropped, totals)
                assert totals["local_choice"] == 0, totals  # every expert was covered throughout
                won = set(stats["per_node"])
                assert won and won <= names, (won, names)
                assert service.counts.get("enrolled", 0) >= 3 * N_VOLUNTEERS  # joins and renewals
                assert not creds.revocations(dep)
        finally:
            for s in servings:
                loop(s.stop())
            loop(service.stop())
            loop.close()


def test_kvasir_worker_enrol_needs_nothing_but_the_link(model, tmp_path):
    """The CLI: `kvasir worker --enrol LINK --slice S` enrols, heartbeats under its enrolled name;
    SIGTERM ends it with 0. (The volunteering path, --budget --source, goes through the same
    enrol_and_serve, then the market.)"""
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import wait_for_nodes
    from modelfile.slicer import parse_span, plan_slice, write_slice

    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", [], auth="jwt")
    s = write_slice(plan_slice(str(model), [(parse_span("all", "--layer"), parse_span("0-1", "--experts"))]),
                    tmp_path / "s.gguf").path
    loop = Loop()
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        service = loop(enrol.EnrolService(enrol.EnrolConfig(str(dep))).start(server.url))
        token = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "enrol", str(dep), "--token",
                                "--nats", server.url], capture_output=True, text=True, timeout=60)
        assert token.returncode == 0, token.stderr
        link = token.stdout.strip()
        assert link.startswith(server.url + "#")
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        env["KVASIR_THREADS"] = "1"
        log = tmp_path / "w.log"
        proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "worker", "--enrol", link,
                                 "--slice", str(s), "--heartbeat", "0.3", "--cache-dir", str(tmp_path / "c")],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        try:
            _wait(lambda: service.counts.get("enrolled") or proc.poll() is not None, "the worker to enrol")
            assert proc.poll() is None, log.read_text()
            (name,) = [r["name"] for r in service.state["keys"].values()]
            from backbone.model import Engine
            fp = model_fingerprint(Engine(model).reader)
            monkey = dict(os.environ)
            os.environ["NATS_CREDS"] = str(dep / "observer.creds")
            try:
                beats = asyncio.run(wait_for_nodes(server.url, fp, {name}, timeout=60))
            finally:
                os.environ.clear()
                os.environ.update(monkey)
            assert beats[name].node == name
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()[-2000:]
            assert "Traceback" not in log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            loop(service.stop())
            loop.close()
