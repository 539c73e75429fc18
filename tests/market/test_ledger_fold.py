"""The ledger grows with nodes and ranges, not with calls: folding keeps what pays, refuses
replays of what it folded, and the totals a status reads never scan the events."""

from __future__ import annotations

import sqlite3

import pytest

from kvasir_bus import market_codec as mc
from market.ledger import Ledger

FP = "0123456789abcdef"
NODES = ("w-1", "w-2", "w-3")


def _fill(led: Ledger, start: int, n: int, source: str = "bb", now: float = 0.0) -> None:
    """``n`` one-row wins over 3 nodes x 4 layers x 8 experts, routed first (as a backbone does)."""
    events = [mc.LedgerEvent(f"e{i}", NODES[i % 3], i % 4, (i // 4) % 8, 1, float(i)) for i in range(start, start + n)]
    remote: dict[tuple[int, int], int] = {}
    for e in events:
        remote[(e.layer, e.expert)] = remote.get((e.layer, e.expert), 0) + e.rows
    assert led.apply_routing("S", start, FP, source, [(la, ex, r) for (la, ex), r in remote.items()], f"r{start}")
    got, _ = led.apply_batch("S", start + 1, FP, source, f"b{start}", [(e, 0.5) for e in events], now)
    assert got["accepted"] == n, got


def _count(led: Ledger) -> int:
    return led._db.execute("SELECT count(*) FROM events").fetchone()[0]


def test_folding_keeps_every_total_and_refuses_a_replay_of_what_it_folded(tmp_path):
    with Ledger(tmp_path / "l.db") as led:
        _fill(led, 0, 600, now=1.0)
        _fill(led, 600, 600, now=2.0)
        before = led.totals(FP)
        served = set(led.served())
        assert led.fold(before=0.0, keep=600) == 600  # the older batch
        assert _count(led) == 600
        assert led.totals(FP) == before and set(led.served()) == served
        assert led.horizon(FP, "bb") == 599.0 and led.horizon(FP, "other") is None
        # a replay of a folded event (its id is gone with it) is late, not paid twice
        late = mc.LedgerEvent("e5", "w-3", 1, 1, 1, 5.0)
        assert led.apply_routing("S", 9, FP, "bb", [(1, 1, 1)], "r-late")
        got, _ = led.apply_batch("S", 10, FP, "bb", "b-late", [(late, 0.5)], 3.0)
        assert got["late"] == 1 and got["accepted"] == 0 and led.totals(FP) == before
        # another backbone's horizon is its own
        other = mc.LedgerEvent("o1", "w-1", 0, 0, 1, 5.0)
        assert led.apply_routing("S", 11, FP, "bb2", [(0, 0, 1)], "r-o")
        assert led.apply_batch("S", 12, FP, "bb2", "b-o", [(other, 0.5)], 3.0)[0]["accepted"] == 1
        # a quarantine voids what is still kept one by one; folded, audited work stays paid
        w2 = {t.node: t for t in led.totals(FP)}["w-2"]
        voided = led.apply_quarantine("S", 13, FP, "w-2", at=4.0, since=0.0)
        assert voided == 200  # the 200 of its 400 wins that were not folded
        after = {t.node: t for t in led.totals(FP)}
        assert after["w-2"].rows == w2.rows - 200 and after["w-2"].events == w2.events - 200
        assert after["w-2"].reward == pytest.approx(w2.reward - 100)


def test_the_file_stops_growing_once_it_holds_keep_events(tmp_path):
    path = tmp_path / "l.db"
    sizes = []
    with Ledger(path) as led:
        for r in range(12):
            _fill(led, r * 5000, 5000, now=float(r))
            led.fold(before=-1.0, keep=5000)
            led._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes.append(path.stat().st_size)
        total = sum(t.events for t in led.totals(FP))
    assert total == 60_000 and _count(Ledger(path, readonly=True)) == 5000
    assert sizes[-1] <= 1.3 * sizes[3], sizes  # 12x the calls, about the same file


def test_totals_read_one_row_per_node_never_the_events(tmp_path):
    with Ledger(tmp_path / "l.db") as led:
        _fill(led, 0, 3000)
        read: set[str] = set()

        def authorize(action, arg1, arg2, db, trigger):
            if action == sqlite3.SQLITE_READ:
                read.add(arg1)
            return sqlite3.SQLITE_OK

        led._db.set_authorizer(authorize)
        totals = led.totals(FP)
        led._db.set_authorizer(None)
        assert [t.node for t in totals] == list(NODES) and sum(t.rows for t in totals) == 3000
        assert "events" not in read and "node_totals" in read


def test_an_old_ledger_file_gets_its_running_totals_counted_once(tmp_path):
    path = tmp_path / "old.db"
    with Ledger(path) as led:
        _fill(led, 0, 300)
        want = led.totals(FP)
        led._db.execute("DELETE FROM node_totals")  # as a file from before running totals
        led._db.commit()
    with Ledger(path) as led:
        assert led.totals(FP) == want
