"""The routed experts' slabs in the fast mode: a repacked copy beside the plain bytes, made when
the engine and a worker load, each call taking its layout by its rows (``kernels.ggml.
expert_layout``: repacked below 8 rows, where ggml's repacked gemv beats the plain one-row
kernel; plain from 8, where the tiled kernel wins 3x), so that every way the project computes
an expert (the layer's one graph, split by each expert's rows, one expert alone, a worker's
slice) gives the same bits; dense weights stay repacked. KVASIR_REPACK=0 repacks nothing.
The suite runs in the deterministic mode (tests/conftest.py): each check runs in a child
process in the fast mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
import numpy as np
from backbone.model import Engine
from kernels import ggml
from kernels.expert import expert_ffn, moe_ffn
from kernels.tensors import QTensor
from modelfile.slice_file import load_slice
from modelfile.slicer import plan_slice, write_slice

engine = Engine(sys.argv[1])
blk, weights = engine.weights.layers[0], engine.weights
slabs = (blk.ffn_gate_exps, blk.ffn_up_exps, blk.ffn_down_exps)
report = {"repack": ggml.repack_enabled(), "label": __import__("kernels.backend", fromlist=["x"]).kernel_label(),
          "prepared_at_load": all(ggml._repacked.get(w) is not None for w in slabs)}  # before any call
report["slabs_repacked"] = [ggml.expert_repacked(w) is not None for w in slabs]
report["dense_api_leaves_slabs"] = all(ggml.repacked(w) is None for w in slabs)  # experts: expert_repacked's
report["dense_repacked"] = ggml.repacked(blk.attn_q) is not None
report["expert_views_repacked"] = [ggml.expert_repacked(w) is not None for w in weights.expert(0, 0)]
if True:
    E = blk.ffn_gate_exps.n_expert
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, engine.cfg.n_embd)).astype(np.float32)
    ids = np.array([[e % E, (e + 3) % E] for e in range(5)], np.int32)
    layer = moe_ffn(*slabs, x, ids)  # (5, 2, D)
    alone = all(np.array_equal(layer[t, k], expert_ffn(*weights.expert(0, int(ids[t, k])), x[t:t + 1],
                                                         routed=True)[0])
                for t in range(5) for k in range(2))
    rows = x[[0, 2, 4]]  # three rows to expert ids[0,0] alone, as one call
    three = engine.local_experts.compute(0, int(ids[0, 0]), rows)
    in_batch = all(np.array_equal(three[i], expert_ffn(*weights.expert(0, int(ids[0, 0])), rows[i:i + 1],
                                                       routed=True)[0]) for i in range(3))
    # a layer where expert 0 gets 12 rows (plain) and the others 1 each (repacked): split
    x12 = rng.standard_normal((12, engine.cfg.n_embd)).astype(np.float32)
    ids12 = np.array([[0, 1 + t % (E - 1)] for t in range(12)], np.int32)
    mixed = moe_ffn(*slabs, x12, ids12)
    split = np.array_equal(mixed[:, 0], expert_ffn(*weights.expert(0, 0), x12, routed=True)) and all(
        np.array_equal(mixed[t, 1], expert_ffn(*weights.expert(0, int(ids12[t, 1])), x12[t:t + 1], routed=True)[0])
        for t in range(12) if (ids12[:, 1] == ids12[t, 1]).sum() == 1)
    report["one_graph_equals_each_expert_alone"] = bool(alone and in_batch)
    report["split_layer_equals_each_expert_alone"] = bool(split)
    out = sys.argv[2]
    write_slice(plan_slice(sys.argv[1], [((0, 0), (1, E - 1))]), out)  # experts 1..E-1 of layer 0, as a worker holds them
    piece = load_slice(out)
    worker = [expert_ffn(*piece.expert_weights(0, e), x[:2], routed=True) for e in (1, E - 1)]
    backbone = [engine.local_experts.compute(0, e, x[:2]) for e in (1, E - 1)]
    report["slice_equals_backbone"] = all(np.array_equal(a, b) for a, b in zip(worker, backbone))
    import asyncio
    from workers.runtime import Worker, WorkerConfig
    fresh = load_slice(out)  # a worker's own map of the slice, not computed with yet
    w = Worker(fresh, WorkerConfig(node="probe"))
    w._index_holdings()
    asyncio.run(w._prepare_kernels())  # what Worker.start does before it subscribes
    report["worker_prepared_its_slabs"] = all(ggml._repacked.get(t) is not None
                                              for h in fresh.holdings for t in fresh.holding_slabs(h)[0])
print(json.dumps(report))
"""


def _probe(model: str, out: Path, repack: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_CPU_TILED_MM",)}
    env.update(KVASIR_KERNEL_MODE="fast", KVASIR_REPACK=repack, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, model, str(out)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # the report, after any log line


def test_experts_take_both_layouts_and_give_the_same_bits_every_way_they_are_computed(models, tmp_path):
    got = _probe(str(models("qwen2moe", "q4_k")), tmp_path / "piece.gguf", "1")
    if not got["repack"]:
        pytest.skip("this ggml has no CPU repack buffer type")
    assert got["label"].endswith("-repack")
    assert got["slabs_repacked"] == [True] * 3 and got["expert_views_repacked"] == [True] * 3
    assert got["dense_api_leaves_slabs"]
    assert got["prepared_at_load"]  # the copy made as the engine loads, not on a request
    assert got["dense_repacked"]  # dense weights: llama.cpp's repacked layout
    assert got["one_graph_equals_each_expert_alone"]
    assert got["split_layer_equals_each_expert_alone"]
    assert got["slice_equals_backbone"]
    assert got["worker_prepared_its_slabs"]


def test_without_repacking_nothing_is_repacked(models, tmp_path):
    got = _probe(str(models("qwen2moe", "q4_k")), tmp_path / "piece.gguf", "0")
    assert got["repack"] is False and got["slabs_repacked"] == [False, False, False]
    assert not got["prepared_at_load"] and got["expert_views_repacked"] == [False] * 3
    assert not got["label"].endswith("-repack")


def _mapped_rss(path) -> int:
    """Bytes of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    real, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == real
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise are Linux's")
def test_a_repacked_mapped_weight_lets_go_of_its_mapped_pages(tmp_path):
    """Once a weight is repacked its kernels read the copy; its pages of the mapped GGUF are
    dropped from the process (the worker's memory is its budget, not twice it), and read back
    with the same bytes if anything still reads them. Arrays in memory are left alone."""
    import mmap

    import numpy as np

    from kernels import ggml
    from kernels.tensors import QTensor, open_gguf, tensor_from_reader
    from synth.model import synth_model

    if not ggml.available():
        pytest.skip("ggml not available")
    path = synth_model(tmp_path / "tiny-q4k.gguf", arch="qwen3moe", preset="tiny", qtype="q4_k", seed=2)
    w = tensor_from_reader(open_gguf(path), "blk.0.ffn_up_exps.weight")
    original = np.array(w.data)  # reads every page: resident now
    held = _mapped_rss(path)
    rp = ggml.repack_weight(w)
    if rp is None:
        pytest.skip("no repacked Q4_K kernel on this CPU")
    page = mmap.PAGESIZE
    inner = (w.ptr + w.nbytes) // page * page - -(-w.ptr // page) * page
    assert inner >= 16 * page
    assert held - _mapped_rss(path) >= inner - page  # the weight's whole pages are gone
    assert np.array_equal(w.data, original)  # and come back from the file unchanged
    copy = QTensor("in memory", w.ggml_type, w.ne, original.copy())
    assert ggml.release_mapped_pages(copy.data) == 0
    assert ggml.repack_weight(copy) is not None and np.array_equal(copy.data, original)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= address < hi
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    return []


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="transparent huge pages are Linux's, and this kernel has none")
def test_a_repacked_weight_asks_for_huge_pages():
    """The repacked copy is read through at every token: its whole 2 MiB pages are advised as
    transparent huge pages (``hg`` in the mapping's VmFlags), so few TLB entries cover it."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from kernels import ggml
    from kernels.tensors import QTensor

    if not ggml.available():
        pytest.skip("ggml not available")
    w = QTensor("big", T.Q4_K, (4096, 4096), np.zeros(4096 * 4096 // 256 * 144, np.uint8))  # 9.4 MB
    rp = ggml.repack_weight(w)
    if rp is None:
        pytest.skip("no repacked Q4_K kernel on this CPU")
    huge = ggml.HUGE_PAGE
    start = -(-rp.ptr // huge) * huge
    assert start + huge <= rp.ptr + rp.data.nbytes
    assert "hg" in _vm_flags(start) and "hg" in _vm_flags(start + huge - 1)
    assert "hg" not in _vm_flags(id(w))  # a Python object's heap was not advised
    assert ggml.advise_huge_pages(rp.ptr, 4096) == 0  # less than a whole huge page: nothing to ask


SPLIT_PROBE = r"""
import json, sys
import numpy as np
from backbone.model import Engine
from kernels import ggml
from kernels.expert import expert_ffn

engine = Engine(sys.argv[1])
w = engine.weights
blk = w.layers[0]
slabs = (blk.ffn_gate_exps, blk.ffn_up_exps, blk.ffn_down_exps)
biases = (blk.ffn_gate_exps_bias, blk.ffn_up_exps_bias, blk.ffn_down_exps_bias)
E, K = blk.ffn_gate_exps.ne[2], engine.cfg.n_expert_used
rng = np.random.default_rng(1)
out = {"repacked": ggml.expert_repacked(slabs[0]) is not None, "cases": []}
for n in (10, 24, 40):  # each expert's rows below and above 8: the layer split by them
    x = rng.standard_normal((n, engine.cfg.n_embd)).astype(np.float32)
    ids = np.argsort(-(rng.standard_normal((n, E)) + np.linspace(0, 3, E)), axis=1)[:, :K].astype(np.int32)
    counts = np.bincount(ids.ravel(), minlength=E)
    got = ggml.moe_ffn(*slabs, x, ids, biases=biases, glu=w.expert_glu)
    same = all(np.array_equal(got[np.nonzero(ids == e)], expert_ffn(*w.expert(0, int(e)), x[np.nonzero(ids == e)[0]],
                                                                      routed=True)) for e in np.unique(ids))
    out["cases"].append({"few": float((counts[ids] < 8).mean()), "same": bool(same)})
print(json.dumps(out))
"""


def test_a_layer_split_by_its_experts_rows_gives_each_expert_its_bits_with_biases_too(models):
    """gpt-oss' experts (bias rows added per expert, swiglu_oai) in the fast mode: a layer whose
    experts get fewer and more than 8 rows, computed in one call (kernels.ggml.moe_ffn: the
    two layouts' halves gathered in one graph, or the minority computed again), equals each
    expert computed alone on its rows."""
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_CPU_TILED_MM", "KVASIR_REPACK")}
    env.update(KVASIR_KERNEL_MODE="fast", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SPLIT_PROBE, str(models("gpt-oss", "q4_k"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if not got["repacked"]:
        pytest.skip("no repacked Q4_K kernel on this CPU: one layout only")
    assert all(c["same"] for c in got["cases"]), got
    assert any(0 < c["few"] < 1 for c in got["cases"])  # some case really split
