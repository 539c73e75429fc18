"""The only compute code: tensors over GGUF bytes, one ggml binding, the numpy backend, ggml's
activation rounding, the expert FFN and the dense ops the backbone runs (RoPE, norms, softmax,
attention). Not a role: the backbone and the workers both import it, and it imports no role.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
