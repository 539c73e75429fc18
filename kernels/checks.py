"""What every kernel checks before it computes, and the table both backends follow.

ggml aborts the process on a failed assertion, so every public kernel validates its weights
and rows here first and raises ``ValueError`` with the tensor's name instead. Both backends
(``kernels/backend.py``) and the ggml binding (``kernels/ggml.py``) import this module; it
imports neither, which is what keeps them free of an import loop.
"""

from __future__ import annotations

import weakref

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.tensors import QTensor

T = GGMLQuantizationType

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

# Weights that passed check_weight, by identity. A QTensor is immutable, so passing once is
# passing for good; the engine multiplies by the same few hundred tensors on every token.
# Weak: a tensor dropped by its owner leaves the set (and its id cannot be mistaken for a new one).
_passed: "weakref.WeakSet[QTensor]" = weakref.WeakSet()


def check_weight(w: QTensor, dims: int = 2) -> None:
    """ValueError unless ``w`` is a ``dims``-D weight (2, or 3 for an expert slab) of a supported
    type whose bytes match its shape."""
    if w in _passed and len(w.ne) == dims:
        return
    if w.ggml_type not in ACT_FORMAT:
        raise ValueError(f"{w.name}: cannot multiply weights of type {T(w.ggml_type).name}")
    if len(w.ne) != dims:
        raise ValueError(f"{w.name}: expected a {dims}-D weight, got ne={w.ne}")
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
    _passed.add(w)


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

    gate/up ne = (n_embd, n_ff), down ne = (n_ff, n_embd); biases, where present, (n_ff,), (n_ff,)
    and (n_embd,) float32; the gate's activation one of :data:`GLUS`.
    """
    for w in (gate, up, down):
        check_weight(w)
    if gate.ne != up.ne:
        raise ValueError(f"{gate.name} ne={gate.ne} and {up.name} ne={up.ne} must have the same shape")
    n_embd, n_ff = gate.ne
    if down.ne != (n_ff, n_embd):
        raise ValueError(f"{down.name}: expected ne=({n_ff}, {n_embd}) to match {gate.name} ne={gate.ne}, "
                         f"got {down.ne}")
    if gate.glu not in GLUS:
        raise ValueError(f"{gate.name}: unknown gated activation {gate.glu!r} (known: {', '.join(GLUS)})")
    for w in (gate, up, down):
        b = w.bias
        if b is not None and (not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != (w.ne[1],)
                              or not b.flags.c_contiguous):
            raise ValueError(f"{w.name}: bias must be a C-contiguous float32 array of shape ({w.ne[1]},), got "
                             f"{getattr(b, 'dtype', type(b).__name__)} {getattr(b, 'shape', '')}")
    return check_rows(x, n_embd, gate.name)


# The gated activations an expert's gate may name, and swiglu_oai's constants (llama.cpp's
# build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE: fixed there too, not read from the file).
GLUS = ("swiglu", "swiglu_oai")
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
