"""Kvasir bus: the contract every role shares (subjects, codecs, fingerprints, the embedded server).

Roles (``backbone``, ``workers``, ``market``) depend on this package, never on each other,
except that the backbone imports the worker's expert kernel: its fallback *is* a local worker.
"""

from kvasir_bus import threads as _threads  # noqa: F401  (thread settings before numpy loads)

__version__ = "0.1.0"
