"""The routed experts' kernel by the rows of each call (``kernels.ggml.expert_layout``), on both
sides: the worker's expert function, the backbone's local fallback and audit path, and the
backbone's layer graph (the expert among another expert's 3 rows: at 8 rows and more the fast
mode splits the layer by each expert's rows, repacked below 8, plain from 8) give the same bits
for the same call at 1, 8, 64 and 512 rows, in the fast and the deterministic mode. Memory: the
deterministic mode repacks the experts and lets go of their mapped pages (one copy); the fast
mode does the same and reads the mapped pages back for its calls of 8 rows or more (up to two).

ggml fixes its mode as it loads, so each mode runs in a child process (a tiny qwen2moe Q4_K:
the type ggml repacks on this CPU, where the layouts would differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import ggml

ROOT = Path(__file__).resolve().parents[2]
ROWS = (1, 8, 64, 512)

PROBE = r"""
import json, sys
import numpy as np
from backbone.model import Engine
from kernels import ggml
from kernels.expert import expert_ffn, prepare
from modelfile.slice_file import load_slice
from modelfile.slicer import plan_slice, write_slice

engine = Engine(sys.argv[1])
blk = engine.weights.layers[0]
slabs = (blk.ffn_gate_exps, blk.ffn_up_exps, blk.ffn_down_exps)
E, D = blk.ffn_gate_exps.ne[2], engine.cfg.n_embd
write_slice(plan_slice(sys.argv[1], [((0, 0), (1, E - 1))]), sys.argv[2])  # experts 1..E-1 of layer 0
piece = load_slice(sys.argv[2])
rng = np.random.default_rng(7)
report = {"mode": ggml.load().mode, "rows": {}}
e, other = 1, E - 1
for n in [int(v) for v in sys.argv[3].split(",")]:
    x = rng.standard_normal((n, D)).astype(np.float32)
    worker = expert_ffn(*piece.expert_weights(0, e), x, routed=True)  # what a worker answers
    fallback = engine.local_experts.compute(0, e, x)  # the backbone's fallback and audits
    # the backbone's one-graph layer: expert e gets these n rows among 3 rows of another expert
    extra = rng.standard_normal((3, D)).astype(np.float32)
    both = np.concatenate([x, extra])
    ids = np.array([[e]] * n + [[other]] * 3, np.int32)
    layer = engine.local_experts.run_ids(0, both, ids)[:, 0]
    run_layer = engine.local_experts.run_layer(0, [(e, x), (other, extra)])
    alone = [expert_ffn(*piece.expert_weights(0, e), x[i:i + 1], routed=True)[0] for i in (0, n - 1)]
    report["rows"][str(n)] = {
        "worker_equals_fallback": bool(np.array_equal(worker, fallback)),
        "worker_equals_layer_graph": bool(np.array_equal(worker, layer[:n])),
        "worker_equals_run_layer": bool(np.array_equal(worker, run_layer[0])),
        "other_expert_equals_its_call": bool(np.array_equal(
            layer[n:], expert_ffn(*piece.expert_weights(0, other), extra, routed=True))),
        "rows_equal_each_alone": bool(np.array_equal(worker[0], alone[0]) and np.array_equal(worker[-1], alone[1])),
    }
report["layouts"] = [ggml.expert_layout(int(blk.ffn_gate_exps.ggml_type), n, report["mode"]) for n in (1, 8, 64, 512)]
report["slab_repacked"] = [ggml.expert_repacked(w) is not None for w in slabs]
report["expert_view_repacked"] = [ggml.expert_repacked(w) is not None for w in piece.expert_weights(0, e)]


def mapped_rss(path):
    real, total, inside = __import__("os").path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) >= 6 and fields[5] == real
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


baseline = mapped_rss(sys.argv[2])  # what the calls above left of the other map of the file
fresh = load_slice(sys.argv[2])  # a worker's own map of the slice, as Worker.start prepares it
held = [t for h in fresh.holdings for t in fresh.holding_slabs(h)[0]]
for t in held:
    t.data.sum()  # every mapped page read in, as a worker that served from the plain bytes would
report["slice_bytes"] = sum(t.nbytes for t in held)
report["prepared_slab_bytes"] = prepare(held)
report["slice_mapped_rss_after_prepare"] = mapped_rss(sys.argv[2]) - baseline
big = rng.standard_normal((64, D)).astype(np.float32)
for layer, e in fresh.experts():  # a prefill's calls: 64 rows to every held expert
    expert_ffn(*fresh.expert_weights(layer, e), big, routed=True)
report["slice_mapped_rss_after_64_row_calls"] = mapped_rss(sys.argv[2]) - baseline
report["dense_repacked"] = ggml.repacked(blk.attn_q) is not None
report["repack_enabled"] = ggml.repack_enabled()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def need_ggml():
    if not ggml.available():
        pytest.skip("ggml not available")


def _probe(model, out: Path, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_CPU_TILED_MM", "KVASIR_REPACK")}
    env.update(KVASIR_KERNEL_MODE=mode, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, str(model), str(out), ",".join(map(str, ROWS))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_worker_fallback_and_layer_graph_give_the_same_bits_at_every_row_count(need_ggml, models, tmp_path, mode):
    got = _probe(models("qwen2moe", "q4_k"), tmp_path / "piece.gguf", mode)
    assert got["mode"] == mode
    for n in ROWS:
        r = got["rows"][str(n)]
        assert r["worker_equals_fallback"], (mode, n)
        assert r["worker_equals_layer_graph"], (mode, n)
        assert r["worker_equals_run_layer"], (mode, n)
        assert r["other_expert_equals_its_call"], (mode, n)
        if mode == "deterministic" or n < 8:  # batch-invariant below the tiled kernel's 8 rows, always in det
            assert r["rows_equal_each_alone"], (mode, n)
    if mode == "fast":
        # from 8 rows the fast mode's tiled kernel runs (another summation order): the kernel
        # is chosen by the call's rows, and both sides chose the same one (asserted above)
        assert not all(got["rows"][str(n)]["rows_equal_each_alone"] for n in ROWS if n >= 8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise are Linux's")
@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_routed_experts_cost_one_copy_in_either_layout(need_ggml, models, tmp_path, mode):
    got = _probe(models("qwen2moe", "q4_k"), tmp_path / "piece.gguf", mode)
    assert got["dense_repacked"] == (mode == "fast" and got["repack_enabled"])  # deterministic: vec_dot/tinyBLAS
    if not ggml.has_repacked_kernel(ggml.T.Q4_K):
        pytest.skip("this ggml has no repacked Q4_K kernel on this CPU")
    assert got["layouts"] == (["repacked"] * 4 if mode == "deterministic" else ["repacked", "plain", "plain", "plain"])
    assert got["slab_repacked"] == [True] * 3 and got["expert_view_repacked"] == [True] * 3
    # the repacked copy replaces the mapped bytes: resident memory stays about the slice's size
    assert got["prepared_slab_bytes"] == got["slice_bytes"] > 0
    assert got["slice_mapped_rss_after_prepare"] < 0.1 * got["slice_bytes"]
    if mode == "deterministic":  # no call reads the plain bytes again
        assert got["slice_mapped_rss_after_64_row_calls"] < 0.1 * got["slice_bytes"]
    else:  # a call of 64 rows runs the plain layout: its pages come back (the second copy)
        assert got["slice_mapped_rss_after_64_row_calls"] > 0.5 * got["slice_bytes"]


def test_the_layout_rule_takes_only_what_both_sides_see(need_ggml):
    from gguf import GGMLQuantizationType as T

    for qtype in (T.Q4_K, T.Q8_0, T.Q4_0, T.F16):
        # what a deterministic process on this machine would do (this one's mode or not)
        allowed = os.environ.get(ggml.ENV_REPACK, "1") != "0"
        det = "repacked" if ggml.has_repacked_kernel(int(qtype)) and allowed else "plain"
        for rows in (1, 7, 8, 64, 512, 4096):  # the deterministic mode: one layout at every row count
            assert ggml.expert_layout(int(qtype), rows, "fast") == (det if rows < ggml.FAST_REPACK_BELOW else "plain")
            assert ggml.expert_layout(int(qtype), rows, "deterministic") == det
    assert not ggml.has_repacked_kernel(int(T.F16))
    with pytest.raises(ValueError):
        ggml.expert_layout(int(T.Q4_K), 0)


def test_a_large_one_row_expert_call_gets_every_thread():
    """1-row Q8_0 at the 122B shape ran on one thread (decode_threads, half the cores): half
    of what ggml does with the team. Expert calls take the full team once they are large."""
    work = 3 * 3072 * 1024
    assert ggml.expert_threads(work) == ggml.n_threads()
    assert ggml.expert_threads(ggml.SMALL_WORK - 1) == 1
