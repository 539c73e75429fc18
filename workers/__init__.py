"""Expert workers: hold a slice of a GGUF's experts and compute a pure function of it.

A worker has no transformer: no attention, no KV cache, no sampler, no tokenizer. Its core
install is numpy, gguf, msgpack, nats-py and structlog: no compiler needed.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
