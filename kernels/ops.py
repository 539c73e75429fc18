"""The math of the dense path, as pure numpy functions that round where llama.cpp's CPU
backend rounds (DESIGN.md section 8; NOTES-numerics.md). No I/O, no state.

The numpy twin of ``kernels/dense.py``: the engine runs these when the kernels are numpy's
(``rms_norm``, ``route`` and ``combine`` always); tests/kernels/test_dense.py checks
attention, RoPE and rms_norm against ggml's.

Shapes use T for rows (tokens of the whole batch), D for n_embd, H/Hkv for query/KV heads,
Dh for head_dim, S for the keys a query sees, E for experts and K for experts used.
"""

from __future__ import annotations

import numpy as np

F16_MIN_NORMAL = np.float32(6.103515625e-5)  # llama.cpp clamps the top-k weight sum here


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """(T, D) -> (T, D). Sum of squares in float64, then ``1/sqrtf(mean + eps)`` in float32."""
    x = np.asarray(x, dtype=np.float32)
    sq = (x * x).astype(np.float64)
    mean = (sq.sum(axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    y = x * scale
    return y * weight if weight is not None else y


def rope_cache(positions: np.ndarray, n_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, n_rot/2), float32, as ggml builds them: theta starts at float(pos)
    and is multiplied by ``powf(base, -2/n_rot)`` once per pair, in float32."""
    theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
    theta = positions.astype(np.float32)
    cos = np.empty((len(positions), n_rot // 2), dtype=np.float32)
    sin = np.empty_like(cos)
    for i in range(n_rot // 2):
        # Evaluate in float64 and round once (numpy's float32 SIMD cos/sin are less accurate).
        # Not bit-exact to ggml: glibc's cosf/sinf differ from this in ~1% of values and ggml's
        # rotation uses an FMA; the engine's ggml path uses ggml_rope_ext (kernels.dense.rope_qk).
        cos[:, i] = np.cos(theta.astype(np.float64))
        sin[:, i] = np.sin(theta.astype(np.float64))
        theta = theta * theta_scale
    return cos, sin


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate (T, H, Dh) by per-row angles (T, n_rot/2). NEOX rotates the pairs
    (i, i + n_rot/2), NORM the pairs (2i, 2i+1); dimensions past n_rot pass through."""
    half = cos.shape[1]
    n_rot = 2 * half
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, n_rot/2): broadcast over heads
    if style == "neox":
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_rot] = x0 * s + x1 * c
    elif style == "norm":
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * c - x1 * s
        out[..., 1:n_rot:2] = x0 * s + x1 * c
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis as ggml computes it: exp in float32, the sum in float64,
    then a float32 multiply by the reciprocal. Rows of all -inf are not expected."""
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    total = e.astype(np.float64).sum(axis=-1, keepdims=True)
    return e * (1.0 / total).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos0: int) -> np.ndarray:
    """Causal GQA attention of one sequence chunk against its KV cache.

    q: (L, H, Dh) float32 after RoPE; k, v: (Hkv, S, Dh) float16, the cache including this
    chunk, where query i sits at position ``q_pos0 + i`` and sees keys ``0..q_pos0 + i``.
    Returns (L, H * Dh) float32. Like llama.cpp without flash attention: Q rounded to f16 for
    the product with the f16 keys, softmax in f32, probabilities rounded to f16 before V.
    """
    L, H, Dh = q.shape
    Hkv, S, _ = k.shape
    r = H // Hkv  # query head h uses KV head h // r
    qh = q.astype(np.float16).astype(np.float32).reshape(L, Hkv, r, Dh).transpose(1, 2, 0, 3)  # (Hkv, r, L, Dh)
    kf = k.astype(np.float32)[:, None]  # (Hkv, 1, S, Dh)
    vf = v.astype(np.float32)[:, None]
    scores = np.matmul(qh, kf.transpose(0, 1, 3, 2))  # (Hkv, r, L, S)
    scores *= np.float32(1.0 / np.sqrt(np.float32(Dh)))
    visible = np.arange(S)[None, :] <= (q_pos0 + np.arange(L))[:, None]  # (L, S)
    scores = np.where(visible, scores, np.float32(-np.inf))
    p = softmax(scores).astype(np.float16).astype(np.float32)
    out = np.matmul(p, vf)  # (Hkv, r, L, Dh)
    return out.transpose(2, 0, 1, 3).reshape(L, H * Dh)


def route(logits: np.ndarray, k: int, renormalise: bool, softmax=softmax) -> tuple[np.ndarray, np.ndarray]:
    """Router: softmax over all experts, top-k by descending probability.

    logits (T, E) -> ids (T, K) int64 in top-k order, weights (T, K) float32 (the selected
    probabilities, divided by their sum clamped below at 6.1e-5 when ``renormalise``).
    ``softmax`` may be ggml's own (bit for bit llama.cpp's) instead of this module's.
    """
    probs = softmax(logits.astype(np.float32))
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalise:
        # ggml_sum_rows adds in float64, left to right, then rounds once to float32.
        total = weights[:, :1].astype(np.float64)
        for j in range(1, weights.shape[1]):
            total = total + weights[:, j:j + 1]
        weights = weights / np.maximum(total.astype(np.float32), F16_MIN_NORMAL)
    return ids, weights


def route_softmax_weight(logits: np.ndarray, k: int, softmax=softmax) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss' router (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): top-k on the logits
    themselves, then a softmax over the k chosen. logits (T, E) -> ids (T, K) int64 in
    descending order, weights (T, K) float32."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return ids, softmax(np.take_along_axis(logits, ids, axis=-1))


def combine(expert_out: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted sum of expert outputs in top-k order, as llama.cpp adds them.

    expert_out (T, K, D), weights (T, K) -> (T, D): each output times its weight, then
    ``((o0 + o1) + o2) + ...`` in float32, a fixed order whoever computed each expert.
    """
    weighted = expert_out * weights[:, :, None]
    acc = weighted[:, 0].copy()
    for j in range(1, weighted.shape[1]):
        acc += weighted[:, j]
    return acc


def silu_gate(g: np.ndarray) -> np.ndarray:
    """qwen2moe's shared-expert gate ``silu(g)/g`` (a sigmoid, computed as llama.cpp does)."""
    silu = g / (np.float32(1.0) + np.exp(-g))
    return silu / g


def gated_delta_net(qkv, z, beta_logits, alpha_logits, conv_state, state, conv_w, dt_bias, ssm_a, norm_w, *,
                    k_heads: int, eps: float, interleave: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A gated delta-net layer's mixer for one sequence chunk, in float64 (the reference that
    ``kernels.deltanet.delta_net`` is checked against; that one rounds as llama.cpp does).

    qkv (L, C), z (L, Hv*S), beta_logits, alpha_logits (L, Hv), conv_state (C, W-1), state
    (Hv, S, S) with ``state[h, j, i]`` = S_h[i][j] (ggml's transposed layout), conv_w (C, W),
    dt_bias, ssm_a (Hv,), norm_w (S,). V head h reads Q/K head ``h % k_heads`` (ggml's tiling).
    Returns y (L, Hv*S) float32, the new conv state (C, W-1) and the new state (Hv, S, S).
    """
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    state = f(state).copy()
    Hv, S, _ = state.shape
    L, C = np.shape(qkv)
    W = np.shape(conv_w)[1]
    conv_in = np.concatenate([f(conv_state), f(qkv).T], axis=1)  # (C, W-1+L)
    x = np.stack([(conv_in[:, t:t + W] * f(conv_w)).sum(axis=1) for t in range(L)])  # (L, C)
    x = x / (1.0 + np.exp(-x))  # silu
    q = x[:, :k_heads * S].reshape(L, k_heads, S)
    k = x[:, k_heads * S:2 * k_heads * S].reshape(L, k_heads, S)
    v = x[:, 2 * k_heads * S:].reshape(L, Hv, S)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)  # l2 norm: rms_norm(eps/S) / sqrt(S)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    beta = 1.0 / (1.0 + np.exp(-f(beta_logits)))
    g = np.log1p(np.exp(f(alpha_logits) + f(dt_bias))) * f(ssm_a)  # softplus * a
    o = np.empty((L, Hv, S))
    for t in range(L):
        for h in range(Hv):
            src = h // (Hv // k_heads) if interleave else h % k_heads
            kh, qh = k[t, src], q[t, src]
            m = state[h] * np.exp(g[t, h])
            delta = (v[t, h] - m @ kh) * beta[t, h]
            m = m + np.outer(delta, kh)
            o[t, h] = (m @ qh) / np.sqrt(S)
            state[h] = m
    y = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * f(norm_w)
    zz = f(z).reshape(L, Hv, S)
    y = y * (zz / (1.0 + np.exp(-zz)))
    return (y.reshape(L, Hv * S).astype(np.float32), conv_in[:, L:].astype(np.float32),
            state.astype(np.float32))
