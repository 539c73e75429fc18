"""Gated activations as ggml's CPU backend computes them, in float32, as pure numpy.

llama.cpp's expert FFN rounds ``silu(g) * u`` (``ggml_swiglu_split``) or gpt-oss'
``swiglu_oai`` to float32 before the down projection quantizes it to Q8_K/Q8_0. A value that
differs from ggml's by one ulp lands, now and then, on the other side of a quant step, and one
such step moves a one-row expert output by ~1e-3 relative. So the numpy worker computes these
activations with ggml's own float32 operations, in ggml's order:

- ``swiglu``: ``ggml_vec_swiglu_f32`` runs ``ggml_v_silu`` on whole SIMD vectors (16 floats with
  AVX-512, 8 with AVX2, 4 with NEON) and the scalar ``x / (1 + expf(-x))`` on the rest of a row.
  ``ggml_v_silu`` is ``x / (1 + ggml_v_expf(-x))``, an exp approximated with a degree-5
  polynomial (``ggml-cpu/vec.h``). There are two forms of it: AVX-512's folds the 1 into the
  polynomial and scales with ``vscalefps``; AVX2's and NEON's (the same operations) add
  ``k + k * j`` with ``k = 2^n``. :data:`VARIANTS` names both.
- ``swiglu_oai``: scalar code, ``x / (1 + expf(alpha * -x)) * (y + 1)`` in float32
  (``ggml_compute_forward_swiglu_oai_f32``).

Every float32 ``fma(a, b, c)`` of ggml is computed as ``a * b + c`` in float64 (the product is
exact) and rounded to float32; the float64 sum rounds once more, which gives a wrong float32
result only when it lands exactly on a float32 rounding midpoint: those few values are redone
exactly (:func:`fma32`). ``expf`` is glibc's algorithm step by step (:func:`expf`; it is not the
correctly rounded exp on about 6 in 10,000 inputs).

Only IEEE float32/float64 operations are used, so a numpy worker on any CPU computes the same
bits. Inputs are float32 arrays; NaN and infinite inputs are not handled specially.
"""

from __future__ import annotations

import numpy as np

#: ggml's vector silu per build: "avx512" (x86 with AVX-512F and DQ), "avx2" (x86 with AVX2 and
#: FMA), "neon" (aarch64: AVX2's operations, 4 floats a vector), with the floats per
#: ``ggml_v_silu`` call; the rest of a row takes the scalar silu.
WIDTH = {"avx512": 16, "avx2": 8, "neon": 4}
VARIANTS = tuple(WIDTH)
#: What the numpy worker emulates on every CPU: the AVX-512 build, which x86 backbones run.
DEFAULT_VARIANT = "avx512"

_F = np.float32
_SHIFT = _F(float.fromhex("0x1.8p23"))
_LOG2E = _F(float.fromhex("0x1.715476p+0"))
_LN2_HI = _F(float.fromhex("0x1.62e4p-1"))
_LN2_LO = _F(float.fromhex("0x1.7f7d1cp-20"))
_C1 = _F(float.fromhex("0x1.ffffecp-1"))
_C2 = _F(float.fromhex("0x1.fffdb6p-2"))
_C3 = _F(float.fromhex("0x1.555e66p-3"))
_C4 = _F(float.fromhex("0x1.573e2ep-5"))
_C5 = _F(float.fromhex("0x1.0e4020p-7"))
_ONE = _F(1.0)

# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, e_exp2f_data.c): N = 32 table entries holding
# the bits of 2^(i/N) less i << 47, so that adding k << 47 makes 2^(k/N) for any integer k.
_EXP2F_TAB = np.array([np.float64(2.0 ** (i / 32)).view(np.uint64) - np.uint64(i << 47) for i in range(32)],
                      dtype=np.uint64)
_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * 32
_EXP_SHIFT = float.fromhex("0x1.8p+52")
_EXP_C0 = float.fromhex("0x1.c6af84b912394p-5") / 32 / 32 / 32
_EXP_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / 32 / 32
_EXP_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / 32
_EXPF_OVER = _F(float.fromhex("0x1.62e42ep6"))  # above: inf
_EXPF_UNDER = _F(float.fromhex("-0x1.9fe368p6"))  # below: 0

_FEW = 4096  # lanes per piece of v_expf (its 8 sums, 256 KB, stay in cache)
_MID_MASK = np.uint64((1 << 29) - 1)  # float64 mantissa bits below a float32's
_MID = np.uint64(1 << 28)  # ... exactly half a float32 ulp


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``round(a * b + c)`` with one rounding, as a hardware FMA computes it.

    a, b, c float32 (broadcast) -> float32. The product is exact in float64; the float64 sum
    rounds, and rounding that again to float32 is wrong only when the float64 sum is exactly
    half-way between two float32 values and the exact sum is not: there the sum is recomputed
    with its rounding error (TwoSum) and nudged off the midpoint toward the exact value.
    Normal float32 results only (the activations never reach the subnormal range here).
    """
    p = np.multiply(a, b, dtype=np.float64)
    s = np.add(p, c)
    mid = (s.view(np.uint64) & _MID_MASK) == _MID
    if mid.any():
        s = _fix_midpoints(p, np.asarray(c, dtype=np.float64), np.asarray(s), np.asarray(mid))
    return s.astype(np.float32)


def _fix_midpoints(p, c, s, mid):
    shape = np.shape(s)
    s = np.array(s, ndmin=1, copy=True) if s.ndim == 0 else s  # s is a fresh sum: changed in place
    at = np.nonzero(mid.reshape(s.shape))
    pm, cm, sm = np.broadcast_to(p, s.shape)[at], np.broadcast_to(c, s.shape)[at], s[at]
    bb = sm - pm
    err = (pm - (sm - bb)) + (cm - bb)  # exact: pm + cm = sm + err
    s[at] = np.where(err != 0, np.nextafter(sm, np.copysign(np.inf, err)), sm)
    return s.reshape(shape)


def fma32_naive(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` in float64, rounded to float32: :func:`fma32` without its midpoint fix
    (for measuring how often the fix matters)."""
    return (np.multiply(a, b, dtype=np.float64) + c).astype(np.float32)


def expf(x: np.ndarray) -> np.ndarray:
    """float32 ``expf`` as glibc computes it (ARM's optimized-routines code, also musl's and
    bionic's): ``x N / ln 2 = k + r``, ``2^(k/N)`` from a 32-entry table, a cubic in ``r``, all in
    float64, rounded to float32 once. float32 -> float32. Its result is within 0.502 ulp of the
    true exp, so it is not always the correctly rounded one (about 6 in 10,000 inputs differ)."""
    x = np.asarray(x, dtype=np.float32)
    z = _INVLN2N * x.astype(np.float64)
    kd = z + _EXP_SHIFT
    ki = kd.view(np.uint64)
    r = z - (kd - _EXP_SHIFT)
    s = (_EXP2F_TAB[ki % np.uint64(32)] + (ki << np.uint64(47))).view(np.float64)  # 2^(k/N)
    y = (_EXP_C0 * r + _EXP_C1) * (r * r) + (_EXP_C2 * r + 1.0)
    with np.errstate(over="ignore", under="ignore"):
        out = (y * s).astype(np.float32)
    out = np.where(x > _EXPF_OVER, _F(np.inf), out)
    return np.where(x < _EXPF_UNDER, _F(0), out)


def v_expf(x: np.ndarray, variant: str = DEFAULT_VARIANT) -> np.ndarray:
    """``ggml_v_expf`` of float32 ``x``, lane by lane, in the ``variant``'s operations. -> float32.

    Each FMA is :func:`fma32`'s. In pieces of at most 4,096 lanes, the FMAs are first computed as
    float64 sums rounded to float32 (:func:`fma32_naive`), keeping every sum, and only if one of
    them sits exactly on a float32 midpoint (a few in a million) is the piece computed again with
    :func:`fma32`: the same bits in half the time of checking each FMA."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown ggml_v_expf variant {variant!r}: expected one of {VARIANTS}")
    x = np.asarray(x, dtype=np.float32)
    if x.size > _FEW:  # in pieces that stay in cache: 3x quicker than whole rows of 64 x 1024
        flat = x.reshape(-1)
        out = np.empty_like(flat)
        for i in range(0, flat.size, _FEW):
            out[i:i + _FEW] = v_expf(flat[i:i + _FEW], variant)
        return out.reshape(x.shape)
    sums = np.empty((8,) + x.shape, dtype=np.float64)  # the 8 FMAs' float64 sums, checked at the end
    used = iter(range(8))

    def fast_fma(a, b, c):
        s = sums[next(used)]
        np.multiply(a, b, out=s, dtype=np.float64)
        s += c
        return s.astype(np.float32)

    out = _v_expf(x, variant, fast_fma)
    if ((sums.view(np.uint64) & _MID_MASK) == _MID).any():
        out = _v_expf(x, variant, fma32)
    return out


def _v_expf(x: np.ndarray, variant: str, fma) -> np.ndarray:
    z = fma(x, _LOG2E, _SHIFT)
    n = z - _SHIFT  # exact: the integer nearest x / ln 2
    neg_n = -n
    b = fma(neg_n, _LN2_LO, fma(neg_n, _LN2_HI, x))  # x - n ln2, in two parts
    u = b * b
    big = np.abs(n) > _F(192)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if variant == "avx512":
            j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, _ONE))
            if not big.any():  # nearly always: |x| < 133
                return np.ldexp(j, n.astype(np.int32))  # vscalefps: j * 2^n, one rounding
            res = np.ldexp(j, np.clip(n, -400, 400).astype(np.int32))
            return np.where(big, np.where(n <= 0, _F(0), _F(np.inf)), res).astype(np.float32)
        j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, _C1 * b)
        e = z.view(np.uint32) << np.uint32(23)  # 2^n's exponent bits (wraps as the integer op does)
        k = (e + _ONE.view(np.uint32)).view(np.float32)
        res = fma(j, k, k)
        c = np.abs(n) > _F(126)
        if c.any():  # 2^n out of float32's normal range: 2^n as s1 * s2
            g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
            s1 = (g + np.uint32(0x7F000000)).view(np.float32)
            s2 = (e - g).view(np.float32)
            res = np.where(c, fma32(s2, j, s2) * s1, res)
            res = np.where(big, s1 * s1, res)
        return res.astype(np.float32)


def host_variant() -> str:
    """The variant ggml's CPU backend runs on this machine (a native build: what the CPU has)."""
    import platform

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "avx512f" in flags and "avx512dq" in flags:
        return "avx512"
    return "avx2"


def v_silu(x: np.ndarray, variant: str = DEFAULT_VARIANT) -> np.ndarray:
    """``ggml_v_silu``: ``x / (1 + ggml_v_expf(0 - x))`` in float32. float32 -> float32."""
    x = np.asarray(x, dtype=np.float32)
    return x / (_ONE + v_expf(_F(0) - x, variant))


def silu_scalar(x: np.ndarray) -> np.ndarray:
    """``ggml_silu_f32``: ``x / (1.0f + expf(-x))``, the scalar code for a row's tail."""
    x = np.asarray(x, dtype=np.float32)
    return x / (_ONE + expf(-x))


def swiglu(g: np.ndarray, u: np.ndarray, variant: str = DEFAULT_VARIANT) -> np.ndarray:
    """``ggml_vec_swiglu_f32`` row by row: ``silu(g) * u``, float32 (n, n_ff) each -> (n, n_ff).

    The first ``n_ff - n_ff % width`` columns of a row take the vector silu, the rest the
    scalar one, as the C loop does."""
    g = np.asarray(g, dtype=np.float32)
    u = np.asarray(u, dtype=np.float32)
    split = g.shape[-1] - g.shape[-1] % WIDTH[variant]
    if split == g.shape[-1]:
        s = v_silu(g, variant)
    else:
        s = np.concatenate([v_silu(g[..., :split], variant), silu_scalar(g[..., split:])], axis=-1)
    return s * u


def swiglu_oai(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss' activation as ``ggml_compute_forward_swiglu_oai_f32`` computes it, in float32:
    ``x = min(g, limit)``, ``y = clamp(u, -limit, limit)``, ``x / (1 + expf(alpha * -x)) * (y + 1)``.
    float32 (n, n_ff) each -> (n, n_ff)."""
    x = np.minimum(np.asarray(g, dtype=np.float32), _F(limit))
    y = np.clip(np.asarray(u, dtype=np.float32), _F(-limit), _F(limit))
    glu = x / (_ONE + expf(_F(alpha) * -x))
    return glu * (y + _ONE)
