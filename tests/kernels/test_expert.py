"""The expert FFN a worker runs: hand-computable values, numpy vs ggml, llama.cpp's op choice.

Measured (x86 AVX2, ggml 0.25.3): numpy vs ggml expert_ffn max |diff| / max |y| at n_embd 512,
n_ff 256 is <= 4e-7 for Q4_K/Q6_K/Q8_0/Q4_0 and up to 1.2e-5 for F16; at the 3072x1024 shape
up to ~6e-5. The larger figures come from values next to a rounding boundary of the
activation rounding before ``down`` (f16, or Q8 steps of amax/127): a 1-ulp difference in
silu(g)*u moves such a value by a whole step. The tests allow 2e-4.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

import kernels  # noqa: F401  (thread settings before numpy work)
from kernels.backend import silu_mul
from kernels.expert import expert_ffn
from kernels.tensors import QTensor

N_EMBD, N_FF = 512, 256
NEAR = 2e-4


def _f32(name: str, w: np.ndarray) -> QTensor:
    """(out, in) f32 weights as an F32 QTensor with ne (in, out)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return QTensor(name, T.F32, (w.shape[1], w.shape[0]), w.view(np.uint8).reshape(-1))


def _random(rows: int, cols: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)


def _quantized(name: str, w: np.ndarray, t: T) -> QTensor:
    if t in (T.F16, T.Q8_0, T.Q4_0):
        data = np.ascontiguousarray(gguf_quantize(w, t)).view(np.uint8).reshape(-1)
    else:
        from kernels import ggml

        data = ggml.quantize(w, t)
    return QTensor(name, t, (w.shape[1], w.shape[0]), data)


def _expert(t: T, seed: int = 0, suffix: str = "exps") -> tuple[QTensor, QTensor, QTensor]:
    return (_quantized(f"blk.0.ffn_gate_{suffix}.weight", _random(N_FF, N_EMBD, seed), t),
            _quantized(f"blk.0.ffn_up_{suffix}.weight", _random(N_FF, N_EMBD, seed + 1), t),
            _quantized(f"blk.0.ffn_down_{suffix}.weight", _random(N_EMBD, N_FF, seed + 2), t))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


BACKENDS = ["numpy", "ggml"]


def _need(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "ggml":
        request.getfixturevalue("ggml")  # skips without llama_cpp


# --- hand-computable ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_like_weights_give_the_formula(backend, request):
    _need(backend, request)
    # gate picks x0, x1; up picks 2*x0, 2*x1; down writes h0, h1 to outputs 0, 1.
    eye = np.eye(2, 4, dtype=np.float32)
    gate, up, down = _f32("g", eye), _f32("u", 2 * eye), _f32("d", eye.T)
    x = np.array([[1.0, -2.0, 3.0, 4.0], [0.0, 0.5, -1.0, 9.0]], dtype=np.float32)
    y = expert_ffn(gate, up, down, x, routed=False, backend=backend)

    def silu(v: float) -> float:
        return v / (1 + math.exp(-v))

    expected = np.array([[silu(1.0) * 2.0, silu(-2.0) * -4.0, 0, 0],  # 1.4621172, 0.9536234
                         [0.0, silu(0.5) * 1.0, 0, 0]], dtype=np.float32)
    assert y.shape == (2, 4) and y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-7)


def test_silu_mul_is_rounded_like_ggml():
    g = np.array([[-20.0, -1.0, 0.0, 2.0, 100.0]], dtype=np.float32)
    u = np.full_like(g, 3.0)
    h = silu_mul(g, u)
    assert h.dtype == np.float32
    np.testing.assert_allclose(h[0], [-20 * 3 / (1 + math.exp(20)), -3 / (1 + math.e), 0.0,
                                      6 / (1 + math.exp(-2)), 300.0], rtol=1e-7)


def test_the_caller_must_say_whether_the_expert_is_routed():
    gate, up, down = _f32("g", np.eye(2, 4)), _f32("u", np.eye(2, 4)), _f32("d", np.eye(4, 2))
    with pytest.raises(TypeError, match="routed"):
        expert_ffn(gate, up, down, np.ones((1, 4), np.float32))


# --- numpy vs ggml ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.F16], ids=lambda t: t.name)
def test_numpy_and_ggml_agree(ggml, qtype, n):
    gate, up, down = _expert(qtype)
    x = np.random.default_rng(n).standard_normal((n, N_EMBD)).astype(np.float32)
    y = expert_ffn(gate, up, down, x, routed=True, backend="ggml")
    assert y.shape == (n, N_EMBD) and y.dtype == np.float32
    assert _rel(expert_ffn(gate, up, down, x, routed=True, backend="numpy"), y) < NEAR


def test_ggml_graph_equals_separate_ggml_ops(ggml):
    """One graph gives the same bits as mul_mat_id, swiglu, mul_mat_id run one by one: the
    intermediates are float32 in both and ``down`` quantizes the same values."""
    gate, up, down = _expert(T.Q8_0)
    x = np.random.default_rng(9).standard_normal((5, N_EMBD)).astype(np.float32)
    g = ggml.matmul(gate, x, routed=True)
    u = ggml.matmul(up, x, routed=True)
    fused = expert_ffn(gate, up, down, x, routed=True, backend="ggml")
    separate = ggml.matmul(down, silu_mul(g, u), routed=True)
    assert _rel(separate, fused) < 1e-5  # only silu's exp differs (ggml's SIMD expf vs libm)


def test_ggml_is_deterministic_and_routed_rows_are_batch_independent(ggml):
    gate, up, down = _expert(T.Q8_0)
    x = np.random.default_rng(4).standard_normal((16, N_EMBD)).astype(np.float32)
    a = expert_ffn(gate, up, down, x, routed=True, backend="ggml")
    assert np.array_equal(a, expert_ffn(gate, up, down, x, routed=True, backend="ggml"))
    singles = np.concatenate([expert_ffn(gate, up, down, x[i:i + 1], routed=True, backend="ggml")
                              for i in range(16)])
    assert np.array_equal(a, singles)


def test_shared_expert_uses_llama_cpps_dense_op(ggml):
    """A shared expert (``routed=False``) goes through ggml_mul_mat (tinyBLAS for F16), a routed
    one through ggml_mul_mat_id (vec_dot): they differ by float order only. A one-row dense call
    runs as two rows, so a row gets the same bits alone as inside a batch (batch invariance)."""
    routed = _expert(T.F16, suffix="exps")
    shared = tuple(QTensor(w.name.replace("exps", "shexp"), w.ggml_type, w.ne, w.data) for w in routed)
    x = np.random.default_rng(5).standard_normal((4, N_EMBD)).astype(np.float32)
    y_routed = expert_ffn(*routed, x, routed=True, backend="ggml")
    y_shared = expert_ffn(*shared, x, routed=False, backend="ggml")
    assert _rel(y_shared, y_routed) < NEAR
    assert np.array_equal(expert_ffn(*shared, x[:1], routed=False, backend="ggml"), y_shared[:1])
    assert np.array_equal(expert_ffn(*routed, x[:1], routed=True, backend="ggml"), y_routed[:1])
    assert np.array_equal(expert_ffn(*shared, x, routed=True, backend="ggml"), y_routed)
    # The names are labels: the caller's ``routed`` alone picks the op.
    assert np.array_equal(expert_ffn(*routed, x, routed=False, backend="ggml"), y_shared)


def test_concurrent_calls_match_serial_calls(ggml):
    gate, up, down = _expert(T.Q4_K)
    xs = [np.random.default_rng(s).standard_normal((n, N_EMBD)).astype(np.float32)
          for s, n in enumerate((1, 8, 3, 64, 12, 2))]
    expected = [expert_ffn(gate, up, down, x, routed=True, backend="ggml") for x in xs]
    results: dict[int, list[np.ndarray]] = {i: [] for i in range(len(xs))}

    def run(i: int) -> None:
        for _ in range(4):
            results[i].append(expert_ffn(gate, up, down, xs[i], routed=True, backend="ggml"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, e in enumerate(expected):
        assert all(np.array_equal(r, e) for r in results[i])


def test_expert_slab_of_3d_tensors(ggml):
    two = [_expert(T.Q4_K, seed=s) for s in (0, 10)]
    stacked = [QTensor(w0.name, w0.ggml_type, (*w0.ne, 2), np.concatenate([w0.data, w1.data]))
               for w0, w1 in zip(*two)]
    x = np.random.default_rng(6).standard_normal((3, N_EMBD)).astype(np.float32)
    for backend in ("numpy", "ggml"):
        y = expert_ffn(*(t.expert(1) for t in stacked), x, routed=True, backend=backend)
        assert np.array_equal(y, expert_ffn(*two[1], x, routed=True, backend=backend))


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_shapes_raise_value_error(backend, request):
    _need(backend, request)
    gate, up, down = _expert(T.Q8_0)
    x = np.zeros((2, N_EMBD), np.float32)
    with pytest.raises(ValueError, match="same shape"):
        wide_up = _quantized("u", _random(2 * N_FF, N_EMBD, 1), T.Q8_0)
        expert_ffn(gate, wide_up, down, x, routed=True, backend=backend)
    with pytest.raises(ValueError, match=r"expected ne=\(256, 512\)"):
        expert_ffn(gate, up, gate, x, routed=True, backend=backend)
    with pytest.raises(ValueError, match=r"shape \(n>=1, 512\)"):
        expert_ffn(gate, up, down, np.zeros((2, N_FF), np.float32), routed=True, backend=backend)
    with pytest.raises(ValueError, match="2-D weight"):
        stacked = QTensor("g", T.Q8_0, (N_EMBD, N_FF // 2, 2), gate.data)
        expert_ffn(stacked, up, down, x, routed=True, backend=backend)
