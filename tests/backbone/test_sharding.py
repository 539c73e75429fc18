"""Sharded over NATS == monolithic, bit for bit, whatever the workers do.

Each test runs a prompt of at least 32 tokens and 16 greedy steps with the experts dispatched
to real worker processes on an embedded nats-server, and compares the logits of every position
with the monolithic run: the maximum |difference| must be exactly 0.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from launch.swarm import spawn_worker, wait_for_nodes
from kvasir_bus.fingerprint import model_fingerprint
from tests.polling import until

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

N_PROMPT, N_DECODE = 36, 16
ARCH, QTYPE = "qwen2moe", "q4_k"  # shared expert, K-quants: the most moving parts


@pytest.fixture(scope="module")
def model(models):
    return models(ARCH, QTYPE)


@pytest.fixture(scope="module")
def prompt(model):
    n_vocab = Engine(model).cfg.n_vocab
    return np.random.default_rng(7).integers(0, n_vocab, N_PROMPT).tolist()


@pytest.fixture(scope="module")
def monolithic(model, prompt):
    gen = generate(Engine(model), prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    return gen.tokens, gen.logits_array()


@pytest.fixture
def swarm(nats_server, model, tmp_path):
    """start(node, source_args) launches a worker process; all are stopped after the test."""
    procs = []

    def start(nodes_and_args: list[tuple[str, list[str]]], model_fp: str | None = None):
        for node, args in nodes_and_args:
            log = open(tmp_path / f"{node}.log", "w")
            procs.append(spawn_worker(nats_server.url, node, args, heartbeat_s=0.5, log_file=log))
        fp = model_fp or model_fingerprint(Engine(model).reader)
        mine = procs[-len(nodes_and_args):]
        asyncio.run(wait_for_nodes(nats_server.url, fp, {n for n, _ in nodes_and_args}, procs=mine))
        return mine

    yield start
    for p in procs:
        if p.alive():
            os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def bus_backbone(engine, url, dispatch=DispatchConfig()):
    """The backbone dispatching to the workers on ``url`` (no manifest, no market needed)."""
    cfg = BackboneConfig(model_path=engine.path, nats_url=url, dispatch=dispatch, serve_manifest=False)
    return BackboneService(engine, cfg)


def run_sharded(url, model, prompt, cfg=DispatchConfig(), on_token=None, bundle_nodes: int = 0):
    """Tokens, logits and dispatch stats of a sharded generation; with ``bundle_nodes``, once
    the backbone has heard that many bundle workers' heartbeats (a worker started last may
    otherwise be heard only after a short generation is over)."""
    engine = Engine(model)
    with bus_backbone(engine, url, cfg) as backbone:
        remote = backbone.dispatch
        if bundle_nodes:
            remote.bus.run(until(lambda: remote.coverage.bundle_nodes == bundle_nodes,
                                 "the bundle heartbeats"))
        hook = (lambda t: on_token(t, remote)) if on_token else None
        gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False,
                       keep_logits=True, on_token=hook)
        stats = remote.stats.to_dict()
    return gen.tokens, gen.logits_array(), stats


def assert_identical(sharded, monolithic):
    tokens, logits, _ = sharded
    assert len(logits) >= 32 + 16
    assert tokens == monolithic[0]
    assert np.abs(logits - monolithic[1]).max() == 0.0
    assert np.array_equal(logits, monolithic[1])


def half(lo, hi):
    return ["--model", None, "--layer", "all", "--experts", f"{lo}-{hi}"]


def model_args(model, experts: str, layer: str = "all"):
    return ["--model", str(model), "--layer", layer, "--experts", experts]


def test_workers_covering_every_expert_compute_all_and_change_nothing(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    # A generous fixed timeout: on a loaded machine the adaptive one may (rightly) give up on a
    # call, which is not what this test is about.
    sharded = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0))
    assert_identical(sharded, monolithic)
    totals = sharded[2]["totals"]
    assert totals["remote"] == totals["calls"] > 0
    assert totals["fallback_rate"] == 0.0
    assert set(sharded[2]["per_node"]) == {"w0", "w1"}


def test_partial_coverage_falls_back_locally_for_the_holes(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-2", layer="0"))])  # only 3 experts of layer 0
    sharded = run_sharded(nats_server.url, model, prompt)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["remote"] > 0
    assert t["no_responders"] + t["local_choice"] > 0
    assert t["timeouts"] == 0
    assert sharded[2]["per_layer"]["1"]["remote"] == 0


def test_two_racing_replicas_per_expert_first_reply_wins_and_the_other_is_dropped(
        nats_server, swarm, model, prompt, monolithic):
    swarm([("a", model_args(model, "0-7")), ("b", model_args(model, "0-7"))])
    # A generous fixed timeout: on a loaded machine the adaptive one may (rightly) give up on a
    # call, which is not what this test is about.
    sharded = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0), bundle_nodes=2)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["remote"] == t["calls"]
    assert t["invalid"] == 0
    # Both replicas answer every request; our dispatch takes one reply per call and counts
    # each loser that arrived before the end as a duplicate instead of using it.
    assert 0 < t["duplicates"] <= t["calls"]
    assert sum(n["calls"] for n in sharded[2]["per_node"].values()) == t["remote"]


def test_worker_killed_mid_generation_costs_speed_not_correctness(nats_server, swarm, model, prompt, monolithic):
    victim, _ = swarm([("victim", model_args(model, "0-3")), ("steady", model_args(model, "4-7"))])
    killed = []

    def on_token(i_token, remote):
        if not killed and len(remote.stats.nodes) and remote.stats.totals().remote > 20:
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
            killed.append(True)

    # A fixed timeout: with the adaptive one a fresh backbone computes its first step here while
    # the calls are out, and on a loaded machine slow replies may keep the victim from ever serving
    # the 20 calls that arm the kill. A killed worker is "no responders" at once either way.
    sharded = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=10.0), on_token=on_token)
    assert killed, "the worker was never killed"
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["remote"] > 0 and t["local"] > 0


def test_frozen_worker_costs_a_timeout_per_call_never_a_hang(nats_server, swarm, model, prompt, monolithic):
    frozen, _ = swarm([("frozen", model_args(model, "0-3")), ("steady", model_args(model, "4-7"))])
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        sharded = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=0.1))
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["timeouts"] > 0
    assert "frozen" not in sharded[2]["per_node"]
    assert sharded[2]["per_node"]["steady"]["calls"] > 0


def test_worker_holding_another_build_is_never_used(nats_server, swarm, models, model, prompt, monolithic):
    other = models(ARCH, QTYPE, seed=2)  # same shapes, other weights: another fingerprint
    other_fp = model_fingerprint(Engine(other).reader)
    assert other_fp != model_fingerprint(Engine(model).reader)
    swarm([("stranger", model_args(other, "0-7"))], model_fp=other_fp)
    sharded = run_sharded(nats_server.url, model, prompt)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["remote"] == 0
    assert sharded[2]["per_node"] == {}


def test_f16_wire_rounding_is_applied_to_local_experts_too(nats_server, swarm, model, prompt):
    swarm([("w0", model_args(model, "0-3"))])  # half the experts remote, half local
    engine = Engine(model, wire_dtype="float16")
    mono = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    engine16 = Engine(model, wire_dtype="float16")
    with bus_backbone(engine16, nats_server.url) as backbone:
        remote = backbone.dispatch
        gen = generate(engine16, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        assert remote.stats.totals().remote > 0
    assert np.array_equal(gen.logits_array(), mono.logits_array())


def test_a_new_replica_is_used_as_soon_as_it_heartbeats(nats_server, swarm, model, prompt, monolithic):
    engine = Engine(model)
    cfg = DispatchConfig(uncovered_ttl_s=600)  # only a heartbeat can end "uncovered" here
    with bus_backbone(engine, nats_server.url, cfg) as backbone:
        remote = backbone.dispatch
        first = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        alone = remote.stats.totals()
        assert alone.remote == 0 and alone.no_responders > 0 and alone.local_choice > 0
        swarm([("late", model_args(model, "0-7"))])
        # the test's own connection heard the heartbeat; under load the backbone's can hear it a
        # few steps later (CI: 7 local choices in the second generation): wait for that instead
        remote.bus.run(until(lambda: remote.coverage.uncovered == 0, "the backbone hears the late worker"))
        second = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        both = remote.stats.totals()
    assert both.local_choice == alone.local_choice and both.no_responders == alone.no_responders
    assert both.remote > 0
    assert np.array_equal(first.logits_array(), monolithic[1])
    assert np.array_equal(second.logits_array(), monolithic[1])
