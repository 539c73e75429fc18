"""The server with its experts on the swarm: worker processes on an embedded nats-server.

Deterministic mode: whatever the workers do (killed, frozen mid-stream), each of 8 concurrent
streams gets exactly the tokens it gets alone on one machine; the faults cost speed only.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.generate_bus import generate_all, new_request
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.service import BackboneConfig, BackboneService
from backbone.tokenizer import Tokenizer
from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from launch.swarm import spawn_worker, wait_for_nodes
from tests.polling import until

openai = pytest.importorskip("openai", reason="the acceptance tests use the official openai client")

ROOT = Path(__file__).resolve().parents[2]
N_STREAMS, N_TOKENS = 8, 16


@pytest.fixture(scope="module")
def model(models):
    return models("qwen2moe", "q4_k")  # shared expert, K-quants: as tests/backbone/test_sharding.py


@pytest.fixture(scope="module")
def prompts(model):
    n_vocab = Engine(model).cfg.n_vocab
    rng = np.random.default_rng(11)
    return [rng.integers(0, n_vocab, int(n)).tolist() for n in rng.integers(4, 24, N_STREAMS)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    return [generate(Engine(model), p, N_TOKENS, Sampler(SamplerConfig()), stop_on_eos=False).tokens for p in prompts]


@pytest.fixture
def workers(nats_server, model, tmp_path):
    procs = []

    def start(specs: list[tuple[str, str]]):
        for node, experts in specs:
            log = open(tmp_path / f"{node}.log", "w")
            procs.append(spawn_worker(nats_server.url, node, ["--model", str(model), "--layer", "all",
                                                              "--experts", experts], heartbeat_s=0.5, log_file=log))
        fp = model_fingerprint(Engine(model).reader)
        asyncio.run(wait_for_nodes(nats_server.url, fp, {n for n, _ in specs}, procs=procs))
        return procs

    yield start
    for p in procs:
        if p.alive():
            os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def test_eight_streams_survive_a_killed_and_a_frozen_worker_token_for_token(
        nats_server, workers, model, prompts, alone):
    victim, frozen, _steady = workers([("victim", "0-3"), ("frozen", "4-7"), ("steady", "0-7")])
    engine = Engine(model)
    # A fixed timeout: a frozen worker's calls give up after it and fall back locally (or are
    # won by the steady replica, which races it); tokens cannot depend on which.
    bb_cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, serve_manifest=False, market=False,
                            dispatch=DispatchConfig(timeout_s=0.5))
    with BackboneService(engine, bb_cfg) as backbone:
        # The backbone puts a call in the bundle of every holder its view of the heartbeats
        # knows: until it has heard all three, "victim" would be asked nothing at all.
        asyncio.run(until(lambda: backbone.dispatch.coverage.bundle_nodes == 3,
                          "the backbone to hear every worker's bundle heartbeat"))
        cfg = ServerConfig(port=0, model_name="tiny", bus_model=backbone.model, bus_url=nats_server.url,
                           scheduler=SchedulerConfig(max_active=N_STREAMS, step_tokens=64, deterministic=True))
        with ServerThread(engine, Tokenizer(model), cfg) as server:
            sched = server.server.scheduler
            faults: dict[str, int] = {}
            answered: dict[str, threading.Event] = {"victim": threading.Event(), "frozen": threading.Event()}

            def inject() -> None:  # on a thread of its own, watching the scheduler's counters
                # Each fault waits for its worker's first reply as well as for the tokens: whether
                # that reply wins its race against "steady" or comes second does not matter.
                for name, node, pid, sig, after in (
                        ("kill", "victim", victim.proc.pid, signal.SIGKILL, N_STREAMS * 3),
                        ("stop", "frozen", frozen.proc.pid, signal.SIGSTOP, N_STREAMS * 7)):
                    while sched.stats.generated_tokens < after or not answered[node].is_set():
                        time.sleep(0.005)
                    os.kill(pid, sig)
                    faults[name] = sched.stats.completed  # streams already finished at that moment

            injector = threading.Thread(target=inject, daemon=True)
            injector.start()

            async def on_reply(msg) -> None:  # a worker's answer on the bus names its node, won or not
                for decode in (codec.decode_bundle_reply, codec.decode_reply):
                    try:
                        reply = decode(msg.data)
                    except codec.CodecError:
                        continue  # not this kind (or not a worker's reply at all: a token)
                    if reply.node in answered and not isinstance(reply, codec.ErrorReply):
                        answered[reply.node].set()
                    return

            async def ask():
                nc = await connect(nats_server.url, "test-client")
                try:
                    await nc.subscribe("_INBOX.>", cb=on_reply)
                    await nc.flush()
                    return await asyncio.gather(*(generate_all(nc, backbone.model,
                                                               new_request(p, N_TOKENS, stop_on_eos=False),
                                                               timeout_s=120) for p in prompts))
                finally:
                    await nc.drain()

            results = asyncio.run(ask())
            injector.join(5)
            stats = backbone.stats.to_dict()
    victim.proc.wait()
    # Both faults came mid-stream, each after its worker had served (a reply seen on the bus).
    assert faults == {"kill": 0, "stop": 0}, "a fault came after a stream had finished: not mid-stream"
    assert [tokens for tokens, _, _ in results] == alone
    t = stats["totals"]
    assert t["remote"] > 0
    assert t["local"] + t["timeouts"] + stats["per_node"]["steady"]["calls"] > 0


def test_kvasir_serve_http_with_nats_serves_the_swarm_and_exits_on_sigterm(nats_server, workers, model, alone,
                                                                            prompts):
    workers([("w0", "0-3"), ("w1", "4-7")])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", str(model), "--nats",
                             nats_server.url, "--http", "127.0.0.1:0", "--model-name", "tiny", "--deterministic"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"(http://\S+)/v1", line)
        assert match, f"no serving line: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        assert "experts on the bus" in line
        client = openai.OpenAI(base_url=match.group(1) + "/v1", api_key="none", max_retries=0, timeout=60)
        tok = Tokenizer(model)
        out = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=N_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == tok.decode_bytes(alone[0]).decode("utf-8", errors="replace")
        assert out.usage.completion_tokens == N_TOKENS
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
