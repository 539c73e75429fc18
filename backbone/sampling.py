"""Choosing the next token from logits: greedy, or temperature + top-p with a seeded RNG."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasir_bus.errors import UsageError


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, cfg: SamplerConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits (V,) -> token id."""
        if self.cfg.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.cfg.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cumulative, self.cfg.top_p)) + 1]  # smallest set with mass >= top_p
        q = p[keep] / p[keep].sum()
        return int(keep[self.rng.choice(len(keep), p=q)])
