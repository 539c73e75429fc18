"""qwen35moe's own ops through ggml: the gated delta-net core, multi-section RoPE (IMROPE) and
the sigmoid gates, built as llama.cpp builds them (src/models/qwen35moe.cpp,
src/models/delta-net-base.cpp) so that they round exactly as llama.cpp does on CPU.

The delta-net layer of one sequence chunk of L tokens (S = head size, Hk/Hv = Q-K/V heads,
C = (2*Hk + Hv)*S conv channels, W = conv width):

    conv_in = [conv_state (C, W-1) | qkv^T (C, L)]             # the state is the last W-1 inputs
    x       = silu(ssm_conv(conv_in, conv_w))                   # (L, C): causal conv per channel
    q, k, v = x split into (L, Hk, S), (L, Hk, S), (L, Hv, S)
    q, k    = l2_norm(q), l2_norm(k)                            # rms_norm(eps/S) * 1/sqrt(S)
    beta    = sigmoid(beta_logits)                              # (L, Hv)
    g       = softplus(alpha_logits + dt_bias) * ssm_a          # (L, Hv), log of the decay
    o, s    = gated_delta_net(q, k, v, g, beta, state)          # llama.cpp's fused op, K = 1
    y       = rms_norm(o) * ssm_norm * silu(z)                  # (L, Hv*S)

The fused op runs each (head, sequence) token by token, so a chunk split anywhere gives the
same result as the whole: prefill chunks and decode steps mix freely. llama.cpp's unfused
chunked fallback rounds differently; llama.cpp picks the fused op on CPU (``fused_gdn_ch``,
``fused_gdn_ar``), and so do we. ``kernels/ops.py`` has the same math in numpy
(``ops.gated_delta_net``), checked against this to float32 tolerance.

As everywhere in this package, ggml aborts on a failed assertion: inputs are checked in Python.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kernels import ggml
from kernels.ggml import Graph, run_cached, threads_for

_F32, _I32 = 0, 26
ROPE_TYPE_IMROPE = 40  # GGML_ROPE_TYPE_IMROPE
NODES = 64  # the delta-net graph has ~30 nodes (views and reshapes count)


def l2_norm_params(eps: float, n: int) -> tuple[np.float32, np.float32]:
    """``build_gdn_l2_norm``: rms_norm with ``eps/n`` then a scale ``1.0f/sqrtf(n)``, both float32."""
    fn = np.float32(n)
    return np.float32(np.float32(eps) / fn), np.float32(1.0) / np.sqrt(fn)


def _f32(a, shape: tuple[int, ...], what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {a.shape}")
    return a


def delta_net(qkv: np.ndarray, z: np.ndarray, beta_logits: np.ndarray, alpha_logits: np.ndarray,
              conv_state: np.ndarray, state: np.ndarray, conv_w: np.ndarray, dt_bias: np.ndarray,
              ssm_a: np.ndarray, norm_w: np.ndarray, *, k_heads: int, eps: float, interleave: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence chunk through a delta-net layer (the module docstring's steps).

    qkv (L, C), z (L, Hv*S), beta_logits and alpha_logits (L, Hv): the input projections.
    conv_state (C, W-1) and state (Hv, S, S): this sequence's states before the chunk.
    conv_w (C, W) float32, dt_bias, ssm_a (Hv,), norm_w (S,): the layer's weights.
    V head h reads Q/K head ``h % k_heads`` (qwen35moe: the fused op's own tiling), or with
    ``interleave`` head ``h // (Hv/k_heads)`` (qwen3next repeats Q and K interleaved first).
    Returns y (L, Hv*S) float32 (before ``ssm_out``), the new conv state and the new state.
    """
    state = np.asarray(state)
    if state.ndim != 3 or state.shape[1] != state.shape[2]:
        raise ValueError(f"state: expected (Hv, S, S), got shape {state.shape}")
    Hv, S, _ = state.shape
    if k_heads <= 0 or Hv % k_heads:
        raise ValueError(f"{k_heads} Q/K heads cannot serve {Hv} V heads")
    C = (2 * k_heads + Hv) * S
    conv_w = np.asarray(conv_w)
    if conv_w.ndim != 2 or conv_w.shape[0] != C or conv_w.shape[1] < 2:
        raise ValueError(f"conv_w: expected ({C}, W >= 2), got shape {conv_w.shape}")
    W = conv_w.shape[1]
    qkv = np.asarray(qkv)
    if qkv.ndim != 2 or qkv.shape[1] != C or qkv.shape[0] == 0:
        raise ValueError(f"qkv: expected (L, {C}), got shape {qkv.shape}")
    L = qkv.shape[0]
    z = _f32(z, (L, Hv * S), "z")
    beta_logits = _f32(beta_logits, (L, Hv), "beta_logits")
    alpha_logits = _f32(alpha_logits, (L, Hv), "alpha_logits")
    conv_state = _f32(conv_state, (C, W - 1), "conv_state")
    state = _f32(state, (Hv, S, S), "state")
    conv_w = _f32(conv_w, (C, W), "conv_w")
    dt_bias = _f32(dt_bias, (Hv,), "dt_bias")
    ssm_a = _f32(ssm_a, (Hv,), "ssm_a")
    norm_w = _f32(norm_w, (S,), "norm_w")

    # The conv input and the next conv state are copies, no arithmetic: numpy does them.
    conv_in = np.concatenate([conv_state, np.asarray(qkv, dtype=np.float32).T], axis=1)  # (C, W-1+L)
    new_conv = np.ascontiguousarray(conv_in[:, L:])
    lib = ggml.load()
    threads = threads_for(L * Hv * S * S * 4)

    def build() -> Graph:
        g = Graph(lib, n_tensors=48, nodes=NODES)
        try:
            xin = g.input(_F32, (W - 1 + L, C, 1))
            cw = g.input(_F32, (W, C))
            zt = g.input(_F32, (Hv * S, L))
            bt = g.input(_F32, (Hv, L))
            at = g.input(_F32, (Hv, L))
            st = g.input(_F32, (S, S, Hv))
            dt = g.input(_F32, (Hv,))
            aw = g.input(_F32, (Hv,))
            nw = g.input(_F32, (S,))
            g.output(core(g, lib, xin, cw, zt, bt, at, st, dt, aw, nw, L=L, C=C, Hv=Hv, S=S, k_heads=k_heads,
                           eps=eps, interleave=interleave))  # (S, Hv, L)
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    packed = np.empty((L + S, Hv * S), dtype=np.float32)
    y = np.empty((L, Hv * S), dtype=np.float32)
    key = ("gdn", L, C, W, Hv, S, k_heads, float(eps), bool(interleave), threads)
    run_cached(key, build, (conv_in, conv_w, z, beta_logits, alpha_logits, state, dt_bias, ssm_a, norm_w,
                            packed, y))
    return y, new_conv, np.ascontiguousarray(packed[L:].reshape(Hv, S, S))


def delta_net_layer(h: np.ndarray, conv_state: np.ndarray, state: np.ndarray, *, wqkv, wz, wbeta, walpha, wout,
                    conv_w: np.ndarray, dt_bias: np.ndarray, ssm_a: np.ndarray, norm_w: np.ndarray, k_heads: int,
                    eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A qwen35moe delta-net layer's mixer for one sequence chunk in one ggml graph: the input
    projections (``ggml_mul_mat`` of h by wqkv, wz, wbeta, walpha), :func:`delta_net`'s steps,
    then the output projection wout, as llama.cpp's ``build_layer_attn_linear`` builds them.

    h (L, D) float32: the layer's normed input rows. The weights are QTensors, bound as
    :func:`kernels.ggml.matmul` binds them (repacked where it repacks), so every product takes
    the kernel that the op-by-op path and llama.cpp take for the same rows; the thread count
    never changes a result. conv_state (C, W-1), state (Hv, S, S) and the rest as in
    :func:`delta_net`. Returns (L, D) float32 after ``ssm_out``, the new conv state, the new state.
    """
    h = ggml.check_rows(h, wqkv.ne[0], "delta-net input")
    for w in (wqkv, wz, wbeta, walpha, wout):
        ggml.check_weight(w)
    state = np.asarray(state)
    if state.ndim != 3 or state.shape[1] != state.shape[2]:
        raise ValueError(f"state: expected (Hv, S, S), got shape {state.shape}")
    Hv, S, _ = state.shape
    if k_heads <= 0 or Hv % k_heads:
        raise ValueError(f"{k_heads} Q/K heads cannot serve {Hv} V heads")
    L, D = h.shape
    C = (2 * k_heads + Hv) * S
    conv_w = np.asarray(conv_w)
    if conv_w.ndim != 2 or conv_w.shape[0] != C or conv_w.shape[1] < 2:
        raise ValueError(f"conv_w: expected ({C}, W >= 2), got shape {conv_w.shape}")
    W = conv_w.shape[1]
    shapes = {"qkv": (wqkv, C), "z": (wz, Hv * S), "beta": (wbeta, Hv), "alpha": (walpha, Hv)}
    for what, (w, n) in shapes.items():
        if tuple(w.ne) != (D, n):
            raise ValueError(f"{what} projection {w.name}: expected ne ({D}, {n}), got {tuple(w.ne)}")
    if tuple(wout.ne) != (Hv * S, D):
        raise ValueError(f"output projection {wout.name}: expected ne ({Hv * S}, {D}), got {tuple(wout.ne)}")
    conv_state = _f32(conv_state, (C, W - 1), "conv_state")
    state = _f32(state, (Hv, S, S), "state")
    conv_w = _f32(conv_w, (C, W), "conv_w")
    dt_bias = _f32(dt_bias, (Hv,), "dt_bias")
    ssm_a = _f32(ssm_a, (Hv,), "ssm_a")
    norm_w = _f32(norm_w, (S,), "norm_w")

    # The conv input (C, W-1+L): its first W-1 columns the conv state (a numpy copy), the rest
    # the qkv projection transposed in by the graph (ggml_cpy: a copy, no rounding).
    conv_in = np.empty((C, W - 1 + L), dtype=np.float32)
    conv_in[:, :W - 1] = conv_state
    lib = ggml.load()
    threads = threads_for(L * D * (C + Hv * S), L)
    weights = (wqkv, wz, wbeta, walpha, wout)
    packs = [ggml.repacked(w) for w in weights]

    def build() -> Graph:
        g = Graph(lib, n_tensors=64, nodes=NODES + 16)
        try:
            ctx = g.ctx
            ht = g.input(_F32, (D, L))
            wt = [ggml.weight_input(g, w, rp) for w, rp in zip(weights, packs)]
            xin = g.input(_F32, (W - 1 + L, C, 1))
            cw = g.input(_F32, (W, C))
            st = g.input(_F32, (S, S, Hv))
            dt = g.input(_F32, (Hv,))
            aw = g.input(_F32, (Hv,))
            nw = g.input(_F32, (S,))
            qkv = g.scratch(lib.ggml_mul_mat(ctx, wt[0], ht))  # (C, L)
            zt = g.scratch(lib.ggml_mul_mat(ctx, wt[1], ht))  # (Hv*S, L)
            bt = g.scratch(lib.ggml_mul_mat(ctx, wt[2], ht))  # (Hv, L)
            at = g.scratch(lib.ggml_mul_mat(ctx, wt[3], ht))  # (Hv, L)
            dst = g.view(lib.ggml_view_2d(ctx, xin, L, C, (W - 1 + L) * 4, (W - 1) * 4))  # (L, C) of xin
            g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_permute(ctx, qkv, 1, 0, 2, 3)), dst)))
            y = g.scratch(core(g, lib, xin, cw, zt, bt, at, st, dt, aw, nw, L=L, C=C, Hv=Hv, S=S,
                                k_heads=k_heads, eps=eps, interleave=False))  # (S, Hv, L)
            y = g.view(lib.ggml_reshape_2d(ctx, y, Hv * S, L))
            g.output(lib.ggml_mul_mat(ctx, wt[4], y))  # (D, L)
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    packed = np.empty((L + S, Hv * S), dtype=np.float32)
    out = np.empty((L, D), dtype=np.float32)
    key = ("gdn_layer", L, D, C, W, Hv, S, k_heads, float(eps), threads,
           *((w.ggml_type, rp is not None) for w, rp in zip(weights, packs)))
    run_cached(key, build, (h, *(ggml.weight_data(w, rp) for w, rp in zip(weights, packs)), conv_in, conv_w,
                            state, dt_bias, ssm_a, norm_w, packed, out))
    return out, np.ascontiguousarray(conv_in[:, L:]), np.ascontiguousarray(packed[L:].reshape(Hv, S, S))


def core(g: Graph, lib, xin, cw, zt, bt, at, st, dt, aw, nw, *, L: int, C: int, Hv: int, S: int, k_heads: int,
          eps: float, interleave: bool, in_place: bool = False):
    """The module docstring's steps from the conv input on, into graph ``g``: the fused op's
    packed result (Hv*S, L + S) becomes an output here (the next bound array), and the gated
    output y (S, Hv, L) is returned for the caller to make an output or use further. ``xin``
    (W-1+L, C, 1): the conv input; zt (Hv*S, L), bt and at (Hv, L): the z, beta and alpha
    projections (contiguous); st (S, S, Hv) the state; cw, dt, aw, nw the layer's conv, dt, a
    and norm. ``in_place``: the packed result stays scratch and its new state is copied into
    ``st`` itself (``ggml_cpy``, after the op has read it), as llama.cpp writes its recurrent
    memory back (``build_recurrent_attn``)."""
    ctx = g.ctx
    l2_eps, l2_scale = l2_norm_params(eps, S)
    conv = g.scratch(lib.ggml_ssm_conv(ctx, xin, cw))  # (C, L, 1)
    conv = g.scratch(lib.ggml_silu(ctx, conv))
    f4 = 4  # bytes per float
    row = C * f4
    q = g.view(lib.ggml_view_4d(ctx, conv, S, k_heads, L, 1, S * f4, row, row * L, 0))
    k = g.view(lib.ggml_view_4d(ctx, conv, S, k_heads, L, 1, S * f4, row, row * L, k_heads * S * f4))
    v = g.view(lib.ggml_view_4d(ctx, conv, S, Hv, L, 1, S * f4, row, row * L, 2 * k_heads * S * f4))
    q = g.scratch(lib.ggml_scale(ctx, g.scratch(lib.ggml_rms_norm(ctx, q, float(l2_eps))), float(l2_scale)))
    k = g.scratch(lib.ggml_scale(ctx, g.scratch(lib.ggml_rms_norm(ctx, k, float(l2_eps))), float(l2_scale)))
    if interleave and Hv != k_heads:  # qwen3next's ggml_repeat_4d, exact copies
        r = Hv // k_heads
        q, k = (g.view(lib.ggml_reshape_4d(ctx, g.scratch(lib.ggml_repeat_4d(
            ctx, g.view(lib.ggml_reshape_4d(ctx, x, S, 1, k_heads, L)), S, r, k_heads, L)), S, Hv, L, 1))
            for x in (q, k))
    beta = g.scratch(lib.ggml_sigmoid(ctx, g.view(lib.ggml_reshape_4d(ctx, bt, 1, Hv, L, 1))))
    gate = g.scratch(lib.ggml_add(ctx, at, dt))
    gate = g.scratch(lib.ggml_softplus(ctx, gate))
    gate = g.scratch(lib.ggml_mul(ctx, gate, aw))
    gate = g.view(lib.ggml_reshape_4d(ctx, gate, 1, Hv, L, 1))
    s0 = g.view(lib.ggml_reshape_4d(ctx, st, S, S, Hv, 1))
    out = lib.ggml_gated_delta_net(ctx, q, k, v, gate, beta, s0, 1)  # (Hv*S, L + S)
    if in_place:
        out = g.scratch(out)
        new_state = g.view(lib.ggml_view_3d(ctx, out, S, S, Hv, S * 4, S * S * 4, Hv * S * L * 4))  # (S, S, Hv)
        g.expand(g.view(lib.ggml_cpy(ctx, new_state, st)))
    else:
        out = g.output(out)
    o = g.view(lib.ggml_view_4d(ctx, out, S, Hv, L, 1, S * f4, Hv * S * f4, Hv * S * L * f4, 0))
    y = g.scratch(lib.ggml_rms_norm(ctx, o, float(eps)))
    y = g.scratch(lib.ggml_mul(ctx, y, nw))
    zs = g.scratch(lib.ggml_silu(ctx, g.view(lib.ggml_reshape_3d(ctx, zt, S, Hv, L))))
    return lib.ggml_mul(ctx, y, zs)  # (S, Hv, L): for the caller's g.output or g.scratch


def rope_multi_qk(q: np.ndarray, k: np.ndarray, positions: np.ndarray, n_rot: int, sections, base: float,
                  n_ctx_orig: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """IMROPE of queries (T, H, Dh) and keys (T, Hkv, Dh) as qwen35moe calls ``ggml_rope_multi``
    for text: the 4 x T positions are (pos, pos, pos, 0) (``llm_graph_input_pos::set_input``);
    YaRN off (freq_scale 1, ext_factor 0, attn_factor 1, beta_fast 32, beta_slow 1)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.size == 0:
        raise ValueError(f"q {q.shape} and k {k.shape}: expected (T, H, Dh) and (T, Hkv, Dh)")
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    sections = tuple(int(s) for s in sections)
    if len(sections) != 4 or min(sections) < 0 or not 0 < sum(sections) <= Dh // 2:
        raise ValueError(f"rope sections {sections}: expected 4 sizes summing to 1..{Dh // 2}")
    if n_rot <= 0 or n_rot % 2 or n_rot > Dh:
        raise ValueError(f"n_rot={n_rot} must be even and in 2..{Dh}")
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    if pos.shape != (T,):
        raise ValueError(f"positions: expected shape ({T},), got {pos.shape}")
    pos4 = np.concatenate([pos, pos, pos, np.zeros(T, dtype=np.int32)])
    lib = ggml.load()
    threads = threads_for((H + Hkv) * T * Dh * 16)
    params = (int(n_rot), sections, int(n_ctx_orig), float(base))

    def build() -> Graph:
        g = Graph(lib, n_tensors=6)
        try:
            pt = g.input(_I32, (4 * T,))
            secs = (ctypes.c_int * 4)(*sections)
            g.keep.append(secs)  # ggml copies them into op_params; kept anyway
            for heads in (H, Hkv):
                xt = g.input(_F32, (Dh, heads, T))
                g.output(lib.ggml_rope_multi(g.ctx, xt, pt, None, int(n_rot), secs, ROPE_TYPE_IMROPE,
                                             int(n_ctx_orig), float(base), 1.0, 0.0, 1.0, 32.0, 1.0))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    qo, ko = np.empty_like(q), np.empty_like(k)
    run_cached(("imrope", T, H, Hkv, Dh, params, threads), build, (pos4, q, qo, k, ko))
    return qo, ko


def sigmoid_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x * sigmoid(gate)`` for same-shaped (T, N) float32 (the gated attention output)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    if x.ndim != 2 or x.shape != gate.shape or x.size == 0:
        raise ValueError(f"x {x.shape} and gate {gate.shape}: expected the same non-empty (T, N)")
    T, N = x.shape
    lib = ggml.load()

    def build() -> Graph:
        g = Graph(lib, n_tensors=4)
        try:
            xt = g.input(_F32, (N, T))
            gt = g.input(_F32, (N, T))
            s = g.scratch(lib.ggml_sigmoid(g.ctx, gt))
            g.output(lib.ggml_mul(g.ctx, xt, s))
            return g.finish(1)
        except BaseException:
            g.free()
            raise

    out = np.empty_like(x)
    run_cached(("sigmoid_gate", T, N), build, (x, gate, out))
    return out
