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
    threads = threads_for(n * D * (H + 2 * Hkv) * Dh)
    rps = [repacked(w) for w in (wq, wk, wv)]

    def build() -> Graph:
        g = Graph(lib, n_tensors=40, nodes=NODES)
        try:
            ctx, eps = g.ctx, float(shape.eps)
            xt = g.input(T.F32, (D, n))
            nt = g.input(T.F32, (D,))
            pt = g.input(T.I32, (n,))
            ws = [weight_input(g, w, rp) for w, rp in zip((wq, wk, wv), rps)]
            bs = [g.input(T.F32, (w.ne[1],)) if b is not None else None for w, b in zip((wq, wk, wv), bias)]
            ns = [g.input(T.F32, (Dh,)) if v is not None else None for v in norms]
            h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, xt, eps)), nt))
            outs = []
            for w, b in zip(ws, bs):
                y = g.scratch(lib.ggml_mul_mat(ctx, w, h))
                outs.append(y if b is None else g.scratch(lib.ggml_add(ctx, y, b)))
            q, k, v = outs
            q = g.view(lib.ggml_reshape_3d(ctx, q, Dh, H, n))
            k = g.view(lib.ggml_reshape_3d(ctx, k, Dh, Hkv, n))
            if ns[0] is not None:
                q = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, q, eps)), ns[0]))
            if ns[1] is not None:
                k = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, k, eps)), ns[1]))
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
                  shexp_gate_kind: str = "silu_div") -> FfnIn:
    """Output projection (+bias) and residual, the FFN norm, the router (+bias, softmax) and the
    shared expert with its gate, as one graph. attn (T, H*Dh), x (T, D) float32."""
    attn = np.ascontiguousarray(attn, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, D = x.shape
    E = router.ne[1]
    if wo.ne != (attn.shape[1], D) or attn.shape[0] != n or router.ne[0] != D:
        raise ValueError(f"attention_out: attn {attn.shape}, x {x.shape}, Wo {wo.ne}, router {router.ne} do not fit")
    if shexp_gate_kind not in ("silu_div", "sigmoid"):
        raise ValueError(f"unknown shared-expert gate {shexp_gate_kind!r}")
    bo, router_bias, shexp_gate = _vec(bo), _vec(router_bias), _vec(shexp_gate)
    has = (bo is not None, router_bias is not None, shexp is not None, shexp_gate is not None)
    F = shexp[0].ne[1] if shexp is not None else 0
    lib = ggml.load()
    threads = threads_for(n * (wo.ne[0] * D + D * E + 3 * D * F))
    rp_o = repacked(wo)
    rp_s = [repacked(w) for w in shexp] if shexp is not None else []

    def build() -> Graph:
        g = Graph(lib, n_tensors=48, nodes=NODES)
        try:
            ctx = g.ctx
            at = g.input(T.F32, (wo.ne[0], n))
            xt = g.input(T.F32, (D, n))
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

    x_out, h_out = np.empty_like(x), np.empty_like(x)
    r_out = np.empty((n, E), dtype=np.float32)
    s_out = np.empty_like(x) if shexp is not None else None
    key = ("attn_out", n, float(eps), threads, _key(wo), _key(router), router_softmax, has, shexp_gate_kind,
           tuple(_key(w) for w in shexp) if shexp is not None else None, rp_o is not None,
           tuple(rp is not None for rp in rp_s))
    arrays = [attn, x, weight_data(wo, rp_o), *((bo,) if has[0] else ()), _vec(ffn_norm), router.data,
              *((router_bias,) if has[1] else ()), *(weight_data(w, rp) for w, rp in zip(shexp or (), rp_s)),
              *((shexp_gate,) if has[3] else ()), x_out, h_out, r_out, *((s_out,) if has[2] else ())]
    run_cached(key, build, arrays)
    return FfnIn(x_out, h_out, r_out, s_out)
