"""The dense-path math on tiny cases whose answers can be worked out by hand."""

import numpy as np
import pytest

from kernels import ops


def test_rms_norm_scales_by_root_mean_square():
    x = np.array([[3.0, 4.0]], dtype=np.float32)  # mean of squares 12.5
    y = ops.rms_norm(x, np.array([1.0, 2.0], dtype=np.float32), eps=0.0)
    expected = np.array([[3.0, 8.0]]) / np.sqrt(12.5)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    assert y.dtype == np.float32


def test_rms_norm_eps_keeps_zero_rows_finite():
    y = ops.rms_norm(np.zeros((1, 4), np.float32), None, eps=1e-6)
    assert np.all(y == 0)


def test_rope_at_position_zero_is_identity():
    x = np.random.default_rng(0).standard_normal((1, 2, 8)).astype(np.float32)
    cos, sin = ops.rope_cache(np.array([0]), 8, 10000.0)
    for style in ("neox", "norm"):
        np.testing.assert_array_equal(ops.rope(x, cos, sin, style), x)


def test_rope_rotates_the_right_pairs_by_position_times_frequency():
    # n_rot 4, base 100: pair 0 turns by p radians, pair 1 by p / 10.
    p = 3
    cos, sin = ops.rope_cache(np.array([p]), 4, 100.0)
    np.testing.assert_allclose(cos[0], np.cos([p, p / 10]), rtol=1e-6)
    x = np.array([[[1.0, 0.0, 0.0, 0.0]]], dtype=np.float32)
    neox = ops.rope(x, cos, sin, "neox")  # pairs (0, 2), (1, 3)
    np.testing.assert_allclose(neox[0, 0], [np.cos(p), 0, np.sin(p), 0], atol=1e-6)
    norm = ops.rope(x, cos, sin, "norm")  # pairs (0, 1), (2, 3)
    np.testing.assert_allclose(norm[0, 0], [np.cos(p), np.sin(p), 0, 0], atol=1e-6)


def test_rope_leaves_dimensions_past_n_rot_alone():
    cos, sin = ops.rope_cache(np.array([5]), 2, 10000.0)
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]], dtype=np.float32)
    assert list(ops.rope(x, cos, sin, "neox")[0, 0, 2:]) == [3.0, 4.0]


def test_softmax_of_log_ratios():
    p = ops.softmax(np.log(np.array([[1.0, 2.0, 5.0]], dtype=np.float32)))
    np.testing.assert_allclose(p, [[0.125, 0.25, 0.625]], rtol=1e-6)


def test_route_picks_top_k_in_descending_order_and_renormalises():
    logits = np.log(np.array([[0.1, 0.6, 0.3]], dtype=np.float32))
    ids, w = ops.route(logits, 2, renormalise=False)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(w, [[0.6, 0.3]], rtol=1e-6)
    ids, w = ops.route(logits, 2, renormalise=True)
    np.testing.assert_allclose(w, [[2 / 3, 1 / 3]], rtol=1e-6)


def test_combine_weights_and_sums_in_top_k_order():
    out = np.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], dtype=np.float32)  # (T=1, K=3, D=2)
    w = np.array([[0.5, 0.25, 2.0]], dtype=np.float32)
    np.testing.assert_array_equal(ops.combine(out, w), [[2.5, 2.25]])


def test_attention_with_one_key_returns_its_value():
    q = np.ones((1, 2, 4), np.float32)  # one query, two heads
    k = np.ones((1, 1, 4), np.float16)  # one KV head shared by both (GQA)
    v = np.array([[[1.0, 2.0, 3.0, 4.0]]], np.float16)
    out = ops.attention(q, k, v, q_pos0=0)
    np.testing.assert_array_equal(out, [[1, 2, 3, 4, 1, 2, 3, 4]])


def test_attention_is_causal_and_averages_equal_scores():
    q = np.zeros((2, 1, 2), np.float32)  # zero queries: equal scores over visible keys
    k = np.zeros((1, 2, 2), np.float16)
    v = np.array([[[2.0, 0.0], [0.0, 2.0]]], np.float16)
    out = ops.attention(q, k, v, q_pos0=0)
    np.testing.assert_array_equal(out[0], [2, 0])  # sees only key 0
    np.testing.assert_array_equal(out[1], [1, 1])  # sees both, mean


@pytest.mark.parametrize("g", [-3.0, -0.5, 0.25, 4.0])
def test_shared_expert_gate_is_a_sigmoid(g):
    got = ops.silu_gate(np.array([g], np.float32))
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-g)), rtol=1e-6)
