"""The SQLite ledger: each event counted once, priced when recorded, durable across reopening."""

import pytest

from kvasir_bus.wire import Holding
from kvasir_bus.errors import KvasirError
from kvasir_bus.market_codec import LedgerEvent, NodeAudits, NodeTotals
from market.ledger import Ledger

FP = "feedc0ffee000001"


def ev(i, node="w-1", rows=4, layer=0, expert=1):
    return LedgerEvent(f"bb:1:{i}", node, layer, expert, rows, 1.7e9 + i)


def test_events_are_stored_once_and_totalled_per_node(tmp_path):
    with Ledger(tmp_path / "m.db") as led:
        assert led.record(FP, "bb", "b1", [(ev(1), 1.0), (ev(2, "w-2", 10), 2.0)], now=1.0) \
            == (2, 0)
        assert led.record(FP, "bb", "b1", [(ev(1), 1.0), (ev(2, "w-2", 10), 2.0)], now=2.0) \
            == (0, 2)
        assert led.record(FP, "bb", "b2", [(ev(3), 1.5), (ev(3), 1.5), (ev(2, "w-2", 10), 9.0)],
                          now=3.0) == (1, 2)
        assert led.totals() == [NodeTotals("w-1", 2, 8, 4 * 1.0 + 4 * 1.5),
                                NodeTotals("w-2", 1, 10, 20.0)]  # first price kept
        assert led.totals(FP) == led.totals() and led.totals("other") == []
        assert led.models() == [FP]


def test_the_ledger_survives_reopening(tmp_path):
    path = tmp_path / "sub" / "m.db"  # the directory is created too
    with Ledger(path) as led:
        led.record(FP, "bb", "b1", [(ev(i), 0.5) for i in range(100)], now=1.0)
        before = led.totals()
    with Ledger(path) as led:
        assert led.totals() == before == [NodeTotals("w-1", 100, 400, 200.0)]
        assert led.record(FP, "bb", "b1", [(ev(i), 0.5) for i in range(100)], now=2.0) \
            == (0, 100)
    with Ledger(path, readonly=True) as led:
        assert led.totals() == before


def test_wal_journal_and_full_sync(tmp_path):
    with Ledger(tmp_path / "m.db") as led:
        assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert led._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_failed_batch_stores_nothing(tmp_path):
    with Ledger(tmp_path / "m.db") as led:
        with pytest.raises(TypeError):
            led.record(FP, "bb", "b1", [(ev(1), 1.0), (ev(2), object())], now=1.0)
        assert led.totals() == []


def test_readonly_needs_an_existing_ledger(tmp_path):
    with pytest.raises(KvasirError, match="no ledger at"):
        Ledger(tmp_path / "missing.db", readonly=True)
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(KvasirError, match="junk.db"):
        Ledger(tmp_path / "junk.db")


def test_pending_assignments_are_kept_until_their_grace_ends(tmp_path):
    path = tmp_path / "m.db"
    with Ledger(path) as led:
        led.save_assignment(FP, "w-1", [Holding(0, 0, 8)], 100, until=50.0)
        led.save_assignment(FP, "w-2", [Holding(1, 0, 8), Holding(1, 16, 24)], 200, until=10.0)
        led.save_assignment(FP, "w-1", [Holding(0, 8, 16)], 100, until=60.0)  # replaces
    with Ledger(path) as led:
        assert led.assignments(now=5.0) == [
            (FP, "w-1", (Holding(0, 8, 16),), 100, 60.0),
            (FP, "w-2", (Holding(1, 0, 8), Holding(1, 16, 24)), 200, 10.0)]
        assert led.assignments(now=20.0) == [(FP, "w-1", (Holding(0, 8, 16),), 100, 60.0)]
        led.drop_assignment(FP, "w-1")
        assert led.assignments(now=20.0) == []


def test_audit_counts_add_up_per_node_once_per_routing_message_and_stay_bounded(tmp_path):
    """Routing messages carry each node's audits; the same message id applied again (a stream
    redelivery, a spool replay) adds nothing; the file keeps the most recently audited nodes."""
    with Ledger(tmp_path / "m.db") as led:
        assert led.apply_routing("S", 1, FP, "bb", [], "bb:1:r0", [("tab-a", 16, 0), ("py-0", 3, 0)])
        assert led.apply_routing("S", 2, FP, "bb", [], "bb:1:r1", [("tab-a", 2, 0), ("liar", 0, 1)])
        assert not led.apply_routing("S", 3, FP, "bb", [], "bb:1:r1", [("tab-a", 2, 0), ("liar", 0, 1)])
        assert led.apply_routing("S", 4, FP, "bb2", [], "bb2:1:r0", [("tab-a", 1, 0)])  # another backbone's
        assert led.audits(FP) == [NodeAudits("tab-a", 19, 0), NodeAudits("liar", 0, 1), NodeAudits("py-0", 3, 0)]
        assert led.audits("other") == []
        with led._db:
            led._add_audits(FP, 5, [("new", 1, 0)], keep=2)  # the least recently audited go first
        assert led.audits(FP) == [NodeAudits("new", 1, 0), NodeAudits("tab-a", 19, 0)]
    with Ledger(tmp_path / "m.db", readonly=True) as led:  # durable, like the credit
        assert led.audits(FP, limit=1) == [NodeAudits("new", 1, 0)]
