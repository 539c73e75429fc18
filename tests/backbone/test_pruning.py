"""Last-layer row pruning: with ``all_logits=False`` the last layer's FFN (norm, router, shared
and routed experts) and the head run only on each sequence's last row, as llama.cpp's
``inp_out_ids`` does. In deterministic mode every product is batch-invariant, so the pruned
logits are the unpruned ones' last rows bit for bit; in either mode the remote experts of the
last layer are asked for those rows only, and a sharded step equals the monolithic one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone.experts import LocalExperts
from backbone.model import Engine
from kernels import backend

ROOT = Path(__file__).resolve().parents[2]
# One architecture per path of Engine.forward: qwen3moe/qwen2moe/mixtral run one graph per
# layer (one sequence) or two (a batch); gpt-oss and qwen35moe run op by op.
CASES = [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0"), ("mixtral", "f16"), ("gpt-oss", "q8_0"),
         ("qwen35moe", "q4_k")]


class Remote:
    """An expert backend that is not the engine's own (so the engine takes its sharded path),
    computing what a worker with the backbone's kernels computes, and recording every call."""

    def __init__(self, engine: Engine):
        self.local = LocalExperts(engine.weights)
        self.rows: dict[int, int] = {}

    def run_layer(self, layer: int, calls):
        self.rows[layer] = self.rows.get(layer, 0) + sum(len(r) for _, r in calls)
        return self.local.run_layer(layer, calls)


def _steps(engine: Engine, all_logits: bool) -> list[np.ndarray]:
    """A prompt, a chunk and a decode step of one sequence, then a batch of a prefill and a
    decode: every shape the scheduler and generate() send."""
    rng = np.random.default_rng(5)
    V = engine.cfg.n_vocab
    p, chunk, b = rng.integers(0, V, 13), rng.integers(0, V, 4), rng.integers(0, V, 9)
    a, other = engine.new_sequence(), engine.new_sequence()
    out = engine.forward([(a, p)], all_logits=all_logits)
    out += engine.forward([(a, chunk)], all_logits=all_logits)
    out += engine.forward([(a, chunk[:1])], all_logits=all_logits)
    out += engine.forward([(other, b), (a, chunk[1:2])], all_logits=all_logits)
    return out


@pytest.mark.parametrize("arch,qtype", CASES)
def test_pruned_logits_are_the_last_rows_of_all_logits_in_deterministic_mode(models, arch, qtype):
    if backend.kernel_mode() != "deterministic":
        pytest.skip("the suite's default mode is deterministic; bit equality holds there")
    engine = Engine(models(arch, qtype))
    full = _steps(engine, True)
    pruned = _steps(engine, False)
    assert [len(p) for p in pruned] == [1] * len(pruned)
    for f, p in zip(full, pruned):
        assert np.array_equal(p, f[-1:])
    if engine.fused:  # the op-by-op path prunes the same rows
        engine.fused = engine.step_graphs = False
        assert all(np.array_equal(a, b) for a, b in zip(_steps(engine, False), pruned))


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("gpt-oss", "q8_0")])
def test_last_layer_experts_see_only_the_kept_rows(models, arch, qtype):
    engine = Engine(models(arch, qtype))
    remote = Remote(engine)
    engine.use_experts(remote)
    K, last = engine.cfg.n_expert_used, engine.cfg.n_layer - 1
    prompts = [np.arange(11) % engine.cfg.n_vocab, np.arange(6) % engine.cfg.n_vocab]
    engine.forward([(engine.new_sequence(), p) for p in prompts], all_logits=False)
    assert remote.rows[0] == 17 * K  # every row before the last layer
    assert remote.rows[last] == 2 * K  # one row per sequence in it
    mono = Engine(models(arch, qtype))  # one sequence, all local: one graph per layer where it can
    mono.forward([(mono.new_sequence(), prompts[0])], all_logits=False)
    assert (mono.local_experts.rows[0], mono.local_experts.rows[last]) == (11 * K, K)


def test_sharded_equals_monolithic_with_pruning(models):
    """Monolithic (one graph per layer for one sequence) and sharded (two graphs per layer,
    experts through a backend) steps with pruning give the same bits, in the suite's mode."""
    for arch, qtype in CASES:
        mono = Engine(models(arch, qtype))
        sharded = Engine(models(arch, qtype))
        sharded.use_experts(Remote(sharded))
        for m, s in zip(_steps(mono, False), _steps(sharded, False)):
            assert np.array_equal(m, s), arch


def test_sharded_equals_monolithic_with_pruning_in_the_fast_mode_too():
    """The test above in the fast mode (llama.cpp's tiled kernels, not batch-invariant): the
    pruned rows take the same kernels whoever computes the experts."""
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "test_sharded_equals_monolithic_with_pruning and not fast"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 passed" in out.stdout
