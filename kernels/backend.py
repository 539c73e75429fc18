"""Quantized matmul ``W x`` as llama.cpp's CPU backend computes it, in two backends.

- ``ggml``: llama.cpp's own kernels, called through ctypes on the GGUF bytes
  (``kernels/ggml.py``). Bit-identical to llama.cpp on this CPU. Needs llama-cpp-python.
- ``numpy``: dequantise W once (cached), round the activations the way ggml does before its
  dot products (``kernels/actquant.py``), accumulate in float64 and round to float32 once.
  Matches ggml to ~1e-6 relative; a row's result does not depend on the other rows in the
  batch. Needs only numpy and gguf: what a phone worker runs.

Which one this process uses: env ``KVASIR_KERNEL`` = ``auto`` (default: ggml if its libraries
load, else numpy) | ``ggml`` | ``numpy``. Tests force one with ``matmul(w, x, backend="numpy")``
or ``get_backend("numpy").matmul(w, x)``.

Shapes: a weight has ``ne = (ne0, ne1)`` in ggml order (ne0 = input features); ``x`` is
(n, ne0) and the result (n, ne1), both float32, i.e. ``y = x @ W.T`` in numpy terms.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels import actquant
from kernels.tensors import QTensor

T = GGMLQuantizationType

ENV_KERNEL = "KVASIR_KERNEL"
ENV_CACHE_MB = "KVASIR_DEQUANT_CACHE_MB"
DEFAULT_CACHE_MB = 1024  # float64 weights: one 3072x1024 expert (gate+up+down) is 75 MB

# What ggml converts the activations to before multiplying with each weight type
# (type_traits_cpu[type].vec_dot_type in ggml-cpu.c). Also the set of supported weight types.
_ACT_FORMAT_BY_NAME = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0", "MXFP4": "q8_0",
    "Q4_1": "q8_1", "Q5_1": "q8_1",
    "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K",
    "IQ2_XXS": "q8_K", "IQ2_XS": "q8_K", "IQ2_S": "q8_K", "IQ3_XXS": "q8_K", "IQ3_S": "q8_K",
    "IQ1_S": "q8_K", "IQ1_M": "q8_K", "IQ4_XS": "q8_K", "TQ1_0": "q8_K", "TQ2_0": "q8_K",
}
ACT_FORMAT: dict[GGMLQuantizationType, str] = {t: _ACT_FORMAT_BY_NAME[t.name] for t in T
                                                if t.name in _ACT_FORMAT_BY_NAME}


# --- validation shared by both backends (ggml aborts the process on what it rejects) ----------

def check_weight(w: QTensor) -> None:
    """ValueError unless ``w`` is a 2-D weight of a supported type whose bytes match its shape.

    A QTensor is immutable, so one that passed is marked and not checked again (the engine
    multiplies by the same few hundred tensors on every token)."""
    if w.__dict__.get("_checked"):
        return
    if w.ggml_type not in ACT_FORMAT:
        raise ValueError(f"{w.name}: cannot multiply weights of type {T(w.ggml_type).name}")
    if len(w.ne) != 2:
        raise ValueError(f"{w.name}: expected a 2-D weight, got ne={w.ne}")
    if min(w.ne) < 1:
        raise ValueError(f"{w.name}: empty weight, ne={w.ne}")
    block, _ = GGML_QUANT_SIZES[w.ggml_type]
    if w.ne[0] % block:
        raise ValueError(f"{w.name}: row length {w.ne[0]} is not a multiple of {T(w.ggml_type).name}'s "
                         f"block size {block}")
    data = w.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"{w.name}: data must be a 1-D C-contiguous uint8 array")
    if data.nbytes != w.nbytes:
        raise ValueError(f"{w.name}: data has {data.nbytes} bytes, {T(w.ggml_type).name} ne={w.ne} "
                         f"needs {w.nbytes}")
    object.__setattr__(w, "_checked", True)


def check_rows(x: np.ndarray, width: int, what: str) -> np.ndarray:
    """x as a C-contiguous (n, width) float32 array, n >= 1; ValueError otherwise."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != width or x.shape[0] < 1:
        raise ValueError(f"{what}: expected input of shape (n>=1, {width}), got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{what}: expected floating-point input, got {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def check_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray) -> np.ndarray:
    """Validate an expert FFN's weights and input; returns x as C-contiguous (n, n_embd) float32.

    gate/up ne = (n_embd, n_ff), down ne = (n_ff, n_embd).
    """
    for w in (gate, up, down):
        check_weight(w)
    if gate.ne != up.ne:
        raise ValueError(f"{gate.name} ne={gate.ne} and {up.name} ne={up.ne} must have the same shape")
    n_embd, n_ff = gate.ne
    if down.ne != (n_ff, n_embd):
        raise ValueError(f"{down.name}: expected ne=({n_ff}, {n_embd}) to match {gate.name} ne={gate.ne}, "
                         f"got {down.ne}")
    return check_rows(x, n_embd, gate.name)


# --- numpy backend ----------------------------------------------------------------------------

class DequantCache:
    """Bounded LRU of dequantised weights, keyed by the tensor's data pointer, size and type.

    Each entry keeps a reference to the source bytes, so the memory (a GGUF memmap) cannot be
    unmapped and its address reused while the entry lives. Thread-safe; two threads missing at
    once may both dequantise, and the second result replaces the first.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple, tuple[np.ndarray, np.ndarray | None, np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(w: QTensor) -> tuple:
        return (w.data.ctypes.data, w.data.nbytes, int(w.ggml_type), tuple(w.ne))

    def get(self, w: QTensor) -> tuple[np.ndarray, np.ndarray | None]:
        """(W (ne1, ne0) float64, Q4_1/Q5_1 block minima (ne1, ne0/32) float64 or None)."""
        key = self._key(w)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0], hit[1]
        dense = w.f32().astype(np.float64)
        mins = _block_minima(w) if ACT_FORMAT[w.ggml_type] == "q8_1" else None
        size = dense.nbytes + (0 if mins is None else mins.nbytes)
        if size <= self.max_bytes:
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self.bytes -= old[3]
                self._entries[key] = (dense, mins, w.data, size)
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, evicted = self._entries.popitem(last=False)
                    self.bytes -= evicted[3]
        return dense, mins

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _block_minima(w: QTensor) -> np.ndarray:
    """The per-block minimum ``m`` (f16 at byte 2 of each Q4_1/Q5_1 block), (ne1, ne0/32) float64."""
    block, type_size = GGML_QUANT_SIZES[w.ggml_type]
    blocks = w.data.reshape(w.ne[1], w.ne[0] // block, type_size)
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float64)


def _cache_bytes_from_env() -> int:
    value = os.environ.get(ENV_CACHE_MB)
    if not value:
        return DEFAULT_CACHE_MB << 20
    try:
        mb = float(value)
    except ValueError:
        raise ValueError(f"{ENV_CACHE_MB}={value!r}: expected a size in MiB") from None
    if mb < 0:
        raise ValueError(f"{ENV_CACHE_MB}={value!r}: expected a size in MiB")
    return int(mb * (1 << 20))


class NumpyBackend:
    """ggml's CPU numerics emulated in numpy (activation rounding + float64 accumulation)."""

    name = "numpy"

    def __init__(self, cache_bytes: int | None = None):
        self.cache = DequantCache(_cache_bytes_from_env() if cache_bytes is None else cache_bytes)

    def matmul(self, w: QTensor, x: np.ndarray, *, routed: bool = False) -> np.ndarray:
        """x (n, ne0) float32 -> (n, ne1) float32. ``routed`` changes nothing here (it selects
        ggml's op); kept so both backends take the same arguments."""
        check_weight(w)
        x = check_rows(x, w.ne[0], w.name)
        dense, mins = self.cache.get(w)  # (ne1, ne0) f64
        fmt = ACT_FORMAT[w.ggml_type]
        if fmt == "q8_0":
            xa = actquant.q8_0(x)
        elif fmt == "q8_K":
            xa = actquant.q8_K(x)
        elif fmt == "f16":
            xa = actquant.f16(x).astype(np.float64)
        elif fmt == "bf16":
            xa = actquant.bf16(x).astype(np.float64)
        elif fmt == "q8_1":
            d, s, q = actquant.quantize_q8_1(x)  # (n, nb), (n, nb), (n, nb, 32)
            d64 = d.astype(np.float64)
            xa = (d64[..., None] * q).reshape(x.shape)
            # ggml takes the weights' minimum term as m * s with s = f16(d_f32 * sum q), where
            # the dequantised product gives m * d_f16 * sum q: add the difference.
            qsum = q.astype(np.int64).sum(axis=-1)
            delta = s.astype(np.float64) - d64 * qsum  # (n, nb)
            return (xa @ dense.T + delta @ mins.T).astype(np.float32)
        else:  # f32
            xa = x.astype(np.float64)
        return (xa @ dense.T).astype(np.float32)


# --- ggml backend -----------------------------------------------------------------------------

class GgmlBackend:
    """llama.cpp's CPU kernels through ctypes (``kernels/ggml.py``)."""

    name = "ggml"

    def __init__(self):
        from kernels import ggml

        ggml.load()  # raises GgmlUnavailable
        self._ggml = ggml

    def matmul(self, w: QTensor, x: np.ndarray, *, routed: bool = False) -> np.ndarray:
        """x (n, ne0) float32 -> (n, ne1) float32 via ``ggml_mul_mat`` (``routed``: ``ggml_mul_mat_id``)."""
        return self._ggml.matmul(w, x, routed=routed)


class Backend(Protocol):
    name: str

    def matmul(self, w: QTensor, x: np.ndarray, *, routed: bool = False) -> np.ndarray: ...


_backends: dict[str, Backend] = {}
_default: Backend | None = None
_select_lock = threading.RLock()  # re-entered: the default is chosen through get_backend(name)


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name`` ("ggml" or "numpy"), or this process's default for None.

    The default follows env KVASIR_KERNEL (auto | ggml | numpy), read once. Raises
    ``kernels.ggml.GgmlUnavailable`` when ggml is asked for and cannot be loaded.
    """
    global _default
    if name is None:
        if _default is None:
            with _select_lock:
                if _default is None:
                    _default = _select_default()
        return _default
    if name not in ("ggml", "numpy"):
        raise ValueError(f"unknown kernel backend {name!r}: expected 'ggml' or 'numpy'")
    backend = _backends.get(name)
    if backend is None:
        with _select_lock:
            backend = _backends.get(name)
            if backend is None:
                backend = GgmlBackend() if name == "ggml" else NumpyBackend()
                _backends[name] = backend
    return backend


def _select_default() -> Backend:
    choice = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
    if choice in ("ggml", "numpy"):
        return get_backend(choice)
    if choice != "auto":
        raise ValueError(f"{ENV_KERNEL}={choice!r}: expected auto, ggml or numpy")
    from kernels.ggml import GgmlUnavailable

    try:
        return get_backend("ggml")
    except GgmlUnavailable:
        return get_backend("numpy")


def backend_name() -> str:
    """"ggml" or "numpy": the backend ``matmul`` and ``expert_ffn`` use in this process."""
    return get_backend().name


def matmul(w: QTensor, x: np.ndarray, *, backend: str | None = None, routed: bool = False) -> np.ndarray:
    """W applied to rows: x (n, ne0) float32 -> (n, ne1) float32, as ggml_mul_mat(W, X) computes
    on CPU (llama.cpp's numerics). ``routed=True`` computes it as llama.cpp does for a routed
    expert (``ggml_mul_mat_id``), which takes other CPU paths for 2+ rows with the ggml backend."""
    return get_backend(backend).matmul(w, x, routed=routed)
