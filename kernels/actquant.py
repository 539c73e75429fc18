"""The rounding ggml's CPU backend applies to activations before a matmul, as pure numpy.

Before ``ggml_mul_mat(W, X)`` on CPU, ggml converts each row of ``X`` to the "vec_dot type" of
``W``'s type and multiplies in that format: Q8_0 (blocks of 32) for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4
weights, Q8_1 for Q4_1/Q5_1, Q8_K (blocks of 256) for the K-quants and the other IQ types,
f16 for F16, bf16 for BF16, nothing for F32. That rounding, not the weights, is most of the
gap between llama.cpp and a plain f32 product (up to ~1e-2 relative on Q4_K); reproducing it
brings a numpy product to ~1e-6 of ggml.

The functions here reproduce the x86 (AVX/AVX2/AVX-512) builds bit for bit:

- Q8_0/Q8_1 (``quantize_row_q8_0``/``_q8_1`` in ``ggml-cpu/arch/x86/quants.c``):
  ``amax = max|x|``, ``d = amax/127`` stored as f16, ``q = rint(x * (127/amax))`` (round half
  to even, in float32). Q8_1 also stores ``s = f16(d * sum(q))`` with the float32 ``d``.
  The scalar reference (``quantize_row_q8_0_ref``, used on other CPUs) differs slightly:
  ``x * (1/d)`` rounded half away from zero. ARM NEON uses ``1/d`` with round half to even.
- Q8_K (``quantize_row_q8_K_ref``, which x86 calls directly): ``max`` is the signed value of
  largest magnitude (the first one on ties), ``iscale = -127/max``, ``q = min(127,
  rint(iscale*x))``, ``d = 1/iscale`` stored as float32.
- f16: round to nearest even (F16C); bf16: round to nearest even on the top 16 bits.

All functions take float32 arrays of shape ``(..., k)`` (``k`` a multiple of the block size)
and work on the last axis. NaN and infinity are not handled specially.
"""

from __future__ import annotations

import numpy as np

QK8_0 = 32  # block size of Q8_0 and Q8_1
QK_K = 256  # block size of Q8_K

_F127 = np.float32(127.0)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """(..., k) float32 -> (..., k/block, block) float32 view."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks of ``x`` as ggml's x86 ``quantize_row_q8_0`` makes them.

    x (..., k) float32 -> (d (..., k/32) float16, q (..., k/32, 32) int8); the value of
    element j of block b is ``float(d[b]) * q[b, j]``.
    """
    xb = _blocks(x, QK8_0)
    amax = np.abs(xb).max(axis=-1)  # (..., nb) f32
    d = (amax / _F127).astype(np.float16)  # f32 division, then RNE to f16
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, _F127 / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])  # f32 multiply, round half to even
    return d, np.clip(q, -128, 127).astype(np.int8)


def quantize_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_1 blocks of ``x`` as ggml's x86 ``quantize_row_q8_1`` makes them.

    x (..., k) float32 -> (d (..., k/32) float16, s (..., k/32) float16, q (..., k/32, 32) int8).
    ``d`` and ``q`` equal Q8_0's; ``s = f16(d_f32 * sum(q))`` with ``d_f32 = amax/127`` before
    its rounding to f16. The dot with Q4_1/Q5_1 weights uses ``s`` for the weights' minimum
    term, so its f16 rounding shows in the result.
    """
    xb = _blocks(x, QK8_0)
    amax = np.abs(xb).max(axis=-1)
    d32 = amax / _F127
    d, q = quantize_q8_0(x)
    qsum = q.astype(np.int32).sum(axis=-1).astype(np.float32)
    s = (d32 * qsum).astype(np.float16)
    return d, s, q


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K blocks of ``x`` as ggml's ``quantize_row_q8_K_ref`` makes them.

    x (..., k) float32 -> (d (..., k/256) float32, q (..., k/256, 256) int8); the value of
    element j of block b is ``d[b] * q[b, j]``. An all-zero block has ``d = 0``.
    """
    xb = _blocks(x, QK_K)
    idx = np.abs(xb).argmax(axis=-1)  # first index of the largest magnitude, as `ax > amax`
    vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]  # signed value
    zero = vmax == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / vmax).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale[..., None]), 127)  # nearest_int is round half to even
    return d, q.astype(np.int8)


def q8_0(x: np.ndarray) -> np.ndarray:
    """x (..., k) float32 -> the values ggml multiplies after Q8_0 rounding, (..., k) float64."""
    d, q = quantize_q8_0(x)
    return (d.astype(np.float64)[..., None] * q).reshape(np.shape(x))


def q8_K(x: np.ndarray) -> np.ndarray:
    """x (..., k) float32 -> the values ggml multiplies after Q8_K rounding, (..., k) float64."""
    d, q = quantize_q8_K(x)
    return (d.astype(np.float64)[..., None] * q).reshape(np.shape(x))


def f16(x: np.ndarray) -> np.ndarray:
    """x float32 -> float32 holding x rounded to float16 (what ggml multiplies F16 weights with)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    """x float32 -> float32 holding x rounded to bfloat16, round half to even
    (``ggml_compute_fp32_to_bf16``; NaN payloads aside)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)
