"""Attention through ggml (kernels/dense.py): the same math as ops.attention, llama.cpp's rounding."""

import numpy as np
import pytest

from kernels import dense, ggml, ops

pytestmark = pytest.mark.skipif(not dense.available(), reason="ggml (llama-cpp-python) is not installed")


def make_cache(rng, S, Hkv, Dh, cells=None, garbage=False):
    """K (cells, Hkv*Dh) and transposed V (Hkv*Dh, cells) f16 caches holding S random cells, plus
    the same keys/values as (Hkv, S, Dh) for ops.attention."""
    cells = cells or dense.cache_cells_for(S)
    k = rng.standard_normal((S, Hkv, Dh)).astype(np.float16)
    v = rng.standard_normal((S, Hkv, Dh)).astype(np.float16)
    fill = (lambda shape: rng.standard_normal(shape).astype(np.float16)) if garbage else \
        (lambda shape: np.zeros(shape, np.float16))
    kc, vc = fill((cells, Hkv * Dh)), fill((Hkv * Dh, cells))
    kc[:S] = k.reshape(S, -1)
    vc[:, :S] = v.reshape(S, -1).T
    return kc, vc, k.transpose(1, 0, 2), v.transpose(1, 0, 2)


@pytest.mark.parametrize("L,q_pos0,H,Hkv,Dh", [(40, 0, 8, 2, 64), (1, 39, 8, 2, 64), (7, 250, 4, 4, 32),
                                                 (1, 600, 4, 1, 128), (3, 0, 2, 2, 16)])
def test_matches_numpy_attention(L, q_pos0, H, Hkv, Dh):
    rng = np.random.default_rng(L + q_pos0)
    kc, vc, k, v = make_cache(rng, q_pos0 + L, Hkv, Dh)
    q = rng.standard_normal((L, H, Dh)).astype(np.float32)
    ours = dense.attention(q, kc, vc, q_pos0)
    assert ours.shape == (L, H * Dh) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ops.attention(q, k, v, q_pos0), rtol=0, atol=1e-3)


def test_hand_case_exact():
    H = Hkv = 1
    Dh = 16
    kc = np.zeros((256, Dh), np.float16)
    vc = np.zeros((Dh, 256), np.float16)
    V = np.array([[1, 2, 3, 4] * 4, [3, 0, -1, 8] * 4, [5, 5, 5, 5] * 4], np.float16)
    vc[:, :3] = V.T
    vc[:, 3:] = 1000  # cells past the chunk are masked: their (finite) values must not leak
    kc[3:] = 7
    q = np.zeros((2, H, Dh), np.float32)  # all scores 0: a uniform softmax over the visible cells
    out = dense.attention(q, kc, vc, q_pos0=0)  # rows see cells {0} and {0, 1}
    np.testing.assert_array_equal(out[0], V[0].astype(np.float32))
    np.testing.assert_array_equal(out[1], (V[0].astype(np.float32) + V[1]) / 2)
    # One key far ahead of the others: its probability is 1, the others underflow to 0.
    kc[:3] = 0
    kc[2, 0] = 64
    q = np.zeros((1, H, Dh), np.float32)
    q[0, 0, 0] = 64  # score 64*64/4 = 1024 against 0
    out = dense.attention(q, kc, vc, q_pos0=2)
    np.testing.assert_array_equal(out[0], V[2].astype(np.float32))


def test_deterministic_and_independent_of_threads(monkeypatch):
    rng = np.random.default_rng(5)
    kc, vc, _, _ = make_cache(rng, 300, 2, 64)
    q = rng.standard_normal((20, 8, 64)).astype(np.float32)
    first = dense.attention(q, kc, vc, 280)
    np.testing.assert_array_equal(dense.attention(q, kc, vc, 280), first)
    monkeypatch.setattr(ggml, "SMALL_WORK", 0)  # every graph multi-threaded
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KVASIR_THREADS", threads)
        np.testing.assert_array_equal(dense.attention(q, kc, vc, 280), first)


def test_masked_cells_add_exact_zeros():
    """More cells in the graph (n_kv 256 -> 512 -> 768) changes nothing: the extra cells are
    masked and their values are zero (or any finite garbage)."""
    rng = np.random.default_rng(6)
    kc, vc, _, _ = make_cache(rng, 100, 2, 32, cells=768, garbage=True)
    q = rng.standard_normal((9, 4, 32)).astype(np.float32)
    base = dense.attention(q, kc, vc, 91, n_kv=256)
    for n_kv in (512, 768):
        np.testing.assert_array_equal(dense.attention(q, kc, vc, 91, n_kv=n_kv), base)


def test_decode_row_equals_the_batch_row():
    """One query (duplicated to two rows) gives bit for bit the row llama.cpp computes for that
    token when it evaluates the whole chunk in one batch."""
    rng = np.random.default_rng(7)
    kc, vc, _, _ = make_cache(rng, 30, 2, 64)
    q = rng.standard_normal((12, 8, 64)).astype(np.float32)
    batch = dense.attention(q, kc, vc, 18)
    for i in (0, 5, 11):
        np.testing.assert_array_equal(dense.attention(q[i:i + 1], kc, vc, 18 + i), batch[i:i + 1])


def test_long_chunks_in_pieces_give_the_same_rows(monkeypatch):
    rng = np.random.default_rng(12)
    kc, vc, _, _ = make_cache(rng, 300, 2, 32)
    q = rng.standard_normal((41, 4, 32)).astype(np.float32)
    whole = dense.attention(q, kc, vc, 259)
    for budget in (8 * 512 * 4 * 2, 8 * 512 * 4 * 7, 1):  # pieces of 2, 7 and (at least) 2 rows
        monkeypatch.setattr(dense, "MAX_KQ_BYTES", budget)
        np.testing.assert_array_equal(dense.attention(q, kc, vc, 259), whole)


def test_cells_seen_padded_to_64_give_the_bits_of_llama_cpps_256():
    """llama.cpp's graph sees its used cells padded to 256; ours to 64 (every masked cell is
    work): at every length the extra cells between add exact zeros, in both query-row paths
    (one row: vec_dot; several: tinyBLAS)."""
    rng = np.random.default_rng(16)
    kc, vc, _, _ = make_cache(rng, 256, 2, 64, cells=512, garbage=True)
    for used in (1, 2, 31, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 511):
        for L in (1, 2, 5):
            if L > used:
                continue
            q = rng.standard_normal((L, 8, 64)).astype(np.float32)
            llama = -(-used // 256) * 256
            seen = dense.n_kv_for(used, 512)
            assert seen == max(64, -(-used // 64) * 64) and seen <= llama
            np.testing.assert_array_equal(dense.attention(q, kc, vc, used - L, n_kv=seen),
                                          dense.attention(q, kc, vc, used - L, n_kv=llama))


def test_n_kv_and_cache_cells():
    assert dense.n_kv_for(1, 256) == 64
    assert dense.n_kv_for(64, 256) == 64
    assert dense.n_kv_for(65, 256) == 128
    assert dense.n_kv_for(256, 256) == 256
    assert dense.n_kv_for(257, 1024) == 320
    assert dense.n_kv_for(300, 300) == 300  # capped by the cache
    assert dense.n_kv_for(20, 30) == 30
    assert dense.cache_cells_for(1) == 256
    assert dense.cache_cells_for(600) == 768
    assert dense.cache_cells_for(600, n_ctx=300) == 512


def test_bad_inputs_raise_instead_of_aborting():
    rng = np.random.default_rng(8)
    kc, vc, _, _ = make_cache(rng, 10, 2, 16)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    dense.attention(q, kc, vc, 8)
    bad = [
        (q, kc.astype(np.float32), vc, 8),  # K cache not f16
        (q, kc, vc.T, 8),  # V not transposed (or not contiguous)
        (q, kc, vc[:, :100].copy(), 8),  # V with another cell count
        (q, kc, vc, 255),  # positions past the cache
        (q, kc, vc, -1),
        (q[:, :3], kc, vc, 8),  # 3 query heads on 2 KV heads
        (q[..., :12], kc, vc, 8),  # a head size that does not divide the K rows
        (q[0], kc, vc, 8),  # not (L, H, Dh)
    ]
    for args in bad:
        with pytest.raises(ValueError):
            dense.attention(*args)
    with pytest.raises(ValueError):
        dense.attention(q, kc, vc, 8, n_kv=9)  # fewer cells than positions used


def test_rope_is_ggml_and_close_to_numpy():
    rng = np.random.default_rng(9)
    pos = np.arange(300)
    q = rng.standard_normal((300, 4, 64)).astype(np.float32)
    k = rng.standard_normal((300, 2, 64)).astype(np.float32)
    # ggml's angle of a pair is within a few float32 ULPs of theta (up to 3e-5 near theta = 256),
    # and which way it rounds depends on the CPU and build (an AVX-512 build of llama.cpp lands
    # nearer the exact angle than numpy's float32 product): a rotated pair may then differ by
    # that angle times its length. 4 ULPs of the position bound every pair's angle error.
    def tolerance(x):  # (T, 1, 1): per position
        ulps = 4 * np.spacing(pos.astype(np.float32))
        return (1e-5 + ulps * 2 * np.abs(x).max(axis=(1, 2)))[:, None, None]

    for style in ("neox", "norm"):
        rq, rk = dense.rope_qk(q, k, pos, 64, style, 10000.0)
        cos, sin = ops.rope_cache(pos, 64, 10000.0)
        for got, x in ((rq, q), (rk, k)):
            err = np.abs(got - ops.rope(x, cos, sin, style))
            assert (err <= tolerance(x)).all(), f"{style}: max error {err.max()}"
            assert err[:16].max() <= 1e-5  # small angles: the same to float32 noise
        np.testing.assert_array_equal(rq[0], q[0])  # position 0 rotates by nothing
        np.testing.assert_array_equal(dense.rope(k, pos, 64, style, 10000.0), rk)
    # Partial rotation: the dimensions past n_rot pass through.
    r = dense.rope(q, pos, 32, "neox", 10000.0)
    np.testing.assert_array_equal(r[..., 32:], q[..., 32:])


def test_numpy_rms_norm_equals_ggml():
    rng = np.random.default_rng(10)
    for shape in [(40, 256), (5, 4, 64), (3, 2048)]:
        x = (rng.standard_normal(shape) * rng.uniform(1e-3, 10, shape[:-1] + (1,))).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        np.testing.assert_array_equal(ops.rms_norm(x, w, 1e-6), dense.rms_norm(x, w, 1e-6))


def test_engine_paths_agree_and_cache_layout(models):
    from backbone.model import Engine

    from kernels.backend import backend_name

    engine = Engine(models("qwen3moe", "q8_0"))
    assert engine.ggml_attention == (backend_name() == "ggml")
    engine.ggml_attention = True
    c = engine.cfg
    tokens = np.random.default_rng(11).integers(0, c.n_vocab, 20)
    seq = engine.new_sequence()
    ours = np.concatenate([engine.forward([(seq, tokens[:15])])[0]] +
                          [engine.forward([(seq, tokens[i:i + 1])])[0] for i in range(15, 20)])
    gqa = c.n_head_kv * c.head_dim
    assert seq.k[0].shape == (256, gqa) and seq.v[0].shape == (gqa, 256)
    assert not seq.k[0][20:].any() and not seq.v[0][:, 20:].any()
    engine.ggml_attention = False
    seq2 = engine.new_sequence()
    (numpy_path,) = engine.forward([(seq2, tokens)])
    np.testing.assert_allclose(ours, numpy_path, rtol=0, atol=2e-2)
    np.testing.assert_array_equal(seq2.v[0], seq.v[0])  # layer 0's values do not depend on the path
