"""Who computes the routed experts of a layer step.

The engine hands an :class:`ExpertBackend` every selected expert of one layer with all the rows
that chose it, and gets back one output per expert in the same order. :class:`LocalExperts`
computes them here with the worker's own function; the sharded backend (dispatch over NATS)
has the same interface and falls back to a :class:`LocalExperts` for anything it cannot get.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import numpy as np

from kernels.expert import expert_ffn


class ExpertBackend(Protocol):
    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """calls: (expert, rows (n, D) float32) -> outputs (n, D) float32, in the same order."""


class LocalExperts:
    """Every expert computed on this node from the resident GGUF (the fallback replica)."""

    def __init__(self, weights):
        self.weights = weights
        self.calls: Counter[int] = Counter()  # per layer
        self.rows: Counter[int] = Counter()

    def compute(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        self.calls[layer] += 1
        self.rows[layer] += len(rows)
        return expert_ffn(*self.weights.expert(layer, expert), rows, routed=True)

    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        return [self.compute(layer, e, rows) for e, rows in calls]
