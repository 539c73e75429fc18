"""The dense ops through ggml itself. Attention with the graph llama.cpp builds on CPU (flash
attention off).

Why: numpy computes Q·K, the softmax and P·V in float32 in its own summation order and with its
own ``exp``; llama.cpp rounds Q and the probabilities to f16 for its f16 products and uses its
SIMD ``expf``. Their 1-ulp differences now and then flip one of those f16 roundings, which moves
logits by up to ~3e-3. Building the same ggml ops with the same shapes, strides and types as
``llm_graph_context::build_attn_mha`` (src/llama-graph.cpp) makes attention bit-identical:

    q   (Dh, H, L) f32 -> permute(0, 2, 1, 3)                       # (Dh, L, H)
    k   = view of the K cache (Dh, Hkv, n_kv) -> permute(0, 2, 1, 3)  # (Dh, n_kv, Hkv), f16
    v   = view of the V cache (n_kv, Hkv, Dh) -> permute(0, 2, 1, 3)  # (n_kv, Dh, Hkv), f16
    kq  = mul_mat(k, q)          (prec F32; Q converted to f16)        # (n_kv, L, H)
    kq  = soft_max_ext(kq, mask, 1/sqrt(Dh), 0)   mask F32 (n_kv, L): 0 visible, -inf masked
    kqv = mul_mat(v, kq)         (P converted to f16)                 # (Dh, L, H)
    out = cont_2d(permute(kqv, 0, 2, 1, 3), Dh*H, L)                   # (H*Dh, L)

The caches use llama.cpp's layout (src/llama-kv-cache.cpp, ``v_trans`` = true without flash
attention): per layer K is (kv_size, Hkv*Dh) f16 (one row of n_embd_k_gqa per cell) and V is
transposed, (Hkv*Dh, kv_size) f16, both zero where no token was stored (masked cells must add
exactly 0 * V). ``n_kv``, the number of cells the graph sees, decides the vector tails of the
accumulations; llama.cpp uses ``min(kv_size, max(256, GGML_PAD(used_cells, 256)))``
(``llama_kv_cache::get_n_kv``). Past a multiple of 64 the extra masked cells add exact zeros
in the same SIMD lanes (the longest vector loop of ggml's f16 dot product, AVX-512's, takes 64
at a time), so n_kv only has to be such a multiple for results to be independent of it
(tests/kernels/test_dense.py checks it against 256 at every length): :func:`n_kv_for` pads to 64
(:data:`N_KV_SEEN`). Every masked cell is work, about all of a short sequence's attention:
padding to 256 where 64 does, a decode step of 16 streams of 80 tokens spent a third of its
time attending to empty cells. The caches themselves still grow in chunks of 256 cells
(:func:`cache_cells_for`), as llama.cpp pads its context.

Batch shape matters too: on x86 ``ggml_mul_mat`` uses llamafile's tinyBLAS when there are at
least 2 query rows and ``vec_dot`` for one, and the two sum in different orders. In the
deterministic mode a decode step (one token) is therefore computed with its query row
duplicated (``min_rows=2``), which gives the row llama.cpp computes for that token when it
evaluates the sequence in one batch, whatever else is batched; in the fast mode one row attends
alone (``min_rows=1``), the row llama.cpp computes when it decodes that token alone, as its
users' generation does (``kvasir verify`` compares it so). With 2 rows or more a row's result
does not depend on the other rows, so long chunks run in pieces.

Flash attention (the fast mode's default, as llama-server runs on a CPU; ``KVASIR_FLASH_ATTN=0``
turns it off; never in the deterministic mode: see ``kernels.ggml.flash_attn_setting``) is
``build_attn_mha``'s other branch, one op in place of the four above:

    out = flash_attn_ext(q, k, v, mask, 1/sqrt(Dh), 0, 0)   (prec F32)  # (Dh, H, L), contiguous
    v   = view of the V cache (Dh, Hkv, n_kv) -> permute(0, 2, 1, 3)  # as k: V not transposed
    mask F16 (n_kv, L)

with llama.cpp's cache layout for it: V (kv_size, Hkv*Dh), as K (``v_trans`` false). ggml
skips the masked cells, so their number costs a mask read each, but it decides whether one
query row's cells are split over the threads (from 512 on): the cells seen are llama.cpp's,
padded to 256 (:func:`n_kv_for`).

The graphs are built with ``kernels/ggml.py``'s :class:`~kernels.ggml.Graph` and run through its
per-thread graph cache and work buffer (``run_cached``): one binding for every ggml op here. As
there, ggml aborts the process on a failed assertion, so every input is checked in Python first.

Also here, because llama.cpp computes them with ggml too and numpy's versions differ by an ulp
now and then: RoPE (``rope_qk``), ``rms_norm``, the router's ``softmax`` and qwen2moe's
shared-expert gate. ``kernels/ops.py`` holds the same math in numpy.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kernels import ggml
from kernels.ggml import Graph, run_cached, threads_for

N_KV_PAD = 256  # llama.cpp pads its context (and the cells its graph sees) to a multiple of this
N_KV_SEEN = 64  # the cells our graphs see: a multiple of this gives the same bits (see above)
GGML_PREC_F32 = 10
ROPE_MODES = {"norm": 0, "neox": 2}  # GGML_ROPE_TYPE_NORMAL / GGML_ROPE_TYPE_NEOX
MAX_KQ_BYTES = 64 << 20  # bound on the KQ scores (and their softmax) of one attention graph

_F32, _F16, _I32 = 0, 1, 26  # ggml_type values


def available() -> bool:
    """Whether these ops can run: ggml's libraries load (``kernels.ggml.available``)."""
    return ggml.available()


def flash_attn() -> bool:
    """Whether attention is ggml's flash attention in this process (fixed when ggml loads:
    ``kernels.ggml.flash_attn_setting``, the fast mode only). Then a V cache is laid out as its
    K cache, (kv_size, Hkv*Dh) (:func:`v_cache_shape`), and the masks are f16 (:func:`mask_dtype`)."""
    return ggml.available() and ggml.load().flash_attn


def v_cache_shape(kv_size: int, gqa: int) -> tuple[int, int]:
    """A V cache's shape: (kv_size, gqa) with flash attention, else transposed, (gqa, kv_size)."""
    return (kv_size, gqa) if flash_attn() else (gqa, kv_size)


def mask_dtype() -> type:
    """The KQ masks' dtype: float16 for flash attention (ggml asks it), else float32."""
    return np.float16 if flash_attn() else np.float32


def n_kv_for(used: int, kv_size: int) -> int:
    """The number of KV cells the attention sees with ``used`` cells occupied in a cache of
    ``kv_size`` cells: ``min(kv_size, max(64, GGML_PAD(used, 64)))``. llama.cpp's graph sees
    ``GGML_PAD(used, 256)`` cells; the masked cells between add exact zeros (module docstring).
    With flash attention llama.cpp's own count (the module docstring says why)."""
    pad = N_KV_PAD if flash_attn() else N_KV_SEEN
    padded = -(-int(used) // pad) * pad
    return min(int(kv_size), max(pad, padded))


def cache_cells_for(used: int, n_ctx: int | None = None) -> int:
    """Cells to allocate for ``used`` occupied ones: whole chunks of 256, as llama.cpp pads its
    context (``GGML_PAD(n_ctx, 256)``), so that ``n_kv_for`` never exceeds the cache."""
    cells = max(N_KV_PAD, -(-int(used) // N_KV_PAD) * N_KV_PAD)
    if n_ctx is not None:
        cells = min(cells, max(N_KV_PAD, -(-int(n_ctx) // N_KV_PAD) * N_KV_PAD))
    return cells


# --- attention -----------------------------------------------------------------------------------

_masks: "OrderedDict[tuple, np.ndarray]" = OrderedDict()


def causal_mask(q_pos0: int, L: int, n_kv: int, rows: int | None = None, window: int = 0) -> np.ndarray:
    """llama.cpp's KQ mask (``llama_kv_cache::set_input_kq_mask``) for one sequence whose cells
    0.. hold positions 0..: (rows, n_kv) float32 (float16 with flash attention), 0 where query i (at position q_pos0 + i) sees
    cell j (j <= q_pos0 + i), -inf elsewhere; rows past L repeat row L-1. ``window`` > 0: a
    sliding-window layer's mask (LLAMA_SWA_TYPE_STANDARD), which also hides the cells j with
    q_pos0 + i - j >= window. Read-only, cached."""
    rows = L if rows is None else rows
    dtype = mask_dtype()
    key = (q_pos0, L, rows, n_kv, window, dtype)
    m = _masks.get(key)
    if m is None:
        if L == 1 and window == 0:  # a decode step (a new key every step): no index arrays
            m = np.full((rows, n_kv), -np.inf, dtype=dtype)
            m[:, :q_pos0 + 1] = 0
        else:
            last = q_pos0 + np.minimum(np.arange(rows), L - 1)
            cells = np.arange(n_kv)[None, :]
            visible = cells <= last[:, None]
            if window > 0:
                visible &= last[:, None] - cells < window
            m = np.where(visible, dtype(0), dtype(-np.inf)).astype(dtype)
        m.flags.writeable = False
        _masks[key] = m
        while len(_masks) > 64:
            _masks.popitem(last=False)
    return m


def kq_scale(head_dim: int) -> np.float32:
    """``1.0f/sqrtf(float(n_embd_head))``, in float32 as llama.cpp computes it."""
    return np.float32(1.0) / np.sqrt(np.float32(head_dim))


def _check_cache(a, what: str) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float16 or a.ndim != 2 or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous 2-D float16 array, got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, q_pos0: int, n_kv: int | None = None,
              *, scale: float | None = None, min_rows: int | None = None, sinks: np.ndarray | None = None,
              window: int = 0) -> np.ndarray:
    """Causal GQA attention of one sequence chunk against its KV cache, as llama.cpp computes it.

    q: (L, H, Dh) float32 after RoPE, query i at position ``q_pos0 + i``.
    k_cache: (kv_size, Hkv*Dh) float16, cell j holding the key of position j (llama.cpp's K cache).
    v_cache: (Hkv*Dh, kv_size) float16, the values transposed (llama.cpp's V cache, v_trans);
    with flash attention (:func:`flash_attn`) (kv_size, Hkv*Dh), as K.
    The cache must already hold this chunk (cells up to ``q_pos0 + L - 1``) and be zero (at
    least finite) in the cells past it. ``n_kv``: the cells the graph sees (default
    :func:`n_kv_for`); ``scale`` defaults to ``1/sqrt(Dh)``; with fewer than ``min_rows`` queries
    the last one is repeated (see the module docstring) and the extra rows dropped; the default
    is the kernel mode's: 2 deterministic (batch-invariant), 1 fast (as llama.cpp decodes).
    gpt-oss: ``sinks`` (H,) float32, one more logit per head in every softmax row
    (``ggml_soft_max_add_sinks``), and ``window`` > 0, a sliding window (:func:`causal_mask`).
    Returns (L, H*Dh) float32.
    """
    if not isinstance(q, np.ndarray) or q.ndim != 3 or q.size == 0:
        raise ValueError(f"q: expected a non-empty (L, H, Dh) array, got shape {getattr(q, 'shape', None)}")
    L, H, Dh = q.shape
    _check_cache(k_cache, "k_cache")
    _check_cache(v_cache, "v_cache")
    kv_size, n_embd_gqa = k_cache.shape
    if n_embd_gqa % Dh or n_embd_gqa == 0:
        raise ValueError(f"k_cache rows of {n_embd_gqa} are not a whole number of heads of {Dh}")
    Hkv = n_embd_gqa // Dh
    if H % Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} KV heads")
    flash = flash_attn()
    if v_cache.shape != v_cache_shape(kv_size, n_embd_gqa):
        raise ValueError(f"v_cache: expected shape {v_cache_shape(kv_size, n_embd_gqa)} "
                         f"({'as K: flash attention' if flash else 'transposed'}), got {v_cache.shape}")
    q_pos0 = int(q_pos0)
    used = q_pos0 + L
    if q_pos0 < 0 or used > kv_size:
        raise ValueError(f"positions {q_pos0}..{used - 1} do not fit a cache of {kv_size} cells")
    n_kv = n_kv_for(used, kv_size) if n_kv is None else int(n_kv)
    if not used <= n_kv <= kv_size:
        raise ValueError(f"n_kv={n_kv} must lie in [{used}, {kv_size}]")
    scale = kq_scale(Dh) if scale is None else np.float32(scale)
    if sinks is not None:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32)
        if sinks.shape != (H,):
            raise ValueError(f"sinks: expected shape ({H},), got {sinks.shape}")
    window = int(window)
    if window < 0:
        raise ValueError(f"window must not be negative, got {window}")

    if min_rows is None:
        min_rows = 2 if ggml.deterministic() else 1
    # Long chunks in pieces (as llama.cpp's ubatches bound its KQ): each query row's result does
    # not depend on the other rows of its piece as long as there are at least 2.
    # (flash attention keeps no KQ: a chunk is one op, as llama.cpp runs an ubatch)
    max_rows = L if flash else max(2, int(min_rows), MAX_KQ_BYTES // (8 * n_kv * H))  # KQ and softmax, f32
    if L > max_rows:
        out = np.empty((L, H * Dh), dtype=np.float32)
        n = -(-L // max_rows)
        a = 0
        for i in range(n):
            b = a + L // n + (i < L % n)
            out[a:b] = attention(q[a:b], k_cache, v_cache, q_pos0 + a, n_kv, scale=scale, min_rows=min_rows,
                                 sinks=sinks, window=window)
            a = b
        return out

    rows = max(L, int(min_rows))
    if rows > L:  # repeat the last query (same position, so the same mask row)
        qx = np.empty((rows, H, Dh), dtype=np.float32)
        qx[:L] = q
        qx[L:] = q[L - 1]
    else:
        qx = np.ascontiguousarray(q, dtype=np.float32)
    mask = causal_mask(q_pos0, L, n_kv, rows, window)
    out = np.empty((rows, H * Dh), dtype=np.float32)
    lib = ggml.load()
    threads = threads_for(rows * n_kv * H * Dh, L)
    has_sinks = sinks is not None
    key = ("attn", rows, H, Hkv, Dh, n_kv, kv_size, float(scale), threads, has_sinks, flash)
    arrays = (qx, k_cache, v_cache, mask) + ((sinks,) if has_sinks else ()) + (out,)
    run_cached(key, lambda: _build_attention(lib, rows, H, Hkv, Dh, n_kv, kv_size, scale, threads, has_sinks, flash),
               arrays)
    return out[:L] if rows > L else out


def _build_attention(lib: ggml.Lib, rows, H, Hkv, Dh, n_kv, kv_size, scale, threads, has_sinks=False,
                     flash=False) -> Graph:
    """The graph of ``build_attn_mha`` for one stream; inputs q, K cache, V cache, mask, [sinks,]
    output. ``flash``: its flash-attention branch (V laid out as K, the mask f16)."""
    g = Graph(lib, n_tensors=20)
    try:
        ctx, gqa = g.ctx, Hkv * Dh
        f16 = lambda n: lib.ggml_row_size(_F16, n)  # noqa: E731  bytes of n f16 values
        qt = g.input(_F32, (Dh, H, rows))
        kc = g.input(_F16, (gqa, kv_size))  # llama.cpp's layers[il].k: ne = (n_embd_k_gqa, kv_size)
        # layers[il].v: with v_trans ne = (kv_size, n_embd_v_gqa); without (flash attention) as k
        vc = g.input(_F16, (gqa, kv_size) if flash else (kv_size, gqa))
        mt = g.input(_F16 if flash else _F32, (n_kv, rows))
        st = g.input(_F32, (H,)) if has_sinks else None
        qc = qt.contents
        # build_attn_mha views q per stream (one here) ...
        q = g.view(lib.ggml_view_4d(ctx, qt, Dh, H, rows, 1, qc.nb[1], qc.nb[2], qc.nb[2] * rows, 0))
        # ... and get_k / get_v view the caches (n_kv cells, one stream) ...
        k = g.view(lib.ggml_view_4d(ctx, kc, Dh, Hkv, n_kv, 1, f16(Dh), f16(gqa), f16(gqa * kv_size), 0))
        if flash:
            v = g.view(lib.ggml_view_4d(ctx, vc, Dh, Hkv, n_kv, 1, f16(Dh), f16(gqa), f16(gqa * kv_size), 0))
        else:
            v = g.view(lib.ggml_view_4d(ctx, vc, n_kv, Hkv, Dh, 1, f16(kv_size * Dh), f16(kv_size),
                                        f16(kv_size * gqa), 0))
        # ... then everything is permuted to (.., tokens or cells, heads).
        q = g.view(lib.ggml_permute(ctx, q, 0, 2, 1, 3))
        k = g.view(lib.ggml_permute(ctx, k, 0, 2, 1, 3))
        v = g.view(lib.ggml_permute(ctx, v, 0, 2, 1, 3))
        if flash:
            cur = lib.ggml_flash_attn_ext(ctx, q, k, v, mt, float(scale), 0.0, 0.0)  # (Dh, H, rows)
            if st is not None:
                lib.ggml_flash_attn_ext_add_sinks(cur, st)
            lib.ggml_prec_set_acc(cur, GGML_PREC_F32)
            g.output(cur)  # contiguous: llama.cpp reshapes it to (H*Dh, rows)
            return g.finish(threads)
        kq = g.scratch(lib.ggml_mul_mat(ctx, k, q))  # (n_kv, rows, H)
        lib.ggml_prec_set_acc(kq, GGML_PREC_F32)
        kq = g.scratch(lib.ggml_soft_max_ext(ctx, kq, mt, float(scale), 0.0))
        if st is not None:
            lib.ggml_soft_max_add_sinks(kq, st)
        kqv = g.scratch(lib.ggml_mul_mat(ctx, v, kq))  # (Dh, rows, H)
        cur = g.view(lib.ggml_permute(ctx, kqv, 0, 2, 1, 3))  # (Dh, H, rows)
        g.output(lib.ggml_cont_2d(ctx, cur, Dh * H, rows))
        return g.finish(threads)
    except BaseException:
        g.free()
        raise


# --- RoPE, and RMS norm, through ggml -------------------------------------------------------------

def rope_qk(q: np.ndarray, k: np.ndarray, positions: np.ndarray, n_rot: int, style: str, base: float,
            n_ctx_orig: int = 0, **yarn) -> tuple[np.ndarray, np.ndarray]:
    """RoPE of queries (T, H, Dh) and keys (T, Hkv, Dh) in one ggml graph, as llama.cpp calls
    ``ggml_rope_ext`` (no frequency factors; freq_scale 1 and YaRN off: ext_factor 0, attn_factor
    1, beta_fast 32, beta_slow 1, unless given). Not what numpy computes: glibc's ``cosf`` and
    ``sinf`` are not always correctly rounded, and the compiler contracts ``x0*cos - x1*sin``
    into an FMA."""
    return _rope((q, k), positions, n_rot, style, base, n_ctx_orig, **yarn)


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, style: str, base: float, n_ctx_orig: int = 0,
         **yarn) -> np.ndarray:
    """``ggml_rope_ext`` of (T, H, Dh) float32 rows at ``positions`` (T,); see :func:`rope_qk`."""
    return _rope((x,), positions, n_rot, style, base, n_ctx_orig, **yarn)[0]


def rope_params(n_rot: int, style: str, base: float, n_ctx_orig: int = 0, freq_scale=1.0, ext_factor=0.0,
                attn_factor=1.0, beta_fast=32.0, beta_slow=1.0) -> tuple:
    """The arguments of ``ggml_rope_ext`` after the positions, as :func:`rope_qk` passes them
    (the fused layer graphs of ``kernels/fused.py`` pass the same)."""
    if style not in ROPE_MODES:
        raise ValueError(f"unknown rope style {style!r}")
    return (int(n_rot), ROPE_MODES[style], int(n_ctx_orig), float(base), float(freq_scale), float(ext_factor),
            float(attn_factor), float(beta_fast), float(beta_slow))


def _rope(xs, positions, n_rot, style, base, n_ctx_orig=0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
          beta_fast=32.0, beta_slow=1.0) -> tuple[np.ndarray, ...]:
    xs = tuple(np.ascontiguousarray(x, dtype=np.float32) for x in xs)
    T = xs[0].shape[0] if xs[0].ndim == 3 else -1
    for x in xs:
        if x.ndim != 3 or x.size == 0 or x.shape[0] != T:
            raise ValueError(f"expected non-empty (T, heads, Dh) arrays with one T, got shape {x.shape}")
        if n_rot <= 0 or n_rot % 2 or n_rot > x.shape[2]:
            raise ValueError(f"n_rot={n_rot} must be even and in 2..{x.shape[2]}")
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    if pos.shape != (T,):
        raise ValueError(f"positions: expected shape ({T},), got {pos.shape}")
    params = rope_params(n_rot, style, base, n_ctx_orig, freq_scale=freq_scale, ext_factor=ext_factor,
                         attn_factor=attn_factor, beta_fast=beta_fast, beta_slow=beta_slow)
    shapes = tuple(x.shape for x in xs)
    lib = ggml.load()
    threads = threads_for(sum(x.size for x in xs) * 16)

    def build() -> Graph:
        g = Graph(lib, n_tensors=2 * len(xs) + 2)
        try:
            pt = g.input(_I32, (T,))
            for t, h, d in shapes:
                xt = g.input(_F32, (d, h, t))
                g.output(lib.ggml_rope_ext(g.ctx, xt, pt, None, *params))
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    outs = tuple(np.empty_like(x) for x in xs)
    arrays = [pos]
    for x, y in zip(xs, outs):
        arrays += [x, y]
    run_cached(("rope", shapes, params, threads), build, arrays)
    return outs


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``ggml_rms_norm`` over the last axis of (T, D) or (T, H, Dh) float32, times ``weight``
    (fused RMS_NORM + MUL on CPU, as in llama.cpp's ``build_norm``). ``ops.rms_norm`` equals it
    bit for bit (checked in the tests); this is the reference it is checked against."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim not in (2, 3) or x.size == 0:
        raise ValueError(f"x: expected a non-empty 2-D or 3-D array, got shape {x.shape}")
    ne = tuple(reversed(x.shape))
    w = None if weight is None else np.ascontiguousarray(weight, dtype=np.float32)
    if w is not None and w.shape != (ne[0],):
        raise ValueError(f"weight: expected shape ({ne[0]},), got {w.shape}")
    lib = ggml.load()
    threads = threads_for(x.size * 4)

    def build() -> Graph:
        g = Graph(lib, n_tensors=4)
        try:
            xt = g.input(_F32, ne)
            wt = None if w is None else g.input(_F32, (ne[0],))
            y = lib.ggml_rms_norm(g.ctx, xt, float(eps))
            if wt is not None:
                g.scratch(y)  # unused when the CPU fuses RMS_NORM + MUL, written otherwise
                y = lib.ggml_mul(g.ctx, y, wt)
            g.output(y)
            return g.finish(threads)
        except BaseException:
            g.free()
            raise

    out = np.empty_like(x)
    arrays = (x, out) if w is None else (x, w, out)
    run_cached(("rms", ne, w is not None, float(eps), threads), build, arrays)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """``ggml_soft_max`` over the last axis of (T, E) float32: the router's probabilities,
    bit for bit as llama.cpp computes them (ggml's own vectorised expf)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"x: expected a non-empty 2-D array, got shape {x.shape}")
    T, E = x.shape
    lib = ggml.load()

    def build() -> Graph:
        g = Graph(lib, n_tensors=3)
        try:
            g.output(lib.ggml_soft_max(g.ctx, g.input(_F32, (E, T))))
            return g.finish(1)
        except BaseException:
            g.free()
            raise

    out = np.empty_like(x)
    run_cached(("softmax", T, E), build, (x, out))
    return out


def shared_expert_gate(h: np.ndarray, w: np.ndarray, kind: str = "silu_div") -> np.ndarray:
    """The shared-expert gate as llama.cpp builds it: ``g = mul_mat(w, h)`` with the (D,) f32
    weight as a (D, 1) matrix, then ``silu(g) / g`` (qwen2moe) or ``sigmoid(g)`` (qwen35moe):
    the same function, rounded differently. h (T, D) -> (T, 1) float32.

    One row is computed as two (the row duplicated), like every dense product here, so that a
    decode step equals the same row inside a batch (tinyBLAS from two rows, vec_dot for one)."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if h.ndim != 2 or w.shape != (h.shape[1],):
        raise ValueError(f"h {h.shape} and w {w.shape}: expected (T, D) and (D,)")
    if kind not in ("silu_div", "sigmoid"):
        raise ValueError(f"unknown shared-expert gate {kind!r}")
    if h.shape[0] == 1:
        return shared_expert_gate(np.repeat(h, 2, axis=0), w, kind)[:1]
    T, D = h.shape
    lib = ggml.load()

    def build() -> Graph:
        g = Graph(lib, n_tensors=6)
        try:
            wt = g.input(_F32, (D, 1))
            ht = g.input(_F32, (D, T))
            gate = g.scratch(lib.ggml_mul_mat(g.ctx, wt, ht))  # (1, T)
            if kind == "sigmoid":
                g.output(lib.ggml_sigmoid(g.ctx, gate))
            else:
                silu = g.scratch(lib.ggml_silu(g.ctx, gate))
                g.output(lib.ggml_div(g.ctx, silu, gate))
            return g.finish(1)
        except BaseException:
            g.free()
            raise

    out = np.empty((T, 1), dtype=np.float32)
    run_cached(("shexp_gate", kind, T, D), build, (w, h, out))
    return out
