"""bench/dispatch_inproc.py: the dispatch's direct path with the bus faked in process. Every step
it times must take that path (it refuses to print otherwise), with audits on and off."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("audit", [0.0, 0.5])
def test_the_in_process_dispatch_bench_times_direct_steps_only(audit):
    spec = importlib.util.spec_from_file_location("dispatch_inproc", ROOT / "bench" / "dispatch_inproc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.bench(calls=4, hidden=64, audit=audit, steps=40, rounds=2)
    assert out["calls_per_step"] == 4 and out["audit_rate"] == audit
    assert 0 < out["engine_thread_us_per_step_min"] <= out["engine_thread_us_per_step_median"]
