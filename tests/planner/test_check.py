"""A reduced bench/plan_check.py grid: real swarms (kvasir serve --nats, kvasir worker, streaming
clients) beside kvasir plan's prediction from a profile calibrated in the same test.

The bound is looser than the bench's goal (15% tokens/s): this runs on a machine that other jobs
share, with a quick calibration and short runs. It asserts the comparison only, never a time.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Predicted / measured tokens/s within this factor either way: loose, because the machine is
# shared (other jobs' load moves a run by up to 2x, bench/results/plan_check-*.json); a model that
# is wrong in kind (a missing round trip, a cost counted per replica) misses by more.
LOOSE_FACTOR = 3.0

# Round trips injected by the bench's delaying proxy: a sleep, which other jobs' load does not
# stretch, dominates these runs (where the model is checked closest, within 7% in a quiet run).
# At zero round trip the measured side is CPU alone and moved 4x under load in a CI-like run:
# bench/plan_check.py checks those configurations, with their errors saved, not this test.
GRID = [
    {"workers": 1, "rtt_ms": 20, "streams": [1]},
    {"workers": 2, "rtt_ms": 20, "streams": [4]},
    {"workers": 1, "rtt_ms": 50, "streams": [4]},
]


@pytest.mark.timeout(300)
def test_predictions_of_a_reduced_grid_are_near_the_measured_swarms(models, tmp_path):
    pytest.importorskip("aiohttp")
    from bench.plan_check import run

    path = models("qwen3moe", "q4_k")
    # one calibration whatever the speed probes say: the suite's own work moves them, and this
    # test's bound is loose (test_a_calibration_made_while_the_speed_moved_is_made_again below)
    out = run(Path(path), GRID, tokens=8, prompt=8, quick_calibrate=True, workdir=tmp_path, passes=1,
              calibrations=1)
    assert len(out["configs"]) == 3
    for c in out["configs"]:
        ratio = c["predicted"]["tokens_per_s"] / c["measured"]["tokens_per_s"]
        assert abs(math.log(ratio)) <= math.log(LOOSE_FACTOR), c


def test_a_calibration_made_while_the_speed_moved_is_made_again(tmp_path, monkeypatch):
    """bench/plan_check.py's calibrate_steady: a calibration whose speed probes (before, after)
    differ by more than STEADY is made again, at most ``tries`` times, every attempt kept."""
    from bench import plan_check

    speeds = iter([1.0, 1.4, 1.0, 1.05, 1.0, 1.0])  # moved by 40%, then held within 5%
    monkeypatch.setattr(plan_check, "speed_probe", lambda: {"python_s": next(speeds), "numpy_s": 0.005})
    made = []
    monkeypatch.setattr(plan_check, "calibrate", lambda model, out, quick: made.append(out))
    attempts = plan_check.calibrate_steady(Path("m.gguf"), tmp_path / "p.json", True)
    assert len(made) == 2 and [a[1]["python_s"] for a in attempts] == [1.4, 1.05]
    speeds = iter([1.0, 2.0] * 5)  # never steady: the last of ``tries`` is kept
    made.clear()
    attempts = plan_check.calibrate_steady(Path("m.gguf"), tmp_path / "p.json", True, tries=3)
    assert len(made) == 3 and len(attempts) == 3
