"""Quantized matmul ``W x`` as llama.cpp's CPU backend computes it, in two backends.

Each backend computes ``matmul`` and ``expert_ffn`` (the :class:`Backend` protocol).

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

import contextlib
import os
import threading
from collections import OrderedDict
from typing import Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES

from kernels import actquant, glu
from kvasir_bus import threads
from kernels.checks import ACT_FORMAT, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, check_ffn, check_rows, check_weight
from kernels.tensors import QTensor


ENV_KERNEL = "KVASIR_KERNEL"
ENV_CACHE_MB = "KVASIR_DEQUANT_CACHE_MB"
DEFAULT_CACHE_MB = 1024  # float64 weights: one 3072x1024 expert (gate+up+down) is 75 MB


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

    def expert_ffn(self, gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *,
                   routed: bool, plain: bool = False) -> np.ndarray:
        """down(silu(gate x) * up x): x (n, n_embd) f32 -> (n, n_embd) f32, three matmuls with
        ggml's activation rounding and ggml's swiglu rounding between them (one layout only:
        ``plain`` changes nothing)."""
        x = check_ffn(gate, up, down, x)
        _, _, h = self.hidden(gate, up, x)
        y = self.matmul(down, h, routed=routed)  # (n, n_embd)
        return y if down.bias is None else y + down.bias

    def hidden(self, gate: QTensor, up: QTensor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The gate and up projections (biases added) and the activation ``h`` the down projection
        multiplies, each (n, n_ff) float32, of checked rows x (n, n_embd) float32."""
        g = self.matmul(gate, x)  # (n, n_ff)
        u = self.matmul(up, x)  # (n, n_ff)
        if gate.bias is not None:
            g = g + gate.bias
        if up.bias is not None:
            u = u + up.bias
        h = swiglu_oai(g, u) if gate.glu == "swiglu_oai" else silu_mul(g, u)
        return g, u, h


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss' activation as ``ggml_swiglu_oai`` computes it: x = min(g, limit), y = clamp(u,
    -limit, limit), x * sigmoid(alpha x) * (y + 1), float32 (n, n_ff) each -> (n, n_ff), in
    ggml's float32 operations with glibc's expf (``kernels/glu.py``)."""
    return glu.swiglu_oai(g, u, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, float32 (n, n_ff) each -> float32 (n, n_ff), as ``ggml_vec_swiglu_f32``
    computes it on an AVX-512 CPU: its vector exp and silu in float32, FMA for FMA
    (``kernels/glu.py``), the same bits on every CPU numpy runs on."""
    return glu.swiglu(g, u)


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

    def expert_ffn(self, gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *,
                   routed: bool, plain: bool = False) -> np.ndarray:
        """The whole FFN as one ggml graph, the ops llama.cpp builds (``kernels.ggml.expert_ffn``;
        ``plain``: a routed call in the plain layout whatever its rows)."""
        return self._ggml.expert_ffn(gate, up, down, x, routed=routed, plain=plain)


class Backend(Protocol):
    """What a kernel backend computes; both give llama.cpp's CPU numerics (to ~1e-6 for numpy)."""

    name: str

    def matmul(self, w: QTensor, x: np.ndarray, *, routed: bool = False) -> np.ndarray:
        """W applied to rows: x (n, ne0) float32 -> (n, ne1) float32."""

    def expert_ffn(self, gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *,
                   routed: bool) -> np.ndarray:
        """One expert's SwiGLU FFN: x (n, n_embd) float32 -> (n, n_embd) float32."""


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


def kernel_label(backend: str | None = None, machine: str | None = None, mode: str | None = None,
                 repack: bool | None = None) -> str:
    """What a node announces as its kernel: the backend, the CPU architecture and, for ggml,
    ``-det`` in deterministic mode, ``-repack`` after it where the mode repacks (the fast mode
    its dense weights and its routed experts' calls of fewer than 8 rows, the deterministic
    mode its routed experts: ``kernels.ggml.expert_layout``)
    (``ggml-x86_64-repack``, ``ggml-x86_64``, ``ggml-x86_64-det-repack``, ``ggml-x86_64-det``,
    ``numpy-aarch64``). ggml's dot products have one implementation per architecture and round
    differently, its two modes take different kernels from 8 rows on, and its repacked kernels
    sum in another order: two nodes with the same label give identical bits. numpy is
    batch-invariant in both modes (it emulates the one-row kernel). ``repack`` None: this
    process's setting when ``mode`` is this process's mode (or None); for the other mode, the
    fast one's off and the deterministic one's what this machine's ggml would do."""
    import platform

    backend = backend or backend_name()
    label = f"{backend}-{machine or platform.machine() or 'unknown'}"
    if backend != "ggml":
        return label
    own_mode = kernel_mode()
    mode = mode or own_mode
    if mode == "deterministic":  # -repack here: its routed experts repacked (kernels.ggml.expert_layout)
        if repack is None:
            repack = _repack_experts_setting() if mode == own_mode else _repack_possible()
        return label + "-det-repack" if repack else label + "-det"
    if repack is None:
        repack = mode == own_mode and _repack_setting()
    if not repack:
        return label
    # the routed experts' layout where it is not the default rule (kernels.ggml.expert_layout)
    layout = _expert_layout_setting() if mode == own_mode else "rows"
    return label + "-repack" + {"rows": "", "repacked": "-xall", "plain": "-xplain"}[layout]


def kernel_mode() -> str:
    """``fast`` (llama.cpp's default kernels) or ``deterministic`` (batch-invariant): fixed in
    a process once ggml has loaded, else what env KVASIR_KERNEL_MODE says."""
    from kernels.ggml import loaded_mode

    return loaded_mode() or threads.kernel_mode()


def set_mode(mode: str) -> None:
    """Choose the kernel mode of this process (and of the workers it starts). Raises
    ``ValueError`` when ggml has already loaded in the other mode: it reads its switch once."""
    from kernels.ggml import loaded_mode

    loaded = loaded_mode()
    if loaded is not None and loaded != mode:
        raise ValueError(f"kernel mode {mode!r} asked for after ggml loaded in mode {loaded!r}; "
                         f"set {threads.ENV_MODE}={mode} before the process starts")
    threads.set_kernel_mode(mode)


def kernel_settings() -> dict:
    """The kernel settings this process computes with, as ``kvasir verify`` and the benchmarks
    report them: the same ggml switches apply to llama.cpp loaded in this process."""
    mode = kernel_mode()
    return {"backend": backend_name(), "mode": mode, "label": kernel_label(),
            "tiled_mm": mode == "fast", "one_row_as_two": mode == "deterministic",
            "flash_attn": _flash_attn_setting(mode),
            "repack": _repack_setting(), "repack_experts": _repack_experts_setting(),  # kernels.ggml.expert_layout
            "expert_layout": _expert_layout_setting(),
            "threads": _threads_setting(), "decode_threads": _decode_threads()}


def _flash_attn_setting(mode: str) -> bool:
    """Whether attention is ggml's flash attention (``kernels.dense.flash_attn``): the fast
    mode's default, env KVASIR_FLASH_ATTN=0 turns it off; never in the deterministic mode."""
    from kernels.ggml import flash_attn_setting, load, loaded_mode

    if loaded_mode() is not None:  # fixed as ggml loaded
        return bool(load().flash_attn)
    return mode == "fast" and flash_attn_setting()


def _decode_threads() -> int:
    from kernels.ggml import decode_threads

    return decode_threads()


def _expert_layout_setting() -> str:
    """How the routed experts' calls take their layout (``kernels.ggml.expert_layout``): ``rows``
    by their rows (the default), ``repacked`` or ``plain`` every call (KVASIR_EXPERT_LAYOUT)."""
    if backend_name() != "ggml":
        return "plain"
    from kernels import ggml

    return ggml.load().expert_layout


def _repack_experts_setting() -> bool:
    from kernels import ggml

    return backend_name() == "ggml" and ggml.repack_experts_enabled()


def _repack_possible() -> bool:
    """Whether a process of the other mode on this machine would repack (its ggml has the
    repack buffer, KVASIR_REPACK is not 0)."""
    from kernels import ggml

    return (backend_name() == "ggml" and ggml.load().repack_buft is not None
            and os.environ.get(ggml.ENV_REPACK, "1") != "0")


def _repack_setting() -> bool:
    from kernels import ggml

    return backend_name() == "ggml" and ggml.repack_enabled()


def _threads_setting() -> int:
    from kernels.ggml import n_threads

    return n_threads()


def apply_kernel_flags(args, *, local_processes: int = 1, share: bool = False) -> None:
    """Apply ``--deterministic`` / ``--threads`` before anything loads ggml. Without
    ``--deterministic`` the mode is left to env KVASIR_KERNEL_MODE (default fast); without
    ``--threads`` and KVASIR_THREADS the cores are split over ``local_processes``, and with
    ``share`` (the serving commands) this process then keeps its threads at the cores the
    machine's other processes leave free (``kvasir_bus.threads.share_cores``)."""
    from kvasir_bus.errors import UsageError

    try:
        if getattr(args, "deterministic", False):
            set_mode("deterministic")
        else:
            kernel_mode()  # a bad KVASIR_KERNEL_MODE fails here, as a usage error
        from kernels.ggml import expert_layout_setting

        expert_layout_setting()  # and a bad KVASIR_EXPERT_LAYOUT
        n = getattr(args, "threads", None)
        if n is not None:
            if n < 1:
                raise ValueError(f"--threads must be >= 1, got {n}")
            threads.set_threads(n)
        elif not os.environ.get(threads.ENV_THREADS) and local_processes > 1:
            threads.set_threads(threads.default_threads(local_processes))
        elif share:
            threads.share_cores()  # a KVASIR_THREADS set by hand wins (share_cores does nothing)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def thread_cap(n: int):
    """A context in which this thread's kernel calls run on at most ``n`` threads
    (``kernels.ggml.thread_cap``: one OpenMP team per thread of a process, within the CPUs);
    nothing to do for the numpy backend."""
    if backend_name() == "ggml":
        from kernels.ggml import thread_cap as ggml_thread_cap

        return ggml_thread_cap(n)
    return contextlib.nullcontext()


def backend_name() -> str:
    """"ggml" or "numpy": the backend ``matmul`` and ``expert_ffn`` use in this process."""
    return get_backend().name


def matmul(w: QTensor, x: np.ndarray, *, backend: str | None = None, routed: bool = False) -> np.ndarray:
    """W applied to rows: x (n, ne0) float32 -> (n, ne1) float32, as ggml_mul_mat(W, X) computes
    on CPU (llama.cpp's numerics). ``routed=True`` computes it as llama.cpp does for a routed
    expert (``ggml_mul_mat_id``), which takes other CPU paths for 2+ rows with the ggml backend."""
    return get_backend(backend).matmul(w, x, routed=routed)
