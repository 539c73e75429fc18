"""One expert's SwiGLU FFN: the pure function a worker computes, and the backbone's fallback.

    y = down( silu(gate x) * up x )        x (n, n_embd) -> y (n, n_embd)

with ``gate``/``up`` of ne (n_embd, n_ff) and ``down`` of ne (n_ff, n_embd), each weight in
its GGUF quantization. The result is the expert's output before the router weight is applied
(llama.cpp multiplies by the weight after ``down``).

Rounding follows llama.cpp on CPU: each matmul rounds its input the ggml way
(``kernels/actquant.py``), ``silu(g) * u`` is rounded to float32 before ``down`` quantizes
it. With the ggml backend the three matmuls and the SwiGLU run as one ggml graph, the same ops
llama.cpp builds: ``ggml_mul_mat_id`` for routed experts (``build_moe_ffn``), ``ggml_mul_mat``
for a shared expert (``build_ffn``). The two ops take different CPU paths for 2+ rows, so pick
the one matching the tensor (``routed``; by default inferred from the GGUF name: ``*_exps``
is routed, anything else, e.g. ``ffn_gate_shexp``, dense).
"""

from __future__ import annotations

import numpy as np

from kernels import backend as backends
from kernels.tensors import QTensor


def is_routed(w: QTensor) -> bool:
    """Whether ``w`` belongs to a routed expert (``ffn_*_exps``, or an expert slab of it)."""
    return "_exps" in w.name


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, float32 (n, n_ff) each -> float32 (n, n_ff); silu evaluated in float64 and
    rounded once, then multiplied in float32 as ``ggml_vec_swiglu_f32`` does."""
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        s = (g64 / (1.0 + np.exp(-g64))).astype(np.float32)
    return s * u


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *,
               routed: bool | None = None, backend: str | None = None) -> np.ndarray:
    """One expert's SwiGLU FFN: down(silu(gate(x)) * up(x)). x (n, n_embd) f32 -> (n, n_embd) f32.

    gate/up have ne (n_embd, n_ff), down has ne (n_ff, n_embd). Pure function; the exact code
    a worker runs. ``routed``: compute as llama.cpp computes a routed expert (True) or a dense
    FFN / shared expert (False); None infers it from ``gate.name``. ``backend``: "ggml" or
    "numpy", None for this process's default (``kernels.backend.backend_name()``).
    Raises ValueError on mismatched shapes or unsupported types.
    """
    x = backends.check_ffn(gate, up, down, x)
    if routed is None:
        routed = is_routed(gate)
    impl = backends.get_backend(backend)
    if impl.name == "ggml":
        from kernels import ggml

        return ggml.expert_ffn(gate, up, down, x, routed=routed)
    g = impl.matmul(gate, x, routed=routed)  # (n, n_ff)
    u = impl.matmul(up, x, routed=routed)  # (n, n_ff)
    return impl.matmul(down, silu_mul(g, u), routed=routed)  # (n, n_embd)
