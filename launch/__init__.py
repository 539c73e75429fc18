"""``kvasir up``: a whole local swarm in one command (NATS, the market, workers, the backbone).

The only package allowed to import every role: it orchestrates them, it computes nothing.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)
