"""llama.cpp as the reference engine (through llama-cpp-python), for ``kvasir verify``,
the parity tests and the benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import numpy as np

from kvasir_bus.errors import DependencyError, ModelFileError


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise DependencyError("this needs llama-cpp-python (pip install 'kvasir-bus[backbone]')") from None
    return llama_cpp


def quiet_llama(llama_cpp, path: str, **kwargs):
    """A ``llama_cpp.Llama`` that logs nothing and fails with a one-line error."""
    kwargs.setdefault("verbose", False)
    with _stderr_silenced():  # llama.cpp prints some warnings even when not verbose
        try:
            return llama_cpp.Llama(model_path=path, **kwargs)
        except Exception as exc:
            raise ModelFileError(f"{path}: llama.cpp cannot load it ({exc})") from None


@contextlib.contextmanager
def _stderr_silenced():
    """Point file descriptor 2 at /dev/null for the duration (C code writes there directly)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (e.g. captured): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        # llama-cpp-python's log callback prints through sys.stderr, which may not be fd 2.
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class Reference:
    """llama.cpp on one model, as its CPU backend computes by default except for settings that
    change the kernels, not the model: flash attention as this process's engine computes
    attention (``flash_attn`` None: ``kernels.dense.flash_attn``, on in the fast mode by
    default, off in the deterministic one) and, with ``repack=False``, no repacking of dense weights into interleaved
    layouts (llama.cpp's default repacks Q4_0/Q4_K/IQ4_NL... weights for other kernels that round
    in another order; our fast mode repacks the same dense weights, the deterministic mode none).
    ``repack_experts``: whether the routed experts are repacked (None: llama.cpp's default with
    ``repack``, this process's setting without it: our deterministic mode repacks them)."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_threads: int | None = None, n_batch: int = 512,
                 repack: bool = False, logits_all: bool = True, repack_experts: bool | None = None,
                 flash_attn: bool | None = None):
        llama_cpp = import_llama_cpp()
        self.path = os.fspath(path)
        if flash_attn is None:  # as this process attends (kernels.dense.flash_attn)
            from kernels.backend import kernel_settings

            flash_attn = kernel_settings()["flash_attn"]
        self.flash_attn = bool(flash_attn)
        if not repack and repack_experts is None:  # as this process: the deterministic mode repacks experts
            from kernels.backend import kernel_settings

            repack_experts = kernel_settings()["repack_experts"]
        fields = {"use_extra_bufts": repack or bool(repack_experts)}
        overrides = None
        if repack and repack_experts is False:  # our fast mode with KVASIR_EXPERT_LAYOUT=plain (kernels.ggml.expert_layout)
            overrides = _plain_override(b"_exps")
        elif not repack and repack_experts:  # as our deterministic mode: only the routed experts repacked
            overrides = _plain_override(_NOT_EXPERTS)
        if overrides is not None:
            self._overrides = overrides  # read by llama.cpp as it loads; kept with the model
            fields["tensor_buft_overrides"] = ctypes.addressof(overrides[0])
        with _model_params(llama_cpp, **fields):
            self.llm = quiet_llama(llama_cpp, self.path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                   logits_all=logits_all, flash_attn=self.flash_attn,
                                   n_threads=n_threads or os.cpu_count(),
                                   n_threads_batch=n_threads or os.cpu_count())

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits (len(tokens), n_vocab) float32 of every position, from a fresh KV cache."""
        self.llm.reset()
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def logits_as_generated(self, tokens: list[int], n_prompt: int) -> np.ndarray:
        """Logits (len(tokens), n_vocab) float32 as a generation computes them: the first
        ``n_prompt`` tokens as one batch, then each later token alone (llama.cpp's decode), as
        our engine ran them. Outside the batch-invariant mode a row's kernels depend on the
        batch it is in, so only this order compares like with like."""
        self.llm.reset()
        self.llm.eval(list(tokens[:n_prompt]))
        rows = [np.array(self.llm.scores[:n_prompt], dtype=np.float32)]
        for token in tokens[n_prompt:]:
            self.llm.eval([token])
            rows.append(np.array(self.llm.scores[self.llm.n_tokens - 1:self.llm.n_tokens], dtype=np.float32))
        return np.concatenate(rows)

    def decode_tokens_per_s(self, prompt: list[int], n: int) -> tuple[float, float]:
        """(prefill tokens/s, decode tokens/s) of a prompt then n single-token steps."""
        import time

        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(prompt))
        t1 = time.perf_counter()
        token = int(np.argmax(self.llm.scores[len(prompt) - 1]))
        for _ in range(n):
            self.llm.eval([token])
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        t2 = time.perf_counter()
        return len(prompt) / (t1 - t0), n / (t2 - t1)


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]  # llama_model_tensor_buft_override


_NOT_EXPERTS = b"^(?!.*_exps)"  # every tensor but the routed experts' (llama.cpp's std::regex_search, ECMAScript)


def _plain_override(pattern: bytes) -> tuple:
    """``tensor_buft_overrides`` that keep the tensors whose names match ``pattern`` (``_exps``:
    the routed experts; :data:`_NOT_EXPERTS`: all others) in a plain host buffer while every
    other weight goes where llama.cpp puts it (its extra, repacking buffer types). Overriding to ``ggml_backend_cpu_buffer_type()`` itself would not do: llama.cpp
    then tries the extra types first. The type of a buffer made over host memory
    (``ggml_backend_cpu_buffer_from_ptr``, "CPU_Mapped", the type of llama.cpp's own mapped
    weights) is plain and not that pointer. Returns (the NULL-terminated array, what it needs
    kept alive)."""
    from kernels.ggml import aligned_empty, lib_dir

    base = ctypes.CDLL(str(lib_dir() / "libggml-base.so"), mode=getattr(os, "RTLD_GLOBAL", ctypes.RTLD_GLOBAL))
    base.ggml_backend_cpu_buffer_from_ptr.restype = ctypes.c_void_p
    base.ggml_backend_cpu_buffer_from_ptr.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base.ggml_backend_buffer_get_type.restype = ctypes.c_void_p
    base.ggml_backend_buffer_get_type.argtypes = [ctypes.c_void_p]
    host = aligned_empty(64)  # ggml asserts the buffer's alignment
    buffer = base.ggml_backend_cpu_buffer_from_ptr(host.ctypes.data, host.nbytes)
    buft = base.ggml_backend_buffer_get_type(buffer)
    return (_BuftOverride * 2)(_BuftOverride(pattern, buft), _BuftOverride(None, None)), host, buffer


@contextlib.contextmanager
def _model_params(llama_cpp, **fields):
    """llama-cpp-python has no argument for some model params: set them on the defaults it reads."""
    low = llama_cpp.llama_cpp  # the ctypes module llama_cpp.Llama reads its defaults from
    original = low.llama_model_default_params

    def patched():
        params = original()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    low.llama_model_default_params = patched
    try:
        yield
    finally:
        low.llama_model_default_params = original


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    """The verify report: positions, max |diff|, min cosine, argmax agreement (0..1)."""
    if ours.shape != ref.shape:
        raise ValueError(f"logit shapes differ: ours {ours.shape}, llama.cpp {ref.shape}")
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {
        "positions": int(a.shape[0]),
        "max_abs_diff": float(np.abs(a - b).max()),
        "min_cosine": float(cos.min()),
        "argmax_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
    }
