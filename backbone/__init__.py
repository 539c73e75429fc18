"""The backbone: the dense path of an MoE model (attention, KV cache, norms, router, shared
expert, combine, output head, sampling, tokenisation), with every expert resident as the
fallback replica. With no workers it is a complete single-node engine (milestone M0).
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
