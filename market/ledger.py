"""The contribution ledger: who served which rows, and what it earned. SQLite, durable.

One row per ledger event, keyed by its ``event_id``: ``INSERT OR IGNORE`` makes a re-sent event
a counted duplicate, never a second payment. Each event is stored with the reward rate of its
range at the moment it is recorded (the price is fixed then and never recomputed). A batch is
one transaction; :meth:`Ledger.record` returns only after it is committed (WAL journal,
``synchronous=FULL``), so the market acks a batch only once it would survive a crash.

The same file keeps the market's pending assignments, so a restarted market still counts a
volunteer that is downloading its slice.

Not thread-safe by itself: the service calls it from one worker thread.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from kvasir_bus.wire import Holding
from kvasir_bus.errors import KvasirError
from kvasir_bus.market_codec import LedgerEvent, NodeTotals
from market import DEFAULT_DB

__all__ = ["DEFAULT_DB", "Ledger"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    event_id    TEXT PRIMARY KEY,
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    layer       INTEGER NOT NULL,
    expert      INTEGER NOT NULL,
    rows        INTEGER NOT NULL,
    at          REAL NOT NULL,
    rate        REAL NOT NULL,
    reward      REAL NOT NULL,
    source      TEXT NOT NULL,
    batch_id    TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_node ON events (model, node);
CREATE TABLE IF NOT EXISTS assignments (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    holdings    TEXT NOT NULL,
    budget      INTEGER NOT NULL,
    until       REAL NOT NULL,
    PRIMARY KEY (model, node)
);
"""


class Ledger:
    """The ledger file. ``Ledger(path)`` creates it if needed; ``readonly=True`` only reads
    (``kvasir rewards``) and refuses a missing file."""

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        try:
            if readonly:
                if not self.path.is_file():
                    raise KvasirError(f"no ledger at {self.path} (give --db FILE of a market, "
                                      "or --nats URL to ask the running market)")
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                           check_same_thread=False)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
                self._db.commit()
            self._db.execute("SELECT count(*) FROM events").fetchone()
        except sqlite3.DatabaseError as exc:
            raise KvasirError(f"ledger {self.path}: {exc}") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- events -----------------------------------------------------------------------------
    def record(self, model: str, source: str, batch_id: str,
               priced: Iterable[tuple[LedgerEvent, float]], now: float) -> tuple[int, int]:
        """Store ``(event, rate)`` pairs in one transaction; return (accepted, duplicates).

        An event whose id is already stored (or repeated within the batch) is a duplicate and
        keeps its first price.
        """
        accepted = duplicates = 0
        with self._db:  # one transaction: all of the batch or none of it
            for event, rate in priced:
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO events (event_id, model, node, layer, expert, rows, "
                    "at, rate, reward, source, batch_id, recorded_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (event.event_id, model, event.node, event.layer, event.expert, event.rows,
                     event.at, rate, rate * event.rows, source, batch_id, now))
                if cur.rowcount == 1:
                    accepted += 1
                else:
                    duplicates += 1
        return accepted, duplicates

    def totals(self, model: str | None = None) -> list[NodeTotals]:
        """Events, rows and reward per node (of one model, or of all), sorted by node."""
        where, args = ("WHERE model = ?", (model,)) if model else ("", ())
        rows = self._db.execute(
            f"SELECT node, count(*), sum(rows), sum(reward) FROM events {where} "
            "GROUP BY node ORDER BY node", args).fetchall()
        return [NodeTotals(node, int(n), int(r or 0), float(w or 0.0)) for node, n, r, w in rows]

    def models(self) -> list[str]:
        return [m for (m,) in self._db.execute("SELECT DISTINCT model FROM events ORDER BY 1")]

    # -- pending assignments ----------------------------------------------------------------
    def save_assignment(self, model: str, node: str, holdings: Iterable[Holding], budget: int,
                        until: float) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO assignments VALUES (?, ?, ?, ?, ?)",
                             (model, node, json.dumps([list(h) for h in holdings]), budget,
                              until))

    def drop_assignment(self, model: str, node: str) -> None:
        """Forget a pending assignment (confirmed by a heartbeat, or superseded)."""
        with self._db:
            self._db.execute("DELETE FROM assignments WHERE model = ? AND node = ?",
                             (model, node))

    def assignments(self, now: float) -> list[tuple[str, str, tuple[Holding, ...], int, float]]:
        """Pending assignments still within their grace: (model, node, holdings, budget,
        until). Older ones are deleted."""
        with self._db:
            self._db.execute("DELETE FROM assignments WHERE until < ?", (now,))
        out = []
        for model, node, text, budget, until in self._db.execute(
                "SELECT model, node, holdings, budget, until FROM assignments ORDER BY 1, 2"):
            holdings = tuple(Holding(*h) for h in json.loads(text))
            out.append((model, node, holdings, int(budget), float(until)))
        return out
