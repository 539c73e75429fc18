"""The browser tab's expert kernel (browser/src/kernel.js, run by node) against ggml and numpy.

Two parts, printed as one JSON object (``--save``: also into bench/results/):

* ``errors``: the relative L2 error ``|js - ggml| / |ggml|`` of one expert's output, per weight
  type (F32, F16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4), also with gpt-oss' biases and
  swiglu_oai, at a small shape (n_embd 512, n_ff 256; 1 and 16 rows); beside it numpy's error
  against ggml and the audit's tolerance for that type (backbone/audit.py), the bound a tab's
  reply must stay under.
* ``speed``: rows/s at the 122B expert shape (n_embd 3072, n_ff 1024, Q4_K; 1 and 64 rows) of
  the tab's kernels (node, the same code the page runs: WebAssembly SIMD, and the plain-JS
  fallback), the numpy worker and ggml, in the same run; then the same for Q5_K, Q6_K, Q8_0 and MXFP4
  (the other types the tab runs in SIMD).

``python bench/browser_kernel.py [--quick] [--save]``; needs node and llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from backbone.audit import tolerance  # noqa: E402
from kernels import ggml  # noqa: E402
from kernels.backend import get_backend  # noqa: E402
from kernels.tensors import QTensor  # noqa: E402

import record  # noqa: E402  (bench/record.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "browser", "kernel_cli.mjs")
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def make_expert(qtype: T, n_embd: int, n_ff: int, seed: int, glu: str = "swiglu", bias: bool = False):
    rng = np.random.default_rng(seed)

    def weight(name, rows, cols, b):
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        data = w.view(np.uint8).ravel() if qtype == T.F32 else (
            w.astype(np.float16).view(np.uint8).ravel() if qtype == T.F16 else ggml.quantize(w, qtype))
        bias_row = (0.1 * rng.standard_normal(rows)).astype(np.float32) if b else None
        return QTensor(f"blk.0.ffn_{name}_exps.weight[0]", qtype, (cols, rows), np.ascontiguousarray(data),
                       bias=bias_row, glu=glu if name == "gate" else "swiglu")

    return weight("gate", n_ff, n_embd, bias), weight("up", n_ff, n_embd, bias), weight("down", n_embd, n_ff, bias)


def run_js(experts, x: np.ndarray, repeats: int = 1, wasm: bool = False) -> tuple[np.ndarray, list[float]]:
    gate, up, down = experts
    with tempfile.TemporaryDirectory() as d:
        spec = {"rows": int(x.shape[0]), "repeats": repeats, "x": "x.f32", "glu": gate.glu, "wasm": wasm}
        for name, w in (("gate", gate), ("up", up), ("down", down)):
            w.data.tofile(os.path.join(d, name))
            spec[name] = {"type": int(w.ggml_type), "ne0": int(w.ne[0]), "ne1": int(w.ne[1]), "file": name}
            if w.bias is not None:
                w.bias.astype(np.float32).tofile(os.path.join(d, name + ".bias"))
                spec[name + "Bias"] = name + ".bias"
        np.ascontiguousarray(x, dtype=np.float32).tofile(os.path.join(d, "x.f32"))
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        out = subprocess.run(["node", CLI, d], capture_output=True, text=True, check=True)
        y = np.fromfile(os.path.join(d, "out.f32"), dtype=np.float32).reshape(x.shape[0], down.ne[1])
        return y, json.loads(out.stdout)["seconds"]


def rel(a, b) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def errors(quick: bool) -> dict:
    g, npb = get_backend("ggml"), get_backend("numpy")
    out, wasm_differs, numpy_differs = {}, [], []
    cases = [(t, "swiglu", False) for t in TYPES] + [("MXFP4", "swiglu_oai", True), ("Q4_K", "swiglu_oai", True)]
    for name, glu, bias in cases:
        qt = T[name]
        worst_js = worst_np = 0.0
        for seed in range(2 if quick else 4):
            ex = make_expert(qt, 512, 256, seed, glu, bias)
            for rows in (1, 16):
                x = np.random.default_rng(100 + seed).standard_normal((rows, 512)).astype(np.float32)
                ref = g.expert_ffn(*ex, x, routed=True)
                js, _ = run_js(ex, x)
                worst_js = max(worst_js, rel(js, ref))
                wa, _ = run_js(ex, x, wasm=True)  # SIMD for all but F32 and F16 (the JS kernel)
                if not np.array_equal(wa, js):
                    wasm_differs.append(name)
                nm = npb.expert_ffn(*ex, x, routed=True)
                if not np.array_equal(js, nm):
                    numpy_differs.append(name)
                worst_np = max(worst_np, rel(nm, ref))
        key = name + ("+bias+swiglu_oai" if bias else "")
        out[key] = {"js_vs_ggml": worst_js, "numpy_vs_ggml": worst_np, "audit_tolerance": tolerance(qt)}
        print(f"{key}: js {worst_js:.3g}, numpy {worst_np:.3g}, tolerance {tolerance(qt):g}", file=sys.stderr)
    out["wasm_equals_js_bitwise"] = not wasm_differs
    out["js_equals_numpy_bitwise"] = not numpy_differs
    return out


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def speed(quick: bool, qtype: T = T.Q4_K) -> dict:
    ex = make_expert(qtype, 3072, 1024, 0)
    g, npb = get_backend("ggml"), get_backend("numpy")
    out = {}
    for rows in (1, 64):
        x = np.random.default_rng(rows).standard_normal((rows, 3072)).astype(np.float32)
        reps = 2 if quick or rows > 1 else 5
        _, js = run_js(ex, x, repeats=reps)
        _, wa = run_js(ex, x, repeats=reps, wasm=True)
        npb.expert_ffn(*ex, x, routed=True)  # dequantise once (cached), as a worker does
        t_np = best(lambda: npb.expert_ffn(*ex, x, routed=True), reps)
        g.expert_ffn(*ex, x, routed=True)
        t_g = best(lambda: g.expert_ffn(*ex, x, routed=True), reps * 3)
        out[f"rows_{rows}"] = {"wasm_simd_rows_per_s": rows / min(wa), "js_rows_per_s": rows / min(js), "numpy_rows_per_s": rows / t_np,
                               "ggml_rows_per_s": rows / t_g}
        print(f"{qtype.name} rows {rows}: {out[f'rows_{rows}']}", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer seeds and repeats")
    record.add_save_flag(p)
    args = p.parse_args()
    if not shutil.which("node"):
        print("browser_kernel: node is not on PATH", file=sys.stderr)
        return 2
    result = {"kernel": "js-wasm32 (browser/src/simd.wat, SIMD for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, MXFP4) and js-scalar (browser/src/kernel.js), under node " +
                        subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip() + ")",
              "errors": errors(args.quick), "speed_122b_q4_k": speed(args.quick),
              # the other types the tab runs in SIMD, at the same shape (fewer repeats)
              "speed_122b_other_simd_types": {t: speed(True, T[t]) for t in ("Q5_K", "Q6_K", "Q8_0", "MXFP4")}}
    print(json.dumps(result, indent=2))
    record.save(args, "browser_kernel", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
