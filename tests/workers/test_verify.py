"""A worker checks its slabs against the manifest before serving (workers/verify.py)."""

from __future__ import annotations

import shutil

import numpy as np

from backbone.manifest import build_manifest
from kernels.tensors import open_gguf
from modelfile.slice_file import load_slice
from modelfile.slicer import parse_span, plan_slice, write_slice
from workers.verify import check_slabs, describe


def _slice(model, out, layer="0", experts="2-5"):
    return load_slice(write_slice(plan_slice(model, [(parse_span(layer, "--layer"),
                                                      parse_span(experts, "--experts"))]), out).path)


def test_an_intact_slice_matches_the_manifest(models, tmp_path):
    model = models("qwen3moe", "q4_k")
    manifest = build_manifest(model, cache=False)
    assert check_slabs(_slice(model, tmp_path / "s.gguf"), manifest) == []


def test_flipped_bytes_inside_one_slab_are_named(models, tmp_path):
    model = models("qwen3moe", "q8_0")
    manifest = build_manifest(model, cache=False)
    doctored = tmp_path / "doctored.gguf"
    shutil.copy(model, doctored)
    t = next(t for t in open_gguf(model).tensors if t.name == "blk.0.ffn_up_exps.weight")
    slab = int(t.n_bytes) // 8
    with open(doctored, "r+b") as f:  # 2000 bytes of expert 3 of layer 0's up tensor
        f.seek(int(t.data_offset) + 3 * slab + 16)
        f.write(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    bad = check_slabs(_slice(doctored, tmp_path / "s.gguf"), manifest)
    assert [(m.layer, m.expert, m.kind) for m in bad] == [(0, 3, "up")]
    assert describe(bad) == "1 slab(s) differ from the backbone's manifest: layer 0 expert 3 up"


def _doctor(model, out):
    shutil.copy(model, out)
    t = next(t for t in open_gguf(model).tensors if t.name == "blk.1.ffn_down_exps.weight")
    with open(out, "r+b") as f:  # bytes inside expert 5 of layer 1's down tensor
        f.seek(int(t.data_offset) + 5 * (int(t.n_bytes) // 8) + 40)
        f.write(bytes(range(256)) * 8)
    return out


def test_a_worker_refuses_at_start_to_serve_a_slab_the_manifest_disowns(models, nats_server, tmp_path):
    import subprocess
    import sys

    from backbone.model import Engine
    from backbone.service import BackboneConfig, BackboneService

    model = models("qwen3moe", "q8_0")
    doctored = _doctor(model, tmp_path / "doctored.gguf")
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=nats_server.url, market=False)
    with BackboneService(engine, cfg):
        run = lambda path: subprocess.run(  # noqa: E731
            [sys.executable, "-m", "kvasir_bus.cli", "worker", "--nats", nats_server.url, "--node", "w",
             "--model", str(path), "--layer", "1", "--experts", "4-6"],
            capture_output=True, text=True, timeout=120)
        bad = run(doctored)
        assert bad.returncode != 0
        assert bad.stderr.strip().splitlines()[-1] == (
            "kvasir worker: error: " + bad.stderr.split("kvasir worker: error: ")[-1].strip())
        assert "1 slab(s) differ from the backbone's manifest: layer 1 expert 5 down; refusing to serve them" \
            in bad.stderr
        assert "Traceback" not in bad.stderr
