"""bench/nats_rtt.py runs end to end (few calls) and prints the ratio it saves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_nats_rtt_bench_prints_the_dispatch_over_raw_nats_ratio(nats_cli, tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "nats_rtt.py"), "--calls", "20", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    best = result["best"]
    assert set(best) == {"cli", "nats_py", "dispatch"}
    assert all(best[m]["p50_us"] > 0 and best[m]["calls_per_s"] > 0 for m in best)
    assert result["ratio_dispatch_over_cli_p50"] == round(best["dispatch"]["p50_us"] / best["cli"]["p50_us"], 2)
    assert result["nats_cli"] == "v0.5.0" and result["cli_pub_16B_msgs_per_s"] > 0
