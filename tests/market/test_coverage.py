"""The coverage map: heartbeats, expiry, pending assignments, claims counted only once served.
Pure, time walked by hand."""

import numpy as np
import pytest

from kvasir_bus.wire import Holding
from market.coverage import CoverageMap
from tests.market.fakes import FP, heartbeat


def test_a_heartbeat_puts_a_node_on_the_map_and_counts_its_experts():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    assert cov.observe(heartbeat(FP, "a", [(0, 0, 4), (1, 2, 3)], budget=99), now=100.0)
    entry = cov.get("a")
    assert entry.holdings == (Holding(0, 0, 4), Holding(1, 2, 3))
    assert entry.budget_bytes == 99 and entry.seen_at == 100.0
    assert not cov.copies(2, 8).any()             # a claim, not proof: nothing counts yet
    assert cov.mark_served("a", 0, 1) == (True, False)
    assert cov.mark_served("a", 1, 2) == (True, False)
    copies = cov.copies(2, 8)
    assert copies[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert copies[1].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


def test_the_same_holdings_again_are_no_change_and_other_holdings_are():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4)]), now=0.0)
    assert not cov.observe(heartbeat(FP, "a", [(0, 0, 4)]), now=1.0)
    assert cov.observe(heartbeat(FP, "a", [(0, 0, 5)]), now=2.0)


def test_a_node_that_misses_its_heartbeats_for_the_expiry_drops_out():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4)]), now=0.0)
    cov.observe(heartbeat(FP, "b", [(0, 0, 4)]), now=3.0)
    cov.mark_served("a", 0, 0)
    cov.mark_served("b", 0, 3)
    assert cov.expire(now=5.0) == []           # exactly at the expiry: still there
    assert cov.expire(now=5.5) == ["a"]
    assert "a" not in cov and "b" in cov
    assert cov.copies(1, 4).tolist() == [[1, 1, 1, 1]]
    assert cov.expire(now=8.5) == ["b"] and len(cov) == 0


def test_overlapping_holdings_of_one_node_count_once():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4), (0, 2, 6)]), now=0.0)
    cov.observe(heartbeat(FP, "b", [(0, 3, 4), (5, 0, 99)]), now=0.0)  # beyond the shape
    for node, layer, expert in (("a", 0, 0), ("a", 0, 5), ("b", 0, 3), ("b", 5, 0)):
        cov.mark_served(node, layer, expert)
    assert cov.copies(1, 6).tolist() == [[1, 1, 1, 2, 1, 1]]


def test_a_pending_assignment_counts_for_the_assigner_only_until_the_grace_period_ends():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.assign("new", [Holding(0, 0, 4)], budget_bytes=10, now=0.0)
    assert cov.copies(1, 4, pending=True).tolist() == [[1, 1, 1, 1]]
    assert not cov.copies(1, 4).any()            # never a replica in the demand map
    assert cov.get("new").seen_at is None
    assert cov.expire(now=30.0) == []
    assert cov.expire(now=30.5) == ["new"] and "new" not in cov


def test_serving_an_assigned_expert_confirms_the_assignment_a_heartbeat_does_not():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.assign("w", [Holding(0, 0, 4)], budget_bytes=10, now=0.0)
    cov.observe(heartbeat(FP, "w", [(0, 0, 4)]), now=1.0)  # announced: still pending
    assert cov.get("w").pending == (Holding(0, 0, 4),)
    assert not cov.copies(1, 4).any()
    assert cov.mark_served("w", 0, 2) == (True, True)
    assert cov.get("w").pending == ()
    assert cov.copies(1, 4, pending=True).tolist() == [[1, 1, 1, 1]]  # once, not twice
    assert cov.expire(now=6.5) == ["w"]  # from now on it lives by its heartbeats


def test_a_ghost_that_claims_everything_and_never_serves_counts_for_nothing():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    assert cov.observe(heartbeat(FP, "ghost", [(0, 0, 999_999_999)]), now=0.0)
    assert not cov.copies(2, 8).any() and not cov.copies(2, 8, pending=True).any()
    cov.mark_served("ghost", 1, 3)               # served elsewhere: its claim stays unproven
    assert not cov.copies(2, 8).any()


def test_a_banned_node_is_dropped_and_ignored_from_then_on():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.observe(heartbeat(FP, "liar", [(0, 0, 4)]), now=0.0)
    cov.mark_served("liar", 0, 0)
    assert cov.copies(1, 4).any()
    assert cov.ban("liar") and "liar" not in cov
    assert not cov.observe(heartbeat(FP, "liar", [(0, 0, 4)]), now=1.0)
    assert cov.mark_served("liar", 0, 1) == (False, False)
    assert not cov.copies(1, 4).any()


def test_the_map_holds_at_most_max_nodes():
    cov = CoverageMap(expiry_s=5, grace_s=30, max_nodes=3)
    for i in range(10):
        cov.observe(heartbeat(FP, f"n{i}", [(0, 0, 1)]), now=0.0)
    assert len(cov) == 3


def test_forget_drops_a_node():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.observe(heartbeat(FP, "w", [(0, 0, 2)]), now=0.0)
    assert cov.forget("w") and not cov.forget("w")
    assert not np.any(cov.copies(1, 4))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CoverageMap(expiry_s=0, grace_s=1)
