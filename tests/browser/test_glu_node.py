"""browser/src/glu.js under node gives kernels/glu.py's bits: silu * u with a scalar tail (rows
of 1000, so every row ends in 8 floats outside the 16-float vectors), swiglu_oai, and the
overflow and underflow paths of both exps. The browser kernel's tests use rows of whole vectors;
these cover the rest of glu.js."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kernels import glu
from kernels.checks import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import { swiglu, swigluOai } from "%s";
import { readFileSync, writeFileSync } from "node:fs";
const [g, u] = ["g", "u"].map((n) => new Float32Array(readFileSync(process.argv[2] + "/" + n).buffer.slice(0)));
writeFileSync(process.argv[2] + "/h", Buffer.from(swiglu(g, u, 1000).buffer));
writeFileSync(process.argv[2] + "/o", Buffer.from(swigluOai(g, u, Math.fround(%r), %r).buffer));
"""


def test_glu_js_gives_the_numpy_kernels_bits(tmp_path):
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not on PATH")
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((32, 1000)) * rng.choice([0.5, 3.0, 30.0], (32, 1))).astype(np.float32)
    g[0, :6] = [0.0, 90.0, -90.0, 120.0, -120.0, 1e-30]
    g[0, -6:] = [0.0, 90.0, -90.0, 120.0, -120.0, 1e-30]  # the same in the scalar tail
    u = rng.standard_normal((32, 1000)).astype(np.float32)
    g.tofile(tmp_path / "g")
    u.tofile(tmp_path / "u")
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT % ((ROOT / "browser" / "src" / "glu.js").as_uri(), SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
    subprocess.run([node, str(script), str(tmp_path)], check=True, timeout=120)
    h = np.fromfile(tmp_path / "h", dtype=np.float32).reshape(g.shape)
    o = np.fromfile(tmp_path / "o", dtype=np.float32).reshape(g.shape)
    np.testing.assert_array_equal(h, glu.swiglu(g, u))
    np.testing.assert_array_equal(o, glu.swiglu_oai(g, u, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
