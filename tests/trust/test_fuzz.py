"""The short version of bench/fuzz.py: 500 random and mutated messages on each of the 14 subjects
while the backbone generates. No process dies, both services still answer, every generation is
bit-identical, the market exits cleanly. RSS growth is reported but asserted only by the full
bench (100k messages per subject): a few thousand messages are too few to tell growth from warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"


def test_a_short_fuzz_of_every_subject_breaks_nothing():
    out = subprocess.run([sys.executable, str(BENCH), "--messages", "500"], capture_output=True, text=True,
                         timeout=600)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    checks = report["checks"]
    assert checks["no_crash"], report
    assert checks["still_answering"], report
    assert checks["bit_identical"], report
    assert checks["market_clean_exit"], report
    assert report["messages"] == 500 * report["subjects"]
