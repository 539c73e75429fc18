"""How far a reply of another kernel is from the numpy kernel's, once its quant-step flips are taken out.

Two honest kernels that round activations as ggml does but sum in other orders (ggml on another
CPU, a numpy worker against ggml) compute the gate and up projections a few float32 ulps apart.
Almost always the down projection then rounds the activation ``h`` to the same Q8_K/Q8_0/f16
value, and the outputs agree to ~1e-7; but an element of ``h`` that sits within those few ulps
of a rounding boundary may round to the other side, and one such flip moves a one-row output by
up to ~3e-3 relative. A plain relative L2 bound must then be loose enough for the flip, and a liar
stays under it (``backbone/audit.py``).

:func:`explained_gap` recomputes the expert with the numpy kernel, lists every rounding of the
down projection's input that summation-order noise could move (an element of ``h`` within its
error bound of a Q8 step boundary or an f16/bf16 midpoint; a Q8_0 block scale within reach of an
f16 midpoint), and returns the relative L2 gap of the reply after the best choice of those
roundings. What a reply may still differ by is then only float summation order (~1e-6); what a
liar may choose is the rounding of values that an honest kernel could also have rounded either
way.

Error bound of an element (absolute): the projections' float32 sums at most ``GAMMA`` roundings
of a partial sum no larger than ``|w| |x|`` (Cauchy-Schwarz over the row), times the activation's
sensitivity to each input, plus ``8`` ulps of ``h`` for the activation itself.
"""

from __future__ import annotations

import numpy as np

from kernels import actquant, glu
from kernels.checks import ACT_FORMAT, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, check_ffn
from kernels.tensors import QTensor

ULP = 2.0 ** -24  # float32's unit roundoff
#: float32 roundings allowed for in one output of a projection: ggml sums a row's blocks in 8
#: lanes and then across them (a 3072-wide Q8_0 row: 12 + 3), other kernels in other orders.
GAMMA = 16
#: Passes over the flip candidates of a row (each takes in or out every flip that helps).
MAX_PASSES = 4


def explained_gap(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, reply: np.ndarray) -> float:
    """Relative L2 gap ``|reply - y'| / |y|`` of a reply (n, n_embd) to the numpy kernel's expert
    output y on rows x (n, n_embd), y' being y with the best subset of the possible rounding flips
    of the down projection's input applied. inf for a reply of the wrong shape or not finite."""
    from kernels.backend import get_backend

    x = check_ffn(gate, up, down, x)
    reply = np.asarray(reply)
    if reply.shape != (x.shape[0], down.ne[1]) or not np.isfinite(reply).all():
        return float("inf")
    npb = get_backend("numpy")
    g, u, h = npb.hidden(gate, up, x)  # (n, n_ff) each
    y = npb.matmul(down, h)
    if down.bias is not None:
        y = y + down.bias
    y64 = y.astype(np.float64)
    norm = float(np.linalg.norm(y64))
    r = reply.astype(np.float64) - y64  # (n, n_embd)
    wd = npb.cache.get(down)[0]  # (n_embd, n_ff) float64
    err = _h_error(npb, gate, up, x, g, u, h)
    total = 0.0
    for row in range(x.shape[0]):
        dirs = _flip_directions(h[row], err[row], ACT_FORMAT[down.ggml_type], wd)
        total += _best_residual(r[row], dirs) ** 2
    diff = float(np.sqrt(total))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def _h_error(npb, gate, up, x, g, u, h) -> np.ndarray:
    """Absolute error bound of each element of h (n, n_ff) float64."""
    xn = np.linalg.norm(x.astype(np.float64), axis=1)[:, None]  # (n, 1)
    gn = _row_norms(npb, gate)[None, :]
    un = _row_norms(npb, up)[None, :]
    dg = GAMMA * ULP * gn * xn
    du = GAMMA * ULP * un * xn
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    if gate.glu == "swiglu_oai":
        xg = np.minimum(g64, SWIGLU_OAI_LIMIT)
        yu = np.clip(u64, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        act = xg / (1.0 + np.exp(-SWIGLU_OAI_ALPHA * xg))
        slope = 1.0 + SWIGLU_OAI_ALPHA * np.abs(xg) / 4  # >= |d/dx (x sigmoid(alpha x))|
        dh = slope * np.abs(yu + 1.0) * dg + np.abs(act) * du
    else:
        with np.errstate(over="ignore"):
            act = g64 / (1.0 + np.exp(-g64))
        dh = 1.1 * np.abs(u64) * dg + np.abs(act) * du  # silu' <= 1.1
    return dh + 8 * ULP * np.abs(h.astype(np.float64))


def _row_norms(npb, w: QTensor) -> np.ndarray:
    dense = npb.cache.get(w)[0]  # (ne1, ne0) float64
    return np.sqrt(np.einsum("ij,ij->i", dense, dense))


def _flip_directions(h: np.ndarray, err: np.ndarray, fmt: str, wd: np.ndarray) -> np.ndarray:
    """Output-space changes (k, n_embd) float64 of each rounding of one row's h (n_ff,) that its
    error bound ``err`` could move, for the down projection's activation format ``fmt``."""
    if fmt == "q8_K":
        return _q8_flips(h, err, actquant.QK_K, wd, signed_max=True)
    if fmt in ("q8_0", "q8_1"):
        return _q8_flips(h, err, actquant.QK8_0, wd, signed_max=False)
    if fmt in ("f16", "bf16"):
        h32 = h.astype(np.float32)
        rounded = actquant.f16(h32) if fmt == "f16" else actquant.bf16(h32)
        cols, other = _near_midpoint(h32, err, rounded, fmt)
        return (other - rounded[cols].astype(np.float64))[:, None] * wd[:, cols].T
    return np.zeros((0, wd.shape[0]))


def _q8_flips(h, err, block, wd, *, signed_max: bool) -> np.ndarray:
    """Flips of one row's Q8_K (``signed_max``: scale from the signed largest value) or Q8_0
    blocks: an element whose scaled value is within reach of a half-integer, rounded to the other
    integer; for Q8_0 also a block scale within reach of an f16 midpoint, rounded the other way."""
    hb = h.reshape(-1, block).astype(np.float32)
    eb = err.reshape(-1, block)
    at = np.abs(hb).argmax(axis=-1)[:, None]  # the block's largest magnitude sets its scale
    vmax = np.take_along_axis(hb, at, axis=-1)[:, 0].astype(np.float64)
    emax = np.take_along_axis(eb, at, axis=-1)[:, 0]
    live = vmax != 0
    if signed_max:
        d, q = actquant.quantize_q8_K(hb)
        iscale = np.where(live, -127.0 / np.where(live, vmax, 1.0), 0.0)
    else:
        d, q = actquant.quantize_q8_0(hb)
        iscale = np.where(live, 127.0 / np.where(live, np.abs(vmax), 1.0), 0.0)
    d, q = d.reshape(-1), q.reshape(hb.shape).astype(np.int64)  # quantize_* add a block axis of their own
    dval = d.astype(np.float64)
    s = hb.astype(np.float64) * iscale[:, None]  # (nb, block): what is rounded to q
    rel_max = np.where(live, emax / np.where(live, np.abs(vmax), 1.0), 0.0)
    reach = np.abs(iscale)[:, None] * eb + np.abs(s) * rel_max[:, None] + 1e-6  # in q units
    a = np.abs(s)
    other = np.where(s > q, q + 1, q - 1)
    near = live[:, None] & (np.abs(a - np.floor(a) - 0.5) <= reach) & (other >= -128) & (other <= 127)
    b, j = np.nonzero(near)
    dirs = [(dval[b] * (other[b, j] - q[b, j]))[:, None] * wd[:, b * block + j].T]
    if not signed_max:  # the block scale d = f16(amax / 127) near an f16 midpoint
        d32 = (np.abs(vmax) / 127.0).astype(np.float32)
        blocks, other_d = _near_midpoint(d32, np.abs(d32.astype(np.float64)) * rel_max, d.astype(np.float32), "f16")
        blocks_ok = live[blocks]
        for bb, od in zip(blocks[blocks_ok], other_d[blocks_ok]):
            cols = slice(bb * block, (bb + 1) * block)
            dirs.append(((od - dval[bb]) * (wd[:, cols] @ q[bb].astype(np.float64)))[None, :])
    return np.concatenate(dirs) if dirs else np.zeros((0, wd.shape[0]))


def _near_midpoint(v: np.ndarray, err: np.ndarray, rounded: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Where float32 values v lie within err of the midpoint between their fmt (f16/bf16)
    rounding and the fmt neighbour on their side: (indices, that neighbour as float64)."""
    v = np.asarray(v, np.float32)
    rounded = np.asarray(rounded, np.float32)
    side = v != rounded
    if fmt == "f16":
        r16 = rounded.astype(np.float16)
        other = np.nextafter(r16, np.where(v > rounded, np.float16(np.inf), np.float16(-np.inf))).astype(np.float64)
    else:  # bf16: a step of 1 << 16 in the float32 bits, away from or toward zero
        bits = rounded.view(np.uint32).astype(np.int64)
        away = (v > rounded) == (rounded >= 0)
        other = np.where(away, bits + (1 << 16), bits - (1 << 16)).astype(np.uint32).view(np.float32).astype(np.float64)
    mid = (rounded.astype(np.float64) + other) / 2
    near = side & (np.abs(v.astype(np.float64) - mid) <= err) & np.isfinite(other)
    idx = np.flatnonzero(near)
    return idx, other[idx]


def _best_residual(r: np.ndarray, dirs: np.ndarray) -> float:
    """|r - the sum of the best subset of the rows of dirs| (each flip happens or not), found by
    passes that take a flip in, or out again, while that shortens the residual (the flips are
    columns of the down projection, nearly orthogonal, so few passes settle)."""
    res = r.copy()
    if len(dirs) == 0:
        return float(np.linalg.norm(res))
    c = np.zeros(len(dirs))
    norms = np.einsum("ij,ij->i", dirs, dirs)
    for _ in range(MAX_PASSES):
        changed = False
        for i in np.argsort(-np.abs(dirs @ res) / np.maximum(norms, 1e-300)):  # the likeliest first
            sign = 1.0 - 2.0 * c[i]  # adding it (0 -> 1) or taking it out (1 -> 0)
            if 2.0 * sign * float(dirs[i] @ res) > norms[i]:
                res -= sign * dirs[i]
                c[i] += sign
                changed = True
        if not changed:
            break
    return float(np.linalg.norm(res))
