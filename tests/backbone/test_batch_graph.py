"""A step of several sequences decoding runs as one ggml graph from the token ids to the logits,
each sequence's attention against its own KV cache inside it (``Engine._batch_graphs``;
``kernels.fused.step_graph`` with ``StepShape.streams``): one graph launch per step instead of
(3 + sequences) per layer; a step with prompt chunks (a shape that seldom recurs) the same ops
in one graph per layer, which builds one layer's graph. Each sequence gets the bits of the
per-layer path and, in the deterministic mode, of its run alone; the graph is built once per
batch shape and reused step after step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone import model
from backbone.model import Engine
from kernels import dense, fused, ggml

ROOT = Path(__file__).resolve().parents[2]
CASES = [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0"), ("mixtral", "f16")]


def _steps(engine: Engine) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Three prompts read together (every logit), three decode steps of the three, then a
    mixed step (two decode tokens and a chunk, last logits only). Returns every step's logits
    and, per sequence, its tokens in the order fed."""
    rng = np.random.default_rng(7)
    V = engine.cfg.n_vocab
    seqs = [engine.new_sequence() for _ in range(3)]
    fed = [[rng.integers(0, V, n)] for n in (5, 17, 33)]
    out = engine.forward([(s, f[0]) for s, f in zip(seqs, fed)])
    nxt = [int(o[-1].argmax()) for o in out]
    for _ in range(3):
        batch = [(s, np.array([t])) for s, t in zip(seqs, nxt)]
        for f, (_, ids) in zip(fed, batch):
            f.append(ids)
        step = engine.forward(batch, all_logits=False)
        out += step
        nxt = [int(o[-1].argmax()) for o in step]
    batch = [(seqs[0], np.array([nxt[0]])), (seqs[1], rng.integers(0, V, 6)), (seqs[2], np.array([nxt[2]]))]
    for f, (_, ids) in zip(fed, batch):
        f.append(ids)
    out += engine.forward(batch, all_logits=False)
    return out, fed


def _launches(monkeypatch) -> list[int]:
    """A counter of ggml graph launches (every kernel runs its graphs through Graph.run)."""
    count = [0]
    real = ggml.Graph.run

    def counted(self, arrays):
        count[0] += 1
        return real(self, arrays)

    monkeypatch.setattr(ggml.Graph, "run", counted)
    return count


def _stats(engine: Engine) -> tuple[dict, dict]:
    return dict(engine.local_experts.calls), dict(engine.local_experts.rows)


@pytest.mark.parametrize("arch,qtype", CASES)
def test_a_decode_step_of_a_batch_is_one_graph_launch_with_the_bits_of_the_per_layer_path(models, arch, qtype, monkeypatch):
    engine = Engine(models(arch, qtype))
    assert engine.batch_graphs
    count = _launches(monkeypatch)
    per_step = []
    real_forward = engine.forward

    def forward(batch, **kw):
        n0 = count[0]
        out = real_forward(batch, **kw)
        per_step.append(count[0] - n0)
        return out

    monkeypatch.setattr(engine, "forward", forward)
    one_graph, fed = _steps(engine)
    L = engine.cfg.n_layer  # decode steps: one graph; steps with prompt chunks: one per layer (cheap builds)
    layers = engine.weights.layers
    if all(fused.experts_in_graph(8, blk) for blk in layers):
        assert per_step == [L, 1, 1, 1, L]
    else:  # the fast mode's two expert layouts: a step with prompt chunks of 8 rows or more stops at
        # each layer's experts, split by their rows (kernels.ggml.moe_ffn): per layer its graph, the
        # shared expert and two more (a decode step of 8 streams or more is tried in one graph
        # first: tests/backbone/test_speculation.py)
        assert per_step[1:4] == [1, 1, 1] and all(L < n <= 4 * L + 1 for n in (per_step[0], per_step[4])), per_step
    stats = _stats(engine)
    engine.local_experts.calls.clear()
    engine.local_experts.rows.clear()
    engine.batch_graphs = False  # three graphs per layer and one attention graph per sequence
    per_step.clear()
    per_layer, _ = _steps(engine)
    assert min(per_step) > 3 * engine.cfg.n_layer
    assert all(np.array_equal(a, b) for a, b in zip(one_graph, per_layer))
    assert stats == _stats(engine)  # the experts' statistics (the market's demand) too
    if ggml.deterministic():  # batch-invariant: each sequence's logits are those of its run alone
        monkeypatch.setattr(engine, "forward", real_forward)
        for i, tokens in enumerate(fed):
            alone = engine.forward([(engine.new_sequence(), np.concatenate(tokens))])[0]
            ends = np.cumsum([len(t) for t in tokens])
            assert np.array_equal(one_graph[i], alone[:ends[0]])  # the prompt, every row
            for k in range(1, 5):  # each later step: its last row
                assert np.array_equal(one_graph[3 * k + i], alone[ends[k] - 1:ends[k]])


def test_a_decode_step_reuses_its_graph_until_a_sequence_crosses_256_cells(models, monkeypatch):
    """The graph is cached by each sequence's rows and cache shape (n_kv padded to 64 cells,
    the cache to 256); positions, masks and the cells written are bound per call. Two
    sequences decoding ten steps, one of them crossing 256 cells (its cache grows, and its
    cells seen pass 256): two graphs built, the second at the crossing."""
    engine = Engine(models("qwen3moe", "q4_k", ctx=512))
    V = engine.cfg.n_vocab
    rng = np.random.default_rng(3)
    a, b = engine.new_sequence(), engine.new_sequence()
    engine.forward([(a, rng.integers(0, V, 250))])
    engine.forward([(b, rng.integers(0, V, 10))])
    built = []
    real_put = ggml.GraphCache.put
    monkeypatch.setattr(ggml.GraphCache, "put", lambda self, key, g: built.append(a.n_past) or real_put(self, key, g))
    for _ in range(10):
        out = engine.forward([(a, rng.integers(0, V, 1)), (b, rng.integers(0, V, 1))], all_logits=False)
        assert len(out) == 2 and out[0].shape == (1, V)
    assert built == [250, 256]  # the first step, and the one that writes cell 256
    assert (a.n_past, b.n_past) == (260, 20)


def test_a_decode_steps_bindings_are_reused_while_the_caches_hold_and_renewed_when_one_grows(models):
    """What a batch step binds of its sequences (each one's per-layer caches, ``Engine._caches``;
    the step's blocks, ``_step_blocks``) is kept from step to step while no cache has to grow:
    the same lists, checked once. A sequence crossing 256 cells moves to a bigger slot, and the
    next step binds its new caches. The logits are the per-layer path's, bit for bit."""
    def run(batch_graphs: bool):
        engine = Engine(models("qwen3moe", "q4_k", ctx=512))
        engine.batch_graphs = batch_graphs
        rng = np.random.default_rng(5)
        V = engine.cfg.n_vocab
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.forward([(a, rng.integers(0, V, 252))])
        engine.forward([(b, rng.integers(0, V, 9))])
        out, bound, blocks = [], [], []
        for _ in range(8):  # a writes cells 252..259: it crosses 256 at the fifth step
            out += engine.forward([(a, rng.integers(0, V, 1)), (b, rng.integers(0, V, 1))], all_logits=False)
            bound.append(a.bound[1] if a.bound else None)
            blocks.append(getattr(engine._thread, "blocks", (None, None, None))[2])
        return out, bound, blocks, a

    out, bound, blocks, a = run(True)
    assert all(x is bound[0] for x in bound[:4]) and all(x is bound[4] for x in bound[4:]) and bound[4] is not bound[0]
    assert all(x is blocks[0] for x in blocks[:4]) and blocks[4] is not blocks[0]
    assert a.k[0].shape[0] == 512 and bound[4][0][0] is a.k[0]  # the new slot's caches are the ones bound
    per_layer, _, _, _ = run(False)
    assert all(np.array_equal(x, y) for x, y in zip(out, per_layer))


def test_the_kept_bindings_let_go_of_a_dropped_sequences_caches(models):
    """What ``_step_blocks`` keeps for the next step holds no cache past its sequence: a server
    that has finished its streams keeps none of their memory."""
    import gc
    import weakref

    engine = Engine(models("qwen3moe", "q4_k"))
    seqs = [engine.new_sequence() for _ in range(2)]
    for s in seqs:
        s.slots = None  # caches of their own (arrays that only the sequence should hold)
        engine.forward([(s, np.array([1, 2, 3]))])
    engine.forward([(s, np.array([4])) for s in seqs], all_logits=False)
    assert engine._thread.blocks[2] is not None
    cache = weakref.ref(seqs[0].k[0])
    del s, seqs
    gc.collect()
    assert engine._thread.blocks[2] is None and cache() is None


def test_a_batch_with_remote_experts_is_one_graph_per_layer_with_the_local_bits(models, monkeypatch):
    from tests.backbone.test_pruning import Remote

    local = Engine(models("qwen2moe", "q8_0"))
    sharded = Engine(models("qwen2moe", "q8_0"))
    remote = Remote(sharded)
    sharded.use_experts(remote)
    calls = []
    real = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    got, _ = _steps(sharded)
    assert calls == ([1] * sharded.cfg.n_layer + [0]) * 5  # a graph per layer, then the last combine and head
    want, _ = _steps(local)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert remote.rows == _stats(local)[1]  # every row each layer's experts saw, asked of the remote


def test_a_wide_batch_runs_a_few_layers_per_graph_with_the_same_bits(models, monkeypatch):
    engine = Engine(models("qwen3moe", "q4_k"))
    whole, _ = _steps(engine)
    calls = []
    real = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw))
    monkeypatch.setattr(model, "MAX_STREAM_LAYERS", 3)  # three sequences: one layer per graph
    split, _ = _steps(engine)
    assert calls == [1] * (5 * engine.cfg.n_layer)
    assert all(np.array_equal(a, b) for a, b in zip(whole, split))


def test_a_chunk_too_long_for_one_attention_graph_takes_the_per_layer_path(models, monkeypatch):
    """kernels.dense.attention runs a chunk whose scores pass MAX_KQ_BYTES in pieces; a batch
    holding one goes the per-layer way (and gets the same bits)."""
    engine = Engine(models("qwen3moe", "q4_k"))
    whole, _ = _steps(engine)
    monkeypatch.setattr(dense, "MAX_KQ_BYTES", 8 * 256 * engine.cfg.n_head * 8)  # 8 query rows at most
    used = []
    real = engine._batch_graphs
    monkeypatch.setattr(engine, "_batch_graphs", lambda *a: used.append(1) or real(*a))
    pieces, _ = _steps(engine)
    assert len(used) == 4  # the decode steps and the mixed one (its chunk of 6); not the prompts of 17, 33
    assert all(np.array_equal(a, b) for a, b in zip(whole, pieces))


@pytest.mark.parametrize("flash", ["1", "0"])  # flash attention, the fast mode's default, and off
def test_batch_graphs_match_the_per_layer_path_in_the_fast_mode_too(flash):
    """The first test in the fast mode (repacked weights, llama.cpp's tiled kernels; one query
    row attends alone): the one-graph step and the per-layer path run the same ops."""
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", KVASIR_FLASH_ATTN=flash, PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "one_graph_launch"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "3 passed" in out.stdout


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_kept_bindings_follow_a_delta_net_state_the_per_layer_path_replaced(models, arch):
    """The per-layer path gives a sequence new conv and recurrent state arrays; the step graphs
    that follow must bind those, not the ones ``Engine._caches`` kept from an earlier graph step
    (a batch that outgrows the graphs' state scratch, then shrinks again, goes so)."""
    def run(switch: bool) -> list[np.ndarray]:
        engine = Engine(models(arch, "q4_k"))
        rng = np.random.default_rng(3)
        V = engine.cfg.n_vocab
        a, b = engine.new_sequence(), engine.new_sequence()
        engine.forward([(a, rng.integers(0, V, 7)), (b, rng.integers(0, V, 5))])
        out = []
        for k in range(6):
            engine.batch_graphs = not switch or k % 3 != 1  # step 1 and 4 op by op, the others in a graph
            engine.step_graphs = engine.batch_graphs or not switch
            out += engine.forward([(a, rng.integers(0, V, 1)), (b, rng.integers(0, V, 1))], all_logits=False)
        return out

    mixed, graphs = run(True), run(False)
    assert all(np.array_equal(x, y) for x, y in zip(mixed, graphs))
