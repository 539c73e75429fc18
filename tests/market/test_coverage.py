"""The coverage map: heartbeats, expiry, pending assignments. Pure, time walked by hand."""

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
    copies = cov.copies(2, 8)
    assert copies[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert copies[1].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


def test_the_same_holdings_again_are_no_change_and_other_holdings_are():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4)]), now=0.0)
    assert not cov.observe(heartbeat(FP, "a", [(0, 0, 2), (0, 2, 4)]), now=1.0)
    assert cov.observe(heartbeat(FP, "a", [(0, 0, 5)]), now=2.0)


def test_a_node_that_misses_its_heartbeats_for_the_expiry_drops_out():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4)]), now=0.0)
    cov.observe(heartbeat(FP, "b", [(0, 0, 4)]), now=3.0)
    assert cov.expire(now=5.0) == []           # exactly at the expiry: still there
    assert cov.expire(now=5.5) == ["a"]
    assert "a" not in cov and "b" in cov
    assert cov.copies(1, 4).tolist() == [[1, 1, 1, 1]]
    assert cov.expire(now=8.5) == ["b"] and len(cov) == 0


def test_overlapping_holdings_of_one_node_count_once():
    cov = CoverageMap(expiry_s=5, grace_s=60)
    cov.observe(heartbeat(FP, "a", [(0, 0, 4), (0, 2, 6)]), now=0.0)
    cov.observe(heartbeat(FP, "b", [(0, 3, 4), (5, 0, 99)]), now=0.0)  # beyond the shape
    assert cov.copies(1, 6).tolist() == [[1, 1, 1, 2, 1, 1]]


def test_a_pending_assignment_counts_until_the_grace_period_ends():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.assign("new", [Holding(0, 0, 4)], budget_bytes=10, now=0.0)
    assert cov.copies(1, 4).tolist() == [[1, 1, 1, 1]]
    assert cov.get("new").seen_at is None
    assert cov.expire(now=30.0) == []
    assert cov.expire(now=30.5) == ["new"] and "new" not in cov


def test_a_heartbeat_with_the_assigned_experts_confirms_the_assignment():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.assign("w", [Holding(0, 0, 4)], budget_bytes=10, now=0.0)
    cov.observe(heartbeat(FP, "w", []), now=1.0)  # still loading: pending stays
    assert cov.get("w").pending == (Holding(0, 0, 4),)
    assert cov.copies(1, 4).tolist() == [[1, 1, 1, 1]]
    cov.observe(heartbeat(FP, "w", [(0, 0, 4)]), now=2.0)
    assert cov.get("w").pending == ()
    assert cov.copies(1, 4).tolist() == [[1, 1, 1, 1]]  # once, not twice
    assert cov.expire(now=7.5) == ["w"]  # from now on it lives by its heartbeats


def test_an_expired_heartbeat_leaves_a_pending_assignment_counting():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.observe(heartbeat(FP, "w", [(0, 0, 2)]), now=0.0)
    cov.assign("w", [Holding(0, 2, 4)], budget_bytes=10, now=1.0)
    assert cov.expire(now=6.0) == ["w"]
    entry = cov.get("w")
    assert entry.holdings == () and entry.pending == (Holding(0, 2, 4),)
    assert cov.copies(1, 4).tolist() == [[0, 0, 1, 1]]


def test_forget_drops_a_node():
    cov = CoverageMap(expiry_s=5, grace_s=30)
    cov.observe(heartbeat(FP, "w", [(0, 0, 2)]), now=0.0)
    assert cov.forget("w") and not cov.forget("w")
    assert not np.any(cov.copies(1, 4))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CoverageMap(expiry_s=0, grace_s=1)
