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

from kernels.backend import backend_name
from kernels.expert import expert_ffn, moe_ffn as ggml_moe_ffn
from kernels.flips import explained_gap


class ExpertBackend(Protocol):
    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """calls: (expert, rows (n, D) float32) -> outputs (n, D) float32, in the same order."""


class LocalExperts:
    """Every expert computed on this node from the resident GGUF (the fallback replica)."""

    def __init__(self, weights):
        self.weights = weights
        self.backend = backend_name()  # the kernel of this process: what "local" means bit for bit
        self.calls: Counter[int] = Counter()  # per layer
        self.rows: Counter[int] = Counter()

    def compute(self, layer: int, expert: int, rows: np.ndarray, *, backend: str | None = None,
                plain: bool = False) -> np.ndarray:
        """One expert on ``rows``; ``backend`` another kernel than this process's, ``plain`` the
        plain layout at any rows (to audit a worker that announced them: ``backbone.audit``)."""
        self.calls[layer] += 1
        self.rows[layer] += len(rows)
        return expert_ffn(*self.weights.expert(layer, expert), rows, routed=True, backend=backend, plain=plain)

    def explained_gap(self, layer: int, expert: int, rows: np.ndarray, reply: np.ndarray) -> float:
        """A foreign kernel's reply against the numpy kernel, its quant-step flips taken out
        (``kernels.flips.explained_gap``): what the audit bounds for a kernel it cannot rerun."""
        self.calls[layer] += 1
        self.rows[layer] += len(rows)
        return explained_gap(*self.weights.expert(layer, expert), rows, reply)

    def weight_type(self, layer: int) -> int:
        """The ggml type of a layer's down-projection experts (the audit's tolerance keys on it)."""
        return int(self.weights.expert(layer, 0)[2].ggml_type)

    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        if self.backend != "ggml" or not calls:
            return [self.compute(layer, e, rows) for e, rows in calls]
        # All of them in one ggml graph (mul_mat_id, as llama.cpp): each expert still sees
        # exactly its rows, so each output has the bits compute() gives it alone.
        counts = [len(rows) for _, rows in calls]
        x = np.concatenate([rows for _, rows in calls]) if len(calls) > 1 else calls[0][1]
        ids = np.repeat(np.array([e for e, _ in calls], dtype=np.int32), counts)[:, None]
        out = self.run_ids(layer, x, ids)[:, 0]
        return np.split(out, np.cumsum(counts)[:-1])

    def run_ids(self, layer: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Rows ``x`` (T, D) through the experts ``ids`` (T, K) of ``layer`` in one ggml graph:
        (T, K, D) float32, each slot the bits :meth:`compute` gives that expert's rows."""
        blk = self.weights.layers[layer]
        out = ggml_moe_ffn(blk.ffn_gate_exps, blk.ffn_up_exps, blk.ffn_down_exps, x, ids,
                           biases=(blk.ffn_gate_exps_bias, blk.ffn_up_exps_bias, blk.ffn_down_exps_bias),
                           glu=self.weights.expert_glu)
        # (counted once the call has checked the ids are the layer's experts; np.unique: 4-5x slower)
        self.calls[layer] += int(np.count_nonzero(np.bincount(np.ravel(ids))))
        self.rows[layer] += ids.size
        return out
