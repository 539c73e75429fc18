"""A transformer layer's dense path as two ggml graphs, the ops llama.cpp builds, in its order.

The engine used to call one small graph per op (norm, each projection, RoPE, router, softmax,
shared expert, its gate): a dozen calls into ggml per layer and step, each paying Python and
ctypes overhead that, on a decode step, costs more than the arithmetic. Here the dense path
between two points where the engine must act anyway is one graph:

    attention_in:   h = rms_norm(x) * attn_norm
                    q, k, v = Wq h (+bq), Wk h (+bk), Wv h (+bv)       # (T, H*Dh), (T, Hkv*Dh) x2
                    q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm  # per head (qwen3moe)
                    q, k = rope(q), rope(k)
    -- the engine stores k, v in each sequence's KV cache and runs its attention --
    attention_out:  x = x + Wo attn (+bo)
                    h = rms_norm(x) * ffn_norm
                    router = Wr h (+br), softmax'ed unless the router takes top-k of logits
                    shared = down(silu(gate h) * up h) * shexp_gate(h)  # where the model has one
    -- the engine routes, runs the experts (one graph, ``kernels.ggml.moe_ffn``), combines --

Every op is the one the single-op kernels of ``kernels/dense.py`` and ``kernels/ggml.py`` use,
with the same shapes, so the results are those bits (the tests compare the two paths): rows
are independent in every op here, and the caller passes a one-row step as two rows in
deterministic mode, as :func:`kernels.ggml.matmul` does. A graph is built once per shape (rows,
weight types, which optional parts a layer has) and kept in the per-thread graph cache; a call
only rebinds the data pointers, the layer's weights included, so all layers share one graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from kernels import ggml
from kernels.ggml import Graph, repacked, run_cached, threads_for, weight_data, weight_input
from kernels.tensors import QTensor

NODES = 64  # graph size: attention_out with a shared expert and its gate has about 25 nodes


@dataclass(frozen=True)
class AttentionShape:
    """What fixes the attention projections' shapes besides the weights."""

    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope: tuple  # kernels.dense.rope_params(...)


def _key(w: QTensor | None) -> tuple | None:
    return None if w is None else (int(w.ggml_type), w.ne)


def _vec(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


def _qkv_heads(g: Graph, lib, x, norm, ws, bs, q_norm, k_norm, shape: AttentionShape, rows: int):
    """The ops both attention builders start with: h = rms_norm(x) * norm, Q/K/V = W h (+ bias),
    Q and K as (Dh, heads, rows) with their per-head RMS norms when the model has them.
    Returns (h, q, k, v); v stays (Hkv*Dh, rows)."""
    ctx, eps = g.ctx, float(shape.eps)
    h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x, eps)), norm))
    outs = []
    for w, b in zip(ws, bs):
        y = g.scratch(lib.ggml_mul_mat(ctx, w, h))
        outs.append(y if b is None else g.scratch(lib.ggml_add(ctx, y, b)))
    q, k, v = outs
    q = g.view(lib.ggml_reshape_3d(ctx, q, shape.head_dim, shape.n_head, rows))
    k = g.view(lib.ggml_reshape_3d(ctx, k, shape.head_dim, shape.n_head_kv, rows))
    if q_norm is not None:
        q = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, q, eps)), q_norm))
    if k_norm is not None:
        k = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, k, eps)), k_norm))
    return h, q, k, v


def attention_in(x: np.ndarray, positions: np.ndarray, shape: AttentionShape, *, attn_norm: np.ndarray,
                 wq: QTensor, wk: QTensor, wv: QTensor, bq=None, bk=None, bv=None, q_norm=None,
                 k_norm=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Norm, Q/K/V projections (+biases), per-head Q/K norms and RoPE of rows ``x`` (T, D)
    float32 at ``positions`` (T,): q (T, H, Dh), k (T, Hkv, Dh), v (T, Hkv*Dh) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    n, D = x.shape
    H, Hkv, Dh = shape.n_head, shape.n_head_kv, shape.head_dim
    if wq.ne != (D, H * Dh) or wk.ne != (D, Hkv * Dh) or wv.ne != (D, Hkv * Dh) or pos.shape != (n,):
        raise ValueError(f"attention_in: x {x.shape}, positions {pos.shape} and weights {wq.ne}, {wk.ne}, "
                         f"{wv.ne} do not fit heads {H}/{Hkv} x {Dh}")
    bias = [_vec(b) for b in (bq, bk, bv)]
    norms = [_vec(v) for v in (q_norm, k_norm)]
    has = tuple(b is not None for b in bias) + tuple(v is not None for v in norms)
    lib = ggml.load()
    threads = threads_for(n * D * (H + 2 * Hkv) * Dh, n)
    rps = [repacked(w) for w in (wq, wk, wv)]

    def build() -> Graph:
        g = Graph(lib, n_tensors=40, nodes=NODES)
        try:
            ctx = g.ctx
            xt = g.input(T.F32, (D, n))
            nt = g.input(T.F32, (D,))
            pt = g.input(T.I32, (n,))
            ws = [weight_input(g, w, rp) for w, rp in zip((wq, wk, wv), rps)]
            bs = [g.input(T.F32, (w.ne[1],)) if b is not None else None for w, b in zip((wq, wk, wv), bias)]
            ns = [g.input(T.F32, (Dh,)) if v is not None else None for v in norms]
            _, q, k, v = _qkv_heads(g, lib, xt, nt, ws, bs, ns[0], ns[1], shape, n)
            g.output(lib.ggml_rope_ext(ctx, q, pt, None, *shape.rope))
            g.output(lib.ggml_rope_ext(ctx, k, pt, None, *shape.rope))
            g.output(lib.ggml_cont_2d(ctx, v, Hkv * Dh, n))  # a copy: the product is a scratch buffer
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    q_out = np.empty((n, H, Dh), dtype=np.float32)
    k_out = np.empty((n, Hkv, Dh), dtype=np.float32)
    v_out = np.empty((n, Hkv * Dh), dtype=np.float32)
    key = ("attn_in", n, shape, threads, _key(wq), _key(wk), _key(wv), has, tuple(rp is not None for rp in rps))
    arrays = [x, _vec(attn_norm), pos, *(weight_data(w, rp) for w, rp in zip((wq, wk, wv), rps)), *(b for b in bias if b is not None),
              *(v for v in norms if v is not None), q_out, k_out, v_out]
    run_cached(key, build, arrays)
    return q_out, k_out, v_out


@dataclass(frozen=True)
class FfnIn:
    """What attention_out computes after the residual: the FFN input and the router's output."""

    x: np.ndarray  # (T, D) the residual stream after attention
    h: np.ndarray  # (T, D) rms_norm(x) * ffn_norm
    router: np.ndarray  # (T, E) probabilities, or logits when the router softmaxes after top-k
    shared: np.ndarray | None  # (T, D) the gated shared expert, or None


def attention_out(attn: np.ndarray, x: np.ndarray, *, eps: float, wo: QTensor, bo=None,
                  ffn_norm: np.ndarray, router: QTensor, router_bias=None, router_softmax: bool = True,
                  shexp: tuple[QTensor, QTensor, QTensor] | None = None, shexp_gate=None,
                  shexp_gate_kind: str = "silu_div", keep: np.ndarray | None = None) -> FfnIn:
    """Output projection (+bias) and residual, the FFN norm, the router (+bias, softmax) and the
    shared expert with its gate, as one graph. attn (T, H*Dh), x (T, D) float32. ``keep``
    (n,): after the output projection, only these rows go on (llama.cpp's ``inp_out_ids`` on
    the last layer), so every result has n rows."""
    attn = np.ascontiguousarray(attn, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    T_in, D = x.shape
    keep = None if keep is None else np.ascontiguousarray(keep, dtype=np.int32)
    n = T_in if keep is None else len(keep)
    E = router.ne[1]
    if wo.ne != (attn.shape[1], D) or attn.shape[0] != T_in or router.ne[0] != D:
        raise ValueError(f"attention_out: attn {attn.shape}, x {x.shape}, Wo {wo.ne}, router {router.ne} do not fit")
    if shexp_gate_kind not in ("silu_div", "sigmoid"):
        raise ValueError(f"unknown shared-expert gate {shexp_gate_kind!r}")
    bo, router_bias, shexp_gate = _vec(bo), _vec(router_bias), _vec(shexp_gate)
    has = (bo is not None, router_bias is not None, shexp is not None, shexp_gate is not None)
    F = shexp[0].ne[1] if shexp is not None else 0
    lib = ggml.load()
    if keep is not None and (keep.ndim != 1 or n == 0 or keep.min() < 0 or keep.max() >= T_in):
        raise ValueError(f"attention_out: rows to keep {keep} are not rows of the {T_in} given")
    threads = threads_for(T_in * wo.ne[0] * D + n * (D * E + 3 * D * F), T_in)
    rp_o = repacked(wo)
    rp_s = [repacked(w) for w in shexp] if shexp is not None else []

    def build() -> Graph:
        g = Graph(lib, n_tensors=48, nodes=NODES)
        try:
            ctx = g.ctx
            at = g.input(T.F32, (wo.ne[0], T_in))
            xt = g.input(T.F32, (D, T_in))
            kt = g.input(T.I32, (n,)) if keep is not None else None
            wot = weight_input(g, wo, rp_o)
            bot = g.input(T.F32, (D,)) if has[0] else None
            fnt = g.input(T.F32, (D,))
            wrt = g.input(router.ggml_type, router.ne)
            brt = g.input(T.F32, (E,)) if has[1] else None
            sw = [weight_input(g, w, rp) for w, rp in zip(shexp, rp_s)] if has[2] else None
            sgt = g.input(T.F32, (D, 1)) if has[3] else None

            y = g.scratch(lib.ggml_mul_mat(ctx, wot, at))
            if bot is not None:
                y = g.scratch(lib.ggml_add(ctx, y, bot))
            if kt is not None:  # the rows whose logits are wanted, as llama.cpp prunes them
                y, xt = (g.scratch(lib.ggml_get_rows(ctx, t, kt)) for t in (y, xt))
            x2 = g.output(lib.ggml_add(ctx, xt, y))
            h = g.output(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x2, float(eps))), fnt))
            r = lib.ggml_mul_mat(ctx, wrt, h)  # (E, T)
            if brt is not None:
                r = lib.ggml_add(ctx, g.scratch(r), brt)
            if router_softmax:
                r = lib.ggml_soft_max(ctx, g.scratch(r))
            g.output(r)
            if sw is not None:  # kernels.ggml.expert_ffn(routed=False), then the gate
                gate = g.scratch(lib.ggml_mul_mat(ctx, sw[0], h))
                up = g.scratch(lib.ggml_mul_mat(ctx, sw[1], h))
                s = lib.ggml_mul_mat(ctx, sw[2], g.scratch(lib.ggml_swiglu_split(ctx, gate, up)))
                if sgt is not None:  # kernels.dense.shared_expert_gate
                    gl = g.scratch(lib.ggml_mul_mat(ctx, sgt, h))  # (1, T)
                    if shexp_gate_kind == "sigmoid":
                        gl = g.scratch(lib.ggml_sigmoid(ctx, gl))
                    else:
                        gl = g.scratch(lib.ggml_div(ctx, g.scratch(lib.ggml_silu(ctx, gl)), gl))
                    s = lib.ggml_mul(ctx, g.scratch(s), gl)
                g.output(s)
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    x_out, h_out = np.empty((n, D), np.float32), np.empty((n, D), np.float32)
    r_out = np.empty((n, E), dtype=np.float32)
    s_out = np.empty((n, D), np.float32) if shexp is not None else None
    key = ("attn_out", T_in, n if keep is not None else None, float(eps), threads, _key(wo), _key(router),
           router_softmax, has, shexp_gate_kind,
           tuple(_key(w) for w in shexp) if shexp is not None else None, rp_o is not None,
           tuple(rp is not None for rp in rp_s))
    arrays = [attn, x, *((keep,) if keep is not None else ()), weight_data(wo, rp_o), *((bo,) if has[0] else ()),
              _vec(ffn_norm), router.data, *((router_bias,) if has[1] else ()), *(weight_data(w, rp) for w, rp in zip(shexp or (), rp_s)),
              *((shexp_gate,) if has[3] else ()), x_out, h_out, r_out, *((s_out,) if has[2] else ())]
    run_cached(key, build, arrays)
    return FfnIn(x_out, h_out, r_out, s_out)


# --- one sequence's step as one graph per layer ------------------------------------------------
#
# When a step holds one sequence and every routed expert is local, a layer's only reason to
# return to Python is the router's top-k (numpy, ``kernels.ops.route``: kept there so that the
# expert choice stays the one the other paths make, bit for bit). So the step runs as
# ``n_layer + 1`` graphs, each from one router to the next:
#
#     segment 0:       x = embedding rows;                     attention part of layer 0
#     segment i:       moe part of layer i-1 (its top-k given); attention part of layer i
#     segment n_layer: moe part of the last layer;             output norm and head
#
#     attention part:  h = rms_norm(x) * attn_norm; q, k, v (+biases, Q/K norms, RoPE)
#                      K and V copied into the sequence's f16 cache at n_past
#                      attention over the cache (kernels/dense.py's graph); x = x + Wo attn (+bo)
#                      h = rms_norm(x) * ffn_norm; router probabilities; shared expert (gated)
#     moe part:        experts via mul_mat_id on the chosen ids, times the router weights,
#                      summed in top-k order; x = x + (moe + shared)
#
# Every op is the one the op-by-op path uses, so the bits are the same (the tests compare).


@dataclass(frozen=True)
class StepShape:
    """What fixes a step segment's graph besides the weights' types and shapes."""

    rows: int  # R: rows through the dense ops (a one-row step runs as two in deterministic mode)
    n_new: int  # L: the tokens this step stores (L == R, or 1 when R == 2 for one row)
    kv_size: int  # cells of the sequence's cache
    n_kv: int  # cells the attention sees (kernels.dense.n_kv_for)
    scale: float  # the attention's KQ scale
    n_expert_used: int
    glu: str  # the routed experts' activation
    shexp_gate: str  # silu_div or sigmoid (kernels.dense.shared_expert_gate)


def _attention_part(g: Graph, lib, x, pos, mask, keep, layer, shape: AttentionShape, step: StepShape, rps: dict):
    """Inputs of one layer's attention part, in binding order, and its ops; returns
    (x after attention, h, router probabilities, gated shared expert or None), of the rows
    ``keep`` (an I32 input, or None for all rows) after the output projection."""
    ctx, eps, R, L = g.ctx, float(shape.eps), step.rows, step.n_new
    H, Hkv, Dh = shape.n_head, shape.n_head_kv, shape.head_dim
    gqa, A = Hkv * Dh, max(R, 2)
    an = g.input(T.F32, (x_ne0 := layer.attn_q.ne[0],))
    ws = [weight_input(g, w, rps.get(id(w))) for w in (layer.attn_q, layer.attn_k, layer.attn_v)]
    bs = [g.input(T.F32, (w.ne[1],)) if b is not None else None
          for w, b in ((layer.attn_q, layer.attn_q_bias), (layer.attn_k, layer.attn_k_bias),
                       (layer.attn_v, layer.attn_v_bias))]
    qn = g.input(T.F32, (Dh,)) if layer.attn_q_norm is not None else None
    kn = g.input(T.F32, (Dh,)) if layer.attn_k_norm is not None else None
    kc = g.input(T.F16, (gqa, step.kv_size))  # the cache, as kernels/dense.py's attention reads it
    vc = g.input(T.F16, (step.kv_size, gqa))
    kd = g.input(T.F16, (gqa, L))  # where this step's keys go: cells n_past.. (bound per call)
    vd = g.input(T.F16, (gqa, L))  # and its values, transposed: element (c, j) at V[c, n_past + j]
    vd.contents.nb[0], vd.contents.nb[1] = 2 * step.kv_size, 2
    vd.contents.nb[2] = vd.contents.nb[3] = 2 * step.kv_size * gqa
    wo = weight_input(g, layer.attn_output, rps.get(id(layer.attn_output)))
    bo = g.input(T.F32, (layer.attn_output.ne[1],)) if layer.attn_output_bias is not None else None
    fn = g.input(T.F32, (x_ne0,))
    wr = weight_input(g, layer.ffn_gate_inp, None)
    br = g.input(T.F32, (layer.ffn_gate_inp.ne[1],)) if layer.ffn_gate_inp_bias is not None else None
    shexp = (layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp) \
        if layer.ffn_gate_shexp is not None else None
    sw = [weight_input(g, w, rps.get(id(w))) for w in shexp] if shexp else None
    sg = g.input(T.F32, (x_ne0, 1)) if layer.ffn_gate_inp_shexp is not None else None

    h, q, k, v = _qkv_heads(g, lib, x, an, ws, bs, qn, kn, shape, R)
    q = g.scratch(lib.ggml_rope_ext(ctx, q, pos, None, *shape.rope))  # (Dh, H, R)
    k = g.scratch(lib.ggml_rope_ext(ctx, k, pos, None, *shape.rope))
    # store this step's L keys and values (f32 -> f16, rounded as numpy's astype rounds)
    g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_view_2d(ctx, k, gqa, L, 4 * gqa, 0)), kd)))
    g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_view_2d(ctx, v, gqa, L, 4 * gqa, 0)), vd)))
    if A > R:  # one query row attends as two (kernels.dense.attention's min_rows)
        q = g.scratch(lib.ggml_repeat_4d(ctx, q, Dh, H, A, 1))
    f16 = lambda n: 2 * n  # noqa: E731  bytes of n f16 values
    qp = g.view(lib.ggml_permute(ctx, q, 0, 2, 1, 3))
    kv = g.view(lib.ggml_view_4d(ctx, kc, Dh, Hkv, step.n_kv, 1, f16(Dh), f16(gqa), f16(gqa * step.kv_size), 0))
    vv = g.view(lib.ggml_view_4d(ctx, vc, step.n_kv, Hkv, Dh, 1, f16(step.kv_size * Dh), f16(step.kv_size),
                                 f16(step.kv_size * gqa), 0))
    kv = g.view(lib.ggml_permute(ctx, kv, 0, 2, 1, 3))
    vv = g.view(lib.ggml_permute(ctx, vv, 0, 2, 1, 3))
    kq = g.scratch(lib.ggml_mul_mat(ctx, kv, qp))  # (n_kv, A, H)
    lib.ggml_prec_set_acc(kq, 10)  # GGML_PREC_F32
    kq = g.scratch(lib.ggml_soft_max_ext(ctx, kq, mask, float(step.scale), 0.0))
    kqv = g.scratch(lib.ggml_mul_mat(ctx, vv, kq))  # (Dh, A, H)
    cur = g.view(lib.ggml_permute(ctx, kqv, 0, 2, 1, 3))  # (Dh, H, A)
    attn = g.scratch(lib.ggml_cont_2d(ctx, cur, Dh * H, A))
    if A > R:
        attn = g.view(lib.ggml_view_2d(ctx, attn, Dh * H, R, 4 * Dh * H, 0))
    y = g.scratch(lib.ggml_mul_mat(ctx, wo, attn))
    if bo is not None:
        y = g.scratch(lib.ggml_add(ctx, y, bo))
    if keep is not None:  # the last layer: only the rows whose logits are wanted go on
        y, x = (g.scratch(lib.ggml_get_rows(ctx, t, keep)) for t in (y, x))
    x2 = g.scratch(lib.ggml_add(ctx, x, y))
    h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x2, eps)), fn))
    r = g.scratch(lib.ggml_mul_mat(ctx, wr, h))  # (E, R)
    if br is not None:
        r = g.scratch(lib.ggml_add(ctx, r, br))
    probs = lib.ggml_soft_max(ctx, r)
    shared = None
    if sw is not None:
        gate = g.scratch(lib.ggml_mul_mat(ctx, sw[0], h))
        up = g.scratch(lib.ggml_mul_mat(ctx, sw[1], h))
        shared = g.scratch(lib.ggml_mul_mat(ctx, sw[2], g.scratch(lib.ggml_swiglu_split(ctx, gate, up))))
        if sg is not None:
            gl = g.scratch(lib.ggml_mul_mat(ctx, sg, h))  # (1, R)
            if step.shexp_gate == "sigmoid":
                gl = g.scratch(lib.ggml_sigmoid(ctx, gl))
            else:
                gl = g.scratch(lib.ggml_div(ctx, g.scratch(lib.ggml_silu(ctx, gl)), gl))
            shared = g.scratch(lib.ggml_mul(ctx, shared, gl))
    return x2, h, probs, shared


def _moe_part(g: Graph, lib, x2, h, shared, layer, step: StepShape):
    """Inputs of one layer's MoE part (its experts' slabs, then ids (K, R) and weights (K, R)
    from the router's top-k) and its ops; returns x + (moe + shared)."""
    ctx, R, K = g.ctx, step.n_new, step.n_expert_used  # the experts see the step's real rows only
    gw, uw, dw = (g.input(w.ggml_type, w.ne) for w in (layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps))
    it = g.input(T.I32, (K, R))
    wt = g.input(T.F32, (1, K, R))
    n_embd = layer.ffn_gate_exps.ne[0]
    if R < step.rows:  # a one-row step run as two: its first row
        first = lambda t: g.view(lib.ggml_view_2d(ctx, t, n_embd, R, 4 * n_embd, 0))  # noqa: E731
        x2, h = first(x2), first(h)
        shared = None if shared is None else first(shared)
    xt = g.view(lib.ggml_reshape_3d(ctx, h, n_embd, 1, R))
    up = g.scratch(lib.ggml_mul_mat_id(ctx, uw, xt, it))  # (n_ff, K, R)
    gate = g.scratch(lib.ggml_mul_mat_id(ctx, gw, xt, it))
    if step.glu == "swiglu_oai":
        act = g.scratch(lib.ggml_swiglu_oai(ctx, gate, up, ggml.SWIGLU_OAI_ALPHA, ggml.SWIGLU_OAI_LIMIT))
    else:
        act = g.scratch(lib.ggml_swiglu_split(ctx, gate, up))
    ex = g.scratch(lib.ggml_mul_mat_id(ctx, dw, act, it))  # (n_embd, K, R)
    ex = g.scratch(lib.ggml_mul(ctx, ex, wt))  # kernels.ops.combine: times the weights ...
    nb1, nb2 = ex.contents.nb[1], ex.contents.nb[2]
    slot = lambda j: g.view(lib.ggml_view_2d(ctx, ex, n_embd, R, nb2, j * nb1))  # noqa: E731
    moe = slot(0)
    for j in range(1, K):  # ... then summed in top-k order
        moe = g.scratch(lib.ggml_add(ctx, moe, slot(j)))
    if shared is not None:
        moe = g.scratch(lib.ggml_add(ctx, moe, shared))
    return lib.ggml_add(ctx, x2, moe)


def _attention_arrays(layer, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, rps: dict) -> list:
    """The data of :func:`_attention_part`'s inputs, in its order."""
    gqa = k_cache.shape[1]
    out = [layer.attn_norm, *(weight_data(w, rps.get(id(w))) for w in (layer.attn_q, layer.attn_k, layer.attn_v))]
    out += [b for b in (layer.attn_q_bias, layer.attn_k_bias, layer.attn_v_bias) if b is not None]
    out += [n for n in (layer.attn_q_norm, layer.attn_k_norm) if n is not None]
    kp, vp = k_cache.__array_interface__["data"][0], v_cache.__array_interface__["data"][0]
    out += [k_cache, v_cache, kp + 2 * gqa * n_past, vp + 2 * n_past]
    out.append(weight_data(layer.attn_output, rps.get(id(layer.attn_output))))
    if layer.attn_output_bias is not None:
        out.append(layer.attn_output_bias)
    out += [layer.ffn_norm, layer.ffn_gate_inp.ptr]
    if layer.ffn_gate_inp_bias is not None:
        out.append(layer.ffn_gate_inp_bias)
    if layer.ffn_gate_shexp is not None:
        out += [weight_data(w, rps.get(id(w))) for w in (layer.ffn_gate_shexp, layer.ffn_up_shexp,
                                                         layer.ffn_down_shexp)]
    if layer.ffn_gate_inp_shexp is not None:
        out.append(layer.ffn_gate_inp_shexp)
    return out


def _layer_key(layer) -> tuple:
    """Which optional tensors a layer has, and its weights' types and shapes."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp",
             "ffn_down_shexp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    optional = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm", "attn_output_bias",
                "ffn_gate_inp_bias", "ffn_gate_inp_shexp")
    return (tuple(_key(getattr(layer, n)) for n in names), tuple(getattr(layer, n) is not None for n in optional))


@dataclass
class Segment:
    """What a segment returns: the residual after attention, the FFN input, the router's
    probabilities and the gated shared expert of its layer (attention part), or the logits."""

    x: np.ndarray | None = None
    h: np.ndarray | None = None
    probs: np.ndarray | None = None
    shared: np.ndarray | None = None
    logits: np.ndarray | None = None


def segment(step: StepShape, *, x: np.ndarray | None = None, prev: Segment | None = None, prev_layer=None,
            ids: np.ndarray | None = None, weights: np.ndarray | None = None, layer=None,
            shape: AttentionShape | None = None, cache: tuple[np.ndarray, np.ndarray] | None = None,
            n_past: int = 0, positions: np.ndarray | None = None, mask: np.ndarray | None = None,
            keep: np.ndarray | None = None, head: tuple | None = None) -> Segment:
    """One graph of a one-sequence step (see above): starting from the embedding rows ``x``
    (R, D), or from ``prev`` (the previous segment's outputs) with ``prev_layer``'s experts on
    ``ids`` (R, K) weighted by ``weights`` (R, K); then ``layer``'s attention part (its cache
    ``(K (kv_size, gqa), V (gqa, kv_size))`` f16, written at ``n_past``), or the ``head``:
    (output_norm (D,), output QTensor, out_idx (n,) int32 rows to return) -> logits (n, V).
    ``keep`` (n,): the layer's rows that go on after its output projection (the last layer's
    rows whose logits are wanted); its outputs then have n rows."""
    lib = ggml.load()
    R = step.rows
    keep = None if keep is None else np.ascontiguousarray(keep, dtype=np.int32)
    R_out = R if keep is None else len(keep)
    rps = {}
    for lay in (layer,) if layer is not None else ():
        for w in (lay.attn_q, lay.attn_k, lay.attn_v, lay.attn_output, lay.ffn_gate_shexp, lay.ffn_up_shexp,
                  lay.ffn_down_shexp):
            if w is not None:
                rps[id(w)] = repacked(w)
    has_shared = prev is not None and prev.shared is not None
    work = 0
    if prev_layer is not None:
        D, F, _ = prev_layer.ffn_gate_exps.ne
        work += 3 * R * step.n_expert_used * D * F
    if layer is not None:
        work += R * sum(w.ne[0] * w.ne[1] for w in (layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_output))
    if head is not None:
        work += len(head[2]) * head[1].ne[0] * head[1].ne[1]
    threads = threads_for(work, step.n_new)
    D = (layer or prev_layer).ffn_gate_exps.ne[0]

    def build() -> Graph:
        g = Graph(lib, n_tensors=160, nodes=256)
        try:
            if prev is None:
                xt = g.input(T.F32, (D, R))
            else:
                x2 = g.input(T.F32, (D, R))
                h = g.input(T.F32, (D, R))
                sh = g.input(T.F32, (D, R)) if has_shared else None
                xt = g.scratch(_moe_part(g, lib, x2, h, sh, prev_layer, step))
                if step.n_new < R and layer is not None:
                    xt = g.scratch(lib.ggml_repeat_4d(g.ctx, xt, D, R, 1, 1))
            if layer is not None:
                pt = g.input(T.I32, (R,))
                mt = g.input(T.F32, (step.n_kv, max(R, 2)))
                kt = g.input(T.I32, (R_out,)) if keep is not None else None
                x2, h, probs, shared = _attention_part(g, lib, xt, pt, mt, kt, layer, shape, step, rps)
                for t in (x2, h, probs) + ((shared,) if shared is not None else ()):
                    g.output(lib.ggml_cont_2d(g.ctx, t, t.contents.ne[0], R_out) if t is not probs else t)
            else:
                n_out = len(head[2])
                ot = g.input(T.I32, (n_out,))
                nt = g.input(T.F32, (D,))
                wt = weight_input(g, head[1], rp_head)
                rows = g.scratch(lib.ggml_get_rows(g.ctx, xt, ot))  # the rows whose logits are wanted
                out = g.scratch(lib.ggml_mul(g.ctx, g.scratch(lib.ggml_rms_norm(g.ctx, rows, float(shape_eps))), nt))
                g.output(lib.ggml_mul_mat(g.ctx, wt, out))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    shape_eps = head[3] if head is not None else 0.0
    rp_head = repacked(head[1]) if head is not None else None
    arrays: list = []
    if prev is None:
        arrays.append(x)
    else:
        arrays += [prev.x, prev.h] + ([prev.shared] if has_shared else [])
        arrays += [prev_layer.ffn_gate_exps.ptr, prev_layer.ffn_up_exps.ptr, prev_layer.ffn_down_exps.ptr,
                   np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(weights, dtype=np.float32)]
    result = Segment()
    if layer is not None:
        arrays += [np.ascontiguousarray(positions, dtype=np.int32), mask] + ([keep] if keep is not None else [])
        arrays += _attention_arrays(layer, cache[0], cache[1], n_past, rps)
        E = layer.ffn_gate_inp.ne[1]
        result = Segment(*(np.empty((R_out, n), np.float32) for n in (D, D, E)),
                         np.empty((R_out, D), np.float32) if layer.ffn_gate_shexp is not None else None)
        arrays += [result.x, result.h, result.probs] + ([result.shared] if result.shared is not None else [])
    else:
        out_idx = np.ascontiguousarray(head[2], dtype=np.int32)
        result = Segment(logits=np.empty((len(out_idx), head[1].ne[1]), np.float32))
        arrays += [out_idx, head[0], weight_data(head[1], rp_head), result.logits]
    key = ("segment", step, threads, prev is None, has_shared, None if keep is None else R_out,
           None if prev_layer is None else _layer_key(prev_layer),
           None if layer is None else (_layer_key(layer), shape, tuple(v is not None for v in rps.values())),
           None if head is None else (len(head[2]), _key(head[1]), float(head[3]), rp_head is not None))
    run_cached(key, build, arrays)
    return result
