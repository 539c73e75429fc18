"""One expert's SwiGLU FFN: the pure function a worker computes, and the backbone's fallback.

    y = down( silu(gate x) * up x )        x (n, n_embd) -> y (n, n_embd)

with ``gate``/``up`` of ne (n_embd, n_ff) and ``down`` of ne (n_ff, n_embd), each weight in
its GGUF quantization. The result is the expert's output before the router weight is applied
(llama.cpp multiplies by the weight after ``down``).

gpt-oss' experts are the same function with what their tensors carry: a bias row on each
projection (``QTensor.bias``, added after the product) and, named by the gate
(``QTensor.glu``), the clamped activation ``swiglu_oai``:

    y = down( swiglu_oai(gate x + bg, up x + bu) ) + bd,
    swiglu_oai(g, u) = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)

The weights arrive as the same three tensors either way, from the backbone's GGUF or from a
worker's slice (which stores the bias rows of the experts it holds), so no caller changes.

Rounding follows llama.cpp on CPU: each matmul rounds its input the ggml way
(``kernels/actquant.py``), ``silu(g) * u`` is rounded to float32 before ``down`` quantizes
it. With the ggml backend the three matmuls and the SwiGLU run as one ggml graph, the same ops
llama.cpp builds: ``ggml_mul_mat_id`` for routed experts (``build_moe_ffn``), ``ggml_mul_mat``
for a shared expert (``build_ffn``). The two ops take different CPU paths for 2+ rows, so the
caller says which one it computes (``routed``): it knows where the tensors came from (the
backbone's ``ffn_*_exps`` slabs or its ``ffn_*_shexp``; a worker's slice holds routed
experts only). A tensor's name is only a label and decides nothing.
"""

from __future__ import annotations

import numpy as np

from kernels import backend as backends
from kernels.tensors import QTensor


# The routed experts' activation per llama.cpp architecture, where it is not swiglu (the same
# as backbone.config's ArchTraits.expert_glu, which a test keeps equal): what a slice of that
# architecture's model computes, and whether its experts carry bias rows.
EXPERT_GLU: dict[str, str] = {"gpt-oss": "swiglu_oai"}


def one_thread():
    """A context in which this thread's expert calls run on it alone, without an OpenMP team:
    for calls small enough to compute inline, so that one thread of the process leads a team
    (``kernels.ggml.one_thread`` says why; nothing to do for the numpy backend)."""
    return backends.thread_cap(1)


def expert_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, *,
               routed: bool, backend: str | None = None, plain: bool = False) -> np.ndarray:
    """One expert's SwiGLU FFN: down(silu(gate(x)) * up(x)). x (n, n_embd) f32 -> (n, n_embd) f32.
    With biases and ``gate.glu == "swiglu_oai"``: gpt-oss' expert (see the module docstring).

    gate/up have ne (n_embd, n_ff), down has ne (n_ff, n_embd). Pure function; the exact code
    a worker runs. ``routed``: compute as llama.cpp computes a routed expert (True) or a dense
    FFN / shared expert (False). ``backend``: "ggml" or "numpy", None for this process's
    default (``kernels.backend.backend_name()``). ``plain``: ggml's plain layout for a routed
    call of any rows (``kernels.ggml.expert_layout`` takes it by the rows otherwise).
    Raises ValueError on mismatched shapes or unsupported types.
    """
    # each backend checks the weights and rows (kernels.checks.check_ffn) before computing
    if plain:
        return backends.get_backend(backend).expert_ffn(gate, up, down, x, routed=routed, plain=True)
    return backends.get_backend(backend).expert_ffn(gate, up, down, x, routed=routed)


def moe_ffn(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray, ids: np.ndarray, *,
            biases=(None, None, None), glu: str = "swiglu") -> np.ndarray:
    """Routed experts of a whole layer at once with ggml (``kernels.ggml.moe_ffn``): x (T, D),
    ids (T, K) -> (T, K, D) float32; row t of slot k has the bits :func:`expert_ffn` (routed)
    gives expert ids[t, k] on the rows that chose it."""
    from kernels import ggml

    return ggml.moe_ffn(gate, up, down, x, ids, biases=biases, glu=glu)


def moe_step(gate: QTensor, up: QTensor, down: QTensor, k: int, *,
             biases=(None, None, None), glu: str = "swiglu"):
    """:func:`moe_ffn` for one row and ``k`` slots of these slabs, bound once
    (``kernels.ggml.MoeStep``): ``step(row (D,), slots)`` -> (k, D) float32, a view valid until
    the step's next call, with the bits ``moe_ffn(..., row[None], [slots])[0]`` gives."""
    from kernels import ggml

    return ggml.MoeStep(gate, up, down, k, biases=biases, glu=glu)


def prepare(weights) -> int:
    """Lay ``weights`` (QTensors: 3-D expert slabs, dense matrices) out for this process's
    kernels now rather than on their first call (a copy in memory, about 0.6 GB/s on 2 cores):
    in the fast mode ggml's repacking of the dense matrices, in both modes that of the routed
    experts' slabs (``kernels.ggml.expert_layout``; each slab then lets go of its mapped pages,
    which in the fast mode its calls of 8 rows or more read back), nothing otherwise. The
    backbone and the workers do it before they serve, so that no request waits a second for a
    weight. Returns the bytes laid out anew."""
    if backends.backend_name() != "ggml":
        return 0
    from kernels import ggml

    done = 0
    for w in weights:
        expert = len(w.ne) == 3 or w.slab is not None
        rp = ggml.expert_repacked(w) if expert else ggml.repacked(w)
        done += w.nbytes if rp is not None else 0
    return done
