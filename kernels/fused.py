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
    attention_out:  x = x + Wo attn (+bo)        (only the rows ``keep``: the last layer's)
                    h = rms_norm(x) * ffn_norm
                    router = Wr h (+br), softmax'ed unless the router takes top-k of logits
                    ids, weights = top-k of the router (``_route``, llama.cpp's build_moe_ffn)
                    shared = down(silu(gate h) * up h) * shexp_gate(h)  # where the model has one
    -- the engine runs the experts (one graph, ``kernels.ggml.moe_ffn``, or remote), combines --

A step needs no Python between its layers at all: ``step_graph`` below runs it as one graph
(or a few), and split at the experts when they are remote; for a batch of several sequences
with each sequence's attention against its own cache inside the graph (``StepShape.streams``).
The two graphs above remain for what step graphs do not cover (``backbone.model.Engine.
_one_graph_per_step``). qwen35moe's and qwen3next's layers run in step graphs only: a gated
delta-net layer as ``_delta_net_part`` (its states updated in place), a gated attention layer
as ``_attention_part`` with the query gate and IMROPE (``AttentionShape.q_gate``, ``sections``).

Every op is the one the single-op kernels of ``kernels/dense.py`` and ``kernels/ggml.py`` use,
with the same shapes, so the results are those bits (the tests compare the two paths): rows
are independent in every op here, and the caller passes a one-row step as two rows in
deterministic mode, as :func:`kernels.ggml.matmul` does; the attention runs the step's rows as
they come (in the fast mode one query row alone: ggml's ``vec_dot``, as llama.cpp decodes a
token; :func:`kernels.dense.attention`'s ``min_rows``). A graph is built once per shape (rows,
weight types, which optional parts a layer has) and kept in the per-thread graph cache; a call
only rebinds the data pointers, the layer's weights included, so all layers share one graph.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from kernels import deltanet, ggml
from kernels.ggml import Graph, address, expert_repacked, repacked, run_cached, threads_for, weight_data, weight_input
from kernels.tensors import QTensor

NODES = 64  # graph size: attention_out with a shared expert and its gate has about 25 nodes


@dataclass(frozen=True)
class AttentionShape:
    """What fixes the attention projections' shapes besides the weights."""

    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope: tuple  # kernels.dense.rope_params(...): ggml_rope_ext's arguments after the positions
    # Gated attention (qwen35moe, qwen3next): attn_q yields per head Dh query values, then Dh
    # gate values; the attention's output is multiplied by sigmoid(gate) before attn_output.
    q_gate: bool = False
    # IMROPE (qwen35moe): ggml_rope_multi with these 4 section sizes and ``rope``'s arguments,
    # on positions (pos, pos, pos, 0) per row; empty: ggml_rope_ext.
    sections: tuple = ()


@dataclass(frozen=True)
class DeltaNetShape:
    """What fixes a gated delta-net layer's shapes besides the weights (``kernels/deltanet.py``):
    Q/K heads, V heads, head size S, conv width W, the RMS eps; ``ba``: qwen3next's one ssm_ba
    projection (beta and alpha interleaved per Q/K head) and its Q/K heads repeated interleaved."""

    k_heads: int
    v_heads: int
    head_dim: int
    conv_kernel: int
    eps: float
    ba: bool = False

    @property
    def channels(self) -> int:
        """C: the conv's channels, Q, K and V of every head."""
        return (2 * self.k_heads + self.v_heads) * self.head_dim


def _key(w: QTensor | None) -> tuple | None:
    return None if w is None else (int(w.ggml_type), w.ne)


def _vec(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


def _qkv_heads(g: Graph, lib, x, norm, ws, bs, q_norm, k_norm, shape: AttentionShape, rows: int):
    """The ops both attention builders start with: h = rms_norm(x) * norm, Q/K/V = W h (+ bias),
    Q and K as (Dh, heads, rows) with their per-head RMS norms when the model has them.
    Returns (h, q, k, v, gate); v stays (Hkv*Dh, rows); gate (H*Dh, rows) where the shape has a
    query gate (``AttentionShape.q_gate``: llama.cpp's views of Qcur_full, the gate made
    contiguous), else None."""
    ctx, eps = g.ctx, float(shape.eps)
    h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x, eps)), norm))
    outs = []
    for w, b in zip(ws, bs):
        y = g.scratch(lib.ggml_mul_mat(ctx, w, h))
        outs.append(y if b is None else g.scratch(lib.ggml_add(ctx, y, b)))
    q, k, v = outs
    Dh, H = shape.head_dim, shape.n_head
    gate = None
    if shape.q_gate:  # per head Dh query values, then Dh gate values
        f4 = 4  # bytes per float
        gate = g.view(lib.ggml_view_3d(ctx, q, Dh, H, rows, 2 * Dh * f4, 2 * Dh * H * f4, Dh * f4))
        gate = g.scratch(lib.ggml_cont_2d(ctx, gate, Dh * H, rows))
        q = g.view(lib.ggml_view_3d(ctx, q, Dh, H, rows, 2 * Dh * f4, 2 * Dh * H * f4, 0))
    else:
        q = g.view(lib.ggml_reshape_3d(ctx, q, Dh, H, rows))
    k = g.view(lib.ggml_reshape_3d(ctx, k, shape.head_dim, shape.n_head_kv, rows))
    if q_norm is not None:
        q = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, q, eps)), q_norm))
    if k_norm is not None:
        k = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, k, eps)), k_norm))
    return h, q, k, v, gate


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
            _, q, k, v, _ = _qkv_heads(g, lib, xt, nt, ws, bs, ns[0], ns[1], shape, n)
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
    """What attention_out computes after the residual: the FFN input and the router's choice."""

    x: np.ndarray  # (T, D) the residual stream after attention
    h: np.ndarray  # (T, D) rms_norm(x) * ffn_norm
    ids: np.ndarray  # (T, K) int32 the experts chosen, in top-k order
    weights: np.ndarray  # (T, K) float32 their weights
    shared: np.ndarray | None  # (T, D) the gated shared expert, or None


def attention_out(attn: np.ndarray, x: np.ndarray, *, eps: float, wo: QTensor, bo=None,
                  ffn_norm: np.ndarray, router: QTensor, router_bias=None, router_softmax: bool = True,
                  n_expert_used: int, norm_topk: bool,
                  shexp: tuple[QTensor, QTensor, QTensor] | None = None, shexp_gate=None,
                  shexp_gate_kind: str = "silu_div", keep: np.ndarray | None = None) -> FfnIn:
    """Output projection (+bias) and residual, the FFN norm, the router (+bias, softmax) and
    its top-k (``_route``; ``router_softmax`` false: top-k of the logits, then a softmax over
    the k), the shared expert with its gate, as one graph. attn (T, H*Dh), x (T, D) float32. ``keep``
    (n,): after the output projection, only these rows go on (llama.cpp's ``inp_out_ids`` on
    the last layer), so every result has n rows."""
    attn = np.ascontiguousarray(attn, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    T_in, D = x.shape
    keep = None if keep is None else np.ascontiguousarray(keep, dtype=np.int32)
    n = T_in if keep is None else len(keep)
    E, K = router.ne[1], int(n_expert_used)
    if wo.ne != (attn.shape[1], D) or attn.shape[0] != T_in or router.ne[0] != D:
        raise ValueError(f"attention_out: attn {attn.shape}, x {x.shape}, Wo {wo.ne}, router {router.ne} do not fit")
    if shexp_gate_kind not in ("silu_div", "sigmoid"):
        raise ValueError(f"unknown shared-expert gate {shexp_gate_kind!r}")
    bo, router_bias, shexp_gate = _vec(bo), _vec(router_bias), _vec(shexp_gate)
    has = (bo is not None, router_bias is not None, shexp is not None, shexp_gate is not None)
    F = shexp[0].ne[1] if shexp is not None else 0
    lib = ggml.load()
    if not 0 < K <= E:
        raise ValueError(f"attention_out: {K} experts used of {E}")
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
            ids, weights = _route(g, lib, g.scratch(r), K, norm_topk and router_softmax, not router_softmax)
            g.output(lib.ggml_cont(ctx, ids))
            g.output(lib.ggml_cont(ctx, weights))
            if sw is not None:
                g.output(lib.ggml_cont(ctx, _shared_expert(g, lib, h, sw, sgt, shexp_gate_kind)))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    x_out, h_out = np.empty((n, D), np.float32), np.empty((n, D), np.float32)
    ids_out, w_out = np.empty((n, K), np.int32), np.empty((n, K), np.float32)
    s_out = np.empty((n, D), np.float32) if shexp is not None else None
    key = ("attn_out", T_in, n if keep is not None else None, float(eps), threads, _key(wo), _key(router),
           router_softmax, K, norm_topk, has, shexp_gate_kind,
           tuple(_key(w) for w in shexp) if shexp is not None else None, rp_o is not None,
           tuple(rp is not None for rp in rp_s))
    arrays = [attn, x, *((keep,) if keep is not None else ()), weight_data(wo, rp_o), *((bo,) if has[0] else ()),
              _vec(ffn_norm), router.data, *((router_bias,) if has[1] else ()),
              *(weight_data(w, rp) for w, rp in zip(shexp or (), rp_s)), *((shexp_gate,) if has[3] else ()),
              x_out, h_out, ids_out, w_out, *((s_out,) if has[2] else ())]
    run_cached(key, build, arrays)
    return FfnIn(x_out, h_out, ids_out, w_out, s_out)


# --- a step: every layer, routing included, in as few graphs as memory allows -------------
#
# When every routed expert is local, nothing needs Python between the embedding and the
# logits: the router's top-k runs in the graph as llama.cpp's
# build_moe_ffn builds it (``_route``). A decode step is one graph; a longer chunk runs a few
# layers per graph, so that each graph's intermediates stay small enough to be kept and reused
# (``kernels.ggml.GraphCache``); one graph serves every group of layers with the same shapes.
#
#     x = embedding rows (get_rows of the token ids)
#     for each layer:
#         attention part:  h = rms_norm(x) * attn_norm; q, k, v (+biases, Q/K norms, RoPE)
#                          K and V copied into the sequence's f16 cache at n_past
#                          attention over the cache (kernels/dense.py's graph); x = x + Wo attn (+bo)
#                          (several sequences: per sequence, its rows' K and V into its cache,
#                           its queries against it, its outputs copied to its rows; then one Wo)
#                          (last layer: only the rows whose logits are wanted go on)
#                          h = rms_norm(x) * ffn_norm; router probabilities; shared expert (gated)
#         routing:         ids = top-k of the probabilities; weights = their probabilities,
#                          divided by their sum where the model renormalises (``_route``)
#         moe part:        experts via mul_mat_id on the ids, times the weights, summed in top-k
#                          order; x = x + (moe + shared)
#     logits = output(rms_norm(x) * output_norm), of the rows asked for
#
# With remote experts (``remote=True``) a graph ends at a layer's routing; the engine publishes
# the rows, runs the shared expert as a graph of its own (``shared_expert``) while the replies
# travel, and the next graph starts with that layer's moe part from the replies and the
# shared expert (``prev``), then goes on with the next layer's attention part.
#
# Every op is the one the op-by-op path uses, so the bits are the same (the tests compare).

SORT_DESC = 1  # GGML_SORT_ORDER_DESC
F16_MIN_NORMAL = 6.103515625e-5  # llama.cpp clamps the top-k weight sum here (kernels.ops.route)


def _route(g: Graph, lib, r, k: int, norm: bool, softmax_weight: bool = False):
    """The router's top-k as llama.cpp's build_moe_ffn builds it, on ``r`` (E, R): the
    probabilities after the softmax, or the logits for a softmax_weight router. Returns the
    ids (K, R) I32, a view of the argsort (in descending order, llama.cpp's own sort, so ties
    fall as in llama.cpp), and the weights (1, K, R): the chosen entries of ``r``, softmaxed
    over the k for softmax_weight, divided by their sum clamped below where ``norm``."""
    ctx = g.ctx
    E, R = r.contents.ne[0], r.contents.ne[1]
    order = g.scratch(lib.ggml_argsort(ctx, r, SORT_DESC))  # (E, R)
    ids = g.view(lib.ggml_view_2d(ctx, order, k, R, order.contents.nb[1], 0))  # ggml_argsort_top_k
    w = g.scratch(lib.ggml_get_rows(ctx, g.view(lib.ggml_reshape_3d(ctx, r, 1, E, R)), ids))  # (1, K, R)
    if softmax_weight:
        w = g.scratch(lib.ggml_soft_max(ctx, g.view(lib.ggml_reshape_2d(ctx, w, k, R))))
    if norm:
        w = g.view(lib.ggml_reshape_2d(ctx, w, k, R))
        total = g.scratch(lib.ggml_clamp(ctx, g.scratch(lib.ggml_sum_rows(ctx, w)), F16_MIN_NORMAL, float("inf")))
        w = g.scratch(lib.ggml_div(ctx, w, total))  # (K, R)
    return ids, g.view(lib.ggml_reshape_3d(ctx, w, 1, k, R))


@dataclass(frozen=True)
class StepShape:
    """What fixes a step's graphs besides the weights' types and shapes."""

    rows: int  # R: rows through the dense ops (a one-row step runs as two in deterministic mode)
    n_new: int  # L: the tokens this step stores (L == R, or 1 when R == 2 for one row)
    kv_size: int  # cells of the sequence's cache
    n_kv: int  # cells the attention sees (kernels.dense.n_kv_for)
    scale: float  # the attention's KQ scale
    n_expert_used: int
    glu: str  # the routed experts' activation
    shexp_gate: str  # silu_div or sigmoid (kernels.dense.shared_expert_gate)
    norm_topk: bool  # whether the top-k weights are divided by their sum
    # Several sequences (one graph for the step of a whole batch): each one's rows, cache and
    # attention; then kv_size and n_kv above are unused (0) and rows == n_new (never one row
    # as two: a batch has two rows at least). Empty: one sequence, as above.
    streams: tuple["Stream", ...] = ()
    # Decode streams whose caches sit side by side in one block (``backbone.kvslots``): each
    # group's attention runs once for all of them (``_attend_group``); ``Stream.group`` says which.
    groups: tuple["KvGroup", ...] = ()


@dataclass(frozen=True)
class Stream:
    """One sequence of a multi-sequence step: rows ``start..start+n_new`` of the step, its KV
    cache of ``kv_size`` cells of which the attention sees ``n_kv`` (``kernels.dense.n_kv_for``),
    and the query rows its attention runs on: ``n_new``, or 2 for one token in deterministic
    mode (the token's row twice: ``kernels.dense.attention``'s ``min_rows``). Its attention is
    the graph :func:`kernels.dense.attention` builds for it alone, so the same bits."""

    start: int
    n_new: int
    rows: int
    kv_size: int
    n_kv: int
    group: int = -1  # its KvGroup in StepShape.groups, or -1: attention of its own


@dataclass(frozen=True)
class KvGroup:
    """Decode streams (one token each) whose caches are slots of one block of ``cells``-cell
    caches (``backbone.kvslots``): ``members`` of them in the ``span`` slots from the first one's
    to the last's (the slots between belong to other sequences: their queries are computed and
    dropped). Their attention is one set of ops over the block's 4-D view: each member's
    queries (``rows``: 1, or its token's row twice in deterministic mode) against ``n_kv`` of
    its own cells, its mask hiding the rest, so each gets the bits it gets alone (``n_kv``
    padded past a multiple of 64 adds exact zeros in the same SIMD lanes: ``kernels.dense``)."""

    cells: int
    span: int
    n_kv: int
    rows: int
    members: int


@dataclass
class GroupInputs:
    """What a :class:`KvGroup`'s ops read besides the caches, bound per call (every layer reads
    the same): ``qidx`` (span*rows,) int32, the step's query row of each slot's rows (a slot
    without a member: any row, its output dropped); ``sel`` (members,) int32, each member's row
    of the step; ``kidx`` (members,) int64, each member's new K cell among the span's
    cells*span; ``vidx`` (members*gqa,) int64, each member's new V elements among the span's
    gqa*cells*span (unread with flash attention: V is stored at kidx, as K); ``mask`` (span,
    rows, n_kv) float32 (float16 with flash attention); ``pick`` (members,) int32, each
    member's first row in the group's output; ``dst`` (members,) int64, its row of the step's
    attention output."""

    qidx: np.ndarray
    sel: np.ndarray
    kidx: np.ndarray
    vidx: np.ndarray
    mask: np.ndarray
    pick: np.ndarray
    dst: np.ndarray
    checked: tuple | None = None  # the (rows, gqa, group) step_graph checked the indices for

    def arrays(self) -> list:
        return [self.qidx, self.sel, self.kidx, self.vidx, self.mask, self.pick, self.dst]


def _ffn_input(g: Graph, lib, x, y, keep, eps: float, fn, wr, br, sw, sg, step: StepShape) -> tuple:
    """What follows every mixer (attention or delta-net) of a layer: the residual, the FFN norm,
    the router's probabilities and the shared expert. ``y``: the mixer's output projection;
    ``keep``: on the last layer, the rows whose logits are wanted. Returns (x2, h, probs, shared)."""
    ctx = g.ctx
    if keep is not None:  # the last layer: only the rows whose logits are wanted go on
        y, x = (g.scratch(lib.ggml_get_rows(ctx, t, keep)) for t in (y, x))
    x2 = g.scratch(lib.ggml_add(ctx, x, y))
    h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x2, eps)), fn))
    r = g.scratch(lib.ggml_mul_mat(ctx, wr, h))  # (E, R)
    if br is not None:
        r = g.scratch(lib.ggml_add(ctx, r, br))
    probs = g.scratch(lib.ggml_soft_max(ctx, r))
    shared = _shared_expert(g, lib, h, sw, sg, step.shexp_gate) if sw is not None else None
    return x2, h, probs, shared


def _attention_part(g: Graph, lib, x, pos, mask, keep, layer, shape: AttentionShape, step: StepShape, rps: dict,
                    with_shared: bool = True, pos4=None, group_in=()):
    """Inputs of one layer's attention part, in binding order, and its ops; returns
    (x after attention, h, router probabilities, gated shared expert or None), of the rows
    ``keep`` (an I32 input, or None for all rows) after the output projection.
    ``with_shared`` false: without the shared expert (a remote layer's: :func:`shared_expert`).
    ``pos4``: the (4R,) I32 positions of IMROPE (``AttentionShape.sections``). ``group_in``:
    per ``step.groups`` its :class:`GroupInputs`' tensors (made once per graph)."""
    ctx, eps, R, L = g.ctx, float(shape.eps), step.rows, step.n_new
    H, Hkv, Dh = shape.n_head, shape.n_head_kv, shape.head_dim
    gqa = Hkv * Dh
    an = g.input(T.F32, (x_ne0 := layer.attn_q.ne[0],))
    ws = [weight_input(g, w, rps.get(id(w))) for w in (layer.attn_q, layer.attn_k, layer.attn_v)]
    bs = [g.input(T.F32, (w.ne[1],)) if b is not None else None
          for w, b in ((layer.attn_q, layer.attn_q_bias), (layer.attn_k, layer.attn_k_bias),
                       (layer.attn_v, layer.attn_v_bias))]
    qn = g.input(T.F32, (Dh,)) if layer.attn_q_norm is not None else None
    kn = g.input(T.F32, (Dh,)) if layer.attn_k_norm is not None else None
    if step.streams:  # each sequence's cache inputs, in its order; then each group's span
        caches = [_cache_inputs(g, gqa, s.kv_size, s.n_new) if s.group < 0 else None for s in step.streams]
        spans = [(g.input(T.F16, (gqa, gr.cells, gr.span)),
                  g.input(T.F16, (gqa, gr.cells, gr.span) if _flash(lib) else (gr.cells, gqa, gr.span)))
                 for gr in step.groups]
    else:
        kc, vc, kd, vd = _cache_inputs(g, gqa, step.kv_size, L)
    wo = weight_input(g, layer.attn_output, rps.get(id(layer.attn_output)))
    bo = g.input(T.F32, (layer.attn_output.ne[1],)) if layer.attn_output_bias is not None else None
    fn = g.input(T.F32, (x_ne0,))
    wr = weight_input(g, layer.ffn_gate_inp, None)
    br = g.input(T.F32, (layer.ffn_gate_inp.ne[1],)) if layer.ffn_gate_inp_bias is not None else None
    sw, sg = _shared_inputs(g, layer, rps) if with_shared else (None, None)

    h, q, k, v, gate = _qkv_heads(g, lib, x, an, ws, bs, qn, kn, shape, R)
    if shape.sections:  # IMROPE, as deltanet.rope_multi_qk (text positions: pos, pos, pos, 0)
        secs = (ctypes.c_int * 4)(*shape.sections)
        g.keep.append(secs)  # ggml copies them into op_params; kept anyway
        n_rot, mode, *rest = shape.rope
        q = g.scratch(lib.ggml_rope_multi(ctx, q, pos4, None, n_rot, secs, mode, *rest))  # (Dh, H, R)
        k = g.scratch(lib.ggml_rope_multi(ctx, k, pos4, None, n_rot, secs, mode, *rest))
    else:
        q = g.scratch(lib.ggml_rope_ext(ctx, q, pos, None, *shape.rope))  # (Dh, H, R)
        k = g.scratch(lib.ggml_rope_ext(ctx, k, pos, None, *shape.rope))
    if step.streams:
        attn = _attend_streams(g, lib, q, k, v, caches, mask, shape, step)
        for gr, (ks, vs), gin in zip(step.groups, spans, group_in):
            _attend_group(g, lib, q, k, v, attn, gr, gin, ks, vs, shape, step.scale)
    else:
        # store this step's L keys and values (f32 -> f16, rounded as numpy's astype rounds)
        _store(g, lib, k, v, kd, vd, gqa, 0, L)
        cur = _attend(g, lib, q, kc, vc, mask, shape, step.kv_size, step.n_kv, step.scale)  # (Dh, H, R)
        attn = g.view(lib.ggml_reshape_2d(ctx, cur, Dh * H, R)) if _flash(lib) \
            else g.scratch(lib.ggml_cont_2d(ctx, cur, Dh * H, R))
    if gate is not None:  # the gated attention's output: times sigmoid(gate) (deltanet.sigmoid_gate)
        attn = g.scratch(lib.ggml_mul(ctx, attn, g.scratch(lib.ggml_sigmoid(ctx, gate))))
    y = g.scratch(lib.ggml_mul_mat(ctx, wo, attn))
    if bo is not None:
        y = g.scratch(lib.ggml_add(ctx, y, bo))
    return _ffn_input(g, lib, x, y, keep, eps, fn, wr, br, sw, sg, step)


def _delta_net_part(g: Graph, lib, x, keep, layer, shape: DeltaNetShape, step: StepShape, rps: dict,
                    with_shared: bool = True):
    """Inputs of one gated delta-net layer's part, in binding order (``_delta_net_arrays``), and
    its ops, as llama.cpp's ``build_layer_attn_linear`` builds them and the op-by-op path
    (``kernels.deltanet.delta_net`` between the projections) computes them; returns what
    :func:`_attention_part` returns. The input projections run on all R rows; each sequence's
    chunk (its rows of the step, or the step's first ``n_new`` rows: one row run as two) goes
    through the conv and the fused recurrence against its own conv and recurrent state, which
    the graph updates in place: the conv input is the state then the chunk's qkv (copies into a
    buffer), its last W-1 columns are copied back into the conv state, the op's new state into
    the recurrent state, each after it has been read."""
    ctx, eps, R = g.ctx, float(shape.eps), step.rows
    Hk, Hv, S, W, C = shape.k_heads, shape.v_heads, shape.head_dim, shape.conv_kernel, shape.channels
    D = layer.attn_qkv.ne[0]
    f4 = 4  # bytes per float
    an = g.input(T.F32, (D,))
    mix = [weight_input(g, w, rps.get(id(w))) for w in _delta_net_projections(layer)]
    seqs = step.streams or (Stream(0, step.n_new, step.n_new, 0, 0),)
    states = [(g.input(T.F32, (W - 1, C)), g.input(T.F32, (S, S, Hv))) for _ in seqs]
    cw = g.input(T.F32, (W, C))
    dt = g.input(T.F32, (Hv,))
    aw = g.input(T.F32, (Hv,))
    nw = g.input(T.F32, (S,))
    wo = weight_input(g, layer.ssm_out, rps.get(id(layer.ssm_out)))
    fn = g.input(T.F32, (D,))
    wr = weight_input(g, layer.ffn_gate_inp, None)
    br = g.input(T.F32, (layer.ffn_gate_inp.ne[1],)) if layer.ffn_gate_inp_bias is not None else None
    sw, sg = _shared_inputs(g, layer, rps) if with_shared else (None, None)

    h = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, x, eps)), an))
    qkv = g.scratch(lib.ggml_mul_mat(ctx, mix[0], h))  # (C, R)
    z = g.scratch(lib.ggml_mul_mat(ctx, mix[1], h))  # (Hv*S, R)
    if shape.ba:  # qwen3next: per Q/K head [beta x r, alpha x r], split by copies
        r = Hv // Hk
        ba = g.scratch(lib.ggml_mul_mat(ctx, mix[2], h))  # (2*Hv, R)
        beta, alpha = (g.scratch(lib.ggml_cont_2d(ctx, g.view(lib.ggml_view_3d(
            ctx, ba, r, Hk, R, 2 * r * f4, 2 * Hv * f4, j * r * f4)), Hv, R)) for j in (0, 1))
    else:
        beta = g.scratch(lib.ggml_mul_mat(ctx, mix[2], h))  # (Hv, R)
        alpha = g.scratch(lib.ggml_mul_mat(ctx, mix[3], h))

    def cols(t, a: int, n: int):  # columns a..a+n of a (rows_of_t, R) tensor: contiguous
        nb1 = t.contents.nb[1]
        return g.view(lib.ggml_view_2d(ctx, t, t.contents.ne[0], n, nb1, a * nb1))

    ys = []
    for s, (cs, st) in zip(seqs, states):
        a, n = s.start, s.n_new
        conv_in = g.buffer(T.F32, (W - 1 + n, C))  # [conv state | the chunk's qkv transposed]
        nb = conv_in.contents.nb[1]
        g.expand(g.view(lib.ggml_cpy(ctx, cs, g.view(lib.ggml_view_2d(ctx, conv_in, W - 1, C, nb, 0)))))
        g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_permute(ctx, cols(qkv, a, n), 1, 0, 2, 3)),
                                     g.view(lib.ggml_view_2d(ctx, conv_in, n, C, nb, (W - 1) * f4)))))
        # the next conv state: the last W-1 inputs (written after both copies above read it)
        g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_view_2d(ctx, conv_in, W - 1, C, nb, n * f4)), cs)))
        xin = g.view(lib.ggml_reshape_3d(ctx, conv_in, W - 1 + n, C, 1))
        y = deltanet.core(g, lib, xin, cw, cols(z, a, n), cols(beta, a, n), cols(alpha, a, n), st, dt, aw, nw,
                           L=n, C=C, Hv=Hv, S=S, k_heads=Hk, eps=eps, interleave=shape.ba, in_place=True)
        ys.append(g.scratch(y))  # (S, Hv, n)
    if step.streams:  # each sequence's outputs to its rows
        y = g.buffer(T.F32, (Hv * S, R))
        for s, ys_ in zip(seqs, ys):
            g.expand(g.view(lib.ggml_cpy(ctx, ys_, cols(y, s.start, s.n_new))))
    else:
        y = g.view(lib.ggml_reshape_2d(ctx, ys[0], Hv * S, step.n_new))
        if R > step.n_new:  # one row as two: the output projection runs on the row twice
            y = g.scratch(lib.ggml_repeat_4d(ctx, y, Hv * S, R, 1, 1))
    y = g.scratch(lib.ggml_mul_mat(ctx, wo, y))  # (D, R)
    return _ffn_input(g, lib, x, y, keep, eps, fn, wr, br, sw, sg, step)


def _delta_net_projections(layer) -> tuple:
    """A delta-net layer's input projections, in graph input order: qkv, z (attn_gate), then
    beta and alpha, or qwen3next's one ssm_ba."""
    if layer.ssm_ba is not None:
        return layer.attn_qkv, layer.attn_gate, layer.ssm_ba
    return layer.attn_qkv, layer.attn_gate, layer.ssm_beta, layer.ssm_alpha


def _delta_net_arrays(layer, rps: dict, with_shared: bool = True) -> tuple[list, list]:
    """The data of :func:`_delta_net_part`'s inputs, in its order, but for each sequence's two
    states (bound per call, between the two lists): those before them, and those after."""
    pre = [layer.attn_norm, *(weight_data(w, rps.get(id(w))) for w in _delta_net_projections(layer))]
    post = [layer.ssm_conv1d, layer.ssm_dt, layer.ssm_a, layer.ssm_norm,
            weight_data(layer.ssm_out, rps.get(id(layer.ssm_out))), layer.ffn_norm, layer.ffn_gate_inp.ptr]
    if layer.ffn_gate_inp_bias is not None:
        post.append(layer.ffn_gate_inp_bias)
    if with_shared:
        post += _shared_arrays(layer, rps)
    for a in post[:4]:  # bound by address: they must be what ggml reads
        if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous):
            raise ValueError("delta-net conv, dt, a and norm weights must be C-contiguous float32")
    return pre, post


def _flash(lib) -> bool:
    """Whether attention is flash attention (``kernels.dense.flash_attn``; fixed as ggml loads)."""
    return getattr(lib, "flash_attn", False)


def _cache_inputs(g: Graph, gqa: int, kv_size: int, n_new: int):
    """A sequence's four cache inputs, in binding order (``_cache_arrays``): its K (gqa,
    kv_size) and V (kv_size, gqa) f16 caches, as kernels/dense.py's attention reads them (V
    as K with flash attention), and where this step's ``n_new`` keys and values go (cells
    n_past.., bound per call)."""
    flash = _flash(g.lib)
    kc = g.input(T.F16, (gqa, kv_size))
    vc = g.input(T.F16, (gqa, kv_size) if flash else (kv_size, gqa))
    kd = g.input(T.F16, (gqa, n_new))  # keys: n_new rows of the K cache from cell n_past
    vd = g.input(T.F16, (gqa, n_new))  # values: the same with flash attention, else transposed:
    if not flash:  # element (c, j) at V[c, n_past + j]
        vd.contents.nb[0], vd.contents.nb[1] = 2 * kv_size, 2
        vd.contents.nb[2] = vd.contents.nb[3] = 2 * kv_size * gqa
    return kc, vc, kd, vd


def _store(g: Graph, lib, k, v, kd, vd, gqa: int, start: int, n: int) -> None:
    """Copy rows ``start..start+n`` of the step's keys k (Dh, Hkv, R) and values v (gqa, R)
    into a cache's places kd, vd (f32 -> f16, rounded as numpy's astype rounds)."""
    ctx = g.ctx
    g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_view_2d(ctx, k, gqa, n, 4 * gqa, 4 * gqa * start)), kd)))
    g.expand(g.view(lib.ggml_cpy(ctx, g.view(lib.ggml_view_2d(ctx, v, gqa, n, 4 * gqa, 4 * gqa * start)), vd)))


def _attend(g: Graph, lib, q, kc, vc, mask, shape: AttentionShape, kv_size: int, n_kv: int, scale: float):
    """``build_attn_mha`` of queries q (Dh, H, rows) against one cache (``kernels.dense.
    _build_attention``'s ops and views): the heads' outputs as a view (Dh, H, rows)."""
    ctx, Hkv, Dh = g.ctx, shape.n_head_kv, shape.head_dim
    gqa = Hkv * Dh
    f16 = lambda n: 2 * n  # noqa: E731  bytes of n f16 values
    qp = g.view(lib.ggml_permute(ctx, q, 0, 2, 1, 3))
    kv = g.view(lib.ggml_view_4d(ctx, kc, Dh, Hkv, n_kv, 1, f16(Dh), f16(gqa), f16(gqa * kv_size), 0))
    if _flash(lib):  # kernels.dense._build_attention's flash op: the result is contiguous
        vv = g.view(lib.ggml_view_4d(ctx, vc, Dh, Hkv, n_kv, 1, f16(Dh), f16(gqa), f16(gqa * kv_size), 0))
        kv = g.view(lib.ggml_permute(ctx, kv, 0, 2, 1, 3))
        vv = g.view(lib.ggml_permute(ctx, vv, 0, 2, 1, 3))
        cur = g.scratch(lib.ggml_flash_attn_ext(ctx, qp, kv, vv, mask, float(scale), 0.0, 0.0))
        lib.ggml_prec_set_acc(cur, 10)  # GGML_PREC_F32
        return cur  # (Dh, H, rows)
    vv = g.view(lib.ggml_view_4d(ctx, vc, n_kv, Hkv, Dh, 1, f16(kv_size * Dh), f16(kv_size),
                                 f16(kv_size * gqa), 0))
    kv = g.view(lib.ggml_permute(ctx, kv, 0, 2, 1, 3))
    vv = g.view(lib.ggml_permute(ctx, vv, 0, 2, 1, 3))
    kq = g.scratch(lib.ggml_mul_mat(ctx, kv, qp))  # (n_kv, rows, H)
    lib.ggml_prec_set_acc(kq, 10)  # GGML_PREC_F32
    kq = g.scratch(lib.ggml_soft_max_ext(ctx, kq, mask, float(scale), 0.0))
    kqv = g.scratch(lib.ggml_mul_mat(ctx, vv, kq))  # (Dh, rows, H)
    return g.view(lib.ggml_permute(ctx, kqv, 0, 2, 1, 3))  # (Dh, H, rows)


def _attend_streams(g: Graph, lib, q, k, v, caches, masks, shape: AttentionShape, step: StepShape):
    """Every sequence's attention of a multi-sequence step, each against its own cache: its
    rows' keys and values stored, its queries (its token's row twice where ``Stream.rows`` says)
    through :func:`_attend`, its outputs copied to its rows of one (H*Dh, R) tensor, which is
    returned. The ops of ``kernels.dense.attention`` on that sequence alone, so its bits."""
    ctx, H, Dh = g.ctx, shape.n_head, shape.head_dim
    gqa = shape.n_head_kv * Dh
    attn = g.buffer(T.F32, (H * Dh, step.rows))
    qn, an = q.contents.nb, attn.contents.nb[1]
    for s, cache, mask in zip(step.streams, caches, masks):
        if cache is None:  # in a group (_attend_group)
            continue
        kc, vc, kd, vd = cache
        _store(g, lib, k, v, kd, vd, gqa, s.start, s.n_new)
        qs = g.view(lib.ggml_view_3d(ctx, q, Dh, H, s.n_new, qn[1], qn[2], qn[2] * s.start))
        if s.rows > s.n_new:  # one token's row twice (only a one-token chunk is padded)
            qs = g.scratch(lib.ggml_repeat_4d(ctx, qs, Dh, H, s.rows, 1))
        cur = _attend(g, lib, qs, kc, vc, mask, shape, s.kv_size, s.n_kv, step.scale)  # (Dh, H, rows)
        if s.rows > s.n_new:
            cn = cur.contents.nb
            cur = g.view(lib.ggml_view_3d(ctx, cur, Dh, H, s.n_new, cn[1], cn[2], 0))
        dst = g.view(lib.ggml_view_2d(ctx, attn, H * Dh, s.n_new, an, an * s.start))
        g.expand(g.view(lib.ggml_cpy(ctx, cur, dst)))  # a copy, as cont_2d's
    return attn


def _group_inputs(g: Graph, gr: KvGroup, gqa: int) -> tuple:
    """A group's :class:`GroupInputs` as graph inputs, in their binding order."""
    return (g.input(T.I32, (gr.span * gr.rows,)), g.input(T.I32, (gr.members,)), g.input(T.I64, (gr.members,)),
            g.input(T.I64, (gr.members * gqa,)),
            g.input(T.F16 if _flash(g.lib) else T.F32, (gr.n_kv, gr.rows, gr.span)),
            g.input(T.I32, (gr.members,)), g.input(T.I64, (gr.members,)))


def _attend_group(g: Graph, lib, q, k, v, attn, gr: KvGroup, gin: tuple, ks, vs, shape: AttentionShape,
                  scale: float) -> None:
    """A :class:`KvGroup`'s attention, into its members' rows of ``attn`` (H*Dh, R): their new
    keys and values stored in their cells (``ggml_set_rows``, f32 -> f16 as ``ggml_cpy``
    rounds), then :func:`_attend`'s ops once over the span, the slots a fourth dimension:
    queries (Dh, rows, H, span) against K (Dh, n_kv, Hkv, span) and V (n_kv, Dh, Hkv, span),
    each (head, slot) the product :func:`_attend` computes for that sequence alone."""
    ctx, H, Hkv, Dh = g.ctx, shape.n_head, shape.n_head_kv, shape.head_dim
    gqa, cells, span, n_kv, rows, n = Hkv * Dh, gr.cells, gr.span, gr.n_kv, gr.rows, gr.members
    qidx, sel, kidx, vidx, mask, pick, dst = gin
    R = attn.contents.ne[1]
    f16 = lambda m: 2 * m  # noqa: E731  bytes of m f16 values
    # the members' new keys (gqa, n) and values, into cell n_past of their slots
    flash = _flash(lib)
    km = g.scratch(lib.ggml_get_rows(ctx, g.view(lib.ggml_reshape_2d(ctx, k, gqa, R)), sel))
    g.expand(g.view(lib.ggml_set_rows(ctx, g.view(lib.ggml_reshape_2d(ctx, ks, gqa, cells * span)), km, kidx)))
    vm = g.scratch(lib.ggml_get_rows(ctx, v, sel))  # (gqa, n)
    if flash:  # V stored as K
        g.expand(g.view(lib.ggml_set_rows(ctx, g.view(lib.ggml_reshape_2d(ctx, vs, gqa, cells * span)), vm, kidx)))
    else:  # V stored transposed: one element a row
        g.expand(g.view(lib.ggml_set_rows(ctx, g.view(lib.ggml_reshape_2d(ctx, vs, 1, gqa * cells * span)),
                                          g.view(lib.ggml_reshape_2d(ctx, vm, 1, gqa * n)), vidx)))
    qg = g.scratch(lib.ggml_get_rows(ctx, g.view(lib.ggml_reshape_2d(ctx, q, Dh * H, R)), qidx))
    qp = g.view(lib.ggml_permute(ctx, g.view(lib.ggml_reshape_4d(ctx, qg, Dh, H, rows, span)), 0, 2, 1, 3))
    kv = g.view(lib.ggml_view_4d(ctx, ks, Dh, Hkv, n_kv, span, f16(Dh), f16(gqa), f16(gqa * cells), 0))
    m4 = g.view(lib.ggml_reshape_4d(ctx, mask, n_kv, rows, 1, span))
    if flash:  # one op over the span: each slot's rows against its own cells and mask row
        vv = g.view(lib.ggml_view_4d(ctx, vs, Dh, Hkv, n_kv, span, f16(Dh), f16(gqa), f16(gqa * cells), 0))
        kv = g.view(lib.ggml_permute(ctx, kv, 0, 2, 1, 3))  # (Dh, n_kv, Hkv, span)
        vv = g.view(lib.ggml_permute(ctx, vv, 0, 2, 1, 3))
        cur = g.scratch(lib.ggml_flash_attn_ext(ctx, qp, kv, vv, m4, float(scale), 0.0, 0.0))
        lib.ggml_prec_set_acc(cur, 10)  # GGML_PREC_F32
        out = g.view(lib.ggml_reshape_2d(ctx, cur, Dh * H, rows * span))  # (Dh, H, rows, span), contiguous
        mine = g.scratch(lib.ggml_get_rows(ctx, out, pick))  # (H*Dh, n): each member's first row
        g.expand(g.view(lib.ggml_set_rows(ctx, attn, mine, dst)))
        return
    vv = g.view(lib.ggml_view_4d(ctx, vs, n_kv, Hkv, Dh, span, f16(cells * Dh), f16(cells), f16(cells * gqa), 0))
    kv = g.view(lib.ggml_permute(ctx, kv, 0, 2, 1, 3))  # (Dh, n_kv, Hkv, span)
    vv = g.view(lib.ggml_permute(ctx, vv, 0, 2, 1, 3))  # (n_kv, Dh, Hkv, span)
    kq = g.scratch(lib.ggml_mul_mat(ctx, kv, qp))  # (n_kv, rows, H, span)
    lib.ggml_prec_set_acc(kq, 10)  # GGML_PREC_F32
    kq = g.scratch(lib.ggml_soft_max_ext(ctx, kq, m4, float(scale), 0.0))
    kqv = g.scratch(lib.ggml_mul_mat(ctx, vv, kq))  # (Dh, rows, H, span)
    cur = g.view(lib.ggml_permute(ctx, kqv, 0, 2, 1, 3))  # (Dh, H, rows, span)
    out = g.scratch(lib.ggml_cont_2d(ctx, cur, Dh * H, rows * span))
    mine = g.scratch(lib.ggml_get_rows(ctx, out, pick))  # (H*Dh, n): each member's first row
    g.expand(g.view(lib.ggml_set_rows(ctx, attn, mine, dst)))


def _shared_inputs(g: Graph, layer, rps: dict):
    """Inputs of a layer's shared expert, in binding order: its gate/up/down weights and its
    gate vector (None where the layer has no shared expert, or no gate)."""
    if layer.ffn_gate_shexp is None:
        return None, None
    sw = [weight_input(g, w, rps.get(id(w))) for w in (layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp)]
    sg = g.input(T.F32, (layer.ffn_gate_shexp.ne[0], 1)) if layer.ffn_gate_inp_shexp is not None else None
    return sw, sg


def _shared_expert(g: Graph, lib, h, sw, sg, gate_kind: str):
    """The shared expert's ops on rows h (D, R): down(silu(gate h) * up h) (``kernels.ggml.
    expert_ffn(routed=False)``), times its gate where the model has one (``kernels.dense.
    shared_expert_gate``): (D, R)."""
    ctx = g.ctx
    gate = g.scratch(lib.ggml_mul_mat(ctx, sw[0], h))
    up = g.scratch(lib.ggml_mul_mat(ctx, sw[1], h))
    shared = g.scratch(lib.ggml_mul_mat(ctx, sw[2], g.scratch(lib.ggml_swiglu_split(ctx, gate, up))))
    if sg is not None:
        gl = g.scratch(lib.ggml_mul_mat(ctx, sg, h))  # (1, R)
        if gate_kind == "sigmoid":
            gl = g.scratch(lib.ggml_sigmoid(ctx, gl))
        else:
            gl = g.scratch(lib.ggml_div(ctx, g.scratch(lib.ggml_silu(ctx, gl)), gl))
        shared = g.scratch(lib.ggml_mul(ctx, shared, gl))
    return shared


def _first(g: Graph, lib, t, n: int):
    """The first ``n`` rows (columns in ggml's order) of a (D, rows) tensor, as a view."""
    return g.view(lib.ggml_view_2d(g.ctx, t, t.contents.ne[0], n, t.contents.nb[1], 0))


def _experts(g: Graph, lib, h, layer, ids, glu: str, rps: dict):
    """Inputs of one layer's routed experts (their slabs, repacked where ``rps`` says) and their
    ops on rows h (D, n) with the routing's ids (K, n): every chosen expert's output, (D, K, n)."""
    ctx, n = g.ctx, h.contents.ne[1]
    gw, uw, dw = (weight_input(g, w, rps[id(w)]) for w in _expert_slabs(layer))
    xt = g.view(lib.ggml_reshape_3d(ctx, h, h.contents.ne[0], 1, n))
    up = g.scratch(lib.ggml_mul_mat_id(ctx, uw, xt, ids))  # (n_ff, K, n)
    gate = g.scratch(lib.ggml_mul_mat_id(ctx, gw, xt, ids))
    if glu == "swiglu_oai":
        act = g.scratch(lib.ggml_swiglu_oai(ctx, gate, up, ggml.SWIGLU_OAI_ALPHA, ggml.SWIGLU_OAI_LIMIT))
    else:
        act = g.scratch(lib.ggml_swiglu_split(ctx, gate, up))
    return g.scratch(lib.ggml_mul_mat_id(ctx, dw, act, ids))  # (D, K, n)


def _combine(g: Graph, lib, x2, shared, ex, weights):
    """x + (moe + shared): the expert outputs ex (D, K, n) times their weights (1, K, n), summed
    in top-k order (``kernels.ops.combine``, the same float32 ops), on rows x2, shared (D, n)."""
    ctx, (D, K, n) = g.ctx, tuple(ex.contents.ne[:3])
    ex = g.scratch(lib.ggml_mul(ctx, ex, weights))
    nb1, nb2 = ex.contents.nb[1], ex.contents.nb[2]
    slot = lambda j: g.view(lib.ggml_view_2d(ctx, ex, D, n, nb2, j * nb1))  # noqa: E731
    moe = slot(0)
    for j in range(1, K):
        moe = g.scratch(lib.ggml_add(ctx, moe, slot(j)))
    if shared is not None:
        moe = g.scratch(lib.ggml_add(ctx, moe, shared))
    return g.scratch(lib.ggml_add(ctx, x2, moe))


def _attention_arrays(layer, rps: dict, with_shared: bool = True) -> tuple[list, list]:
    """The data of :func:`_attention_part`'s inputs, in its order, but for the cache's four
    (bound per call, between the two lists): those before the cache, and those after it."""
    pre = [layer.attn_norm, *(weight_data(w, rps.get(id(w))) for w in (layer.attn_q, layer.attn_k, layer.attn_v))]
    pre += [b for b in (layer.attn_q_bias, layer.attn_k_bias, layer.attn_v_bias) if b is not None]
    pre += [n for n in (layer.attn_q_norm, layer.attn_k_norm) if n is not None]
    post = [weight_data(layer.attn_output, rps.get(id(layer.attn_output)))]
    if layer.attn_output_bias is not None:
        post.append(layer.attn_output_bias)
    post += [layer.ffn_norm, layer.ffn_gate_inp.ptr]
    if layer.ffn_gate_inp_bias is not None:
        post.append(layer.ffn_gate_inp_bias)
    if with_shared:
        post += _shared_arrays(layer, rps)
    return pre, post


def _shared_arrays(layer, rps: dict) -> list:
    """The data of :func:`_shared_inputs`, in its order."""
    if layer.ffn_gate_shexp is None:
        return []
    out = [weight_data(w, rps.get(id(w))) for w in (layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp)]
    if layer.ffn_gate_inp_shexp is not None:
        out.append(layer.ffn_gate_inp_shexp)
    return out


def _cache_arrays(k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, flash: bool) -> list:
    """The cache's four inputs of :func:`_attention_part`: K, V, and where this step's keys and
    values go (cell n_past of K (kv_size, gqa), column n_past of V (gqa, kv_size), f16; with
    ``flash`` attention, cell n_past of V (kv_size, gqa))."""
    kp, vp = address(k_cache), address(v_cache)
    row = 2 * k_cache.shape[1] * n_past
    return [kp, vp, kp + row, vp + (row if flash else 2 * n_past)]


def _layer_key(layer) -> tuple:
    """Which optional tensors a layer has, and its weights' types and shapes."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp",
             "ffn_down_shexp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", *_DELTA_NET_WEIGHTS)
    optional = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm", "attn_output_bias",
                "ffn_gate_inp_bias", "ffn_gate_inp_shexp")
    return (tuple(_key(getattr(layer, n, None)) for n in names),
            tuple(getattr(layer, n, None) is not None for n in optional))


@dataclass(frozen=True)
class Block:
    """One layer of a step graph: its weights, attention shape and the sequence's KV cache
    ``(K (kv_size, gqa), V (gqa, kv_size))`` f16; or a gated delta-net layer: its
    :class:`DeltaNetShape` and the sequence's states ``(conv (C, W-1), recurrent (Hv, S, S))``
    float32, C-contiguous, which the graph updates in place."""

    layer: object  # backbone.model.Layer
    shape: AttentionShape | DeltaNetShape
    cache: tuple[np.ndarray, np.ndarray] | None
    caches: tuple = ()  # a multi-sequence step (StepShape.streams): each sequence's (K, V), cache None
    # per KvGroup of the step: the span's slots of this layer's block, K (span, cells, gqa) and
    # V (span, gqa, cells), C-contiguous views (backbone.kvslots)
    spans: tuple = ()

    @property
    def recurrent(self) -> bool:
        return isinstance(self.shape, DeltaNetShape)


class Blocks(list):
    """A step's :class:`Block` list that :func:`step_graph` marks with the step whose caches it
    checked: given the same list with the same step again (a decode step of the same streams),
    it skips those checks. A caller does not change such a list once it has passed it."""

    __slots__ = ("checked", "__weakref__")


@dataclass
class Routed:
    """A layer stopped at its routed experts, for another node to compute them: the residual
    after attention x and the FFN input h (n, D), the experts chosen ids (n, K) int32 and
    their weights (n, K) float32, of the step's real rows; and the gated shared expert (n, D),
    which the step graph leaves to the caller (None until set: :func:`shared_expert`, run
    while the experts' replies travel), where the layer has one."""

    x: np.ndarray
    h: np.ndarray
    shared: np.ndarray | None
    ids: np.ndarray
    weights: np.ndarray


@dataclass
class StepOut:
    """What a step graph returns: the residual stream after its last layer (R, D), the logits
    (m, V) when it ends with the head, or its last layer stopped at its experts; and per layer
    whose experts it computed the experts chosen (n_i, K)."""

    ids: list[np.ndarray]
    x: np.ndarray | None = None
    logits: np.ndarray | None = None
    routed: Routed | None = None


def experts_in_graph(rows: int, layer) -> bool:
    """Whether a step graph can compute ``layer``'s routed experts on ``rows`` rows: each expert
    takes its layout by the rows it gets (``kernels.ggml.expert_layout``), which the router in
    the graph decides, so one graph holds them while every expert is sure to get fewer rows
    than the repacked layout's threshold (the router gives a row to an expert once), or where
    the experts have one layout only (no repacked copy: another type, KVASIR_REPACK=0). Else the
    step stops at them (``remote``) and :func:`kernels.ggml.moe_ffn` splits them by their rows."""
    return ggml.repacked_rows(rows) or all(expert_repacked(w) is None for w in _expert_slabs(layer))


def layers_per_graph(step: StepShape, layer, shape: AttentionShape, budget: int) -> int:
    """How many layers one step graph may hold with its intermediates (float32 scratch) under
    ``budget`` bytes: all of a decode step's layers on any model this engine serves, one or a
    few of a long chunk's."""
    R, K = step.rows, step.n_expert_used
    D, F, E = layer.ffn_gate_exps.ne
    Fs = layer.ffn_gate_shexp.ne[1] if layer.ffn_gate_shexp is not None else 0
    if isinstance(shape, DeltaNetShape):  # projections, conv, norms; the op's packed state per sequence
        C, VS, S = shape.channels, shape.v_heads * shape.head_dim, shape.head_dim
        per_row = 16 * D + 4 * E + 5 * C + 8 * VS + 3 * K * F + (K + 2) * D + 3 * Fs
        n_seq = max(1, len(step.streams))
        return max(1, budget // (4 * (R * per_row + n_seq * (S * VS + shape.conv_kernel * C))))
    H, Dh = shape.n_head, shape.head_dim
    per_row = 16 * D + 4 * E + 6 * H * Dh + 3 * K * F + (K + 2) * D + 3 * Fs
    scores = sum(s.rows * s.n_kv for s in step.streams) if step.streams else R * step.n_kv  # KQ cells
    per_layer = 4 * (R * per_row + 3 * H * scores + (H * Dh * sum(s.rows for s in step.streams)))
    return max(1, budget // per_layer)


@dataclass
class _StepPlan:
    """What every call of one step graph on the same layers shares (``step_graph``'s ``memo``):
    the graph's cache key (less the thread count), its work, the repacked weights, and the data
    of the inputs that do not change from step to step (weights, norms), per block before and
    after its cache. Working these out walks every weight of every layer: a tenth of a decode
    step. The thread count is not part of the plan: it is read at every call (``threads_for``),
    since a server's share of the cores changes while it runs (``kvasir_bus.threads.CoreShare``)
    and a plan made on a busy second lasts as long as its shape."""

    key: ggml.Key
    work: int  # multiply-adds of one call: threads_for's measure
    rps: dict  # id(weight) -> Repacked | None
    rp_head: object  # Repacked | None
    pre: list  # per block: the inputs bound before its cache (_attention_arrays)
    post: list  # per block: those after it, up to its router and shared expert
    exps: list  # per block: its routed experts' slabs
    head: list  # the output norm and head weight
    owners: tuple  # the objects the memo key names by identity, kept alive with the plan


MEMO_ENTRIES = 64  # step plans a memo keeps (one per layer group, cache size and row count)


def _plan(step: StepShape, blocks: list[Block], local: int, expert_rows: list[int], n_new: int, head,
          key_tail: tuple, speculate: bool = False) -> _StepPlan:
    rps = {}
    for i, b in enumerate(blocks):
        for w in _dense_weights(b.layer):
            rps[id(w)] = repacked(w)
        if i < local and not speculate and not experts_in_graph(expert_rows[i], b.layer):
            raise ValueError(f"step_graph: {expert_rows[i]} rows to the routed experts take each expert's layout "
                             f"by its own rows (kernels.ggml.expert_layout): stop at them (remote) and run "
                             f"kernels.ggml.moe_ffn")
        few = speculate or ggml.repacked_rows(expert_rows[i])
        for w in _expert_slabs(b.layer):  # the routed experts' own layout rule (expert_layout)
            rps[id(w)] = expert_repacked(w) if few else None
    rp_head = repacked(head[1]) if head is not None else None
    work = 0
    for i, b in enumerate(blocks):
        lay = b.layer
        D, F, _ = lay.ffn_gate_exps.ne
        work += 3 * expert_rows[i] * step.n_expert_used * D * F if i < local else 0
        work += step.rows * sum(w.ne[0] * w.ne[1] for w in _mixer_weights(lay))
    if head is not None:
        work += len(head[2]) * head[1].ne[0] * head[1].ne[1]
    key = ("step", step, *key_tail,
           tuple((_layer_key(b.layer), b.shape,
                  tuple(rps[id(w)] is not None for w in _packable(b.layer)))
                 for b in blocks),
           None if head is None else (len(head[2]), _key(head[1]), float(head[3]), rp_head is not None))
    # addresses, read once: the arrays are the layers' (alive as long as the plan: ``owners``)
    pre, post = [], []
    for i, b in enumerate(blocks):
        before, after = (_delta_net_arrays if b.recurrent else _attention_arrays)(b.layer, rps, with_shared=i < local)
        pre.append([address(a) for a in before])
        post.append([address(a) for a in after])
    exps = [[weight_data(w, rps[id(w)]) for w in _expert_slabs(b.layer)] for b in blocks]
    tail = [address(head[0]), weight_data(head[1], rp_head)] if head is not None else []
    owners = tuple(b.layer for b in blocks) + tuple(b.shape for b in blocks) + (head[:2] if head is not None else ())
    return _StepPlan(ggml.Key(key), work, rps, rp_head, pre, post, exps, tail, owners)


def step_graph(step: StepShape, blocks: list[Block], *, x: np.ndarray | None = None,
               prev: tuple[Routed, np.ndarray] | None = None, n_past: int = 0,
               positions: np.ndarray | None = None, mask: np.ndarray | None = None,
               keep: np.ndarray | None = None, n_kept: int = 0, head: tuple | None = None,
               remote: bool = False, memo: dict | None = None, n_pasts: tuple[int, ...] = (),
               masks: tuple[np.ndarray, ...] = (), tokens: tuple[QTensor, np.ndarray] | None = None,
               groups: tuple[GroupInputs, ...] = (), speculate: bool = False) -> StepOut:
    """Layers ``blocks`` of a one-sequence step as one graph (see above), from rows ``x``
    (R, D) float32, from ``tokens`` (the token embedding QTensor, ids (R,) int32: its rows,
    ``ggml_get_rows`` in the graph as :func:`kernels.ggml.get_rows` computes them), or from
    ``prev``: a layer stopped at its experts and their outputs (n, K, D), combined first. ``positions`` (R,) int32, ``mask`` (n_kv, R): each
    layer's K and V go into its cache at ``n_past``. ``keep`` (m,): the last block's rows that
    go on after its output projection (the model's last layer: the rows whose logits are
    wanted), of which the first ``n_kept`` are real (the rest: one row as two). ``remote``: the
    last block stops at its routed experts (``StepOut.routed``), before its shared expert
    (the caller runs :func:`shared_expert` on ``routed.h`` while the experts are away, and
    sets ``routed.shared`` before passing it on as ``prev``). ``head``: (output_norm (D,),
    output QTensor, out_idx (m,) int32, eps) adds the output norm and head on rows ``out_idx``
    of the last layer's output -> logits (m, V). ``memo``: a dict the caller keeps across
    steps, where what the calls on the same layers share is remembered (``_StepPlan``), keyed
    by the identity of the layers, their shapes and the head's weights: they must not change
    while the caller uses it.

    Several sequences (``step.streams``, each block's ``caches``): ``n_pasts`` and ``masks``
    ((rows_i, n_kv_i) float32, float16 with flash attention: ``kernels.dense.causal_mask``) per sequence instead of
    ``n_past`` and ``mask``; every dense op runs on all rows at once, each sequence's
    attention against its own cache (``_attend_streams``), so each gets its bits alone; or, for
    the decode streams of a :class:`KvGroup` (``step.groups``, each block's ``spans``), once for
    the group (``_attend_group``, its ``groups`` inputs), with the same bits.

    ``speculate``: every routed expert in the graph in its repacked layout, whatever the step's
    rows. That is the layout rule's (``kernels.ggml.expert_layout``) exactly where no expert
    got ``repack_below`` rows or more, which only the router in the graph knows: the caller
    checks ``StepOut.ids`` and, where one did, runs the step again the rule's way (the cache
    cells this one wrote are written again; no delta-net state may be in it)."""
    lib = ggml.load()
    flash = _flash(lib)  # V caches laid out as K, masks f16 (kernels.dense.flash_attn)
    mask_dtype, mask_type = (np.float16, T.F16) if flash else (np.float32, T.F32)
    R, K, n_new = step.rows, step.n_expert_used, step.n_new
    keep = None if keep is None else np.ascontiguousarray(keep, dtype=np.int32)
    if keep is not None and not 0 < n_kept <= len(keep):
        raise ValueError(f"step_graph: rows to keep {keep} need 0 < n_kept ({n_kept}) <= {len(keep)}")
    if (x is not None) + (prev is not None) + (tokens is not None) != 1 or (tokens is not None and not blocks) \
            or (remote and (not blocks or head is not None)):
        raise ValueError("step_graph: give one of x, tokens (with layers) or prev; remote needs layers and no head")
    if tokens is not None:  # ggml aborts on a row id out of range: check here
        ids = tokens[1]
        if ids.dtype != np.int32 or ids.shape != (R,) or not ids.flags.c_contiguous \
                or int(ids.min()) < 0 or int(ids.max()) >= tokens[0].ne[1]:
            raise ValueError(f"step_graph: tokens are {ids.dtype}{ids.shape}, expected int32 ({R},) "
                             f"in 0..{tokens[0].ne[1] - 1}")
    # rows through each block's dense ops and its experts (the last block's may be pruned)
    dense_rows = [R] * len(blocks)
    expert_rows = [n_new] * len(blocks)
    if keep is not None:
        dense_rows[-1], expert_rows[-1] = len(keep), n_kept
    local = len(blocks) - (1 if remote else 0)  # blocks whose experts this graph computes
    D = blocks[0].layer.ffn_gate_exps.ne[0] if blocks else prev[0].x.shape[1]
    n_prev = 0 if prev is None else len(prev[0].ids)
    has_shared = prev is not None and prev[0].shared is not None
    if speculate and any(b.recurrent for b in blocks):
        raise ValueError("step_graph: a speculative graph cannot hold a delta-net layer (its state is updated in place)")
    key_tail = (speculate, None if keep is None else (len(keep), n_kept), remote,
                None if prev is None else (n_prev, has_shared), None if tokens is None else _key(tokens[0]))
    plan = None
    if memo is not None:
        mkey = (step, key_tail, tuple(id(b.layer) for b in blocks), tuple(id(b.shape) for b in blocks),
                None if head is None else (id(head[0]), id(head[1]), len(head[2]), head[3]))
        plan = memo.get(mkey)
    if plan is None:
        plan = _plan(step, blocks, local, expert_rows, n_new, head, key_tail, speculate)
        if memo is not None:
            while len(memo) >= MEMO_ENTRIES:
                del memo[next(iter(memo))]
            memo[mkey] = plan
    rps, rp_head, threads = plan.rps, plan.rp_head, threads_for(plan.work, n_new)
    # ggml reads exactly these sizes from the pointers it is given: check them here
    want = {"x": (x, (R, D), np.float32), "positions": (positions, (R,), np.int32),
            "mask": (mask, (R, step.n_kv), mask_dtype)} if blocks else {}
    if prev is not None:
        r = prev[0]
        want.update({"prev.x": (r.x, (n_prev, D), np.float32), "prev.shared": (r.shared, (n_prev, D), np.float32),
                     "prev.weights": (r.weights, (n_prev, K), np.float32),
                     "expert outputs": (prev[1], (n_prev, K, D), np.float32)})
        want.pop("x", None)
    streams = step.streams
    if streams and blocks:
        if len(masks) != len(streams) or len(n_pasts) != len(streams) or mask is not None \
                or sum(s.n_new for s in streams) != R or R != n_new:
            raise ValueError(f"step_graph: {len(streams)} sequences need as many masks and n_pasts "
                             f"({len(masks)}, {len(n_pasts)}) and their rows to make the step's {R}")
        want.pop("mask")
        for i, (s, m) in enumerate(zip(streams, masks)):
            want[f"masks[{i}]"] = (m, (s.rows, s.n_kv), mask_dtype)
        if len(groups) != len(step.groups) or any(s.group >= len(groups) for s in streams) \
                or [sum(s.group == i for s in streams) for i in range(len(groups))] != [gr.members for gr in step.groups]:
            raise ValueError(f"step_graph: {len(step.groups)} KV groups need as many inputs ({len(groups)}) "
                             f"and their members among the streams")
        gqa = next((b.shape.n_head_kv * b.shape.head_dim for b in blocks if not b.recurrent), 0)
        for i, (gr, gi) in enumerate(zip(step.groups if gqa else (), groups)):  # (none read by delta-net layers)
            want.update({f"groups[{i}].qidx": (gi.qidx, (gr.span * gr.rows,), np.int32),
                         f"groups[{i}].sel": (gi.sel, (gr.members,), np.int32),
                         f"groups[{i}].kidx": (gi.kidx, (gr.members,), np.int64),
                         f"groups[{i}].vidx": (gi.vidx, (gr.members * gqa,), np.int64),
                         f"groups[{i}].mask": (gi.mask, (gr.span, gr.rows, gr.n_kv), mask_dtype),
                         f"groups[{i}].pick": (gi.pick, (gr.members,), np.int32),
                         f"groups[{i}].dst": (gi.dst, (gr.members,), np.int64)})
            # ggml reads and writes where these say: a wrong index is memory outside the span.
            # Checked once per step: the step's layer graphs all get the same inputs.
            if gi.checked == (R, gqa, gr):
                continue
            if gi.qidx.size and (gi.qidx.min() < 0 or gi.qidx.max() >= R) or gi.sel.size and (
                    gi.sel.min() < 0 or gi.sel.max() >= R) or gi.dst.size and (gi.dst.min() < 0 or gi.dst.max() >= R) \
                    or gi.kidx.size and (gi.kidx.min() < 0 or gi.kidx.max() >= gr.cells * gr.span) \
                    or gi.vidx.size and (gi.vidx.min() < 0 or gi.vidx.max() >= gqa * gr.cells * gr.span) \
                    or gi.pick.size and (gi.pick.min() < 0 or gi.pick.max() >= gr.span * gr.rows) or gr.n_kv > gr.cells:
                raise ValueError(f"step_graph: KV group {i}'s indices out of range")
            gi.checked = (R, gqa, gr)
    for name, (a, shape, dtype) in want.items():
        if a is not None and (a.shape != shape or a.dtype != dtype):
            raise ValueError(f"step_graph: {name} is {a.dtype}{a.shape}, expected {np.dtype(dtype)}{shape}")
    checked = blocks.__class__ is Blocks and getattr(blocks, "checked", None) == step
    for b in () if checked else blocks:
        # the caches are bound by address: their shapes are the graph's
        pairs = zip(b.caches, streams) if streams else [(b.cache, step)]
        if streams and len(b.caches) != len(streams):
            raise ValueError(f"step_graph: a block with {len(b.caches)} caches for {len(streams)} sequences")
        for (kc, vc), s in pairs:
            if b.recurrent:  # conv and recurrent states, read and written in place
                sh = b.shape
                for a, shape in ((kc, (sh.channels, sh.conv_kernel - 1)), (vc, (sh.v_heads, sh.head_dim, sh.head_dim))):
                    if a.shape != shape or a.dtype != np.float32 or not a.flags.c_contiguous:
                        raise ValueError(f"step_graph: a delta-net state is {a.dtype}{a.shape}, expected "
                                         f"C-contiguous float32{shape}")
            elif kc.shape[0] != s.kv_size or vc.shape[0 if flash else 1] != s.kv_size:
                raise ValueError(f"step_graph: a cache of {kc.shape[0]} cells, the step's has {s.kv_size}")
        if streams and not b.recurrent:
            if len(b.spans) != len(step.groups):
                raise ValueError(f"step_graph: a block with {len(b.spans)} KV spans for {len(step.groups)} groups")
            gqa = b.shape.n_head_kv * b.shape.head_dim
            for (ks, vs), gr in zip(b.spans, step.groups):
                if ks.shape != (gr.span, gr.cells, gqa) or vs.shape != (ks.shape if flash else (gr.span, gqa, gr.cells)) \
                        or ks.dtype != np.float16 or vs.dtype != np.float16 \
                        or not ks.flags.c_contiguous or not vs.flags.c_contiguous:
                    raise ValueError(f"step_graph: a KV span is {ks.dtype}{ks.shape} / {vs.shape}, expected "
                                     f"C-contiguous float16 ({gr.span}, {gr.cells}, {gqa})")
    if blocks.__class__ is Blocks:
        blocks.checked = step
    norm = step.norm_topk
    imrope = any(not b.recurrent and b.shape.sections for b in blocks)  # (4R,) positions for rope_multi

    def build() -> Graph:
        S = len(streams)  # a sequence's attention or delta-net chunk: up to ~48 tensors, ~40 nodes per layer
        G = len(step.groups)  # a group's attention: ~30 tensors and ~20 nodes per layer, 7 inputs
        g = Graph(lib, n_tensors=(200 + 48 * S + 32 * G) * len(blocks) + 64 + S + 8 * G,
                  nodes=(160 + 40 * S + 24 * G) * len(blocks) + 64)
        try:
            ctx = g.ctx
            if tokens is not None:  # the token embedding's rows
                et = g.input(tokens[0].ggml_type, tokens[0].ne)
                xt = g.scratch(lib.ggml_get_rows(ctx, et, g.input(T.I32, (R,))))
            elif prev is None:
                xt = g.input(T.F32, (D, R))
            else:  # the previous layer's combine, its experts' outputs given
                x2, sh = g.input(T.F32, (D, n_prev)), g.input(T.F32, (D, n_prev)) if has_shared else None
                wt, ex = g.input(T.F32, (1, K, n_prev)), g.input(T.F32, (D, K, n_prev))
                xt = _combine(g, lib, x2, sh, ex, wt)
                if n_prev < R and blocks:
                    xt = g.scratch(lib.ggml_repeat_4d(ctx, xt, D, R, 1, 1))  # one row as two again
            if blocks:
                pt = g.input(T.I32, (R,))
                p4 = g.input(T.I32, (4 * R,)) if imrope else None
                mt = [g.input(mask_type, (s.n_kv, s.rows)) for s in streams] if streams \
                    else g.input(mask_type, (step.n_kv, R))
                kt = g.input(T.I32, (len(keep),)) if keep is not None else None
                gqa = next((b.shape.n_head_kv * b.shape.head_dim for b in blocks if not b.recurrent), 0)
                gin = [_group_inputs(g, gr, gqa) for gr in step.groups] if gqa else []
            for i, b in enumerate(blocks):
                last = i == len(blocks) - 1
                rows, n = dense_rows[i], expert_rows[i]
                if b.recurrent:
                    x2, h, probs, shared = _delta_net_part(g, lib, xt, kt if last else None, b.layer, b.shape, step,
                                                           rps, with_shared=i < local)
                else:
                    x2, h, probs, shared = _attention_part(g, lib, xt, pt, mt, kt if last else None, b.layer,
                                                           b.shape, step, rps, with_shared=i < local, pos4=p4,
                                                           group_in=gin)
                ids, weights = _route(g, lib, probs, K, norm)
                if n < rows:  # a one-row step run as two: the experts see its first row only
                    x2, h = _first(g, lib, x2, n), _first(g, lib, h, n)
                    shared = None if shared is None else _first(g, lib, shared, n)
                    ids = g.view(lib.ggml_view_2d(ctx, ids, K, n, ids.contents.nb[1], 0))
                    weights = g.view(lib.ggml_view_3d(ctx, weights, 1, K, n, weights.contents.nb[1],
                                                      weights.contents.nb[2], 0))
                if i == local:  # stop at the experts: what the remote call and the next graph need
                    for t in (x2, h, ids, weights):
                        g.output(lib.ggml_cont(ctx, t))
                    break
                xt = _combine(g, lib, x2, shared, _experts(g, lib, h, b.layer, ids, step.glu, rps), weights)
                g.output(lib.ggml_cont(ctx, ids))  # the experts chosen, for the statistics
                if n < R and not (last and head is not None):
                    xt = g.scratch(lib.ggml_repeat_4d(ctx, xt, D, R, 1, 1))  # one row as two again
            if head is not None:
                ot = g.input(T.I32, (len(head[2]),))
                nt = g.input(T.F32, (D,))
                wt = weight_input(g, head[1], rp_head)
                out = g.scratch(lib.ggml_get_rows(ctx, xt, ot))  # the rows whose logits are wanted
                out = g.scratch(lib.ggml_mul(ctx, g.scratch(lib.ggml_rms_norm(ctx, out, float(head[3]))), nt))
                g.output(lib.ggml_mul_mat(ctx, wt, out))
            elif not remote:
                g.output(lib.ggml_cont(ctx, xt))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    arrays: list = [tokens[0].ptr, tokens[1]] if tokens is not None else [x] if prev is None else [prev[0].x, *((prev[0].shared,) if has_shared else ()),
                                             np.ascontiguousarray(prev[0].weights), np.ascontiguousarray(prev[1])]
    if blocks:
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        arrays += [pos, np.concatenate([pos, pos, pos, np.zeros_like(pos)])] if imrope else [pos]
        arrays += masks if streams else (mask,)
        arrays += [keep] if keep is not None else []
        for gi in groups if groups and gqa else ():  # (read by attention layers only)
            arrays += gi.arrays()
    result = StepOut(ids=[np.empty((n, K), np.int32) for n in expert_rows[:local]])
    for i, b in enumerate(blocks):
        arrays += plan.pre[i]
        if b.recurrent:  # each sequence's conv and recurrent state
            for conv, ssm in (b.caches if streams else (b.cache,)):
                arrays += [conv, ssm]
        elif streams:
            for (kc, vc), p, s in zip(b.caches, n_pasts, streams):
                if s.group < 0:
                    arrays += _cache_arrays(kc, vc, p, flash)
            for ks, vs in b.spans:
                arrays += [ks, vs]
        else:
            arrays += _cache_arrays(b.cache[0], b.cache[1], n_past, flash)
        arrays += plan.post[i]
        if i == local:
            n = expert_rows[i]
            result.routed = Routed(np.empty((n, D), np.float32), np.empty((n, D), np.float32), None,
                                   np.empty((n, K), np.int32), np.empty((n, K), np.float32))
            r = result.routed
            arrays += [r.x, r.h, r.ids, r.weights]
            break
        arrays += plan.exps[i]
        arrays.append(result.ids[i])
    if head is not None:
        out_idx = np.ascontiguousarray(head[2], dtype=np.int32)
        result.logits = np.empty((len(out_idx), head[1].ne[1]), np.float32)
        arrays += [out_idx, *plan.head, result.logits]
    elif not remote:
        result.x = np.empty((R, D), np.float32)
        arrays.append(result.x)
    run_cached((plan.key, threads), build, arrays)
    return result


def shared_expert(layer, h: np.ndarray, rows: int, gate_kind: str, *, tokens: int = 0,
                  memo: dict | None = None) -> np.ndarray:
    """A layer's gated shared expert on its FFN input ``h`` (n, D) float32, in a graph of its
    own (``_shared_expert``: the ops the step graph and ``attention_out`` run): the part of a
    layer with remote experts that needs none of them, computed while their replies travel.
    ``rows``: the rows the step's dense ops ran on (n, or 2 for one row run as two: the row
    twice, so that the same kernels run and give the same bits as in the dense graph) -> (n, D)
    float32. ``gate_kind``: silu_div or sigmoid; ``tokens``: the step's token rows (threads).
    ``memo``: as :func:`step_graph`'s (the layer must not change while the caller uses it)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    n, D = h.shape
    if layer.ffn_gate_shexp is None or layer.ffn_gate_shexp.ne[0] != D or not (rows == n or (n == 1 and rows > 1)):
        raise ValueError(f"shared_expert: rows {h.shape} as {rows} do not fit the layer's shared expert")
    if gate_kind not in ("silu_div", "sigmoid"):
        raise ValueError(f"unknown shared-expert gate {gate_kind!r}")
    mkey = ("shexp", id(layer), n, rows, gate_kind, tokens)
    plan = None if memo is None else memo.get(mkey)
    if plan is None:
        weights = (layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp)
        rps = {id(w): repacked(w) for w in weights}
        key = ("shexp", rows, n, gate_kind, tuple(_key(w) for w in weights),
               tuple(rps[id(w)] is not None for w in weights), layer.ffn_gate_inp_shexp is not None)
        plan = (key, rps, _shared_arrays(layer, rps), layer)  # layer: alive as long as the plan
        if memo is not None:
            while len(memo) >= MEMO_ENTRIES:
                del memo[next(iter(memo))]
            memo[mkey] = plan
    key, rps, weight_arrays, _ = plan
    threads = threads_for(3 * rows * D * layer.ffn_gate_shexp.ne[1], tokens)  # per call, as step_graph's
    lib = ggml.load()

    def build() -> Graph:
        g = Graph(lib, n_tensors=32, nodes=NODES)
        try:
            ht = g.input(T.F32, (D, n))
            sw, sg = _shared_inputs(g, layer, rps)
            if rows > n:  # one row as two, as the dense ops ran it
                ht = g.scratch(lib.ggml_repeat_4d(g.ctx, ht, D, rows, 1, 1))
            shared = _shared_expert(g, lib, ht, sw, sg, gate_kind)
            g.output(lib.ggml_cont(g.ctx, _first(g, lib, shared, n) if rows > n else shared))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    out = np.empty((n, D), np.float32)
    run_cached((key, threads), build, [h, *weight_arrays, out])
    return out


def repackable_weights(layers, head) -> list:
    """Every weight the step graphs bind repacked where the mode repacks: each layer's dense
    matrices and routed-expert slabs (each by its own rule), and the output head
    (``kernels.expert.prepare``)."""
    return [w for layer in layers for w in _packable(layer)] + [head]


def _packable(layer) -> list:
    """A layer's weights that the step graphs bind repacked where the mode repacks."""
    return [*_dense_weights(layer), *_expert_slabs(layer)]


def _expert_slabs(layer) -> tuple:
    """A layer's routed experts' 3-D gate, up and down slabs, in graph input order."""
    return layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps


def _dense_weights(layer) -> list:
    return [w for w in (*_mixer_weights(layer), layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp)
            if w is not None]


_DELTA_NET_WEIGHTS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_ba", "ssm_out")


def _mixer_weights(layer) -> list:
    """A layer's attention or delta-net projections (the ones it has)."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", *_DELTA_NET_WEIGHTS)
    return [w for w in (getattr(layer, n, None) for n in names) if w is not None]
