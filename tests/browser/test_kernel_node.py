"""The browser tab's expert kernel (browser/src/kernel.js and its WebAssembly SIMD dots,
browser/src/simd.wat), run by node, against the Python kernels on many random inputs:

* on the real slabs of the model the browser test serves (every expert of every layer), and on
  random experts of every weight type the tab takes (F32, F16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4,
  and gpt-oss' biases with swiglu_oai);
* the SIMD kernel gives the plain-JS kernel's bits, and both give the numpy worker's bits (the
  same exact integer dot per block, the same float64 sums): a tab computes what
  ``kvasir worker --kernel numpy`` computes, bit for bit;
* against ggml (the backbone's kernel) each output stays far inside the audit's cross-kernel
  tolerance; the largest relative error seen is printed per type.

Needs node and the browser worker's npm install (``make install``); llama-cpp-python for ggml.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backbone.audit import relative_error, tolerance
from kernels.backend import get_backend
from kernels.tensors import QTensor

pytest.importorskip("llama_cpp", reason="the synthetic model and ggml come from llama.cpp")

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "browser" / "kernel_cli.mjs"
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def _node() -> str:
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not on PATH (the browser worker is built with npm and node)")
    if not (ROOT / "browser" / "node_modules" / "wabt").is_dir():
        pytest.skip("browser/node_modules is missing: make install runs `npm ci` in browser/")
    return node


def random_expert(qtype: T, n_embd: int, n_ff: int, seed: int, glu: str = "swiglu", bias: bool = False):
    from kernels import ggml

    rng = np.random.default_rng(seed)

    def weight(name, rows, cols):
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        data = w.view(np.uint8).ravel() if qtype == T.F32 else (
            w.astype(np.float16).view(np.uint8).ravel() if qtype == T.F16 else ggml.quantize(w, qtype))
        b = (0.1 * rng.standard_normal(rows)).astype(np.float32) if bias else None
        return QTensor(f"blk.0.ffn_{name}_exps.weight[0]", qtype, (cols, rows), np.ascontiguousarray(data),
                       bias=b, glu=glu if name == "gate" else "swiglu")

    return weight("gate", n_ff, n_embd), weight("up", n_ff, n_embd), weight("down", n_embd, n_ff)


def run_node(cases: list[tuple[str, tuple, np.ndarray]], workdir: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every (label, expert, rows) through the tab's kernels in one node process:
    [(plain-JS output, SIMD output)] in order."""
    files: dict[int, str] = {}
    specs = []
    for i, (_, ex, x) in enumerate(cases):
        spec = {"rows": int(x.shape[0]), "x": f"x{i}", "glu": ex[0].glu}
        np.ascontiguousarray(x, dtype=np.float32).tofile(workdir / f"x{i}")
        for name, w in zip(("gate", "up", "down"), ex):
            if id(w) not in files:
                files[id(w)] = f"w{len(files)}"
                w.data.tofile(workdir / files[id(w)])
                if w.bias is not None:
                    w.bias.astype(np.float32).tofile(workdir / (files[id(w)] + ".bias"))
            spec[name] = {"type": int(w.ggml_type), "ne0": int(w.ne[0]), "ne1": int(w.ne[1]), "file": files[id(w)]}
            if w.bias is not None:
                spec[name + "Bias"] = files[id(w)] + ".bias"
        specs.append(spec)
    (workdir / "spec.json").write_text(json.dumps({"cases": specs}))
    subprocess.run([_node(), str(CLI), str(workdir)], check=True, capture_output=True, text=True, timeout=300)
    out = []
    for i, (_, ex, x) in enumerate(cases):
        shape = (x.shape[0], ex[2].ne[1])
        out.append(tuple(np.fromfile(workdir / f"out.{m}.{i}.f32", dtype=np.float32).reshape(shape)
                         for m in ("js", "wasm")))
    return out


def check(cases, workdir: Path) -> dict[str, float]:
    g, npb = get_backend("ggml"), get_backend("numpy")
    worst: dict[str, float] = {}
    for (label, ex, x), (js, wasm) in zip(cases, run_node(cases, workdir)):
        assert np.array_equal(wasm, js), f"{label}: the SIMD kernel's bits differ from the plain-JS kernel's"
        numpy = npb.expert_ffn(*ex, x, routed=True)
        assert np.array_equal(js, numpy), (
            f"{label}: the tab's bits differ from the numpy worker's (max |d| {np.abs(js - numpy).max():.3g})")
        err = relative_error(js, g.expert_ffn(*ex, x, routed=True))
        assert err <= tolerance(ex[2].ggml_type), (label, err)
        worst[label.split(" ")[0]] = max(worst.get(label.split(" ")[0], 0.0), err)
    return worst


def test_tab_kernel_on_the_browser_test_models_slabs_gives_numpys_bits(tmp_path):
    """Every expert of the model tests/browser/test_browser_worker.py serves, on random rows,
    1 to 16 at a time and at three input scales."""
    from backbone.model import Engine
    from kernels.tensors import tensors_from_reader
    from synth.model import synth_model

    _node()
    path = synth_model(tmp_path / "tiny-q4k.gguf", arch="qwen3moe", preset="tiny", qtype="q4_k", seed=7)
    ts = tensors_from_reader(Engine(path).reader)
    rng = np.random.default_rng(29)
    cases = []
    for layer in range(2):
        gate, up, down = (ts[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        for e in range(gate.ne[2]):
            ex = (gate.expert(e), up.expert(e), down.expert(e))
            for rows, scale in ((1, 1.0), (3, 0.05), (16, 20.0)):
                x = (scale * rng.standard_normal((rows, gate.ne[0]))).astype(np.float32)
                cases.append((f"{ex[0].ggml_type.name} L{layer} e{e} rows {rows} scale {scale}", ex, x))
    (tmp_path / "run").mkdir()
    worst = check(cases, tmp_path / "run")
    print(f"{len(cases)} calls: tab == numpy bit for bit; worst relative error vs ggml {worst}")


def test_tab_kernel_on_every_weight_type_gives_numpys_bits(tmp_path):
    _node()
    rng = np.random.default_rng(30)
    cases = []
    kinds = [(t, "swiglu", False) for t in TYPES] + [("MXFP4", "swiglu_oai", True), ("Q4_K", "swiglu_oai", True)]
    for name, glu, bias in kinds:
        for seed in range(2):
            ex = random_expert(T[name], 512, 256, seed, glu, bias)
            for rows in (1, 5):
                x = rng.standard_normal((rows, 512)).astype(np.float32)
                cases.append((f"{name}{'+bias+swiglu_oai' if bias else ''} seed {seed} rows {rows}", ex, x))
    # MXFP4 block scales at the ends of E8M0 (0 and 1 are ggml's subnormal halves)
    gate, up, down = random_expert(T.MXFP4, 512, 256, 9)
    edge = []
    for w in (gate, up, down):
        data = w.data.copy()
        data[::17] = np.resize(np.array([0, 1, 2, 3, 100, 120, 124, 126], dtype=np.uint8), data[::17].shape)
        edge.append(QTensor(w.name, w.ggml_type, w.ne, data))
    cases.append(("MXFP4 edge scales", tuple(edge), rng.standard_normal((3, 512)).astype(np.float32)))
    worst = check(cases, tmp_path)
    for label, err in worst.items():
        print(f"{label}: tab == numpy bit for bit; relative error vs ggml {err:.3g} (audit tolerance "
              f"{tolerance(T[label.split('+')[0].split(' ')[0]]):g})")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
