"""Thread and kernel-mode settings that must be in place before numpy (OpenBLAS) or ggml
(OpenMP) load.

On small machines OpenBLAS' idle threads and ggml's OpenMP threads busy-wait against each
other: alternating numpy and ggml calls made a 1-row ggml matmul 30x slower in a probe. A short
OpenBLAS thread timeout fixes it. ggml's OpenMP team keeps libgomp's default spin, as llama.cpp
runs: its per-node barriers are ``omp barrier``, and with a short GOMP_SPINCOUNT a waiting thread
sleeps and, on cores shared with another busy process, waits for the scheduler at every node
(llama.cpp's prefill at half speed; see bench/engine.py).

The kernel mode (env ``KVASIR_KERNEL_MODE``: ``fast``, the default, or ``deterministic``) decides
``GGML_CPU_TILED_MM``, which ggml's CPU backend reads once when it loads:

- ``fast``: llama.cpp's default kernels. From 8 rows on, a K-quant weight goes to the "tiled"
  kernel, which sums in another order than the one-row kernel, so a token's logits depend on
  what else is in its batch (and on how many tokens of a batch chose the same expert).
- ``deterministic``: batch-invariant. ``GGML_CPU_TILED_MM=0`` keeps every K-quant product on one
  kernel whatever the batch size, and ``kernels/ggml.py`` runs one-row dense products as two
  rows (tinyBLAS, like a prompt batch), so every sequence gets exactly its logits alone.

llama.cpp in the same process (the reference of ``kvasir verify``) loads the same libggml-cpu
and so runs with the same setting. The mode wins over a ``GGML_CPU_TILED_MM`` set by hand.
"""

import os

ENV_MODE = "KVASIR_KERNEL_MODE"
ENV_THREADS = "KVASIR_THREADS"
MODES = ("fast", "deterministic")

DEFAULTS = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
}


def kernel_mode() -> str:
    """``fast`` or ``deterministic``, from env KVASIR_KERNEL_MODE (default fast)."""
    value = os.environ.get(ENV_MODE, "").strip().lower() or "fast"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r}: expected fast or deterministic")
    return value


def set_kernel_mode(mode: str) -> None:
    """Record ``mode`` in the environment (inherited by the worker processes this one starts)
    and set ggml's switch for it. Takes effect only if ggml has not loaded yet: callers go
    through ``kernels.backend.set_mode``, which checks that."""
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r}: expected fast or deterministic")
    os.environ[ENV_MODE] = mode
    os.environ["GGML_CPU_TILED_MM"] = "0" if mode == "deterministic" else "1"


def set_threads(n: int) -> None:
    """Threads per ggml call in this process and the processes it starts (env KVASIR_THREADS)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    os.environ[ENV_THREADS] = str(n)


def default_threads(local_processes: int = 1) -> int:
    """Threads per ggml call when ``local_processes`` compute processes share this machine:
    the cores split between them, at least one each, so that their OpenMP teams do not spin
    against each other for the same cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_processes))


def add_kernel_flags(p, *, deterministic: bool = True) -> None:
    """``--deterministic`` and ``--threads N`` on a command that computes (applied by
    ``kernels.backend.apply_kernel_flags`` before anything loads ggml)."""
    if deterministic:
        p.add_argument("--deterministic", action="store_true",
                       help="batch-invariant kernels: each sequence gets exactly the logits it gets "
                       "alone, whatever else is batched (default: llama.cpp's faster default kernels)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads per ggml call (default: env KVASIR_THREADS, else this machine's "
                   "cores split between the compute processes started here)")


for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
try:
    set_kernel_mode(kernel_mode())
except ValueError:  # reported where the mode is read (kernels.backend), with the flag to fix it
    pass
