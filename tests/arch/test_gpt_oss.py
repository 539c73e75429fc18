"""gpt-oss (llama.cpp's openai-moe) against llama.cpp and itself.

What gpt-oss adds, each exercised by the tiny preset: attention sinks, a sliding window of 8
positions on the even layers (shorter than the prompts, so it masks) with a RoPE base of their
own, biases on Q/K/V, the attention output, the router and every routed expert, top-k on the
router logits then a softmax over the k chosen, and swiglu_oai experts; ``--type mxfp4``
writes the experts in MXFP4 and the rest as the published files (Q8_0, F32).

The checks: llama.cpp parity for f32, f16, q8_0, q4_k and mxfp4 over a 36+ token prompt and 16
greedy steps; prefill-then-decode equal to a full recompute; a batch giving each sequence its
logits alone; sharded == monolithic with a worker killed mid-generation and one worker
serving from a ``kvasir slice`` file (which carries its experts' bias rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backbone.config import ARCHES, read_config
from backbone.model import Engine
from tests.parity import PROMPT, assert_logits_match_llama_cpp
from tests.arch.sharding import assert_sharded_with_a_killed_worker_equals_monolithic
from kernels import backend as backends
from kernels.expert import EXPERT_GLU, expert_ffn
from kernels.tensors import open_gguf, tensors_from_reader

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")

from backbone.reference import Reference  # noqa: E402

ARCH = "gpt-oss"
MAX_ABS_DIFF = 1e-3  # the bound; measured: 0 (bit-identical) for all five types
N_PROMPT, N_DECODE = 36, 16


def test_tiny_file_has_what_gpt_oss_adds(models):
    path = models(ARCH, "mxfp4")
    cfg = read_config(open_gguf(path), str(path))
    assert cfg.swa == (True, False) and cfg.n_swa == 8
    assert cfg.layer_rope_base(0) != cfg.layer_rope_base(1)  # the synthetic file gives them their own
    assert cfg.head_dim == 16 and cfg.n_head * cfg.head_dim == 2 * cfg.n_embd  # not hidden / heads
    types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_sinks.weight"] == "F32"
    for name in ("attn_q.bias", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                 "ffn_up_exps.bias", "ffn_down_exps.bias"):
        assert types[f"blk.1.{name}"] == "F32"


def test_the_expert_activation_table_agrees_with_the_architectures():
    assert {a: t.expert_glu for a, t in ARCHES.items() if t.expert_glu != "swiglu"} == EXPERT_GLU


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_k", "mxfp4"])
def test_logits_match_llama_cpp_over_prompt_and_greedy_steps(models, qtype):
    assert_logits_match_llama_cpp(models(ARCH, qtype), PROMPT, min_prompt=N_PROMPT, n_decode=N_DECODE,
                                  max_abs_diff=MAX_ABS_DIFF)


def test_sinks_window_and_swa_rope_base_each_change_the_logits(models):
    """Each gpt-oss feature is live in the tiny model: turning it off moves the logits."""
    path = models(ARCH, "f32")
    engine = Engine(path)
    tokens = np.random.default_rng(2).integers(0, engine.cfg.n_vocab, 40)
    (base,) = engine.forward([(engine.new_sequence(), tokens)])
    cfg = engine.cfg
    for changed in (dataclasses.replace(cfg, swa=()),  # no sliding window
                    dataclasses.replace(cfg, rope_base_swa=cfg.rope_base)):  # one RoPE base
        engine.cfg = changed
        (other,) = engine.forward([(engine.new_sequence(), tokens)])
        assert not np.allclose(other, base, atol=1e-3)
    engine.cfg = cfg
    engine.weights = dataclasses.replace(
        engine.weights, layers=tuple(dataclasses.replace(b, attn_sinks=b.attn_sinks - 50) for b in engine.weights.layers))
    (no_sinks,) = engine.forward([(engine.new_sequence(), tokens)])
    assert not np.allclose(no_sinks, base, atol=1e-3)


@pytest.mark.parametrize("qtype", ["mxfp4", "f16"])
def test_prefill_then_decode_equals_full_recompute(models, qtype):
    engine = Engine(models(ARCH, qtype))
    tokens = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, 40)
    seq = engine.new_sequence()
    steps = [engine.forward([(seq, tokens[:30])])[0], engine.forward([(seq, tokens[30:33])])[0]]
    for t in tokens[33:]:
        steps.append(engine.forward([(seq, np.array([t]))])[0])
    (full,) = engine.forward([(engine.new_sequence(), tokens)])
    assert np.array_equal(np.concatenate(steps), full)


def test_batch_of_three_sequences_gives_each_its_logits_alone(models):
    engine = Engine(models(ARCH, "mxfp4"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (5, 17, 33)]
    alone = [engine.forward([(engine.new_sequence(), p)])[0] for p in prompts]
    seqs = [engine.new_sequence() for _ in prompts]
    together = engine.forward(list(zip(seqs, prompts)))
    for a, b in zip(alone, together):
        assert np.array_equal(b, a)
    nxt = [np.array([int(together[0][-1].argmax())]), rng.integers(0, engine.cfg.n_vocab, 7)]
    mixed = engine.forward([(seqs[0], nxt[0]), (seqs[1], nxt[1])])
    ref0 = engine.forward([(engine.new_sequence(), np.concatenate([prompts[0], nxt[0]]))])[0][-1:]
    ref1 = engine.forward([(engine.new_sequence(), np.concatenate([prompts[1], nxt[1]]))])[0][-7:]
    assert np.array_equal(mixed[0], ref0) and np.array_equal(mixed[1], ref1)


def test_numpy_expert_with_biases_and_swiglu_oai_agrees_with_ggml(models):
    t = tensors_from_reader(open_gguf(models(ARCH, "q8_0")))
    b = lambda kind: t[f"blk.1.ffn_{kind}_exps.bias"].f32()  # noqa: E731
    g, u, d = (t[f"blk.1.ffn_{k}_exps.weight"].expert(5, b(k), "swiglu_oai" if k == "gate" else "swiglu")
               for k in ("gate", "up", "down"))
    x = 3 * np.random.default_rng(4).standard_normal((9, g.ne[0])).astype(np.float32)  # past the clamp
    for routed in (True, False):
        want = backends.get_backend("ggml").expert_ffn(g, u, d, x, routed=routed)
        got = backends.get_backend("numpy").expert_ffn(g, u, d, x, routed=routed)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = expert_ffn(dataclasses.replace(g, glu="swiglu"), u, d, x, routed=True)
    assert not np.allclose(plain, expert_ffn(g, u, d, x, routed=True))
    with pytest.raises(ValueError, match="bias"):
        expert_ffn(g, u, dataclasses.replace(d, bias=np.zeros(3, np.float32)), x, routed=True)
    with pytest.raises(ValueError, match="activation"):
        expert_ffn(dataclasses.replace(g, glu="gelu"), u, d, x, routed=True)


def test_slice_carries_the_bias_rows_and_computes_what_the_model_does(models, tmp_path):
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice

    model = models(ARCH, "mxfp4")
    out = tmp_path / "s.gguf"
    write_slice(plan_slice(model, [(None, parse_span("2-5", "experts"))]), out)
    part, engine = load_slice(out), Engine(model)
    x = np.random.default_rng(5).standard_normal((3, engine.cfg.n_embd)).astype(np.float32)
    for layer, e in part.experts():
        mine = part.expert_weights(layer, e)
        assert mine[0].glu == "swiglu_oai" and all(w.bias is not None for w in mine)
        assert np.array_equal(expert_ffn(*mine, x, routed=True),
                              expert_ffn(*engine.weights.expert(layer, e), x, routed=True))


def test_slice_of_gpt_oss_without_bias_rows_is_refused(models, tmp_path):
    from gguf import GGUFWriter

    from kvasir_bus.errors import ModelFileError
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice_header

    plan = plan_slice(models(ARCH, "f32"), [(parse_span("0", "layers"), parse_span("1", "experts"))])
    plan = dataclasses.replace(plan, tensors=tuple(t for t in plan.tensors if not t.bias))
    path = tmp_path / "nobias.gguf"
    write_slice_header(plan, str(path))
    with open(path, "ab") as f:  # data: zeros of the right sizes
        for t in plan.tensors:
            f.write(b"\0" * (-f.tell() % plan.alignment) + b"\0" * t.nbytes)
        f.write(b"\0" * (-f.tell() % plan.alignment))
    assert GGUFWriter  # the header came from the slicer's own writer
    with pytest.raises(ModelFileError, match="bias rows"):
        load_slice(path)


def test_sharded_with_a_killed_worker_and_a_slice_worker_equals_monolithic(nats_server, models, tmp_path):
    assert_sharded_with_a_killed_worker_equals_monolithic(models(ARCH, "mxfp4"), nats_server.url, tmp_path,
                                                         N_PROMPT, N_DECODE)


# --- kvasir synth --arch gpt-oss ----------------------------------------------------------------

def test_122b_layer_preset_has_gpt_oss_120b_per_layer_shapes():
    from synth import model as synth

    cfg = synth.make_config(ARCH, "122b-layer", "mxfp4")
    s = {t.name: (t.shape, t.ggml_type.name) for t in synth.plan_tensors(cfg)}
    D, E, F = 2880, 128, 2880
    assert (cfg.hidden, cfg.experts, cfg.experts_used, cfg.expert_ffn, cfg.sliding_window) == (D, E, 4, F, 128)
    assert s["blk.0.ffn_gate_exps.weight"] == ((E, F, D), "MXFP4")
    assert s["blk.0.ffn_down_exps.bias"] == ((E, D), "F32")
    assert s["blk.0.attn_q.weight"] == ((64 * 64, D), "Q8_0") and s["blk.0.attn_k.weight"] == ((8 * 64, D), "Q8_0")
    assert s["blk.0.attn_sinks.weight"] == ((64,), "F32")


def test_synth_cli_gpt_oss_flags_and_one_line_errors(tmp_path, capsys):
    from kvasir_bus.cli import main

    out = tmp_path / "g.gguf"
    assert main(["synth", "--arch", ARCH, "--type", "q8_0", "--sliding-window", "4", "--head-dim", "8",
                 "-o", str(out)]) == 0
    cfg = read_config(open_gguf(out), str(out))
    assert cfg.n_swa == 4 and cfg.head_dim == 8
    assert Reference(str(out), n_ctx=64).logits(list(range(20))).shape[0] == 20  # llama.cpp runs it
    capsys.readouterr()
    assert main(["synth", "--arch", "qwen3moe", "--sliding-window", "4", "-o", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only for gpt-oss" in err[0]
