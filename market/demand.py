"""Ranges, usage, replica targets, demand and reward rates. Pure functions over numpy arrays.

**Ranges.** The market cuts every layer that has experts into fixed blocks of
``range_experts`` consecutive experts (the last block of a layer may be shorter):
``[0, R), [R, 2R), ...``. A range is the unit of demand and of assignment; with R = 32 a range
of the 122B model is 32 x 5.3 MB = 170 MB, a sensible download for a phone.

**Replicas.** ``copies[layer, expert]`` counts the nodes holding an expert (live heartbeats
plus pending assignments). A range's replicas are the minimum over its experts: a range is
only as covered as its least-covered expert.

**Usage.** :class:`UsageTracker` sums the rows the router sent to each expert, decayed
exponentially with a half-life, over every backbone that reports. A range's ``ratio`` is its
usage per expert over the mean usage per expert (1.0 everywhere while no statistics came in).

**Targets.** Hot ranges get more replicas: ``target = min_replicas + floor(log_h(ratio))``
for ratio >= h (``h = hot_factor``, 2 by default), clamped to ``[min_replicas,
max_replicas]``. With the defaults: used under 2x the mean -> 1 replica, 2-4x -> 2, over 4x
-> 3. Balanced routing (what MoE training aims for) asks for one replica everywhere; noise
around the mean does not double the swarm.

**Demand** = ``weight x missing`` with ``missing = max(0, target - replicas)`` and
``weight = max(ratio, min_weight)``: how much its experts are used times how many replicas
it lacks. ``min_weight`` keeps a never-routed hole above zero.

**Reward rate** (per row served) = ``base_rate x target / max(1, replicas)``: a range held
by fewer nodes than it needs pays more; one held beyond its target pays less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvasir_bus.wire import Holding
from kvasir_bus.market_codec import DemandEntry, Manifest, RoutingStats

DEFAULT_RANGE_EXPERTS = 32


@dataclass(frozen=True)
class Policy:
    """How targets, demand and rewards are computed (see the module docstring)."""

    min_replicas: int = 1
    max_replicas: int = 3
    hot_factor: float = 2.0
    min_weight: float = 0.1
    base_rate: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas}, {self.max_replicas}")
        if not self.hot_factor > 1:
            raise ValueError(f"hot_factor must be > 1, got {self.hot_factor}")
        if not self.min_weight > 0 or not self.base_rate >= 0:
            raise ValueError("min_weight must be > 0 and base_rate >= 0")


@dataclass(frozen=True)
class Layout:
    """How a model's experts are cut into ranges.

    ``layers``: the layers with experts; ``expert_bytes[i]``: bytes of one expert of
    ``layers[i]``; ranges are ``range_experts`` wide (the last of a layer may be shorter).
    """

    n_layer: int
    n_expert: int
    range_experts: int
    layers: tuple[int, ...]
    expert_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.range_experts < 1:
            raise ValueError(f"range_experts must be >= 1, got {self.range_experts}")
        if len(self.layers) != len(self.expert_bytes) or not self.layers:
            raise ValueError("a layout needs at least one layer with experts and one size "
                             "per layer")

    @classmethod
    def from_manifest(cls, manifest: Manifest, range_experts: int = DEFAULT_RANGE_EXPERTS
                      ) -> Layout:
        layers = manifest.moe_layers
        return cls(n_layer=manifest.n_layer, n_expert=manifest.n_expert,
                   range_experts=min(range_experts, manifest.n_expert), layers=layers,
                   expert_bytes=tuple(manifest.expert_bytes(la) for la in layers))

    @cached_property
    def starts(self) -> np.ndarray:
        """First expert of each range within a layer."""
        return np.arange(0, self.n_expert, self.range_experts)

    @cached_property
    def ranges(self) -> tuple[Holding, ...]:
        """Every range, layer-major: ``ranges[i]`` is range ``i``."""
        ends = [min(int(s) + self.range_experts, self.n_expert) for s in self.starts]
        return tuple(Holding(layer, int(s), e) for layer in self.layers
                     for s, e in zip(self.starts, ends))

    @cached_property
    def _layer_pos(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.layers)}

    @property
    def per_layer(self) -> int:
        return len(self.starts)

    def layer_bytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer``."""
        return self.expert_bytes[self._layer_pos[layer]]

    def range_index(self, layer: int, expert: int) -> int | None:
        """Index of the range holding (layer, expert); None if the model has no such expert."""
        pos = self._layer_pos.get(layer)
        if pos is None or not 0 <= expert < self.n_expert:
            return None
        return pos * self.per_layer + expert // self.range_experts

    def range_bytes(self, index: int) -> int:
        r = self.ranges[index]
        return (r.hi - r.lo) * self.layer_bytes(r.layer)

    @property
    def smallest_expert(self) -> tuple[int, int]:
        """(bytes, layer) of the smallest expert of the model."""
        return min((b, la) for la, b in zip(self.layers, self.expert_bytes))

    def empty_copies(self) -> np.ndarray:
        return np.zeros((self.n_layer, self.n_expert), dtype=np.int32)


class UsageTracker:
    """Rows routed to each expert, decayed with ``half_life_s``, summed over backbones.

    Pure: :meth:`add` and :meth:`matrix` take the time. Hits outside any layout are kept
    (the layout may be learned later) and ignored by :meth:`matrix`.
    """

    def __init__(self, half_life_s: float = 300.0) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._values: dict[tuple[int, int], float] = {}
        self._at: float | None = None

    def _factor(self, now: float) -> float:
        if self._at is None or now <= self._at:
            return 1.0
        return 0.5 ** ((now - self._at) / self.half_life_s)

    def add(self, stats: RoutingStats, now: float) -> None:
        factor = self._factor(now)
        if factor != 1.0:
            for key in self._values:
                self._values[key] *= factor
        if self._at is None or now > self._at:
            self._at = now
        for layer, expert, rows in stats.hits:
            if rows:
                key = (layer, expert)
                self._values[key] = self._values.get(key, 0.0) + float(rows)

    @property
    def empty(self) -> bool:
        return not self._values

    def matrix(self, n_layer: int, n_expert: int, now: float) -> np.ndarray:
        """Decayed usage as float64 (n_layer, n_expert)."""
        out = np.zeros((n_layer, n_expert), dtype=np.float64)
        factor = self._factor(now)
        for (layer, expert), value in self._values.items():
            if layer < n_layer and expert < n_expert:
                out[layer, expert] = value * factor
        return out


@dataclass(frozen=True)
class RangeStats:
    """Per-range arrays, index ``i`` = ``layout.ranges[i]``."""

    replicas: np.ndarray   # int
    usage: np.ndarray      # share of all routed rows, 0..1
    ratio: np.ndarray      # usage per expert / mean usage per expert
    target: np.ndarray     # int
    demand: np.ndarray
    reward_rate: np.ndarray

    def entries(self, layout: Layout) -> tuple[DemandEntry, ...]:
        return tuple(DemandEntry(r.layer, r.lo, r.hi, int(self.replicas[i]),
                                 int(self.target[i]), float(self.usage[i]),
                                 float(self.demand[i]), float(self.reward_rate[i]))
                     for i, r in enumerate(layout.ranges))


def range_stats(layout: Layout, copies: np.ndarray, usage: np.ndarray,
                policy: Policy) -> RangeStats:
    """Replicas, usage, targets, demand and reward rate of every range.

    ``copies``: int (n_layer, n_expert) nodes per expert; ``usage``: float (n_layer, n_expert)
    decayed routed rows per expert.
    """
    layers = np.asarray(layout.layers)
    starts = layout.starts
    sizes = np.diff(np.append(starts, layout.n_expert))                  # (per_layer,)
    replicas = np.minimum.reduceat(copies[layers], starts, axis=1).ravel()
    used = np.add.reduceat(usage[layers], starts, axis=1)                # (n_moe, per_layer)
    total = float(used.sum())
    if total > 0:
        share = (used / total).ravel()
        per_expert_mean = total / (len(layers) * layout.n_expert)
        ratio = (used / sizes / per_expert_mean).ravel()
    else:
        share = np.zeros(replicas.shape, dtype=np.float64)
        ratio = np.ones(replicas.shape, dtype=np.float64)
    extra = np.zeros(ratio.shape, dtype=np.int64)
    hot = ratio >= policy.hot_factor
    if hot.any():
        extra[hot] = np.floor(np.log(ratio[hot]) / math.log(policy.hot_factor) + 1e-9)
    target = np.clip(policy.min_replicas + extra, policy.min_replicas, policy.max_replicas)
    missing = np.maximum(0, target - replicas)
    demand = np.maximum(ratio, policy.min_weight) * missing
    reward = policy.base_rate * target / np.maximum(1, replicas)
    return RangeStats(replicas=replicas, usage=share, ratio=ratio, target=target,
                      demand=demand, reward_rate=reward)


def demand_entries(layout: Layout, copies: np.ndarray, usage: np.ndarray,
                   policy: Policy) -> tuple[DemandEntry, ...]:
    """The demand map's entries, one per range, layer-major."""
    return range_stats(layout, copies, usage, policy).entries(layout)


def signature(entries: tuple[DemandEntry, ...]) -> tuple[tuple[int, int], ...]:
    """What makes a demand map "changed": each range's replicas and target (usage drifts
    with every routing report; republishing for that waits for the periodic tick)."""
    return tuple((e.replicas, e.target) for e in entries)


def event_rate(layout: Layout, stats: RangeStats, layer: int, expert: int) -> float | None:
    """Reward per row for serving (layer, expert) now; None if the model has no such expert."""
    index = layout.range_index(layer, expert)
    return None if index is None else float(stats.reward_rate[index])
