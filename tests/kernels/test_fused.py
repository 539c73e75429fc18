"""The fused kernels: all of a layer's experts in one graph, ggml's embedding lookup, repacking.

Each must give the bits of the op-by-op kernels it replaces (tests/backbone/test_parity.py
checks the same for whole engine steps).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kernels.expert import expert_ffn, moe_ffn, moe_step
from kernels.tensors import QTensor
from tests.kernels.test_expert import N_EMBD, _expert


def _slabs(qtype: T, n_expert: int) -> tuple[list[QTensor], list[tuple[QTensor, QTensor, QTensor]]]:
    """n_expert random experts, stacked into 3-D slabs as in a GGUF, and the experts alone."""
    experts = [_expert(qtype, seed=10 * e) for e in range(n_expert)]
    slabs = [QTensor(ws[0].name, ws[0].ggml_type, (*ws[0].ne, n_expert), np.concatenate([w.data for w in ws]))
             for ws in zip(*experts)]
    return slabs, experts


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 3, 12])
def test_moe_ffn_gives_each_expert_the_bits_it_gives_its_rows_alone(ggml, qtype, n_tokens):
    slabs, experts = _slabs(qtype, 6)
    rng = np.random.default_rng(n_tokens)
    x = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    ids = np.stack([rng.permutation(6)[:3] for _ in range(n_tokens)])  # (T, K=3), distinct per token
    out = moe_ffn(*slabs, x, ids)  # (T, K, D)
    assert out.shape == (n_tokens, 3, N_EMBD)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        alone = expert_ffn(*experts[e], x[rows], routed=True, backend="ggml")
        assert np.array_equal(out[rows, slots], alone)



@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_a_bound_step_gives_moe_ffns_bits_call_after_call(ggml, qtype):
    """The worker's decode step (moe_step: buffers and graph bound once) against moe_ffn, on
    rows and slot lists that change every call, a repeated slot, and f16 rows converted on copy."""
    slabs, _ = _slabs(qtype, 6)
    rng = np.random.default_rng(7)
    step = moe_step(*slabs, 3)
    for slots in ([0, 1, 2], [5, 3, 4], [2, 2, 0], [4, 1, 5]):
        x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
        want = moe_ffn(*slabs, x, np.array([slots]))[0]
        got = step(x[0], slots)
        assert got.shape == (3, N_EMBD) and np.array_equal(got, want), slots
    half = rng.standard_normal(N_EMBD).astype(np.float16)
    assert np.array_equal(step(half, [1, 0, 3]), moe_ffn(*slabs, half[None].astype(np.float32), np.array([[1, 0, 3]]))[0])


def test_a_bound_step_with_bias_rows_and_swiglu_oai_gives_moe_ffns_bits(ggml):
    slabs, _ = _slabs(T.Q8_0, 4)
    rng = np.random.default_rng(8)
    n_ff = slabs[0].ne[1]
    biases = tuple(rng.standard_normal((4, n)).astype(np.float32) for n in (n_ff, n_ff, N_EMBD))
    step = moe_step(*slabs, 2, biases=biases, glu="swiglu_oai")
    x = rng.standard_normal((1, N_EMBD)).astype(np.float32)
    want = moe_ffn(*slabs, x, np.array([[3, 1]]), biases=biases, glu="swiglu_oai")[0]
    assert np.array_equal(step(x[0], [3, 1]), want)


def test_a_bound_step_refuses_out_of_range_slots_and_checks_its_slabs(ggml):
    slabs, _ = _slabs(T.Q8_0, 4)
    step = moe_step(*slabs, 2)
    x = np.ones(N_EMBD, np.float32)
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(ValueError, match=r"out of range 0\.\.3"):
            step(x, bad)
    assert np.array_equal(step(x, [1, 2]), moe_ffn(*slabs, x[None], np.array([[1, 2]]))[0])  # still usable
    with pytest.raises(ValueError, match="do not fit together"):
        moe_step(slabs[0], slabs[1], slabs[0], 2)
    with pytest.raises(ValueError, match="at least one slot"):
        moe_step(*slabs, 0)


def test_moe_ffn_rejects_bad_ids(ggml):
    slabs, _ = _slabs(T.Q8_0, 2)
    x = np.zeros((2, N_EMBD), dtype=np.float32)
    with pytest.raises(ValueError, match="out of range"):
        moe_ffn(*slabs, x, np.array([[0], [2]]))
    with pytest.raises(ValueError, match="ids"):
        moe_ffn(*slabs, x, np.array([0, 1]))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_get_rows_dequantises_as_gguf_does(ggml, qtype):
    w = _expert(qtype)[0]  # (N_EMBD -> N_FF): N_FF rows of N_EMBD
    ids = np.array([3, 0, 3, 255])
    assert np.array_equal(ggml.get_rows(w, ids), w.f32()[ids])
    with pytest.raises(ValueError, match="row ids"):
        ggml.get_rows(w, np.array([256]))


def test_repacked_q4_k_weight_multiplies_like_the_plain_one(ggml):
    """The repack buffer (fast mode's opt-in): ggml interleaves the bytes once; the product
    sums in another order, so it agrees to rounding, not bit for bit."""
    lib = ggml.load()
    if lib.repack_buft is None:
        pytest.skip("this ggml has no CPU repack buffer type")
    w = _expert(T.Q4_K)[0]
    rp = ggml.repack_weight(w)
    if rp is None:
        pytest.skip("no repacked Q4_K kernel on this CPU")
    x = np.random.default_rng(0).standard_normal((5, N_EMBD)).astype(np.float32)

    def product(rp_or_none):
        g = ggml.Graph(lib, n_tensors=4)
        wt = ggml.weight_input(g, w, rp_or_none)
        xt = g.input(T.F32, (N_EMBD, 5))
        g.output(lib.ggml_mul_mat(g.ctx, wt, xt))
        g.finish(1)
        out = np.empty((5, w.ne[1]), dtype=np.float32)
        g.run((ggml.weight_data(w, rp_or_none), x, out))
        g.free()
        return out

    plain, packed = product(None), product(rp)
    assert not np.array_equal(rp.data[:64], w.data[:64])  # really repacked
    np.testing.assert_allclose(packed, plain, rtol=0, atol=1e-4 * np.abs(plain).max())


def _attention_out_inputs(rng, n_rows: int, D: int = 32, E: int = 20, H: int = 2, Dh: int = 16):
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    wo = QTensor("attn_output.weight", T.F32, (H * Dh, D), f32(D, H * Dh).reshape(-1).view(np.uint8))
    router = QTensor("ffn_gate_inp.weight", T.F32, (D, E), f32(E, D).reshape(-1).view(np.uint8))
    return f32(n_rows, H * Dh), f32(n_rows, D), dict(eps=1e-6, wo=wo, ffn_norm=1 + f32(D) / 4, router=router)


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("router_softmax", [True, False])
def test_attention_out_routes_as_ops_route_does(ggml, norm_topk, router_softmax):
    """The top-k in the graph (llama.cpp's argsort, get_rows, sum_rows, clamp, div) chooses the
    experts and weights that kernels.ops.route (or route_softmax_weight) gives on the same
    router output."""
    from kernels import dense, fused, ops
    from kernels.ggml import matmul

    attn, x, kw = _attention_out_inputs(np.random.default_rng(4), 7)
    f = fused.attention_out(attn, x, **kw, router_softmax=router_softmax, n_expert_used=4, norm_topk=norm_topk)
    logits = matmul(kw["router"], f.h)
    if router_softmax:
        ids, weights = ops.route(logits, 4, norm_topk, dense.softmax)
    else:
        ids, weights = ops.route_softmax_weight(logits, 4, dense.softmax)
    assert f.ids.dtype == np.int32 and f.ids.shape == (7, 4)
    assert np.array_equal(f.ids, ids)
    assert np.array_equal(f.weights, weights)


def test_attention_out_keeps_only_the_rows_asked_for(ggml):
    from kernels import fused

    attn, x, kw = _attention_out_inputs(np.random.default_rng(5), 9)
    full = fused.attention_out(attn, x, **kw, n_expert_used=3, norm_topk=True)
    kept = fused.attention_out(attn, x, **kw, n_expert_used=3, norm_topk=True, keep=np.array([8, 2]))
    for name in ("x", "h", "ids", "weights"):
        assert np.array_equal(getattr(kept, name), getattr(full, name)[[8, 2]]), name
    with pytest.raises(ValueError, match="rows to keep"):
        fused.attention_out(attn, x, **kw, n_expert_used=3, norm_topk=True, keep=np.array([9]))
    with pytest.raises(ValueError, match="experts used"):
        fused.attention_out(attn, x, **kw, n_expert_used=21, norm_topk=True)
