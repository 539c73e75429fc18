"""Volunteer assignment: holes first, hottest first, budgets respected. Pure."""

import numpy as np
import pytest

from kvasir_bus.wire import Holding
from market.assign import NoFit, choose, merge
from market.demand import Layout, Policy, range_stats
from tests.market.fakes import make_manifest

POLICY = Policy()
ONE_RANGE = 8 * 3600 + 1000     # fits one range of either layer, never two


def layout(**kw) -> Layout:
    return Layout.from_manifest(make_manifest(**kw), 8)


def hot_usage(lay: Layout, hot: dict[tuple[int, int], float]) -> np.ndarray:
    u = np.ones((lay.n_layer, lay.n_expert))
    for (layer, lo), factor in hot.items():
        u[layer, lo:lo + 8] = factor
    return u


def add(copies: np.ndarray, holdings) -> None:
    for h in holdings:
        copies[h.layer, h.lo:h.hi] += 1


def volunteers(lay, usage, n, budget=ONE_RANGE, copies=None):
    """Assign ``n`` volunteers one after the other; return their holdings and the copies."""
    copies = lay.empty_copies() if copies is None else copies
    got = []
    for _ in range(n):
        choice = choose(lay, copies, usage, POLICY, budget)
        add(copies, choice.holdings)
        got.append(choice.holdings)
    return got, copies


def test_a_budget_below_one_expert_is_refused_naming_the_smallest_expert():
    lay = layout()
    with pytest.raises(NoFit, match=r"budget of 2,999 bytes .* smallest expert is 3,000 "
                                    r"bytes \(layer 0\)") as info:
        choose(lay, lay.empty_copies(), np.zeros((2, 24)), POLICY, 2999)
    assert info.value.smallest == 3000
    assert choose(lay, lay.empty_copies(), np.zeros((2, 24)), POLICY, 3000).holdings == (
        Holding(0, 0, 1),)


def test_volunteers_one_by_one_take_distinct_ranges_hottest_hole_first_until_covered():
    lay = layout()
    usage = hot_usage(lay, {(1, 8): 5.0})
    got, copies = volunteers(lay, usage, 6)
    assert got[0] == (Holding(1, 8, 16),)                       # the hot hole first
    assert got[1:] == [(Holding(0, 0, 8),), (Holding(0, 8, 16),), (Holding(0, 16, 24),),
                       (Holding(1, 0, 8),), (Holding(1, 16, 24),)]  # then in order
    assert copies.min() == 1 and copies.max() == 1               # covered, once each


def test_holes_come_before_a_hot_range_that_lacks_a_second_replica():
    lay = layout()
    usage = hot_usage(lay, {(1, 8): 50.0})           # target 3 there
    copies = lay.empty_copies() + 1
    copies[1, 8:16] = 1
    copies[0, 16:24] = 0                             # one cold hole
    assert choose(lay, copies, usage, POLICY, ONE_RANGE).holdings == (Holding(0, 16, 24),)


def test_with_more_volunteers_than_ranges_the_hot_ranges_get_replicas_first():
    lay = layout()
    usage = hot_usage(lay, {(1, 8): 5.0, (0, 16): 3.0})   # ratios 2.5 and 1.5 (mean 2)
    stats = range_stats(lay, lay.empty_copies(), usage, POLICY)
    hot, warm = lay.range_index(1, 8), lay.range_index(0, 16)
    assert stats.target[hot] == 2 and stats.target[warm] == 1
    got, copies = volunteers(lay, usage, 12)
    assert {h for g in got[:6] for h in g} == set(lay.ranges)    # first every hole
    assert got[6] == (Holding(1, 8, 16),)                        # then the hot range's target
    # then extra replicas by usage per replica after joining: hot 5/3 > warm 3/2 > cold 1/2,
    # then warm 3/2 > hot 5/4
    assert got[7] == (Holding(1, 8, 16),)
    assert got[8] == (Holding(0, 16, 24),)
    replicas = range_stats(lay, copies, usage, POLICY).replicas
    assert replicas[hot] >= replicas[warm] >= max(replicas[i] for i in range(6)
                                                  if i not in (hot, warm))


def test_without_statistics_extra_replicas_spread_evenly_in_order():
    lay = layout()
    got, copies = volunteers(lay, np.zeros((2, 24)), 12)
    assert got[:6] == got[6:]
    assert copies.min() == copies.max() == 2


def test_a_budget_for_part_of_a_range_takes_the_least_covered_experts():
    lay = layout()
    usage = np.zeros((2, 24))
    half = 4 * 3600
    first = choose(lay, lay.empty_copies(), usage, POLICY, half)
    assert first.holdings == (Holding(0, 0, 4),) and first.bytes == 4 * 3000 + 0 * 3600
    copies = lay.empty_copies()
    add(copies, first.holdings)
    second = choose(lay, copies, usage, POLICY, half)
    assert second.holdings == (Holding(0, 4, 8),)       # the other half of the same hole
    add(copies, second.holdings)
    assert range_stats(lay, copies, usage, POLICY).replicas[0] == 1


def test_a_big_budget_takes_several_ranges_that_lack_replicas_merged():
    lay = layout()
    usage = np.zeros((2, 24))
    copies = lay.empty_copies() + 1
    copies[0, 8:24] = 0                                   # two adjacent holes in layer 0
    copies[1, 0:8] = 0                                    # and one in layer 1
    choice = choose(lay, copies, usage, POLICY, 10**9)
    assert choice.holdings == (Holding(0, 8, 24), Holding(1, 0, 8))
    assert choice.bytes == 16 * 3000 + 8 * 3600
    assert choice.reward_rate == pytest.approx(1.0)       # target 1, it is the replica
    # nothing lacks a replica: a big budget still takes one range, not everything
    full = lay.empty_copies() + 1
    assert len(choose(lay, full, usage, POLICY, 10**9).holdings) == 1


def test_a_budget_that_fits_only_the_smaller_layer_skips_the_bigger_one():
    lay = layout()
    copies = lay.empty_copies() + 1
    copies[1, 0:8] = 0                                    # hole in layer 1 (3600 / expert)
    copies[0, 0:8] = 0                                    # hole in layer 0 (3000 / expert)
    usage = hot_usage(lay, {(1, 0): 10.0})                # the layer-1 hole is the scarcer
    assert choose(lay, copies, usage, POLICY, 3600).holdings == (Holding(1, 0, 1),)
    choice = choose(lay, copies, usage, POLICY, 3300)
    assert choice.holdings == (Holding(0, 0, 1),)


def test_the_reward_rate_counts_the_volunteer_as_a_replica():
    lay = layout()
    usage = hot_usage(lay, {(1, 8): 50.0})                # target 3
    copies = lay.empty_copies() + 1
    choice = choose(lay, copies, usage, POLICY, ONE_RANGE)
    assert choice.holdings == (Holding(1, 8, 16),)
    assert choice.reward_rate == pytest.approx(3 / 2)


def test_inputs_are_not_modified():
    lay = layout()
    copies, usage = lay.empty_copies(), np.zeros((2, 24))
    choose(lay, copies, usage, POLICY, 10**9)
    assert not copies.any()


def test_merge_joins_touching_ranges_of_a_layer_only():
    assert merge([Holding(1, 8, 16), Holding(0, 8, 16), Holding(0, 0, 8), Holding(1, 0, 4)]) \
        == (Holding(0, 0, 16), Holding(1, 0, 4), Holding(1, 8, 16))
