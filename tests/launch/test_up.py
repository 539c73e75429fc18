"""`kvasir up` (what `make demo` runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
