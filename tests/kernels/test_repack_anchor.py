"""Repacked weights and the graph cache: a cached graph outlives the engine whose weights it was
built with (it is keyed by shapes), so what it keeps of a weight must not die with it. It kept
the weight's repack buffer, which ggml reads to pick the repacked kernel; once freed, the next
engine of the same shapes got the plain kernel on repacked bytes: other numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from backbone.model import Engine
from kernels import backend, ggml

ROOT = Path(__file__).resolve().parents[2]


def test_engines_one_after_another_give_the_same_logits(models):
    if not ggml.repack_enabled():  # the suite's mode: run this file again with repacking on
        env = dict(os.environ, KVASIR_KERNEL_MODE="fast", KVASIR_REPACK="1", PYTHONPATH=str(ROOT))
        env.pop("GGML_CPU_TILED_MM", None)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                             env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "1 passed" in out.stdout
        return
    assert backend.kernel_mode() == "fast"
    path = models("qwen2moe", "q4_k")
    prompt = np.arange(7) % 50
    runs = []
    for _ in range(4):  # each engine dropped before the next is made: its repacked weights freed
        engine = Engine(path)
        seq = engine.new_sequence()
        logits = engine.forward([(seq, prompt)])
        logits += engine.forward([(seq, prompt[:1])])
        runs.append(logits)
        del engine, seq
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))
