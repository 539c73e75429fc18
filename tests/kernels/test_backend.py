"""Quantized matmul kernels: ggml's activation rounding in numpy, and numpy vs ggml itself.

Figures measured on the x86 AVX2 build (llama-cpp-python 0.3.36, ggml 0.25.3) these tests
guard: numpy vs ggml max |diff| / max |y| <= 3e-7 for every type at (256 in, 64 out), n = 1,
7, 64 (the tests allow 2e-6); a plain f32 product without the activation rounding is ~8e-3 off
on Q4_K.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

import kernels  # noqa: F401  (thread settings before numpy work)
from kernels import actquant, backend as backends, checks
from kernels.backend import DequantCache, NumpyBackend
from kernels.tensors import QTensor

REPO = Path(__file__).resolve().parents[2]
NEAR = 2e-6  # numpy vs ggml, relative to the largest output; measured <= 3e-7


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _gguf_tensor(w: np.ndarray, t: T, name: str = "w") -> QTensor:
    """QTensor of (rows, cols) f32 weights quantized by gguf-py (F16, Q8_0, Q4_0, Q4_1...)."""
    data = np.ascontiguousarray(gguf_quantize(w, t)).view(np.uint8).reshape(-1)
    return QTensor(name, t, (w.shape[1], w.shape[0]), data)


def _ggml_tensor(w: np.ndarray, t: T, name: str = "w") -> QTensor:
    from kernels import ggml

    return QTensor(name, t, (w.shape[1], w.shape[0]), ggml.quantize(w, t))


# --- activation quantizers on hand-computable blocks ------------------------------------------

def test_q8_0_block_with_amax_127_rounds_half_to_even():
    x = np.zeros(32, dtype=np.float32)
    x[:8] = [127.0, -2.5, 2.5, 3.5, 0.49, -0.51, 10.0, -126.6]
    d, q = actquant.quantize_q8_0(x)
    assert d.dtype == np.float16 and d.tolist() == [1.0]  # d = 127/127, id = 127/127
    assert q[0, :8].tolist() == [127, -2, 2, 4, 0, -1, 10, -127]
    assert not q[0, 8:].any()


def test_q8_0_scale_is_amax_over_127_rounded_to_f16():
    x = np.linspace(-1.0, 3.0, 64, dtype=np.float32)  # two blocks
    d, q = actquant.quantize_q8_0(x)
    amax = np.abs(x.reshape(2, 32)).max(axis=1)
    assert d.tolist() == [float(np.float16(np.float32(a) / np.float32(127))) for a in amax]
    assert q[1].max() == 127  # the largest value of each block maps to +-127
    assert actquant.q8_0(x).dtype == np.float64


def test_q8_0_zero_block_has_zero_scale():
    d, q = actquant.quantize_q8_0(np.zeros((2, 32), dtype=np.float32))
    assert not d.any() and not q.any()


def test_q8_1_sum_uses_unrounded_scale():
    x = np.zeros(32, dtype=np.float32)
    x[:4] = [1.0, 0.5, 0.25, -0.3]
    d, s, q = actquant.quantize_q8_1(x)
    assert q[0, :4].tolist() == [127, 64, 32, -38]  # 0.5*127 = 63.5 -> 64 (half to even)
    assert s[0] == np.float16(np.float32(1.0 / 127) * np.float32(127 + 64 + 32 - 38))
    assert d[0] == np.float16(1.0 / 127)


def test_q8_K_scale_comes_from_the_signed_largest_value():
    x = np.zeros(256, dtype=np.float32)
    x[5], x[7], x[9], x[10] = -2.0, 1.0, 0.5, 2.0  # -2 comes first among the |2|s
    d, q = actquant.quantize_q8_K(x)
    iscale = np.float32(-127.0) / np.float32(-2.0)  # 63.5
    assert d.tolist() == [float(np.float32(1.0) / iscale)]
    assert q[0, [5, 7, 9, 10]].tolist() == [-127, 64, 32, 127]  # 63.5 -> 64, 31.75 -> 32
    x[5] = 2.0  # now the first largest is +2: the signs flip
    _, q = actquant.quantize_q8_K(x)
    assert q[0, [5, 7, 10]].tolist() == [-127, -64, -127]


def test_q8_K_zero_block_has_zero_scale():
    d, q = actquant.quantize_q8_K(np.zeros(512, dtype=np.float32))
    assert d.tolist() == [0.0, 0.0] and not q.any()


def test_bf16_rounds_half_to_even():
    one_ulp = 2.0 ** -7
    x = np.array([1 + one_ulp / 2, 1 + 1.5 * one_ulp, -3.0], dtype=np.float32)
    assert actquant.bf16(x).tolist() == [1.0, 1 + 2 * one_ulp, -3.0]


def test_quantizers_reject_ragged_rows():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        actquant.quantize_q8_0(np.zeros(40, dtype=np.float32))
    with pytest.raises(ValueError, match="256"):
        actquant.quantize_q8_K(np.zeros(288, dtype=np.float32))


def test_activation_quantizers_match_ggml_cpu_bytes(ggml):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 512)) * np.exp(3 * rng.standard_normal((40, 1)))).astype(np.float32)
    x[3, :32] = 0
    x[4, :256] = 0
    x[6, :32] = np.round(x[6, :32])  # exact ties after scaling
    blocks = ggml.cpu_from_float(x, T.Q8_0).reshape(40, 16, 34)
    d, q = actquant.quantize_q8_0(x)
    assert np.array_equal(blocks[..., :2].copy().view(np.float16)[..., 0], d)
    assert np.array_equal(blocks[..., 2:].view(np.int8), q)
    blocks = ggml.cpu_from_float(x, T.Q8_1).reshape(40, 16, 36)
    d, s, q = actquant.quantize_q8_1(x)
    assert np.array_equal(blocks[..., 2:4].copy().view(np.float16)[..., 0], s)
    assert np.array_equal(blocks[..., 4:].view(np.int8), q)
    blocks = ggml.cpu_from_float(x, T.Q8_K).reshape(40, 2, 292)  # f32 d, 256 q, 16 i16 sums
    d, q = actquant.quantize_q8_K(x)
    assert np.array_equal(blocks[..., :4].copy().view(np.float32)[..., 0], d)
    assert np.array_equal(blocks[..., 4:260].view(np.int8), q)
    halves = ggml.cpu_from_float(x, T.BF16).view(np.uint16).reshape(x.shape)
    assert np.array_equal((halves.astype(np.uint32) << 16).view(np.float32), actquant.bf16(x))


def test_activation_format_table_matches_ggml(ggml):
    names = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q8_1": T.Q8_1, "q8_K": T.Q8_K}
    for weight_type, fmt in checks.ACT_FORMAT.items():
        assert ggml.vec_dot_type(weight_type) == names[fmt], weight_type.name


# --- numpy backend without ggml ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1])
def test_numpy_matmul_rows_do_not_depend_on_the_batch(qtype):
    w = _gguf_tensor(_weights(64, 256), qtype) if qtype != T.F32 else \
        QTensor("w", T.F32, (256, 64), _weights(64, 256).view(np.uint8).reshape(-1))
    x = _weights(64, 256, seed=1)
    npb = NumpyBackend()
    full = npb.matmul(w, x)
    assert full.shape == (64, 64) and full.dtype == np.float32
    singles = np.concatenate([npb.matmul(w, x[i:i + 1]) for i in range(64)])
    assert np.array_equal(full, singles)


def test_numpy_backend_works_without_llama_cpp():
    code = ("import numpy as np; from kernels import backend; from kernels.tensors import QTensor;"
            "from gguf import GGMLQuantizationType as T;"
            "w = QTensor('w', T.F32, (32, 2), np.ones((2, 32), np.float32).view(np.uint8).reshape(-1));"
            "print(backend.backend_name(), backend.matmul(w, np.ones((1, 32), np.float32)).tolist())")
    env = dict(os.environ, KVASIR_GGML_LIB_DIR="/nonexistent", KVASIR_KERNEL="auto", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numpy", "[[32.0,", "32.0]]"]


def test_kernel_env_rejects_unknown_backend(monkeypatch):
    monkeypatch.setattr(backends, "_default", None)
    monkeypatch.setenv("KVASIR_KERNEL", "cuda")
    with pytest.raises(ValueError, match="KVASIR_KERNEL"):
        backends.backend_name()
    monkeypatch.setenv("KVASIR_KERNEL", "numpy")
    assert backends.backend_name() == "numpy"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        backends.get_backend("blas")


def test_dequant_cache_is_bounded_by_bytes():
    a = _gguf_tensor(_weights(8, 64, seed=1), T.Q8_0, "a")
    b = _gguf_tensor(_weights(8, 64, seed=2), T.Q8_0, "b")
    cache = DequantCache(max_bytes=8 * 64 * 8)  # room for one float64 weight
    first = cache.get(a)[0]
    assert cache.get(a)[0] is first and len(cache) == 1
    cache.get(b)
    assert len(cache) == 1 and cache.bytes == 8 * 64 * 8
    assert cache.get(a)[0] is not first  # evicted, dequantised again
    assert np.array_equal(cache.get(a)[0], first)
    tiny = DequantCache(max_bytes=100)
    tiny.get(a)
    assert len(tiny) == 0  # larger than the budget: computed, not kept


def test_cache_size_comes_from_env(monkeypatch):
    monkeypatch.setenv("KVASIR_DEQUANT_CACHE_MB", "2.5")
    assert NumpyBackend().cache.max_bytes == int(2.5 * (1 << 20))
    monkeypatch.setenv("KVASIR_DEQUANT_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="KVASIR_DEQUANT_CACHE_MB"):
        NumpyBackend()


# --- numpy vs ggml ----------------------------------------------------------------------------

MATMUL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.fixture(scope="module")
def weights_by_type(ggml):
    w = _weights(64, 256)
    out = {}
    for t in MATMUL_TYPES:
        if t in (T.F16, T.Q8_0, T.Q4_0, T.Q4_1):
            out[t] = _gguf_tensor(w, t)
        else:
            out[t] = _ggml_tensor(w, t)
    return out


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("qtype", MATMUL_TYPES, ids=lambda t: t.name)
def test_numpy_matches_ggml(ggml, weights_by_type, qtype, n):
    w = weights_by_type[qtype]
    x = _weights(n, 256, seed=n)
    expected = backends.matmul(w, x, backend="ggml")
    assert expected.shape == (n, 64) and expected.dtype == np.float32
    for routed in (False, True):
        assert _rel(backends.get_backend("numpy").matmul(w, x, routed=routed), expected) < NEAR


def test_activation_rounding_is_what_closes_the_gap_on_q4_k(ggml, weights_by_type):
    w = weights_by_type[T.Q4_K]
    x = _weights(7, 256, seed=7)
    expected = backends.matmul(w, x, backend="ggml")
    plain = x @ w.f32().T
    assert _rel(plain, expected) > 1e-3  # measured ~8e-3
    assert _rel(backends.matmul(w, x, backend="numpy"), expected) < NEAR


def test_gguf_and_ggml_quantizers_agree_on_q8_0(ggml):
    w = _weights(16, 256)
    assert np.array_equal(_gguf_tensor(w, T.Q8_0).data, _ggml_tensor(w, T.Q8_0).data)


def test_ggml_is_deterministic(ggml, weights_by_type):
    x = _weights(64, 256, seed=3)
    for t in (T.Q4_K, T.F16, T.Q8_0):
        a = backends.matmul(weights_by_type[t], x, backend="ggml")
        b = backends.matmul(weights_by_type[t], x, backend="ggml")
        assert np.array_equal(a, b)


def test_ggml_routed_rows_do_not_depend_on_the_batch_within_a_path(ggml, weights_by_type):
    """mul_mat_id runs vec_dot per row below 8 rows and the tiled kernel for K-quants from 8
    rows on: within each regime a row's bits do not depend on the other rows. Between the
    regimes K-quant results differ by ~1 ulp; non-K types never change."""
    x = _weights(64, 256, seed=5)
    for t in (T.Q8_0, T.F16, T.Q4_K):
        w = weights_by_type[t]
        singles = np.concatenate([ggml.matmul(w, x[i:i + 1], routed=True) for i in range(7)])
        assert np.array_equal(ggml.matmul(w, x[:7], routed=True), singles)
        at8 = ggml.matmul(w, x[:8], routed=True)
        assert np.array_equal(ggml.matmul(w, x, routed=True)[:8], at8)
        if t != T.Q4_K:
            assert np.array_equal(at8[:7], singles)


def test_ggml_concurrent_calls_match_serial_calls(ggml, weights_by_type):
    w = weights_by_type[T.Q4_K]
    xs = [_weights(n, 256, seed=n) for n in (1, 3, 9, 17, 64, 2)]
    expected = [ggml.matmul(w, x) for x in xs]
    results: dict[int, np.ndarray] = {}

    def run(i: int) -> None:
        for _ in range(5):
            results[i] = ggml.matmul(w, xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, e in enumerate(expected):
        assert np.array_equal(results[i], e)


def test_expert_slab_of_a_3d_tensor_multiplies_like_a_2d_tensor(ggml):
    w0, w1 = _weights(64, 256, seed=1), _weights(64, 256, seed=2)
    both = np.concatenate([ggml.quantize(w0, T.Q4_K), ggml.quantize(w1, T.Q4_K)])
    exps = QTensor("blk.0.ffn_up_exps.weight", T.Q4_K, (256, 64, 2), both)
    x = _weights(3, 256, seed=3)
    for backend in ("ggml", "numpy"):
        assert np.array_equal(backends.matmul(exps.expert(1), x, backend=backend),
                              backends.matmul(_ggml_tensor(w1, T.Q4_K), x, backend=backend))


def test_ggml_info_reports_version(ggml):
    info = ggml.info()
    assert info["version"] and info["commit"] and info["threads"] >= 1


# --- bad input raises ValueError (ggml would abort the process) -------------------------------

@pytest.mark.parametrize("backend", ["numpy", "ggml"])
def test_wrong_shapes_and_types_raise_value_error(backend):
    if backend == "ggml":
        pytest.importorskip("llama_cpp", reason="ggml backend needs llama-cpp-python")
    w = _gguf_tensor(_weights(64, 256), T.Q8_0)
    mm = backends.get_backend(backend).matmul
    with pytest.raises(ValueError, match=r"shape \(n>=1, 256\)"):
        mm(w, np.zeros((2, 128), np.float32))
    with pytest.raises(ValueError, match="shape"):
        mm(w, np.zeros(256, np.float32))
    with pytest.raises(ValueError, match="shape"):
        mm(w, np.zeros((0, 256), np.float32))
    with pytest.raises(ValueError, match="floating-point"):
        mm(w, np.zeros((1, 256), np.int32))
    with pytest.raises(ValueError, match="bytes"):
        mm(QTensor("w", T.Q8_0, (256, 64), w.data[:-34]), np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match="2-D weight"):
        mm(QTensor("w", T.Q8_0, (256, 32, 2), w.data), np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match="block size 32"):
        mm(QTensor("w", T.Q8_0, (48, 1), np.zeros(51, np.uint8)), np.zeros((1, 48), np.float32))
    with pytest.raises(ValueError, match="I32"):
        mm(QTensor("w", T.I32, (4, 1), np.zeros(16, np.uint8)), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        mm(QTensor("w", T.Q8_0, (256, 64), w.data.view(np.int8)), np.zeros((1, 256), np.float32))


def test_validating_a_weight_leaves_the_frozen_tensor_untouched():
    w = _gguf_tensor(_weights(64, 256), T.Q8_0)
    before = dict(vars(w))
    for _ in range(2):
        checks.check_weight(w)
    assert vars(w) == before  # what passed is remembered outside the tensor
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.name = "other"
    bad = QTensor("bad", T.Q8_0, (256, 64), w.data[:-34])
    for _ in range(2):  # a failed check is never remembered
        with pytest.raises(ValueError, match="bytes"):
            checks.check_weight(bad)


def test_quantize_rejects_bad_input(ggml):
    with pytest.raises(ValueError, match="block size 256"):
        ggml.quantize(np.zeros((2, 96), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="2-D"):
        ggml.quantize(np.zeros(256, np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="importance matrix"):
        ggml.quantize(np.zeros((1, 256), np.float32), T.IQ2_XXS)
    assert ggml.quantize(np.zeros((3, 256), np.float32), T.Q6_K).nbytes == 3 * 210


def test_ggml_graph_cache_keeps_same_shaped_weights_apart(ggml):
    a = _gguf_tensor(_weights(64, 256, seed=1), T.Q8_0, "a")
    b = _gguf_tensor(_weights(64, 256, seed=2), T.Q8_0, "b")
    x = _weights(3, 256, seed=3)
    ya, yb = ggml.matmul(a, x), ggml.matmul(b, x)
    assert not np.array_equal(ya, yb)
    for _ in range(2):
        assert np.array_equal(ggml.matmul(a, x), ya) and np.array_equal(ggml.matmul(b, x), yb)
    np.testing.assert_allclose(ya, backends.matmul(a, x, backend="numpy"), rtol=0, atol=NEAR * np.abs(ya).max())


def test_ggml_graph_cache_is_bounded(ggml):
    w = _gguf_tensor(_weights(64, 256), T.Q4_0)
    cache = ggml.graph_cache()
    for n in range(1, cache.MAX_ENTRIES + 10):
        ggml.matmul(w, _weights(n, 256, seed=n))
    assert len(cache.entries) <= cache.MAX_ENTRIES
    assert cache.bytes <= cache.MAX_ARENA_BYTES
