"""Volunteer assignment: the scarcest range(s) that fit a budget. Pure.

Order of scarcity (first = scarcest), the same for every volunteer, so the outcome is
deterministic:

1. holes (ranges with 0 replicas) before ranges that have a replica;
2. higher demand (usage weight x missing replicas, see :mod:`market.demand`) first;
3. then more usage per replica after the volunteer joins (``usage / (replicas + 1)``): once
   every range is at its target, extra replicas still go to the hottest ranges first;
4. fewer replicas, then lower layer, then lower first expert.

A volunteer gets:

* **the scarcest range** in which at least one expert fits its budget. If the whole range does
  not fit, it gets as many consecutive experts of it as fit, taken where the range is least
  covered (so two half-range volunteers together fill a hole);
* **then more whole ranges**, scarcest first, while the budget holds them and they still
  lack replicas (demand > 0). Demand is recomputed after each pick with the volunteer counted,
  so one node never takes a range twice. A volunteer therefore takes one range when its budget
  fits one range, and a share of the missing coverage in proportion to its memory when it is
  large.

A budget that cannot hold even the smallest expert raises :class:`NoFit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasir_bus.wire import Holding
from market.demand import Layout, Policy, RangeStats, range_stats


class NoFit(Exception):
    """The budget cannot hold even one expert; the message says the smallest expert's size."""

    def __init__(self, budget: int, smallest: int, layer: int) -> None:
        super().__init__(f"a budget of {budget:,} bytes cannot hold even one expert: the "
                         f"smallest expert is {smallest:,} bytes (layer {layer})")
        self.budget, self.smallest, self.layer = budget, smallest, layer


@dataclass(frozen=True)
class Choice:
    """An assignment's content: merged half-open ``holdings``, their ``bytes``, and the reward
    rate per row there with the volunteer counted (experts-weighted over its pieces)."""

    holdings: tuple[Holding, ...]
    bytes: int
    reward_rate: float


def scarcity_order(stats: RangeStats, layout: Layout) -> list[int]:
    """Range indexes, scarcest first (see the module docstring)."""
    def key(i: int) -> tuple:
        r = layout.ranges[i]
        replicas = int(stats.replicas[i])
        return (replicas > 0, -float(stats.demand[i]),
                -float(stats.usage[i]) / (replicas + 1), replicas, r.layer, r.lo)
    return sorted(range(len(layout.ranges)), key=key)


def _least_covered_window(copies_row: np.ndarray, lo: int, hi: int, k: int) -> int:
    """Start of the k consecutive experts in [lo, hi) held by the fewest nodes (leftmost)."""
    sums = np.convolve(copies_row[lo:hi].astype(np.int64), np.ones(k, dtype=np.int64),
                       mode="valid")
    return lo + int(np.argmin(sums))


def merge(holdings: list[Holding]) -> tuple[Holding, ...]:
    """Sort and merge touching or overlapping ranges of the same layer."""
    out: list[Holding] = []
    for h in sorted(holdings):
        if out and out[-1].layer == h.layer and h.lo <= out[-1].hi:
            last = out.pop()
            h = Holding(h.layer, last.lo, max(last.hi, h.hi))
        out.append(h)
    return tuple(out)


def choose(layout: Layout, copies: np.ndarray, usage: np.ndarray, policy: Policy,
           budget: int) -> Choice:
    """What a new volunteer with ``budget`` bytes should hold.

    ``copies``: int (n_layer, n_expert) nodes per expert now (not counting the volunteer);
    ``usage``: float (n_layer, n_expert) decayed routed rows. Neither is modified.
    """
    smallest, small_layer = layout.smallest_expert
    if budget < smallest:
        raise NoFit(budget, smallest, small_layer)
    copies = copies.copy()
    remaining = budget
    pieces: list[Holding] = []
    taken: set[int] = set()

    stats = range_stats(layout, copies, usage, policy)
    for i in scarcity_order(stats, layout):
        r = layout.ranges[i]
        per = layout.layer_bytes(r.layer)
        if per > remaining:
            continue
        k = min(r.hi - r.lo, remaining // per)
        lo = r.lo if k == r.hi - r.lo else _least_covered_window(copies[r.layer], r.lo, r.hi, k)
        piece = Holding(r.layer, lo, lo + k)
        break
    else:  # unreachable: the smallest expert fits, so some range has a fitting expert
        raise NoFit(budget, smallest, small_layer)
    while True:
        pieces.append(piece)
        taken.add(i)
        copies[piece.layer, piece.lo:piece.hi] += 1
        remaining -= (piece.hi - piece.lo) * layout.layer_bytes(piece.layer)
        stats = range_stats(layout, copies, usage, policy)
        for i in scarcity_order(stats, layout):
            if i not in taken and stats.demand[i] > 0 and layout.range_bytes(i) <= remaining:
                piece = layout.ranges[i]
                break
        else:
            break

    weighted = 0.0
    for p in pieces:
        index = layout.range_index(p.layer, p.lo)
        weighted += (p.hi - p.lo) * float(stats.reward_rate[index])
    n = sum(p.hi - p.lo for p in pieces)
    return Choice(holdings=merge(pieces), bytes=budget - remaining, reward_rate=weighted / n)
