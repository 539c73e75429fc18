"""How far an honest numpy worker's expert output is from ggml's, per weight type: the audit's bounds.

    python bench/kernel_gap.py [--quick] [--save]

For each weight type the audit knows (F32, F16, BF16 and the quantized ones), at the ``small``
expert shape (n_embd 512, expert FFN 256) and the 122B one (3072, 1024), for 1, 8 and 64 rows
and a few random experts (swiglu; MXFP4 and Q4_K also with biases and swiglu_oai, as gpt-oss
has them): the relative L2 error ``|numpy - ggml| / |ggml|`` of the numpy kernel
(kernels/backend.py, which rounds activations as ggml's x86 CPU backend does) against ggml (routed
experts run ggml's plain layout in either kernel mode, so one is measured). Beside each
type's worst gap: the audit's bound for it (backbone/audit.py) and the headroom (bound / gap).
The bounds are set from this bench with at least 10x headroom. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from backbone.audit import tolerance  # noqa: E402
from kernels import ggml  # noqa: E402
from kernels.backend import get_backend, kernel_mode  # noqa: E402
from kernels.tensors import QTensor  # noqa: E402

import record  # noqa: E402  (bench/record.py)

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
SHAPES = {"small": (512, 256), "122b": (3072, 1024)}


def make_expert(qtype: T, n_embd: int, n_ff: int, seed: int, glu: str = "swiglu", bias: bool = False):
    rng = np.random.default_rng(seed)

    def weight(name, rows, cols):
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if qtype == T.F32:
            data = w.view(np.uint8).ravel()
        elif qtype == T.F16:
            data = w.astype(np.float16).view(np.uint8).ravel()
        elif qtype == T.BF16:
            data = (w.view(np.uint32) + 0x7FFF + ((w.view(np.uint32) >> 16) & 1) >> 16).astype(np.uint16).view(np.uint8).ravel()
        else:
            data = ggml.quantize(w, qtype)
        b = (0.1 * rng.standard_normal(rows)).astype(np.float32) if bias else None
        return QTensor(f"blk.0.ffn_{name}_exps.weight[0]", qtype, (cols, rows), np.ascontiguousarray(data),
                       bias=b, glu=glu if name == "gate" else "swiglu")

    return weight("gate", n_ff, n_embd), weight("up", n_ff, n_embd), weight("down", n_embd, n_ff)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/kernel_gap.py --save")
    ap.add_argument("--quick", action="store_true", help="one expert a case, the small shape and 1/8 rows")
    record.add_save_flag(ap)
    args = ap.parse_args()
    npb = get_backend("numpy")
    # routed experts run ggml's plain layout in both kernel modes (kernels/ggml.py expert_layout):
    # one mode, this process's, is measured
    modes = {kernel_mode(): get_backend("ggml")}
    cases = [(t, "swiglu", False) for t in TYPES] + [("MXFP4", "swiglu_oai", True), ("Q4_K", "swiglu_oai", True)]
    shapes = {"small": SHAPES["small"]} if args.quick else SHAPES
    rows_list = (1, 8) if args.quick else (1, 8, 64)
    seeds = 1 if args.quick else 3
    out = {}
    for name, glu, bias in cases:
        qt = T[name]
        key = name + ("+bias+swiglu_oai" if bias else "")
        worst = {}
        for shape, (n_embd, n_ff) in shapes.items():
            for seed in range(seeds):
                ex = make_expert(qt, n_embd, n_ff, seed, glu, bias)
                for rows in rows_list:
                    x = np.random.default_rng(1000 + seed + rows).standard_normal((rows, n_embd)).astype(np.float32)
                    ours = npb.expert_ffn(*ex, x, routed=True)
                    for mode, g in modes.items():
                        gap = rel(ours, g.expert_ffn(*ex, x, routed=True))
                        k = f"{shape}/{mode}"
                        worst[k] = max(worst.get(k, 0.0), gap)
        gap = max(worst.values())
        bound = tolerance(qt)
        out[key] = {"worst_gap": gap, "by_shape_and_mode": worst, "audit_bound": bound,
                    "headroom": round(bound / gap, 1) if gap else None}
        print(f"{key}: worst {gap:.3g}, bound {bound:g}, headroom {bound / gap if gap else float('inf'):.0f}x",
              file=sys.stderr, flush=True)
    result = {"bench": "kernel_gap", "machine_arch": platform.machine(), "rows": list(rows_list),
              "shapes": {k: list(v) for k, v in shapes.items()}, "experts_per_case": seeds, "types": out,
              "min_headroom": min(v["headroom"] for v in out.values() if v["headroom"])}
    print(json.dumps(result))
    record.save(args, "kernel_gap", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
