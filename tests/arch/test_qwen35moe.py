"""qwen35moe (Qwen3.5 MoE: gated delta-net + gated attention) and qwen3next (the same family,
NEOX RoPE, one ssm_ba tensor, Q/K heads repeated interleaved) against llama.cpp and itself.

The same checks as tests/backbone/test_parity.py and test_sharding.py on the new architecture:
llama.cpp parity for f32, f16, q8_0 and q4_k over a 36+ token prompt and 16 greedy steps;
prefill-then-decode equal to a full recompute (the conv and recurrent states carried across
chunks); a batch of sequences giving each its logits alone; sharded == monolithic with a
worker killed mid-generation, one worker serving from a ``kvasir slice`` file.
"""

from __future__ import annotations


import numpy as np
import pytest

from backbone.config import read_config
from backbone.model import Engine
from tests.parity import PROMPT, assert_logits_match_llama_cpp
from tests.arch.sharding import assert_sharded_with_a_killed_worker_equals_monolithic
from kernels import deltanet, ops
from kernels.tensors import open_gguf

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")


ARCH = "qwen35moe"
MAX_ABS_DIFF = 1e-3  # the bound; measured: 0 (bit-identical) for all four types
N_PROMPT, N_DECODE = 36, 16


def test_tiny_has_three_delta_net_layers_then_one_gated_attention_layer(models):
    path = models(ARCH, "f32")
    cfg = read_config(open_gguf(path), str(path))
    assert cfg.recurrent == (True, True, True, False)
    assert cfg.traits.delta_net and cfg.traits.attn_q_gate and cfg.traits.rope_style == "imrope"
    assert sum(cfg.rope_sections) == cfg.n_rot // 2
    names = {t.name for t in open_gguf(path).tensors}
    assert {"blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.attn_qkv.weight", "blk.0.post_attention_norm.weight",
            "blk.3.attn_q.weight", "blk.3.attn_q_norm.weight", "blk.3.ffn_gate_inp_shexp.weight"} <= names
    assert "blk.0.attn_q.weight" not in names and "blk.3.ssm_out.weight" not in names
    w = Engine(path).weights.layers
    assert w[3].attn_q.ne == (cfg.n_embd, 2 * cfg.n_head * cfg.head_dim)  # query and gate per head


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_k"])
@pytest.mark.parametrize("arch", [ARCH, "qwen3next"])
def test_logits_match_llama_cpp_over_prompt_and_greedy_steps(models, arch, qtype):
    assert_logits_match_llama_cpp(models(arch, qtype), PROMPT, min_prompt=36, max_abs_diff=MAX_ABS_DIFF)


@pytest.mark.parametrize("arch,qtype", [(ARCH, "q4_k"), (ARCH, "f32"), ("qwen3next", "f16")])
def test_prefill_then_decode_equals_full_recompute(models, arch, qtype):
    engine = Engine(models(arch, qtype))
    tokens = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, 40)
    seq = engine.new_sequence()
    steps = [engine.forward([(seq, tokens[:30])])[0]]
    steps.append(engine.forward([(seq, tokens[30:33])])[0])  # a second chunk, then single steps
    for t in tokens[33:]:
        steps.append(engine.forward([(seq, np.array([t]))])[0])
    incremental = np.concatenate(steps)
    (full,) = engine.forward([(engine.new_sequence(), tokens)])
    assert np.array_equal(incremental, full)


@pytest.mark.parametrize("arch", [ARCH, "qwen3next"])
def test_batch_of_three_sequences_gives_each_its_logits_alone(models, arch):
    engine = Engine(models(arch, "q8_0"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (5, 17, 33)]
    alone = [engine.forward([(engine.new_sequence(), p)])[0] for p in prompts]
    seqs = [engine.new_sequence() for _ in prompts]
    together = engine.forward(list(zip(seqs, prompts)))
    for a, b in zip(alone, together):
        assert np.array_equal(b, a)
    # A mixed step: one sequence decodes a token while another prefills a chunk; each carries
    # its own conv and recurrent state.
    nxt = [np.array([int(together[0][-1].argmax())]), rng.integers(0, engine.cfg.n_vocab, 7)]
    mixed = engine.forward([(seqs[0], nxt[0]), (seqs[1], nxt[1])])
    ref0 = engine.forward([(engine.new_sequence(), np.concatenate([prompts[0], nxt[0]]))])[0][-1:]
    ref1 = engine.forward([(engine.new_sequence(), np.concatenate([prompts[1], nxt[1]]))])[0][-7:]
    assert np.array_equal(mixed[0], ref0)
    assert np.array_equal(mixed[1], ref1)


@pytest.mark.parametrize("interleave", [False, True])
def test_ggml_delta_net_agrees_with_the_numpy_reference(interleave):
    rng = np.random.default_rng(3)
    L, Hk, Hv, S, W = 9, 2, 4, 16, 4
    C = (2 * Hk + Hv) * S
    args = dict(qkv=rng.standard_normal((L, C)), z=rng.standard_normal((L, Hv * S)),
                beta_logits=rng.standard_normal((L, Hv)), alpha_logits=rng.standard_normal((L, Hv)),
                conv_state=rng.standard_normal((C, W - 1)), state=0.1 * rng.standard_normal((Hv, S, S)),
                conv_w=0.5 * rng.standard_normal((C, W)), dt_bias=0.5 * rng.standard_normal(Hv),
                ssm_a=-1 - 0.1 * rng.standard_normal(Hv), norm_w=1 + 0.1 * rng.standard_normal(S))
    args = {k: v.astype(np.float32) for k, v in args.items()}
    got = deltanet.delta_net(**args, k_heads=Hk, eps=1e-6, interleave=interleave)
    want = ops.gated_delta_net(**args, k_heads=Hk, eps=1e-6, interleave=interleave)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    # in two chunks == in one (the states carry everything between them)
    a = {k: (v[:4] if k in ("qkv", "z", "beta_logits", "alpha_logits") else v) for k, v in args.items()}
    y1, conv1, s1 = deltanet.delta_net(**a, k_heads=Hk, eps=1e-6, interleave=interleave)
    b = {**{k: v[4:] for k, v in args.items() if k in ("qkv", "z", "beta_logits", "alpha_logits")},
         **{k: v for k, v in args.items() if k not in ("qkv", "z", "beta_logits", "alpha_logits")},
         "conv_state": conv1, "state": s1}
    y2, conv2, s2 = deltanet.delta_net(**b, k_heads=Hk, eps=1e-6, interleave=interleave)
    assert np.array_equal(np.concatenate([y1, y2]), got[0])
    assert np.array_equal(conv2, got[1]) and np.array_equal(s2, got[2])


@pytest.mark.parametrize("qtype", ["f16", "q4_k"])
def test_delta_net_layer_in_one_graph_gives_the_bits_of_the_op_by_op_path(models, qtype, monkeypatch):
    """A one-sequence step runs each delta-net mixer (projections, conv, recurrence, norm, gate,
    output projection) as one graph: prompt, then two decode steps, the same logits and states
    bit for bit as the separate products around ``deltanet.delta_net`` (a 3-sequence batch's path)."""
    engine = Engine(models(ARCH, qtype), n_ctx=64)
    ids = np.array([3, 17, 5, 250, 9, 41, 2, 77, 130, 12, 8])
    runs = []
    for one_graph in (True, False):
        if not one_graph:
            monkeypatch.setattr(engine, "_delta_net_graph", lambda batch, h: False)
        seq = engine.new_sequence()
        logits = [engine.forward([(seq, ids[:9])])[0], engine.forward([(seq, ids[9:10])])[0],
                  engine.forward([(seq, ids[10:11])])[0]]
        runs.append((logits, [s for s in seq.ssm if s is not None], [c for c in seq.conv if c is not None]))
    for got, want in zip(runs[0], runs[1]):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_delta_net_layer_rejects_mismatched_weights():
    fixed = dict(conv_w=np.zeros((12, 4)), dt_bias=np.zeros(1), ssm_a=np.zeros(1), norm_w=np.zeros(4),
                       k_heads=1, eps=1e-6)
    from kernels.tensors import QTensor
    from gguf import GGMLQuantizationType as Q

    def f32(name, ne):
        return QTensor(name, Q.F32, ne, np.zeros(int(np.prod(ne)), dtype=np.float32).view(np.uint8))
    with pytest.raises(ValueError, match="z projection"):
        deltanet.delta_net_layer(np.zeros((2, 8), dtype=np.float32), np.zeros((12, 3)), np.zeros((1, 4, 4)),
                                 wqkv=f32("qkv", (8, 12)), wz=f32("z", (8, 5)), wbeta=f32("b", (8, 1)),
                                 walpha=f32("a", (8, 1)), wout=f32("o", (4, 8)), **fixed)


def test_bad_delta_net_inputs_raise_value_errors_not_aborts():
    with pytest.raises(ValueError, match="state"):
        deltanet.delta_net(np.zeros((2, 8)), np.zeros((2, 4)), np.zeros((2, 1)), np.zeros((2, 1)),
                           np.zeros((8, 3)), np.zeros((1, 4, 3)), np.zeros((8, 4)), np.zeros(1), np.zeros(1),
                           np.zeros(4), k_heads=1, eps=1e-6)
    with pytest.raises(ValueError, match="qkv"):
        deltanet.delta_net(np.zeros((2, 7)), np.zeros((2, 4)), np.zeros((2, 1)), np.zeros((2, 1)),
                           np.zeros((12, 3)), np.zeros((1, 4, 4)), np.zeros((12, 4)), np.zeros(1), np.zeros(1),
                           np.zeros(4), k_heads=1, eps=1e-6)


# --- sharded == monolithic, with a killed worker ----------------------------------------------

def test_sharded_with_a_killed_worker_and_a_slice_worker_equals_monolithic(nats_server, models, tmp_path):
    assert_sharded_with_a_killed_worker_equals_monolithic(models(ARCH, "q4_k"), nats_server.url, tmp_path,
                                                         N_PROMPT, N_DECODE)
