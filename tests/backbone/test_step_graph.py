"""A one-sequence step with every expert local runs as one ggml graph from the embedding to the
logits, the router's top-k included (``kernels.fused.step_graph``); a long chunk as a few
layers per graph. Each way gives the bits of the two-graphs-per-layer path and of the op-by-op
path, and the same local-expert statistics (the market's demand weights)."""

from __future__ import annotations

import numpy as np
import pytest

from backbone import model
from backbone.model import Engine
from kernels import fused


def every_step_shape(engine: Engine) -> list[np.ndarray]:
    """9 rows, 1 row, 5 rows keeping the last, 1 row keeping it: every shape of a step."""
    rng = np.random.default_rng(11)
    V = engine.cfg.n_vocab
    seq = engine.new_sequence()
    out = engine.forward([(seq, rng.integers(0, V, 9))])
    out += engine.forward([(seq, rng.integers(0, V, 1))])
    out += engine.forward([(seq, rng.integers(0, V, 5))], all_logits=False)
    out += engine.forward([(seq, rng.integers(0, V, 1))], all_logits=False)
    return out


def _run(engine: Engine) -> tuple[list[np.ndarray], dict, dict]:
    engine.local_experts.calls.clear()
    engine.local_experts.rows.clear()
    out = every_step_shape(engine)
    return out, dict(engine.local_experts.calls), dict(engine.local_experts.rows)


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0"), ("mixtral", "f16")])
def test_one_graph_per_step_gives_the_bits_of_every_other_path(models, arch, qtype, monkeypatch):
    engine = Engine(models(arch, qtype))
    assert engine.step_graphs
    calls = []
    real = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    whole = _run(engine)
    assert calls == [engine.cfg.n_layer] * 4  # every step of these tiny shapes: one graph
    calls.clear()
    monkeypatch.setattr(model, "STEP_GRAPH_BYTES", 1)  # one layer per graph
    per_layer = _run(engine)
    assert calls == [1] * (4 * engine.cfg.n_layer)
    engine.step_graphs = False  # two graphs per layer, the top-k from attention_out's graph
    two = _run(engine)
    engine.fused = False  # one call per op, numpy's top-k (kernels.ops.route)
    op_by_op = _run(engine)
    for other in (per_layer, two, op_by_op):
        assert all(np.array_equal(a, b) for a, b in zip(whole[0], other[0]))
        assert whole[1:] == other[1:]


def test_layers_per_graph_keeps_a_long_chunk_small_and_a_decode_step_whole(models):
    engine = Engine(models("qwen3moe", "q4_k"))
    c, blk = engine.cfg, engine.weights.layers[0]
    shape = engine._attention_shape(0)

    def per_graph(rows: int, n_kv: int) -> int:
        step = fused.StepShape(rows, rows, n_kv, n_kv, 1.0, c.n_expert_used, "swiglu", "silu_div", True)
        return fused.layers_per_graph(step, blk, shape, model.STEP_GRAPH_BYTES)

    assert per_graph(2, 256) >= 48  # a decode step of a deep model: one graph
    assert per_graph(512, 4096) < per_graph(8, 4096)
    assert per_graph(4096, 4096) == 1


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0")])
def test_remote_experts_step_is_one_graph_per_layer_with_the_bits_of_the_local_one(models, arch, qtype,
                                                                                  monkeypatch):
    """With the experts elsewhere, a one-sequence step runs one graph per layer (the previous
    layer's combine, its experts' outputs an input, then this layer up to its router) and one
    for the last combine and the head: the same ops as the all-local graph, the same bits."""
    from tests.backbone.test_pruning import Remote

    local = Engine(models(arch, qtype))
    sharded = Engine(models(arch, qtype))
    remote = Remote(sharded)
    sharded.use_experts(remote)
    calls = []
    real = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    got = _run(sharded)
    assert calls == [1] * sharded.cfg.n_layer + [0] + ([1] * sharded.cfg.n_layer + [0]) * 3
    want = _run(local)
    assert all(np.array_equal(a, b) for a, b in zip(got[0], want[0]))
    assert remote.rows == want[2]  # every row each layer's local experts saw, asked of the remote


def test_step_graph_refuses_arrays_of_the_wrong_size(models, monkeypatch):
    """ggml reads as many bytes as the graph's shapes say: a remote layer's outputs of another
    shape are a ValueError, never a read past the array."""
    from tests.backbone.test_pruning import Remote

    engine = Engine(models("qwen3moe", "f32"))
    engine.use_experts(Remote(engine))
    seen = []
    real = fused.step_graph

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append((a, kw, out))
        return out

    monkeypatch.setattr(fused, "step_graph", spy)
    engine.forward([(engine.new_sequence(), np.arange(3))])
    (step, blocks), kw, out = seen[0]
    r = out.routed
    with pytest.raises(ValueError, match="expert outputs"):
        real(step, [], prev=(r, np.zeros((len(r.ids), r.ids.shape[1], 3), np.float32)),
                         head=seen[-1][1]["head"])
    emb, ids = kw["tokens"]
    with pytest.raises(ValueError, match="tokens are"):
        real(step, blocks, **{**kw, "tokens": (emb, ids[:1])})
    with pytest.raises(ValueError, match="tokens are"):  # an id past the vocabulary: ggml would abort
        real(step, blocks, **{**kw, "tokens": (emb, np.full_like(ids, emb.ne[1]))})
    with pytest.raises(ValueError, match="x is"):
        real(step, blocks, **{**kw, "tokens": None, "x": np.zeros((1, emb.ne[0]), np.float32)})


def test_a_remembered_step_plan_gives_the_bits_of_a_fresh_one_and_is_reused(models, monkeypatch):
    engine = Engine(models("qwen3moe", "q4_k"))
    made = []
    real = fused._plan
    monkeypatch.setattr(fused, "_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    remembered = _run(engine)
    n_made = len(made)
    assert n_made == 3  # 9 rows, 5 rows keeping the last, 1 row: three step shapes
    _run(engine)  # the same shapes again, new sequences: nothing worked out anew
    assert len(made) == n_made
    real_step = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, memo=None, **kw: real_step(*a, **kw))
    fresh = _run(engine)  # no memo: every call works its plan out
    assert all(np.array_equal(a, b) for a, b in zip(remembered[0], fresh[0]))
    assert remembered[1:] == fresh[1:]


def test_a_remembered_step_plan_runs_on_the_threads_of_the_moment(models, monkeypatch):
    """A server's share of the cores changes while it runs (kvasir_bus.threads.CoreShare sets
    KVASIR_THREADS): a step plan made on one thread must not keep its shape on one thread once
    two are free, nor give other bits."""
    from kernels import ggml

    engine = Engine(models("qwen3moe", "q4_k"))
    planned = []
    real = ggml.Graph.finish
    monkeypatch.setattr(ggml.Graph, "finish", lambda g, threads: planned.append(threads) or real(g, threads))
    outs = {}
    for threads in ("1", "2", "1"):
        monkeypatch.setenv("KVASIR_THREADS", threads)
        seq = engine.new_sequence()
        outs.setdefault(threads, []).append(engine.forward([(seq, np.arange(9) % engine.cfg.n_vocab)],
                                                           all_logits=False)[0])
    assert 2 in planned  # the step planned on one thread ran on two when they were there
    assert all(np.array_equal(outs["1"][0], o) for o in outs["1"] + outs["2"])
