"""kernels/glu.py: the numpy worker's gated activations give ggml's bits.

One ulp of difference in ``silu(g) * u`` now and then lands on the other side of a Q8 step of
the down projection, and that moves a one-row expert output by ~1e-3: so these are checked bit
for bit against ggml's own ops (``ggml_swiglu_split``, ``ggml_swiglu_oai``) on raw float32 rows,
the float32 FMA against exact rational arithmetic, and ``expf`` against glibc's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from fractions import Fraction

import numpy as np
import pytest

from kernels import glu
from kernels.checks import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT


def _ggml_glu(ggml, g: np.ndarray, u: np.ndarray, oai: bool) -> np.ndarray:
    """ggml's swiglu (or swiglu_oai) of float32 rows g, u (n, n_ff) -> (n, n_ff)."""
    lib = ggml.load()
    n, n_ff = g.shape
    graph = ggml.Graph(lib, 4)
    gt, ut = graph.input(0, (n_ff, n)), graph.input(0, (n_ff, n))  # 0: GGML_TYPE_F32
    op = (lib.ggml_swiglu_oai(graph.ctx, gt, ut, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) if oai
          else lib.ggml_swiglu_split(graph.ctx, gt, ut))
    graph.output(op)
    graph.finish(1)
    out = np.empty((n, n_ff), np.float32)
    graph.run([np.ascontiguousarray(g), np.ascontiguousarray(u), out])
    graph.free()
    return out


def _rows(seed: int, n_ff: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = (scale * rng.standard_normal((64, n_ff))).astype(np.float32)
    g[0, :8] = [0.0, -0.0, 90.0, -90.0, 120.0, -120.0, 1e-30, -1e-30]  # exp overflow / underflow paths
    return g, rng.standard_normal((64, n_ff)).astype(np.float32)


@pytest.mark.parametrize("n_ff", [1024, 1000])  # 1000: each row ends in a scalar tail
@pytest.mark.parametrize("scale", [1.0, 4.0, 30.0])
def test_swiglu_gives_ggmls_bits(ggml, n_ff, scale):
    g, u = _rows(int(scale) * 7 + n_ff, n_ff, scale)
    ours = glu.swiglu(g, u, glu.host_variant())
    np.testing.assert_array_equal(ours, _ggml_glu(ggml, g, u, oai=False))


@pytest.mark.parametrize("scale", [1.0, 4.0, 30.0])
def test_swiglu_oai_gives_ggmls_bits(ggml, scale):
    g, u = _rows(int(scale) + 3, 1024, scale)
    ours = glu.swiglu_oai(g, u, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
    np.testing.assert_array_equal(ours, _ggml_glu(ggml, g, u, oai=True))


def test_the_numpy_kernel_uses_the_avx512_form_on_every_cpu():
    from kernels.backend import silu_mul

    g, u = _rows(5, 1024, 3.0)
    np.testing.assert_array_equal(silu_mul(g, u), glu.swiglu(g, u, "avx512"))
    # the other builds' silu differs in the last bit now and then: a numpy worker that followed
    # its own CPU would not give the bits of a numpy worker elsewhere
    assert (glu.swiglu(g, u, "avx2") != glu.swiglu(g, u, "avx512")).mean() > 0.01


def _fma_exact(a, b, c) -> np.float32:
    """float32 nearest to a * b + c (round half to even), by exact rational arithmetic."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    lo = np.float32(float(exact))  # float(Fraction) is correctly rounded to float64 ...
    cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.uint32)) & 1))
    return np.float32(best)


def test_fma32_rounds_once_where_float64_would_round_twice():
    # exact a*b + c = 2^30 + 192 - 2^-40: just below the midpoint between 2^30 + 128 and
    # 2^30 + 256; the float64 sum rounds onto the midpoint and then to the even neighbour
    a, b, c = np.float32(1 + 2.0**-23), np.float32(64 - 2.0**-17), np.float32(2.0**30 + 128)
    assert glu.fma32_naive(a, b, c) == np.float32(2.0**30 + 256)
    assert glu.fma32(a, b, c) == np.float32(2.0**30 + 128) == _fma_exact(a, b, c)


def test_fma32_matches_exact_arithmetic_on_random_values():
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((2, 2000)) * 8).astype(np.float32)
    c = (rng.standard_normal(2000) * rng.choice([1e-3, 1.0, 1e3, 2.0**24], 2000)).astype(np.float32)
    ours = glu.fma32(a, b, c)
    for i in range(0, 2000, 7):
        assert ours[i] == _fma_exact(a[i], b[i], c[i]), (a[i], b[i], c[i])


def _glibc_expf():
    if platform.system() != "Linux" or "glibc" not in " ".join(platform.libc_ver()).lower():
        pytest.skip("expf is compared with glibc's")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.expf


def test_expf_gives_glibcs_bits_where_the_correctly_rounded_exp_does_not():
    expf = _glibc_expf()
    rng = np.random.default_rng(11)
    x = np.concatenate([(rng.standard_normal(20000) * s).astype(np.float32) for s in (0.5, 3.0, 12.0, 40.0)]
                       + [np.float32([0.0, -0.0, 88.5, 88.8, -87.5, -103.0, -104.0, 1e-40])])
    ref = np.array([expf(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(glu.expf(x), ref)
    with np.errstate(over="ignore", under="ignore"):
        rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    assert (rounded != ref).sum() > 0  # why glibc's algorithm is emulated rather than exp rounded


def test_v_expf_in_pieces_gives_the_bits_of_exact_fmas_throughout():
    """v_expf rounds its FMAs naively and redoes a piece where a float64 sum sits on a float32
    midpoint: over a million values (a few dozen such sums) it equals fma32 at every step."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(1 << 20) * rng.choice([0.1, 1.0, 10.0, 60.0], 1 << 20)).astype(np.float32)
    for variant in ("avx512", "avx2"):
        np.testing.assert_array_equal(glu.v_expf(x, variant), glu._v_expf(x, variant, glu.fma32))
