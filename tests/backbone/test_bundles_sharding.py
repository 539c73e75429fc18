"""Bundles over a real bus: sharded == monolithic bit for bit with bundles on (the default, as in
every test of test_sharding.py) and off, and a worker from before bundles is still served."""

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


def run_sharded(url, model, prompt, cfg: DispatchConfig, bundle_nodes: int, read=None):
    """As test_sharding's, once the backbone has heard ``bundle_nodes`` bundle workers. With
    ``read``: (that, ``read(remote)`` after the generation)."""
    engine = Engine(model)
    with bus_backbone(engine, url, cfg) as backbone:
        remote = backbone.dispatch
        backbone_bus = remote.bus
        backbone_bus.run(until(lambda: remote.coverage.bundle_nodes == bundle_nodes, "the bundle heartbeats"))
        gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        stats = remote.stats.to_dict()
        extra = read(remote) if read is not None else None
    out = gen.tokens, gen.logits_array(), stats
    return out if read is None else (out, extra)


def test_bundles_carry_the_calls_and_change_no_bit_and_off_sends_none(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    on = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0), 2)
    off = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0, bundles=False), 0)
    for sharded in (on, off):
        assert_identical(sharded, monolithic)
        assert sharded[2]["totals"]["remote"] == sharded[2]["totals"]["calls"] > 0
    t = on[2]["totals"]
    assert t["bundles"] > 0 and t["bundled_calls"] > t["bundles"]  # several calls per message
    assert t["foreign"] == 0 and t["invalid"] == 0
    assert off[2]["totals"]["bundles"] == 0


def test_a_worker_without_bundles_is_served_per_expert_beside_a_bundle_worker(
        nats_server, swarm, model, prompt, monolithic):
    swarm([("old", model_args(model, "0-3") + ["--bundles", "off"]), ("new", model_args(model, "4-7"))])
    sharded = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0), 1)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["remote"] == t["calls"] and t["bundles"] > 0
    assert set(sharded[2]["per_node"]) == {"old", "new"}
    assert 0 < t["bundled_calls"] < t["remote"]  # the old worker's calls went per expert
