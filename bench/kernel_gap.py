"""How far an honest numpy worker's expert output is from ggml's, per weight type: the audit's bounds.

    python bench/kernel_gap.py [--quick] [--save] [--dump DIR] [--check-dump DIR] [--other-arch FILE]

For each weight type the audit knows (F32, F16, BF16 and the quantized ones), at the ``small``
expert shape (n_embd 512, expert FFN 256) and the 122B one (3072, 1024), for 1, 8 and 64 rows
and a few random experts (swiglu; MXFP4 and Q4_K also with biases and swiglu_oai, as gpt-oss
has them): the relative L2 error ``|numpy - ggml| / |ggml|`` of the numpy kernel
(kernels/backend.py: activations rounded as ggml's x86 CPU backend rounds them, swiglu in ggml's
own float32 operations, kernels/glu.py) against ggml (routed experts run ggml's plain layout in
either kernel mode, so one is measured). Also 64 one-row calls per expert, counted where the gap
exceeds 1e-5 (an activation on the other side of a quant step: ``flips``). The numpy-vs-ggml gap
stands for any kernel the backbone cannot rerun (it rounds activations alike and sums in another
order). Beside each type's worst gap: the plain bound (backbone/audit.py tolerance: the replica
check) and its headroom; the worst gap once the flips summation order could cause are taken out
(kernels/flips.py, what an audit of such a kernel bounds by EXPLAINED_TOLERANCE) and its headroom;
and the same for a liar at honest x (1 + 1e-3) on the 1/8/64-row calls (how far above the bound).

The numpy kernel on another CPU is held to backbone/audit.py's NUMPY_TOLERANCE against this
one's: ``--dump DIR`` writes the experts, inputs and this machine's numpy outputs (one expert a
case) for ``--check-dump DIR`` to recompute on the other CPU (numpy only: arm64 Python under
qemu-user is enough), and ``--other-arch FILE`` adds what that printed to this run. Prints one
JSON object.
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

from backbone.audit import EXPLAINED_TOLERANCE, NUMPY_TOLERANCE, tolerance  # noqa: E402
from kernels import ggml  # noqa: E402
from kernels.backend import get_backend, kernel_label, kernel_mode  # noqa: E402
from kernels.flips import explained_gap  # noqa: E402
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


FLIP = 1e-5  # a one-row gap above this is an activation on the other side of a quant step
ONE_ROW_CALLS = 64


def cases():
    return [(t, "swiglu", False) for t in TYPES] + [("MXFP4", "swiglu_oai", True), ("Q4_K", "swiglu_oai", True)]


def case_key(name: str, bias: bool) -> str:
    return name + ("+bias+swiglu_oai" if bias else "")


def dump(directory: str, shapes: dict, rows_list) -> None:
    """Experts (raw bytes), inputs and this machine's numpy outputs, one expert a case and shape,
    for ``--check-dump`` on another CPU."""
    os.makedirs(directory, exist_ok=True)
    npb = get_backend("numpy")
    index = []
    for name, glu, bias in cases():
        for shape, (n_embd, n_ff) in shapes.items():
            ex = make_expert(T[name], n_embd, n_ff, 0, glu, bias)
            stem = f"{case_key(name, bias)}-{shape}"
            weights = []
            for w, part in zip(ex, ("gate", "up", "down")):
                w.data.tofile(os.path.join(directory, f"{stem}-{part}.bin"))
                if w.bias is not None:
                    w.bias.tofile(os.path.join(directory, f"{stem}-{part}.bias"))
                weights.append({"ne": list(w.ne), "bias": w.bias is not None})
            calls = []
            for rows in (*rows_list, *([1] * 16)):
                x = np.random.default_rng(5000 + len(calls)).standard_normal((rows, n_embd)).astype(np.float32)
                tag = f"{stem}-call{len(calls)}"
                x.tofile(os.path.join(directory, tag + ".x"))
                npb.expert_ffn(*ex, x, routed=True).tofile(os.path.join(directory, tag + ".y"))
                calls.append({"tag": tag, "rows": rows})
            index.append({"case": case_key(name, bias), "type": name, "glu": glu, "shape": shape,
                          "stem": stem, "weights": weights, "calls": calls, "n_embd": n_embd})
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump({"machine_arch": platform.machine(), "cases": index}, f)


def check_dump(directory: str, how: str) -> dict:
    """Recompute every call of a ``--dump`` with the numpy kernel here (numpy and gguf only: no
    ggml, so an arm64 box or arm64 Python under qemu-user runs it) and compare with the dumped
    outputs: per case the calls with identical bits and the worst relative L2 gap."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    npb = get_backend("numpy")
    types: dict[str, dict] = {}
    for case in index["cases"]:
        stem, qt = case["stem"], T[case["type"]]
        ws = []
        for part, meta in zip(("gate", "up", "down"), case["weights"]):
            data = np.fromfile(os.path.join(directory, f"{stem}-{part}.bin"), dtype=np.uint8)
            bias = np.fromfile(os.path.join(directory, f"{stem}-{part}.bias"), dtype=np.float32) if meta["bias"] else None
            ws.append(QTensor(f"blk.0.ffn_{part}_exps.weight[0]", qt, tuple(meta["ne"]), data, bias=bias,
                              glu=case["glu"] if part == "gate" else "swiglu"))
        t = types.setdefault(case["case"], {"worst_gap": 0.0, "identical_calls": 0, "calls": 0})
        for call in case["calls"]:
            x = np.fromfile(os.path.join(directory, call["tag"] + ".x"), dtype=np.float32).reshape(call["rows"], -1)
            there = np.fromfile(os.path.join(directory, call["tag"] + ".y"), dtype=np.float32).reshape(x.shape)
            here = npb.expert_ffn(*ws, x, routed=True)
            gap = float(np.linalg.norm(here.astype(np.float64) - there) / np.linalg.norm(there.astype(np.float64)))
            t["worst_gap"] = max(t["worst_gap"], gap)
            t["identical_calls"] += bool(np.array_equal(here, there))
            t["calls"] += 1
        print(f"{case['case']} {case['shape']}: {t}", file=sys.stderr, flush=True)
    result = {"machine_arch": platform.machine(), "against": index["machine_arch"], "kernel": kernel_label("numpy"),
              "numpy": np.__version__, "how": how, "types": types,
              "worst_gap": max(t["worst_gap"] for t in types.values()),
              "identical_calls": sum(t["identical_calls"] for t in types.values()),
              "calls": sum(t["calls"] for t in types.values())}
    return result



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/kernel_gap.py --save")
    ap.add_argument("--quick", action="store_true", help="one expert a case, the small shape and 1/8 rows")
    ap.add_argument("--dump", metavar="DIR", help="write experts, inputs and numpy outputs for --check-dump on another CPU")
    ap.add_argument("--check-dump", metavar="DIR", help="recompute a --dump of another CPU here (numpy only) and "
                    "print the comparison (what --other-arch reads)")
    ap.add_argument("--how", default="", help="with --check-dump: how this ran (e.g. 'arm64 under qemu-user')")
    ap.add_argument("--other-arch", metavar="FILE", help="JSON printed by --check-dump on another CPU")
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.check_dump:
        print(json.dumps(check_dump(args.check_dump, args.how)))
        return 0
    npb = get_backend("numpy")
    # one mode, this process's, is measured (the deterministic mode runs its experts repacked
    # where ggml has a repacked kernel for the type, the fast mode plain: kernels/ggml.py expert_layout)
    modes = {kernel_mode(): get_backend("ggml")}
    shapes = {"small": SHAPES["small"]} if args.quick else SHAPES
    rows_list = (1, 8) if args.quick else (1, 8, 64)
    seeds = 1 if args.quick else 3
    if args.dump:
        dump(args.dump, shapes, rows_list)
        print(json.dumps({"dumped": args.dump}))
        return 0
    other = None
    if args.other_arch:
        with open(args.other_arch) as f:
            other = json.load(f)
    out = {}
    for name, glu, bias in cases():
        qt = T[name]
        key = case_key(name, bias)
        worst, flips, one_row, explained, liar = {}, {}, {}, {}, {}
        for shape, (n_embd, n_ff) in shapes.items():
            for seed in range(seeds):
                ex = make_expert(qt, n_embd, n_ff, seed, glu, bias)
                calls = [np.random.default_rng(1000 + seed + rows).standard_normal((rows, n_embd)).astype(np.float32)
                         for rows in rows_list]
                xs = np.random.default_rng(2000 + seed).standard_normal((ONE_ROW_CALLS, n_embd)).astype(np.float32)
                calls += [x[None] for x in xs]
                for i, x in enumerate(calls):
                    ours = npb.expert_ffn(*ex, x, routed=True)
                    for mode, g in modes.items():
                        theirs = g.expert_ffn(*ex, x, routed=True)
                        gap = rel(ours, theirs)
                        k = f"{shape}/{mode}"
                        worst[k] = max(worst.get(k, 0.0), gap)
                        explained[k] = max(explained.get(k, 0.0), explained_gap(*ex, x, theirs))
                        if i < len(rows_list):  # a liar at honest x (1 + 1e-3), 1/8/64 rows
                            lie = explained_gap(*ex, x, theirs * np.float32(1 + 1e-3))
                            liar[k] = min(liar.get(k, np.inf), lie)
                    if i >= len(rows_list):
                        flips[shape] = flips.get(shape, 0) + (gap > FLIP)
                        one_row[shape] = one_row.get(shape, 0) + 1
        gap = max(worst.values())
        bound = tolerance(qt)
        worst_explained = max(explained.values())
        out[key] = {"worst_gap": gap, "by_shape_and_mode": worst, "audit_bound": bound,
                    "headroom": round(bound / gap, 1) if gap else None,
                    "one_row_flips": {s: [flips[s], one_row[s]] for s in one_row},
                    "worst_explained_gap": worst_explained, "explained_by_shape_and_mode": explained,
                    "explained_bound": EXPLAINED_TOLERANCE,
                    "explained_headroom": round(EXPLAINED_TOLERANCE / worst_explained, 1) if worst_explained else None,
                    "liar_explained_gap": min(liar.values()),
                    "liar_over_bound": round(min(liar.values()) / EXPLAINED_TOLERANCE, 1)}
        if other is not None and key in other.get("types", {}):
            out[key]["other_arch_gap"] = other["types"][key]["worst_gap"]
            out[key]["other_arch_identical"] = other["types"][key]["identical_calls"]
        print(f"{key}: worst {gap:.3g} (bound {bound:g}), explained {worst_explained:.3g} (bound "
              f"{EXPLAINED_TOLERANCE:g}), liar {min(liar.values()):.3g}, one-row flips {out[key]['one_row_flips']}",
              file=sys.stderr, flush=True)
    result = {"bench": "kernel_gap", "machine_arch": platform.machine(), "rows": list(rows_list),
              "shapes": {k: list(v) for k, v in shapes.items()}, "experts_per_case": seeds,
              "one_row_calls_per_expert": ONE_ROW_CALLS, "flip_threshold": FLIP, "types": out,
              "min_headroom": min(v["headroom"] for v in out.values() if v["headroom"]),
              "min_explained_headroom": min(v["explained_headroom"] for v in out.values() if v["explained_headroom"]),
              "min_liar_over_bound": min(v["liar_over_bound"] for v in out.values()),
              "explained_tolerance": EXPLAINED_TOLERANCE, "numpy_tolerance": NUMPY_TOLERANCE}
    if other is not None:
        result["other_arch"] = {k: other[k] for k in ("machine_arch", "how", "worst_gap", "identical_calls",
                                                      "calls") if k in other}
    print(json.dumps(result))
    record.save(args, "kernel_gap", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
