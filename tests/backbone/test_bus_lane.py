"""The backbone's bus path through the lane (kvasir_bus.lane): replies handled where nats.py
parses them and a step's requests written to the socket in one write, with no bit changed
against the monolithic run and against the ordinary path; a headed reply (a 503 "no
responders") still goes the ordinary way and ends its call as before."""

from __future__ import annotations

import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from tests.backbone.test_sharding import (  # noqa: F401 (fixtures)
    N_DECODE, assert_identical, bus_backbone, model, model_args, monolithic, prompt, swarm)
from tests.polling import until

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def run_sharded(url, model, prompt, cfg: DispatchConfig, bundle_nodes: int):
    """Tokens, logits, stats, and how many replies came inline and requests went direct."""
    engine = Engine(model)
    with bus_backbone(engine, url, cfg) as backbone:
        remote = backbone.dispatch
        remote.bus.run(until(lambda: remote.coverage.bundle_nodes == bundle_nodes, "the bundle heartbeats"))
        gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        stats = remote.stats.to_dict()
        inline = None if remote._lane is None else remote._lane.delivered
        direct = None if remote._direct is None else remote._direct.written
    return (gen.tokens, gen.logits_array(), stats), inline, direct


def test_replies_come_inline_and_steps_go_direct_and_change_no_bit(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    for bundles in (True, False):
        lane_on, inline, direct = run_sharded(nats_server.url, model, prompt,
                                              DispatchConfig(timeout_s=30.0, bundles=bundles, engine_connection=False), 2 * bundles)
        lane_off, inline_off, direct_off = run_sharded(
            nats_server.url, model, prompt,
            DispatchConfig(timeout_s=30.0, bundles=bundles, inline_delivery=False, direct_publish=False,
                           engine_connection=False), 2 * bundles)
        for sharded in (lane_on, lane_off):
            assert_identical(sharded, monolithic)
            t = sharded[2]["totals"]
            assert t["remote"] == t["calls"] > 0 and t["invalid"] == 0
        assert (inline_off, direct_off) == (None, None)
        t = lane_on[2]["totals"]
        messages = t["bundles"] + t["calls"] - t["bundled_calls"]  # one per bundle, one per call outside them
        assert inline == messages  # every reply inline: each message answered once
        assert 0 < direct <= messages  # nearly every step straight to the socket (one may step aside)
        assert t["bytes_out"] == lane_off[2]["totals"]["bytes_out"]  # the same requests, byte for byte


def test_no_responders_still_take_the_ordinary_path_and_fall_back(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3"))])  # nobody holds 4-7: the server answers 503 at once
    sharded, inline, direct = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0), 1)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["no_responders"] > 0 and t["timeouts"] == 0 and t["invalid"] == 0  # each 503 settled its call at once
    assert inline > 0 and direct > 0


def test_all_bundle_steps_go_on_the_engine_connection_and_change_no_bit(nats_server, swarm, model, prompt, monolithic):
    """EXPERIMENT (s6-blane-direct): the engine thread's own blocking connection takes the steps."""
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    engine = Engine(model)
    with bus_backbone(engine, nats_server.url, DispatchConfig(timeout_s=30.0)) as backbone:
        remote = backbone.dispatch
        remote.bus.run(until(lambda: remote.coverage.bundle_nodes == 2, "the bundle heartbeats"))
        gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        t = remote.stats.to_dict()["totals"]
        steps = remote.direct_steps
    assert_identical((gen.tokens, gen.logits_array(), None), monolithic)
    assert steps > 0 and t["remote"] == t["calls"] > 0 and t["timeouts"] == 0
