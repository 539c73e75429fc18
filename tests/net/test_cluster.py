"""Past one server, with the shipped configs of deploy/cluster/ on loopback (free ports).

* Three servers in a cluster: the server the workers are connected to is killed in the middle
  of a generation; the workers reconnect to the other members by themselves, serve again, and
  the output stays bit-identical to the monolithic run.
* A leafnode edge that dials out to the hub over WebSocket carries a LAN worker's traffic.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from kvasir_bus.server import EmbeddedNats

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "deploy" / "cluster"
N_PROMPT, N_DECODE = 12, 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=11)


@pytest.fixture(scope="module")
def prompt_and_monolithic(model):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig

    engine = Engine(model)
    prompt = np.random.default_rng(5).integers(0, engine.cfg.n_vocab, N_PROMPT).tolist()
    gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                   keep_logits=True)
    return prompt, gen.tokens, gen.logits_array()


def member(name: str, routes: list[str] = ()) -> EmbeddedNats:
    """deploy/cluster/bus-<name>.conf on loopback: every listener moved to a free port."""
    return EmbeddedNats(config=CLUSTER / f"bus-{name}.conf", port=0, http_port=0,
                        websocket_port=0, leafnode_port=0, cluster="127.0.0.1:0",
                        routes=list(routes), server_name=f"bus-{name}").start()


@pytest.fixture
def cluster():
    servers = []
    try:
        servers.append(member("a"))
        servers += [member(n, [servers[0].route_url]) for n in ("b", "c")]
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def workers(tmp_path):
    """start(url, [(node, experts)]) -> processes, once each has heartbeated (seen on watch_url)."""
    from kernels.tensors import open_gguf
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import spawn_worker, wait_for_nodes

    procs = []

    def start(model, url, nodes, watch_url=None):
        for node, experts in nodes:
            log = open(tmp_path / f"{node}.log", "w")
            procs.append(spawn_worker(url, node, ["--model", str(model), "--layer", "all",
                                                  "--experts", experts],
                                      heartbeat_s=0.3, log_file=log))
        fp = model_fingerprint(open_gguf(model))
        asyncio.run(wait_for_nodes(watch_url or url, fp, {n for n, _ in nodes}, procs=procs))
        return procs

    yield start
    for p in procs:
        p.stop()


def sharded_run(model, url, prompt, on_token=None):
    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig, BackboneService

    engine = Engine(model)
    # A generous fixed timeout: these tests count remote calls, and on a loaded machine the
    # adaptive one may (rightly) give up on a call.
    cfg = BackboneConfig(model_path=engine.path, nats_url=url, serve_manifest=False,
                         dispatch=DispatchConfig(timeout_s=10.0))
    with BackboneService(engine, cfg) as backbone:
        remote = backbone.dispatch
        hook = (lambda t: on_token(remote)) if on_token else None
        gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                       keep_logits=True, on_token=hook)
        stats = remote.stats.to_dict()
    return gen.tokens, gen.logits_array(), stats


def per_node_calls(stats: dict) -> dict[str, int]:
    return {node: s["calls"] for node, s in stats["per_node"].items()}


def test_cluster_members_route_to_each_other(cluster, arun):
    from kvasir_bus.connect import connect

    a, b, c = cluster

    async def go():
        asker, answerer = await connect(b.url, "asker"), await connect(c.url, "answerer")

        async def answer(msg):
            await answerer.publish(msg.reply, b"from c")

        await answerer.subscribe("kvasir.test.route", cb=answer)
        await answerer.flush()
        try:
            for _ in range(100):  # interest crosses the routes shortly after the subscription
                try:
                    return (await asker.request("kvasir.test.route", b"", timeout=0.2)).data
                except Exception:
                    await asyncio.sleep(0.05)
        finally:
            await asker.close()
            await answerer.close()

    assert arun(go()) == b"from c"


def test_workers_survive_losing_their_server_mid_generation_bit_identical(
        model, prompt_and_monolithic, cluster, workers):
    from kernels.tensors import open_gguf
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import wait_for_nodes

    a, b, c = cluster
    prompt, mono_tokens, mono_logits = prompt_and_monolithic
    # The workers know only bus-a (the others they learn by gossip); the backbone is on bus-b.
    workers(model, a.url, [("w0", "0-3"), ("w1", "4-7")], watch_url=b.url)
    fp = model_fingerprint(open_gguf(model))
    at_kill: dict[str, int] = {}

    def on_token(remote):
        if at_kill or remote.stats.totals().remote < 10:
            return
        os.kill(a.pid, signal.SIGKILL)  # the workers' server dies without a goodbye
        a.wait(10)
        at_kill.update(per_node_calls(remote.stats.to_dict()))
        # Generation waits here until both workers heartbeat through another member: after
        # that, every dispatch can reach them again.
        asyncio.run(wait_for_nodes(b.url, fp, {"w0", "w1"}, timeout=60))

    tokens, logits, stats = sharded_run(model, b.url, prompt, on_token)
    assert at_kill, "bus-a was never killed"
    assert tokens == mono_tokens
    assert np.array_equal(logits, mono_logits)
    after = per_node_calls(stats)
    assert after["w0"] > at_kill["w0"] and after["w1"] > at_kill["w1"], (at_kill, after)


def test_a_leafnode_edge_over_websocket_carries_a_lan_workers_traffic(
        model, prompt_and_monolithic, workers, tmp_path):
    prompt, mono_tokens, mono_logits = prompt_and_monolithic
    hub = member("a")
    try:
        # The shipped edge config, its hub URLs pointed at the hub's WebSocket listener.
        text = (CLUSTER / "edge.conf").read_text()
        text, n = re.subn(r"urls: \[[^\]]*\]", f'urls: ["{hub.websocket_url}"]', text)
        assert n == 1
        (tmp_path / "edge.conf").write_text(text)
        with EmbeddedNats(config=tmp_path / "edge.conf", port=0) as edge:
            # The worker is on the edge only; its heartbeat is watched for on the hub.
            workers(model, edge.url, [("lan0", "0-7")], watch_url=hub.url)
            tokens, logits, stats = sharded_run(model, hub.url, prompt)
            assert "Leafnode connection created" in edge.log_text()
    finally:
        hub.stop()
    assert tokens == mono_tokens
    assert np.array_equal(logits, mono_logits)
    assert stats["totals"]["remote"] == stats["totals"]["calls"] > 0
    assert set(stats["per_node"]) == {"lan0"}
