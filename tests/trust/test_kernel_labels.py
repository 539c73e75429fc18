"""A liar at honest x (1 + 1e-3) is caught whatever kernel it announces; an honest one passes.

How an audit compares depends on the kernel label a worker announces (backbone/audit.py):

* identical bits for a kernel the backbone computes on its own CPU architecture: its own ggml
  label; from a fast-mode backbone ``-det`` (experts plain: recomputed 7 rows at a time, which
  gives the deterministic mode's bits, in the plain layout), and where it repacks its experts
  (``-repack``: repacked below 8 rows) the fast mode without repacking (the plain layout) and
  ``-det-repack`` (7 rows at a time); and ``numpy-<its arch>``;
* NUMPY_TOLERANCE (1e-5) against the backbone's numpy for the numpy kernel of another CPU and
  the browser's (``numpy-aarch64`` on x86, ``js-wasm32``, ``js-scalar``): they compute the numpy
  kernel's function;
* anything else (ggml of another CPU, a GPU kernel, for a fast backbone without repacking the
  repacked layouts, the other deterministic layout for a deterministic one, and for a
  deterministic-mode backbone ggml's fast mode, whose tiled kernel it cannot run): EXPLAINED_TOLERANCE (1e-4) on the gap to numpy
  after the quant-step flips that summation order could cause are taken out (kernels/flips.py).

The end-to-end cases put a worker on a real bus, announcing the label and answering every expert
with its honest output (computed with the kernel it claims; ggml for a foreign label) or that
times 1 + 1e-3, alone with a fresh backbone (this process's kernel mode) that audits every reply.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backbone.audit import (DET_CHUNK_ROWS, EXPLAINED_TOLERANCE, NUMPY_TOLERANCE, AuditConfig, bound, rerun_backend,
                            rerun_plain, rerun_rows)
from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kernels.backend import kernel_label, kernel_mode
from tests.trust import liars

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")

ROOT = Path(__file__).resolve().parents[2]
HERE = platform.machine()
OTHER = "aarch64" if HERE != "aarch64" else "x86_64"
FAST = kernel_label("ggml", HERE, "fast", repack=False)
REPACK = kernel_label("ggml", HERE, "fast", repack=True)
DET = kernel_label("ggml", HERE, "deterministic", repack=False)  # routed experts plain: vec_dot at every row count
DET_REPACK = kernel_label("ggml", HERE, "deterministic", repack=True)  # routed experts repacked (expert_layout)
DET_HERE = kernel_label("ggml", HERE, "deterministic")  # what a deterministic backbone on this machine runs
NUMPY_LIKE = (kernel_label("numpy", OTHER), "js-wasm32", "js-scalar")
ELSEWHERE = (kernel_label("ggml", OTHER, "fast", repack=False), "cuda-sm90")
Q4_K = int(T.Q4_K)


def expected(mode: str, repack: bool | None = None) -> dict[str, tuple[str, bool, float]]:
    """label -> (rerun with, bits demanded, bound when not) for a ggml backbone in ``mode``
    (``repack``: whether a fast one repacks, None: as this process's label says)."""
    if repack is None:
        repack = kernel_label("ggml", HERE, mode).endswith("-repack")
    own = ({FAST, REPACK, DET, DET_REPACK} if repack else {FAST, DET}) if mode == "fast" else {DET_HERE}
    table = {label: ("ggml", True, 0.0) for label in own}
    table[kernel_label("numpy", HERE)] = ("numpy", True, 0.0)
    table.update({label: ("numpy", False, NUMPY_TOLERANCE) for label in NUMPY_LIKE})
    table.update({label: ("ggml", False, 1e-2) for label in (*ELSEWHERE, *({FAST, REPACK, DET, DET_REPACK} - own))})  # explained
    return table


@pytest.mark.parametrize("mode,repack", [("fast", True), ("fast", False), ("deterministic", None)])
def test_every_label_names_its_rerun_and_its_bound(mode, repack):
    for label, (backend, exact, limit) in expected(mode, repack).items():
        assert rerun_backend(label, "ggml", machine=HERE, mode=mode, repack=repack) == (backend, exact), label
        if not exact:
            assert bound(label, Q4_K) == limit, label
    assert NUMPY_TOLERANCE * 10 <= EXPLAINED_TOLERANCE * 10 <= 1e-3  # the liar at 1e-3: 10x above either
    for repack in (True, False):
        assert rerun_rows(DET, "ggml", machine=HERE, mode="fast", repack=repack) == DET_CHUNK_ROWS
        assert rerun_plain(DET, "ggml", machine=HERE, mode="fast", repack=repack) == repack  # plain told where it repacks
        assert rerun_plain(FAST, "ggml", machine=HERE, mode="fast", repack=repack) == repack
        assert not rerun_plain(REPACK, "ggml", machine=HERE, mode="fast", repack=repack)
    # a fast node with its experts' layout fixed (KVASIR_EXPERT_LAYOUT): plain, or repacked at every row count
    assert rerun_backend(REPACK + "-xplain", "ggml", machine=HERE, mode="fast", repack=True) == ("ggml", True)
    assert rerun_plain(REPACK + "-xplain", "ggml", machine=HERE, mode="fast", repack=True)
    assert rerun_rows(REPACK + "-xall", "ggml", machine=HERE, mode="fast", repack=True) == DET_CHUNK_ROWS
    assert rerun_rows(DET, "ggml", machine=HERE, mode="deterministic") == 0
    # repacked experts below 8 rows are the fast mode's where it repacks (expert_layout)
    assert rerun_rows(DET_REPACK, "ggml", machine=HERE, mode="fast", repack=True) == DET_CHUNK_ROWS
    assert rerun_rows(DET_REPACK, "ggml", machine=HERE, mode="fast", repack=False) == 0
    assert not rerun_plain(DET_REPACK, "ggml", machine=HERE, mode="fast", repack=True)


@pytest.mark.parametrize("repack", ["0", "1"])
def test_a_deterministic_workers_bits_are_the_fast_modes_in_chunks_of_seven_rows(tmp_path, repack):
    """What makes a deterministic worker rerunnable by a fast backbone that repacks: every type,
    40 rows, both modes in a child process each (ggml reads its mode once, as it loads).
    ``-det`` (KVASIR_REPACK=0: experts plain) is the fast mode's plain layout in chunks of 7
    rows (the backbone tells the plain layout: ``rerun_plain``); ``-det-repack`` (experts
    repacked where ggml has the kernel) is the fast mode's own choice below 8 rows."""
    script = (
        "import sys, json, numpy as np; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/bench']\n"
        "from gguf import GGMLQuantizationType as T\n"
        "from kernel_gap import make_expert, TYPES\n"
        "from kernels.backend import get_backend\n"
        "g = get_backend('ggml'); chunk = int(sys.argv[3]); plain = sys.argv[4] == 'plain'\n"
        "for t in TYPES:\n"
        "    ex = make_expert(T[t], 512, 256, 0)\n"
        "    x = np.random.default_rng(1).standard_normal((40, 512)).astype(np.float32)\n"
        "    y = np.concatenate([g.expert_ffn(*ex, x[i:i + chunk], routed=True, plain=plain)\n"
        "                        for i in range(0, 40, chunk)])\n"
        "    y.tofile(sys.argv[2] + '/' + t)\n")
    out = {}
    for mode, chunk in (("deterministic", 40), ("fast", DET_CHUNK_ROWS)):
        d = tmp_path / mode
        d.mkdir()
        env = {**os.environ, "KVASIR_KERNEL_MODE": mode, "KVASIR_REPACK": repack if mode == "deterministic" else "1"}
        told = "plain" if mode == "fast" and repack == "0" else "rows"
        subprocess.run([sys.executable, "-c", script, str(ROOT), str(d), str(chunk), told], env=env, check=True,
                       timeout=300)
        out[mode] = d
    for t in json.loads(json.dumps(["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])):
        det = np.fromfile(out["deterministic"] / t, dtype=np.float32)
        assert np.array_equal(det, np.fromfile(out["fast"] / t, dtype=np.float32)), t


@pytest.fixture(scope="module")
def model(models):
    return models("qwen3moe", "q4_k")


@pytest.fixture(scope="module")
def prompt(model):
    return np.random.default_rng(9).integers(0, Engine(model).cfg.n_vocab, 8).tolist()


def run_with(model, url, prompt, label: str, backend: str, lie):
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=url, market=False, serve_manifest=False,
                         # a fixed timeout: every call waits for the worker's reply (none is computed ahead)
                         dispatch=DispatchConfig(audit=AuditConfig(rate=1.0), bundles=False, timeout_s=10.0))
    with liars.BusLiar(model, url, lie, node="liar", bundles=False, kernel=label, backend=backend) as liar:
        with BackboneService(engine, cfg) as backbone:  # per-expert requests: the liar answers them all
            for _ in range(20):  # until the backbone has heard the liar's heartbeat and sent it calls
                generate(engine, prompt, 2, Sampler(SamplerConfig()), stop_on_eos=False)
                stats = backbone.stats.to_dict()
                if stats["audits"]:
                    break
    return liar, stats


def honest(out, layer, n):
    return out


honest.needs_honest = True

OWN = expected(kernel_mode())  # this process is the backbone: its mode decides what it can rerun
LABELS = sorted(OWN)


@pytest.mark.parametrize("label", LABELS)
def test_a_liar_at_one_in_a_thousand_is_caught_under_every_label(label, model, prompt, nats_server):
    liar, stats = run_with(model, nats_server.url, prompt, label, OWN[label][0], liars.scaled)
    assert liar.sent > 0
    assert stats["quarantined"] == ["liar"], stats
    assert stats["audit_failures"] >= 1


@pytest.mark.parametrize("label", sorted(label for label, (_, exact, limit) in OWN.items()
                                         if not exact and limit != NUMPY_TOLERANCE))
def test_an_honest_kernel_the_backbone_cannot_rerun_passes_every_audit(label, model, prompt, nats_server):
    """ggml's output announced as another kernel: numpy is the reference, so every one of these
    audits compares two kernels that sum in different orders (and flip a quant step now and then)."""
    liar, stats = run_with(model, nats_server.url, prompt, label, "ggml", honest)
    assert liar.sent > 0 and stats["audits"] > 0
    assert stats["quarantined"] == [] and stats["audit_failures"] == 0, stats
