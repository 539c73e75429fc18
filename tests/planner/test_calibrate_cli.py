"""`kvasir calibrate` as a person runs it: the profile's path alone on stdout (a script can read
it), progress on stderr, and bad flags a one-line error with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "calibrate", *args], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.timeout(300)
def test_stdout_holds_only_the_profile_path_and_stderr_only_progress(models, tmp_path):
    out = tmp_path / "profile.json"
    res = calibrate("--model", str(models("qwen3moe", "q4_k")), "-o", str(out), "--quick", "--threads", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == [str(out)]  # no log line of the measured backbone among it
    lines = res.stderr.splitlines()
    assert lines and all(line.startswith("calibrate: ") for line in lines), [
        line for line in lines if not line.startswith("calibrate: ")][:5]
    profile = json.loads(out.read_text())
    assert profile["backbone"]["dispatch"]["backbone_per_call_s"] > 0


def test_a_bad_flag_is_one_line_and_exit_2(models, tmp_path):
    res = calibrate("--model", str(models("qwen3moe", "q4_k")), "-o", str(tmp_path / "p.json"), "--threads", "0")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--threads must be >= 1" in res.stderr
