"""bench/plan_check.py --repredict: the model alone, again, on a saved run's configurations and
measured inputs -- no swarm runs, so it is exact and quick (the way to check a change to the
model against real runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.planner.test_sim import TOY, toy_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def saved_run(profile: dict | None) -> dict:
    def config(streams: int, tok_s: float, itl: float) -> dict:
        return {"workers": 1, "rtt_ms": 20, "streams": streams, "audit": 0, "replicas": "split", "stop_at_s": None,
                "measured": {"tokens_per_s": tok_s, "itl_ms": {"p50": itl, "p95": itl}, "ttft_ms": {"p50": 1.0},
                             "load_avg_1m": [0.1, 0.1], "background_runnable": 0.0, "link_rtt_ms": 20.0}}
    # An older record names no grid group: it is found in the full grid by its figures (2 workers
    # at 20 ms there); a newer one carries its group.
    old = {**config(4, 10.0, 100.0), "workers": 2}
    new = {**config(1, 5.0, 50.0), "group": {"workers": 1, "rtt_ms": 20, "streams": [1]}}
    result = {"bench": "plan_check", "model": TOY.name, "cpus": 2, "tokens": 4, "prompt_tokens": 2,
              "profile": profile or {"machine": {}, "seconds": 1.0, "quick": True}, "configs": [old, new]}
    return {"schema": 1, "bench": "plan_check", "date": "2026-12-03T00:00:00Z", "commit": {"sha": "abc"},
            "result": result}


def test_a_saved_run_is_predicted_again_from_its_own_profile():
    pytest.importorskip("aiohttp")
    from bench.plan_check import repredict

    out = repredict(saved_run(toy_profile()))
    first, second = out["configs"]
    assert (first["workers"], first["streams"], second["workers"], second["streams"]) == (2, 4, 1, 1)
    for c in out["configs"]:
        assert c["tokens_per_s_error"] == pytest.approx(c["predicted"]["tokens_per_s"] / c["measured"]["tokens_per_s"] - 1,
                                                        abs=1e-3)
    assert out["summary"]["configurations"] == 2
    assert repredict(saved_run(toy_profile()))["configs"] == out["configs"]  # the model alone: the same again


def test_a_run_without_its_profile_needs_one_and_says_so_in_one_line(tmp_path):
    pytest.importorskip("aiohttp")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(saved_run(None)))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"), "--repredict", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "--profile" in res.stderr
    profile = tmp_path / "toy.json"
    profile.write_text(json.dumps(toy_profile()))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_check.py"), "--repredict", str(run),
                          "--profile", str(profile)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads(res.stdout)["configs"]) == 2


def test_a_measured_round_keeps_the_machine_speed_probe_beside_its_figures():
    pytest.importorskip("aiohttp")
    from bench.plan_check import compare, speed_probe

    probe = speed_probe(reps=1)
    assert set(probe) == {"python_s", "numpy_s"} and all(v > 0 for v in probe.values())
    rounds = [[{"tok_s": 9.0, "probe": probe}, {"tok_s": 10.0, "probe": probe}]]
    m = {"streams": 1, "tok_s": 10.0, "itl_ms": {"p50": 100.0}, "ttft_ms": {"p50": 1.0}, "load_avg_1m": [0, 0],
         "background_runnable": 0.0, "link_rtt_ms": 0.0, "probe": probe, "passes_tok_s": [10.0],
         "passes_rounds": rounds}
    p = {"tokens_per_s": 11.0, "itl_ms": {"p50": 90.0}, "ttft_ms": {"p50": 1.0}, "bottleneck": "x"}
    c = compare({"workers": 1, "rtt_ms": 0, "streams": [1]}, m, p)
    assert c["measured"]["probe"] == probe and c["measured"]["passes_rounds"] == rounds
    assert c["tokens_per_s_error"] == pytest.approx(0.1)
