"""`kvasir up` (what `make demo` runs) and the dispatch timeout policy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backbone.dispatch import AdaptiveTimeout, DispatchConfig

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def test_up_runs_the_swarm_and_checks_it_against_the_monolithic_run(tmp_path):
    from synth.model import synth_model

    model = synth_model(tmp_path / "m.gguf", arch="qwen2moe", preset="tiny", qtype="q8_0", seed=9)
    db = tmp_path / "ledger.db"
    proc = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model), "--workers", "3",
                           "--prompt", "The swarm splits a model into experts", "-n", "8", "--check", "--json",
                           "--db", str(db)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["check"]["bit_identical"] and result["check"]["tokens_equal"]
    assert result["check"]["max_abs_diff"] == 0.0
    assert set(result["workers"]) == {"worker-0", "worker-1", "worker-2"}
    assert sum(w["calls"] for w in result["workers"].values()) == result["dispatch"]["calls"] > 0
    paid = {n["node"]: n["rows"] for n in result["rewards"]["nodes"]}
    assert paid == {name: w["rows"] for name, w in result["workers"].items()}
    assert db.exists()


def test_adaptive_timeout_follows_latency_between_floor_and_ceiling():
    cfg = DispatchConfig(timeout_floor_s=0.05, timeout_ceiling_s=2.0, initial_timeout_s=0.5)
    t = AdaptiveTimeout(cfg)
    assert t.current() == 0.5  # nothing observed yet
    for _ in range(50):
        t.observe(0.001)
    assert t.current() == 0.05  # fast replies: the floor
    for _ in range(50):
        t.observe(0.2)
    assert 0.2 < t.current() < 0.5  # smoothed latency plus its deviation
    for _ in range(50):
        t.observe(5.0)
    assert t.current() == 2.0  # the ceiling
    assert AdaptiveTimeout(DispatchConfig(timeout_s=0.123)).current() == 0.123  # fixed when configured
