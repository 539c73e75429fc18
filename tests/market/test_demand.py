"""Ranges, usage, targets, demand and reward rates: pure functions, numbers worked by hand."""

import numpy as np
import pytest

from kvasir_bus.wire import Holding
from kvasir_bus.market_codec import RoutingStats
from market.demand import (Layout, Policy, UsageTracker, demand_entries, event_rate,
                           range_stats, signature)
from tests.market.fakes import FP, make_manifest

POLICY = Policy()


def layout(n_layer=2, n_expert=24, r=8, **kw) -> Layout:
    return Layout.from_manifest(make_manifest(n_layer=n_layer, n_expert=n_expert, **kw), r)


def usage_with(lay: Layout, hot: dict[tuple[int, int], float], base: float = 1.0):
    """Every expert used ``base``; each range ``(layer, lo)`` in ``hot`` gets that many times
    the base per expert."""
    u = np.full((lay.n_layer, lay.n_expert), base)
    for (layer, lo), factor in hot.items():
        u[layer, lo:lo + lay.range_experts] = base * factor
    return u


def test_layers_are_cut_into_fixed_ranges_and_the_last_may_be_shorter():
    lay = layout(n_layer=3, n_expert=20, r=8, dense=(0,))
    assert lay.layers == (1, 2)
    assert lay.ranges == (Holding(1, 0, 8), Holding(1, 8, 16), Holding(1, 16, 20),
                          Holding(2, 0, 8), Holding(2, 8, 16), Holding(2, 16, 20))
    assert lay.range_index(2, 17) == 5 and lay.range_index(1, 7) == 0
    assert lay.range_index(0, 1) is None and lay.range_index(1, 20) is None
    assert lay.layer_bytes(1) == 3 * 1200 and lay.layer_bytes(2) == 3 * 1000
    assert lay.range_bytes(2) == 4 * 3600
    assert lay.smallest_expert == (3000, 2)


def test_range_size_is_capped_at_the_experts_of_a_layer():
    assert layout(n_expert=6, r=32).ranges == (Holding(0, 0, 6), Holding(1, 0, 6))


def test_without_routing_statistics_every_range_wants_one_replica():
    lay = layout()
    copies = lay.empty_copies()
    copies[0, 0:8] = 2
    copies[1, 0:4] = 1  # half a range is still a hole
    entries = demand_entries(lay, copies, np.zeros((2, 24)), POLICY)
    assert [(e.layer, e.lo, e.hi) for e in entries] == [(0, 0, 8), (0, 8, 16), (0, 16, 24),
                                                        (1, 0, 8), (1, 8, 16), (1, 16, 24)]
    assert [e.replicas for e in entries] == [2, 0, 0, 0, 0, 0]
    assert [e.target for e in entries] == [1] * 6
    assert [e.usage for e in entries] == [0.0] * 6
    assert [e.demand for e in entries] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # reward per row: target / max(1, replicas)
    assert [e.reward_rate for e in entries] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_hot_ranges_get_more_replicas_capped_at_the_maximum():
    lay = layout()
    # per-expert usage: 1 everywhere, range (1, 8) 8x, range (0, 16) 3x, range (0, 0) 1.9x
    u = usage_with(lay, {(1, 8): 8.0, (0, 16): 3.0, (0, 0): 1.9})
    stats = range_stats(lay, lay.empty_copies(), u, POLICY)
    mean = u.sum() / u.size
    assert stats.ratio.tolist() == pytest.approx([1.9 / mean, 1 / mean, 3 / mean, 1 / mean,
                                                  8 / mean, 1 / mean])
    # mean = 15.9/6 = 2.65: ratios 0.72, 0.38, 1.13, 0.38, 3.02, 0.38 -> only (1, 8) is >= 2x
    assert stats.target.tolist() == [1, 1, 1, 1, 2, 1]
    assert stats.usage.sum() == pytest.approx(1.0)
    u = usage_with(lay, {(1, 8): 100.0})  # ratio ~5.7: 1 + floor(log2) = 3
    assert range_stats(lay, lay.empty_copies(), u, POLICY).target.tolist() == [1, 1, 1, 1, 3, 1]
    capped = Policy(max_replicas=2)
    assert range_stats(lay, lay.empty_copies(), u, capped).target.tolist() == [1, 1, 1, 1, 2, 1]
    assert range_stats(lay, lay.empty_copies(), u, Policy(min_replicas=2, max_replicas=4)
                       ).target.tolist() == [2, 2, 2, 2, 4, 2]


def test_demand_is_usage_weight_times_missing_replicas():
    lay = layout()
    u = np.zeros((2, 24))
    u[1, 8:16] = 100.0                               # only one range is ever routed to
    copies = lay.empty_copies()
    copies[1, 8:16] = 1
    stats = range_stats(lay, copies, u, POLICY)
    assert stats.ratio[4] == pytest.approx(6.0)      # all usage in 1 of 6 ranges
    assert stats.target[4] == 3 and stats.replicas[4] == 1
    assert stats.demand[4] == pytest.approx(6.0 * 2)
    # never-routed holes keep the minimum weight: still wanted, just less than hot ones
    assert stats.demand[0] == pytest.approx(POLICY.min_weight)
    assert stats.reward_rate[4] == pytest.approx(3.0) and stats.reward_rate[0] == 1.0


def test_more_replicas_than_the_target_pay_less():
    lay = layout()
    copies = lay.empty_copies() + 4
    stats = range_stats(lay, copies, np.zeros((2, 24)), Policy(base_rate=2.0))
    assert stats.reward_rate.tolist() == [0.5] * 6 and not stats.demand.any()


def test_usage_decays_with_its_half_life_and_sums_backbones():
    tracker = UsageTracker(half_life_s=10.0)
    assert tracker.empty
    tracker.add(RoutingStats(FP, "bb1", 1.0, [(0, 1, 100), (1, 0, 8)]), now=0.0)
    tracker.add(RoutingStats(FP, "bb2", 1.0, [(0, 1, 50), (9, 9, 1)]), now=10.0)
    m = tracker.matrix(2, 4, now=10.0)
    assert m[0, 1] == pytest.approx(100 * 0.5 + 50) and m[1, 0] == pytest.approx(4.0)
    assert tracker.matrix(2, 4, now=20.0)[0, 1] == pytest.approx(50.0)
    assert m.sum() == pytest.approx(104.0)  # the hit outside the shape is ignored


def test_signature_changes_with_replicas_or_targets_only():
    lay = layout()
    a = demand_entries(lay, lay.empty_copies(), np.zeros((2, 24)), POLICY)
    b = demand_entries(lay, lay.empty_copies(), np.ones((2, 24)), POLICY)
    copies = lay.empty_copies()
    copies[0] = 1
    c = demand_entries(lay, copies, np.zeros((2, 24)), POLICY)
    assert signature(a) == signature(b) != signature(c)


def test_event_rate_is_the_rate_of_the_events_range():
    lay = layout()
    copies = lay.empty_copies()
    copies[0, 8:16] = 2
    stats = range_stats(lay, copies, np.zeros((2, 24)), POLICY)
    assert event_rate(lay, stats, 0, 9) == 0.5
    assert event_rate(lay, stats, 1, 9) == 1.0
    assert event_rate(lay, stats, 7, 0) is None


def test_bad_policies_and_layouts_are_refused():
    with pytest.raises(ValueError):
        Policy(min_replicas=0)
    with pytest.raises(ValueError):
        Policy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        Policy(hot_factor=1.0)
    with pytest.raises(ValueError):
        Layout(2, 4, 0, (0,), (10,))
    with pytest.raises(ValueError):
        UsageTracker(half_life_s=0)
