"""The backbone computes while the replies travel: with remote experts, a one-sequence step's
graph stops at the router, the rows are published, and the shared expert (which needs no routed
expert) runs as its own graph while the workers compute (``kernels.fused.shared_expert``, handed
to the backend as ``while_waiting``); the next graph combines. The bits stay those of the
all-local step, in both kernel modes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from backbone.model import Engine
from kernels import fused
from tests.backbone.test_dispatch import ROWS, bus, rig, times  # noqa: F401  (fixtures)
from tests.backbone.test_pruning import Remote
from tests.backbone.test_step_graph import every_step_shape

ROOT = Path(__file__).resolve().parents[2]


class Overlapping(Remote):
    """A backend that, like the bus's, runs the caller's work after asking for the experts and
    before it has their outputs; it records the order of both."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.events: list[tuple[str, int]] = []

    def run_layer(self, layer: int, calls, while_waiting=None):
        self.events.append(("asked", layer))
        if while_waiting is not None:
            while_waiting()
            self.events.append(("worked", layer))
        return super().run_layer(layer, calls)


def _rig(models, arch: str, qtype: str, monkeypatch):
    """An all-local engine, one on an :class:`Overlapping` backend, that backend, and the list
    each shared-expert graph appends to: (events the backend had recorded, rows of h, rows)."""
    local = Engine(models(arch, qtype))
    sharded = Engine(models(arch, qtype))
    backend = Overlapping(sharded)
    sharded.use_experts(backend)
    ran = []
    real = fused.shared_expert
    monkeypatch.setattr(fused, "shared_expert",
                        lambda layer, h, rows, *a, **kw: ran.append((len(backend.events), len(h), rows))
                        or real(layer, h, rows, *a, **kw))
    return local, sharded, backend, ran


@pytest.mark.parametrize("arch,qtype", [("qwen2moe", "q4_k"), ("qwen2moe", "q8_0"), ("qwen3moe", "q4_k")])
def test_shared_expert_runs_while_the_experts_are_away_with_the_bits_of_the_local_step(models, arch, qtype,
                                                                                      monkeypatch):
    local, sharded, backend, ran = _rig(models, arch, qtype, monkeypatch)
    want = every_step_shape(local)
    ran.clear()  # the local engine's own shared-expert graphs (a fast-mode step of 8+ rows stops at its experts too)
    got = every_step_shape(sharded)
    assert len(got) == len(want) == 4
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    n_layer, has_shared = sharded.cfg.n_layer, sharded.weights.layers[0].ffn_gate_shexp is not None
    per_layer = [("asked", il) for il in range(n_layer)]
    if has_shared:  # each layer's shared expert ran inside its experts' call, after the asking
        per_layer = [e for il in range(n_layer) for e in (("asked", il), ("worked", il))]
        assert [at % 2 for at, _, _ in ran] == [1] * len(ran)
        two = 2 if sharded.one_row_as_two else 1  # a one-row step's dense ops run it as two rows
        assert [(n, rows) for _, n, rows in ran[n_layer:2 * n_layer]] == [(1, two)] * n_layer
    assert backend.events == per_layer * 4
    assert not has_shared or len(ran) == 4 * n_layer


def _batches(engine: Engine) -> list[np.ndarray]:
    """Steps that take the batch path: two sequences at once (prefill, then a decode row each,
    keeping the last rows), and one sequence's decode row with the step graph off."""
    rng = np.random.default_rng(3)
    V = engine.cfg.n_vocab
    a, b = engine.new_sequence(), engine.new_sequence()
    out = engine.forward([(a, rng.integers(0, V, 9)), (b, rng.integers(0, V, 5))])
    out += engine.forward([(a, rng.integers(0, V, 1)), (b, rng.integers(0, V, 1))], all_logits=False)
    engine.step_graphs = False
    out += engine.forward([(a, rng.integers(0, V, 1))], all_logits=False)
    out += engine.forward([(b, rng.integers(0, V, 3))])
    engine.step_graphs = True
    return out


@pytest.mark.parametrize("arch,qtype", [("qwen2moe", "q4_k"), ("qwen2moe", "q8_0")])
def test_shared_expert_runs_while_the_experts_are_away_in_a_batch_step_too(models, arch, qtype, monkeypatch):
    local, sharded, backend, ran = _rig(models, arch, qtype, monkeypatch)
    want = _batches(local)
    ran.clear()  # the local engine's own shared-expert graphs, as above
    got = _batches(sharded)
    assert len(got) == len(want) == 6
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    n_layer = sharded.cfg.n_layer
    assert backend.events == [e for il in range(n_layer) for e in (("asked", il), ("worked", il))] * 4
    assert [at % 2 for at, _, _ in ran] == [1] * len(ran)
    two = 2 if sharded.one_row_as_two else 1
    assert [(n, rows) for _, n, rows in ran[2 * n_layer:3 * n_layer]] == [(1, two)] * n_layer  # the decode row


@pytest.mark.parametrize("repack", ["0", "1"])
def test_overlap_gives_the_local_bits_in_the_fast_mode_too(repack):
    """The tests above in the fast mode (tiled kernels, and repacked weights, whose kernels
    switch with the row count): the shared expert's own graph runs the rows the dense graph would."""
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", KVASIR_REPACK=repack, PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "shared_expert_runs_while"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "5 passed" in out.stdout


def test_shared_expert_refuses_rows_that_do_not_fit(models):
    engine = Engine(models("qwen2moe", "q8_0"))
    layer, D = engine.weights.layers[0], engine.cfg.n_embd
    with pytest.raises(ValueError, match="shared_expert"):
        fused.shared_expert(layer, np.zeros((2, D + 1), np.float32), 2, "silu_div")
    with pytest.raises(ValueError, match="shared_expert"):
        fused.shared_expert(layer, np.zeros((2, D), np.float32), 3, "silu_div")
    with pytest.raises(ValueError, match="gate"):
        fused.shared_expert(layer, np.zeros((2, D), np.float32), 2, "tanh")
    one = fused.shared_expert(layer, np.ones((1, D), np.float32), 2, "silu_div")
    assert np.array_equal(one, fused.shared_expert(layer, np.ones((2, D), np.float32), 2, "silu_div")[:1])


def test_run_layer_does_the_callers_work_once_the_requests_are_out(rig):
    """``while_waiting`` runs after the publish is on its way: a caller's work that waits for
    the request to reach the (fake) bus returns, and the reply is still used."""
    remote, nc, _, _, _ = rig()
    seen = threading.Event()
    answer = times(3)
    nc.answer = lambda subject, req: seen.set() or answer(subject, req)
    waited = []
    (out,) = remote.run_layer(0, [(5, ROWS)], while_waiting=lambda: waited.append(seen.wait(10.0)))
    assert waited == [True]
    assert np.array_equal(out, 3 * ROWS)


def test_run_layer_does_the_callers_work_even_with_nothing_to_ask(rig, bus):
    remote, nc, local, _, _ = rig()
    waited = []
    assert remote.run_layer(0, [], while_waiting=lambda: waited.append(1)) == []
    bus.stop()  # the loop is gone: the expert is computed here, the caller's work still done
    (out,) = remote.run_layer(0, [(5, ROWS)], while_waiting=lambda: waited.append(2))
    assert waited == [1, 2]
    assert np.array_equal(out, 2 * ROWS)
