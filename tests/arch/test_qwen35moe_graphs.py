"""qwen35moe and qwen3next steps as step graphs (kernels/fused.py: ``_delta_net_part`` and the
gated, IMROPE attention of ``_attention_part``) against the op-by-op path they replace.

A step of these architectures runs from the token ids to the logits in a few ggml graphs, the
conv and recurrent states updated in place by the graph; a batch of several sequences (prompt
chunks and decode tokens mixed) too, each sequence's conv and recurrence against its own states. The op-by-op path
(``Engine.step_graphs`` off: one call per op, ``kernels.deltanet.delta_net`` between the
projections) is what the llama.cpp parity tests also check; the two must agree bit for bit over
prompt chunks and decode steps mixed, a chunk that crosses the KV cache's first 256 cells
included, in the tests' deterministic mode (a one-row step as two rows) and, in a child
process, in the fast mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone.model import Engine
from kernels import fused

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

CHUNKS = (30, 3, 1, 1, 1, 240, 1, 1)  # prompt, a chunk, decode steps, a chunk past 256 cells, decode


def _run(engine: Engine, tokens: np.ndarray) -> tuple[list, list, list]:
    """Every step's logits (the last one: the last row only) and the final states."""
    seq = engine.new_sequence()
    logits, at = [], 0
    for i, n in enumerate(CHUNKS):
        logits.append(engine.forward([(seq, tokens[at:at + n])], all_logits=i != len(CHUNKS) - 1)[0])
        at += n
    return logits, [s for s in seq.ssm if s is not None], [c for c in seq.conv if c is not None]


def _compare(path) -> dict:
    """Runs with and without step graphs on one engine, and how many graphs a decode step took."""
    engine = Engine(path, n_ctx=512)
    tokens = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, sum(CHUNKS))
    assert engine.step_graphs
    calls = []
    real = fused.step_graph

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fused.step_graph = counted
    try:
        graphs = _run(engine, tokens)
        seq = engine.new_sequence()
        engine.forward([(seq, tokens[:5])])
        states = [a for a in seq.ssm + seq.conv if a is not None]
        calls.clear()
        engine.forward([(seq, tokens[5:6])])
        decode_graphs = len(calls)
        in_place = all(a is b for a, b in zip(states, [a for a in seq.ssm + seq.conv if a is not None]))
        engine.step_graphs = False
        calls.clear()
        op_by_op = _run(engine, tokens)
        assert not calls  # the reference really is the other path
    finally:
        fused.step_graph = real
    same = all(np.array_equal(g, o) for got, want in zip(graphs, op_by_op) for g, o in zip(got, want))
    return {"same": same, "decode_graphs": decode_graphs, "n_layer": engine.cfg.n_layer, "in_place": in_place,
            "batch_same": _compare_batch(engine)}


def _compare_batch(engine: Engine) -> bool:
    """Three sequences' prompts in one step, then a step of a decode token, a chunk and a
    decode token, then a decode token each: with and without step graphs, the same bits."""
    rng = np.random.default_rng(1)
    steps = [[rng.integers(0, engine.cfg.n_vocab, n) for n in lengths]
             for lengths in ((5, 17, 33), (1, 7, 1), (1, 1, 1))]
    runs = []
    for graphs in (True, False):
        engine.step_graphs = engine.batch_graphs = graphs
        seqs = [engine.new_sequence() for _ in steps[0]]
        out = [logits for i, tokens in enumerate(steps)
               for logits in engine.forward(list(zip(seqs, tokens)), all_logits=i < 2)]
        runs.append(out + [a for s in seqs for a in s.ssm + s.conv if a is not None])
    return all(np.array_equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("arch,qtype", [("qwen35moe", "q4_k"), ("qwen35moe", "f32"), ("qwen3next", "q8_0")])
def test_step_graphs_give_the_bits_of_the_op_by_op_path(models, arch, qtype):
    got = _compare(models(arch, qtype, ctx=512))
    assert got["same"] and got["batch_same"]
    assert 1 <= got["decode_graphs"] <= got["n_layer"]
    assert got["in_place"]  # the states are the sequence's own arrays, written by the graph


_FAST = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.arch.test_qwen35moe_graphs import _compare
for path in sys.argv[2:]:
    print(json.dumps(_compare(path)))
"""


def test_fast_mode_step_graphs_give_the_bits_of_the_op_by_op_path(models):
    """ggml fixes its kernel mode when it loads: the fast mode (one-row decode steps, repacked
    weights) in a child process."""
    paths = [str(models("qwen35moe", "q4_k", ctx=512)), str(models("qwen3next", "f16", ctx=512))]
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("KVASIR_KERNEL_MODE", "KVASIR_REPACK")}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", _FAST, str(root), *paths], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in done.stdout.splitlines():
        got = json.loads(line)
        assert got["same"] and got["batch_same"] and got["in_place"] and 1 <= got["decode_graphs"] <= got["n_layer"]


@pytest.mark.parametrize("arch,qtype", [("qwen35moe", "q4_k"), ("qwen3next", "f16")])
def test_step_graphs_split_at_remote_experts_give_the_bits_of_local_ones(models, arch, qtype):
    """With another backend computing the experts, the step graphs stop at each layer's routing
    (``_step_graphs_remote``): the same logits for a batch (chunks and decode tokens mixed) and
    for one sequence."""
    from backbone.experts import LocalExperts

    engine = Engine(models(arch, qtype))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (5, 17, 33)]
    nxt = [rng.integers(0, engine.cfg.n_vocab, n) for n in (1, 7, 1)]
    runs = []
    for remote in (False, True):
        engine.use_experts(LocalExperts(engine.weights) if remote else None)
        seqs = [engine.new_sequence() for _ in prompts]
        out = engine.forward(list(zip(seqs, prompts))) + engine.forward(list(zip(seqs, nxt)))
        one = engine.new_sequence()
        out += engine.forward([(one, prompts[2])]) + engine.forward([(one, nxt[0])])
        runs.append(out)
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_a_batch_whose_states_exceed_the_bound_runs_the_per_layer_path(models, monkeypatch):
    """A wide batch's recurrent states would make a graph of gigabytes at the 122B's shapes
    (4 MB per sequence and layer): past ``MAX_STATE_BYTES`` it runs the per-layer path, whose
    bits are the same."""
    from backbone import model

    engine = Engine(models("qwen35moe", "q8_0"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (4, 9)]
    want = engine.forward([(engine.new_sequence(), p) for p in prompts])
    calls = []
    real = fused.step_graph
    monkeypatch.setattr(fused, "step_graph", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = engine.cfg
    monkeypatch.setattr(model, "MAX_STATE_BYTES", c.ssm_v_heads * c.ssm_head_dim ** 2 * 4)  # one sequence's
    got = engine.forward([(engine.new_sequence(), p) for p in prompts])
    assert not calls and all(np.array_equal(a, b) for a, b in zip(got, want))
    engine.forward([(engine.new_sequence(), prompts[0])])  # one sequence: its graphs still
    assert calls
