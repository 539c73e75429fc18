"""bench/step.py: the engine's CPU time per step for a batch of decoding sequences, one graph
per step against the per-layer path. Its counts must be real: one graph launch per step on the
one-graph path, (3 + sequences) per layer on the other, and the same logits on both."""

from __future__ import annotations

from tests.bench_script import load


def test_the_step_bench_counts_one_launch_per_step_against_the_per_layer_path(models):
    path = models("qwen3moe", "q4_k")
    out = load("step").child(str(path), streams=3, prompt_tokens=4, steps=2, rounds=2)
    one, per_layer = out["paths"]["one_graph"], out["paths"]["per_layer"]
    assert out["same_logits"] is True
    assert one["graph_launches_per_step"] == 1
    # the embedding, per layer attention_in + 3 attention graphs + attention_out + experts, the head
    assert per_layer["graph_launches_per_step"] == 1 + out["n_layer"] * (3 + 3) + 1
    assert one["steps"] == per_layer["steps"] == 4
    assert one["cpu_ms_per_step"]["median"] > 0 and out["cpu_speedup"] > 0
