"""The model's GGUF files as the swarm cuts them: the slice format (expert-sliced mini-GGUFs
that record the fingerprint of their source) and the planner and writer that cut them.

Not a role: the backbone plans slices for its manifest, workers cut and load them.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
