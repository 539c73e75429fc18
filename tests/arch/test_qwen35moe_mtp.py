"""qwen35moe with its multi-token-prediction block, as the published Qwen3.5 files have it.

``kvasir synth --arch qwen35moe --mtp`` writes ``nextn_predict_layers`` 1 and one more block,
``blk.<n_layer>.*``, with exactly the tensors llama.cpp's loader creates for it
(llama_model_qwen35moe::load_arch_tensors, load_block_mtp): a full-attention Qwen3.5 block with
its MoE and shared expert, plus ``nextn.eh_proj``, ``nextn.enorm``, ``nextn.hnorm`` and the
optional ``nextn.shared_head_norm``. llama.cpp loads the file (and skips the block unless asked
to load MTP); the engine reads it as data and never executes it, so the logits stay bit-identical
to llama.cpp's, and no slice or manifest holds the block's experts (they are never dispatched).
"""

from __future__ import annotations

import pytest

from backbone.config import read_config
from backbone.manifest import build_manifest
from kernels.tensors import open_gguf
from kvasir_bus.cli import main
from kvasir_bus.errors import UsageError
from modelfile.slicer import plan_slice
from synth.model import make_config
from tests.parity import PROMPT, assert_logits_match_llama_cpp

pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")

ARCH = "qwen35moe"


def test_the_mtp_block_is_what_llama_cpps_loader_expects(models):
    path = models(ARCH, "f32", mtp=True)
    r = open_gguf(path)
    assert r.fields["qwen35moe.nextn_predict_layers"].contents() == 1
    assert r.fields["qwen35moe.block_count"].contents() == 5
    cfg = read_config(r, str(path))
    assert (cfg.n_layer, cfg.n_layer_nextn) == (4, 1)
    d, E, hd = cfg.n_embd, cfg.n_expert, cfg.head_dim
    q, kv, ff, sff = cfg.n_head * hd, cfg.n_head_kv * hd, cfg.n_ff_exp, cfg.n_ff_shexp
    # ne (ggml order) of every tensor load_block_mtp creates, for il = n_layer
    want = {"attn_norm.weight": (d,), "post_attention_norm.weight": (d,),
            "attn_q.weight": (d, 2 * q), "attn_k.weight": (d, kv), "attn_v.weight": (d, kv),
            "attn_output.weight": (q, d), "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,),
            "ffn_gate_inp.weight": (d, E), "ffn_gate_exps.weight": (d, ff, E), "ffn_up_exps.weight": (d, ff, E),
            "ffn_down_exps.weight": (ff, d, E), "ffn_gate_inp_shexp.weight": (d,),
            "ffn_gate_shexp.weight": (d, sff), "ffn_up_shexp.weight": (d, sff), "ffn_down_shexp.weight": (sff, d),
            "nextn.eh_proj.weight": (2 * d, d), "nextn.enorm.weight": (d,), "nextn.hnorm.weight": (d,),
            "nextn.shared_head_norm.weight": (d,)}
    got = {t.name[len("blk.4."):]: tuple(int(n) for n in t.shape) for t in r.tensors if t.name.startswith("blk.4.")}
    assert got == want


def test_the_trunk_is_the_same_with_or_without_the_block(models):
    plain, mtp = open_gguf(models(ARCH, "q8_0")), open_gguf(models(ARCH, "q8_0", mtp=True))
    a = {t.name: bytes(t.data) for t in plain.tensors}
    b = {t.name: bytes(t.data) for t in mtp.tensors if not t.name.startswith("blk.4.")}
    assert a == b


@pytest.mark.parametrize("qtype", ["f32", "q4_k"])
def test_logits_match_llama_cpp_with_the_mtp_block(models, qtype):
    report = assert_logits_match_llama_cpp(models(ARCH, qtype, mtp=True), PROMPT, min_prompt=36, n_decode=16)
    assert report["max_abs_diff"] == 0.0, report


def test_slices_and_the_manifest_leave_the_never_executed_block_out(models):
    path = models(ARCH, "f32", mtp=True)
    plan = plan_slice(path, [(None, None)])
    assert {h.layer for h in plan.holdings} == {0, 1, 2, 3} and plan.n_layer == 5
    assert build_manifest(path, cache=False).moe_layers == (0, 1, 2, 3)
    with pytest.raises(UsageError, match="layer 4 is the multi-token-prediction block"):
        plan_slice(path, [((4, 4), None)])


def test_mtp_flag_and_its_refusal(models, tmp_path, capsys):
    with pytest.raises(UsageError, match="only for qwen35moe"):
        make_config("gpt-oss", mtp=True)
    assert main(["synth", "--arch", "qwen3moe", "--mtp", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "only for qwen35moe" in capsys.readouterr().err
    assert main(["info", str(models(ARCH, "f32", mtp=True))]) == 0
    assert "5 (4 + 1 multi-token-prediction, never executed)" in capsys.readouterr().out
