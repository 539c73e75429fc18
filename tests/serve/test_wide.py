"""Wide batches: admission by memory holds 256 concurrent streams, each with its solo tokens, and
what one stream costs is computed from the model's shapes (and matches what the engine allocates)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import MAX_ACTIVE, GenRequest, Scheduler, SchedulerConfig, stream_bytes
from tests.serve.test_scheduler import Collector

STREAMS, TOKENS = 256, 4


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models("qwen2moe", "q8_0"))


def test_256_concurrent_streams_get_their_solo_tokens_under_deterministic(engine):
    rng = np.random.default_rng(3)
    reqs = [GenRequest(tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 6)))), TOKENS,
                       SamplerConfig(temperature=0.9 * (i % 2), seed=i), stop_on_eos=False)
            for i in range(STREAMS)]
    outs = [Collector() for _ in reqs]
    with Scheduler(engine, SchedulerConfig(max_active=MAX_ACTIVE, step_tokens=1024, deterministic=True)) as sched:
        assert sched.stream_cost()["full_context_streams"] >= STREAMS  # memory admits them, no count does
        with sched._cond:  # all queued before the first step is planned: they run side by side
            for r, out in zip(reqs, outs):
                sched.submit(r, out)
        for out in outs:
            out.wait()
        stats = sched.snapshot()
    assert stats["max_step_sequences"] == STREAMS and stats["completed"] == STREAMS
    assert stats["kv_reserved_bytes"] == 0  # every cache released
    for r, out in zip(reqs, outs):
        solo = generate(engine, list(r.prompt), TOKENS, Sampler(r.sampler), stop_on_eos=False).tokens
        assert out.tokens == solo and out.finish == "length"


def test_memory_bound_admits_what_fits_and_queues_the_rest(engine):
    one = stream_bytes(engine.cfg, 8 + TOKENS, engine.n_ctx)["total"]
    reqs = [GenRequest((1, 2, 3, 4, 5, 6, 7, 8), TOKENS, SamplerConfig(), stop_on_eos=False) for _ in range(12)]
    outs = [Collector() for _ in reqs]
    with Scheduler(engine, SchedulerConfig(max_active=MAX_ACTIVE, kv_bytes=5 * one)) as sched:
        with sched._cond:
            for r, out in zip(reqs, outs):
                sched.submit(r, out)
        for out in outs:
            out.wait()
        stats = sched.snapshot()
    assert stats["max_step_sequences"] == 5 and stats["completed"] == 12
    assert len({tuple(o.tokens) for o in outs}) == 1


def test_stream_cost_matches_what_the_engine_allocates(models):
    for arch in ("qwen2moe", "qwen35moe"):
        eng = Engine(models(arch, "q8_0"))
        seq = eng.new_sequence()
        eng.forward([(seq, np.arange(10))])
        cost = stream_bytes(eng.cfg, 10, eng.n_ctx)
        assert cost["kv"] == sum(a.nbytes for a in seq.k + seq.v)
        assert cost["state"] == sum(a.nbytes for a in seq.conv + seq.ssm if a is not None)
        assert (cost["state"] > 0) == (arch == "qwen35moe")


def test_stream_cost_at_the_122b_shapes():
    """Qwen3.5-122B-A10B as synth's 122b-layer preset reads it, 48 layers: 12 gated-attention
    layers of 2 KV heads x 256, 36 delta-net layers of 16 Q/K and 64 V heads of 128, conv 4."""
    cfg = SimpleNamespace(n_layer=48, n_head_kv=2, head_dim=256, is_recurrent=lambda il: il % 4 != 3,
                          ssm_conv_channels=(2 * 16 + 64) * 128, ssm_conv_kernel=4, ssm_v_heads=64, ssm_head_dim=128)
    cost = stream_bytes(cfg, 4096)
    assert cost["per_token"] == 12 * 2 * 2 * 256 * 2 == 24 * 1024  # 24 KiB of K and V per token
    assert cost["kv"] == 4096 * 24 * 1024  # 96 MiB at 4096 tokens
    assert cost["state"] == 36 * 4 * (12288 * 3 + 64 * 128 * 128)  # 149.1 MiB, whatever the length
