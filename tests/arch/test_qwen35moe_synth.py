"""``kvasir synth --arch qwen35moe``: presets, types, size flags, and llama.cpp loading the files."""

from __future__ import annotations

import numpy as np
import pytest

from backbone.config import read_config
from kernels.tensors import open_gguf
from kvasir_bus.cli import main
from synth import model as synth

pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")

from backbone.model import Engine  # noqa: E402
from backbone.reference import Reference, compare  # noqa: E402


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in synth.plan_tensors(cfg)}


def test_122b_layer_preset_has_the_published_per_layer_shapes():
    cfg = synth.make_config("qwen35moe", "122b-layer", "q4_k", layers=4)
    s = shapes(cfg)
    D, E, F = 3072, 256, 1024
    assert (cfg.hidden, cfg.experts, cfg.experts_used, cfg.expert_ffn, cfg.shared_expert_ffn) == (D, E, 8, F, F)
    assert s["blk.0.ffn_gate_exps.weight"] == (E, F, D) and s["blk.0.ffn_down_exps.weight"] == (E, D, F)
    assert s["blk.0.ffn_up_shexp.weight"] == (F, D)
    # delta-net: 16 Q/K heads and 64 V heads of 128, conv width 4
    assert s["blk.0.attn_qkv.weight"] == ((2 * 16 + 64) * 128, D)
    assert s["blk.0.attn_gate.weight"] == (64 * 128, D) and s["blk.0.ssm_out.weight"] == (D, 64 * 128)
    assert s["blk.0.ssm_conv1d.weight"] == ((2 * 16 + 64) * 128, 4)
    assert s["blk.0.ssm_beta.weight"] == (64, D)
    # every 4th layer: gated attention, 32 heads of 256 (query + gate) and 2 KV heads
    assert s["blk.3.attn_q.weight"] == (2 * 32 * 256, D) and s["blk.3.attn_k.weight"] == (2 * 256, D)
    assert "blk.3.ssm_out.weight" not in s and "blk.2.attn_q.weight" not in s
    assert cfg.n_rot == 64 and cfg.rope_sections == (11, 11, 10, 0)


@pytest.mark.parametrize("qtype", ["q4_0", "q5_k", "q6_k"])
def test_every_other_type_loads_and_runs_in_llama_cpp_and_agrees(models, qtype):
    path = models("qwen35moe", qtype)
    tokens = list(np.random.default_rng(5).integers(0, 300, 40))
    engine = Engine(path)
    ours = engine.forward([(engine.new_sequence(), np.array(tokens))])[0]
    report = compare(ours, Reference(path, n_ctx=64, n_batch=64).logits(tokens))
    assert report["argmax_agreement"] == 1.0 and report["max_abs_diff"] <= 1e-3, report


def test_size_flags_apply_and_the_backbone_reads_them_back(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    rc = main(["synth", "--arch", "qwen35moe", "-o", str(out), "--layers", "2", "--full-attention-interval", "2",
               "--ssm-k-heads", "1", "--ssm-v-heads", "2", "--ssm-head-dim", "32", "--conv-kernel", "3",
               "--head-dim", "32", "--rope-dims", "16", "--shared-expert-ffn", "48"])
    assert rc == 0, capsys.readouterr().err
    cfg = read_config(open_gguf(out), str(out))
    assert cfg.recurrent == (True, False)
    assert (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_kernel) == (1, 2, 32, 3)
    assert (cfg.head_dim, cfg.n_rot, cfg.n_ff_shexp) == (32, 16, 48)
    engine = Engine(out)
    logits = engine.forward([(engine.new_sequence(), np.arange(20))])[0]
    ref = Reference(out, n_ctx=32, n_batch=32).logits(list(range(20)))
    assert compare(logits, ref)["max_abs_diff"] <= 1e-3


@pytest.mark.parametrize("argv,needle", [
    (["--arch", "qwen3moe", "--ssm-v-heads", "4"], "only for delta-net architectures"),
    (["--arch", "qwen35moe", "--ssm-k-heads", "3"], "does not divide --ssm-v-heads"),
    (["--arch", "qwen35moe", "--rope-dims", "7"], "--rope-dims 7"),
    (["--arch", "qwen35moe", "--conv-kernel", "1"], "--conv-kernel 1"),
])
def test_bad_delta_net_sizes_are_one_line_errors(tmp_path, capsys, argv, needle):
    rc = main(["synth", "-o", str(tmp_path / "x.gguf"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
