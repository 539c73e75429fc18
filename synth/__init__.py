"""``kvasir synth``: synthetic MoE GGUF models in real llama.cpp architectures, with a byte-level
BPE vocabulary that llama.cpp tokenizes, so that tests and demos run the code real models run.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
