"""The contribution ledger: who served which rows, and what it earned. SQLite, durable.

One row per ledger event, keyed by its ``event_id``: ``INSERT OR IGNORE`` makes a re-sent event
a counted duplicate, never a second payment. Each event is stored with the reward rate of its
range at the moment it is recorded (the price is fixed then and never recomputed). A batch is
one transaction; :meth:`Ledger.record` returns only after it is committed (WAL journal,
``synchronous=FULL``), so the market acks a batch only once it would survive a crash.

The same file keeps the market's pending assignments, so a restarted market still counts a
volunteer that is downloading its slice.

What the market reads from the ledger stream (:mod:`kvasir_bus.ledger_stream`) is applied with
:meth:`Ledger.apply_routing`, :meth:`Ledger.apply_batch` and :meth:`Ledger.apply_quarantine`,
each one transaction. Each is idempotent by what the message names, never by its stream
sequence: the stream redelivers what a dead market took and never acked *after* newer messages
the next market has read, so "sequence at most the highest applied" does not mean "applied".
An event id (``events``), a routing message id (``routing_ids``; the stream sequence where a
message has none) or a quarantined node applied before is not applied again, whether it comes
back from a crash between commit and ack or from a backbone replaying its spool however late.
``stream`` keeps the highest sequence applied, for reports only. ``bounds`` holds, per (model, backbone,
layer, expert), the rows the backbone's replies from workers won (``routed``, from its routing
statistics) and the rows credited so far: an event that would credit more than was routed is
refused ("unbacked"). A quarantined node's events are void (reward 0; ``void`` = 1) and its
later events are refused. The model manifests the market learned are kept too, so a restarted
market can check the stream's events against the geometry with no backbone on the bus.

The file grows with nodes and ranges, not with calls: :meth:`Ledger.fold` (the market runs it
every few seconds) folds events older than the replay window, and all but the newest
``keep`` of them, into ``folded`` (per model, node, layer and expert: what a node needs to check
its pay), and remembers each backbone's ``horizon``, the newest ``at`` folded, refusing its events
at or before it as ``late``. ``node_totals`` keeps each node's events, rows and reward as they are
stored, voided and folded, so a status reads one row per node at any ledger size. A quarantine
voids only events still kept one by one. ``audits`` adds up, per node, the audits the backbones'
routing statistics report (passed, failed), applied with the routing message that carries them
(so once per message id); at most ``MAX_NODES`` nodes a model, the least recently audited
dropped first (anyone may name any node on an open bus).

Not thread-safe by itself: the service calls it from one worker thread.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from kvasir_bus.wire import Holding
from kvasir_bus.errors import KvasirError
from kvasir_bus.market_codec import MAX_NODES, LedgerEvent, NodeAudits, NodeTotals
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
CREATE TABLE IF NOT EXISTS bounds (
    model       TEXT NOT NULL,
    source      TEXT NOT NULL,
    layer       INTEGER NOT NULL,
    expert      INTEGER NOT NULL,
    routed      INTEGER NOT NULL,
    credited    INTEGER NOT NULL,
    PRIMARY KEY (model, source, layer, expert)
);
CREATE TABLE IF NOT EXISTS quarantined (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    at          REAL NOT NULL,
    PRIMARY KEY (model, node)
);
CREATE TABLE IF NOT EXISTS manifests (
    model       TEXT PRIMARY KEY,
    data        BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS stream (
    name        TEXT PRIMARY KEY,
    seq         INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS routing_ids (
    model       TEXT NOT NULL,
    source      TEXT NOT NULL,
    msg_id      TEXT NOT NULL,
    PRIMARY KEY (model, source, msg_id)
);
CREATE INDEX IF NOT EXISTS events_by_time ON events (recorded_at);
CREATE TABLE IF NOT EXISTS node_totals (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    events      INTEGER NOT NULL,
    rows        INTEGER NOT NULL,
    reward      REAL NOT NULL,
    PRIMARY KEY (model, node)
);
CREATE TABLE IF NOT EXISTS folded (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    layer       INTEGER NOT NULL,
    expert      INTEGER NOT NULL,
    events      INTEGER NOT NULL,
    rows        INTEGER NOT NULL,
    reward      REAL NOT NULL,
    PRIMARY KEY (model, node, layer, expert)
);
CREATE TABLE IF NOT EXISTS horizons (
    model       TEXT NOT NULL,
    source      TEXT NOT NULL,
    at          REAL NOT NULL,
    PRIMARY KEY (model, source)
);
CREATE TABLE IF NOT EXISTS audits (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    passed      INTEGER NOT NULL,
    failed      INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    PRIMARY KEY (model, node)
);
CREATE TABLE IF NOT EXISTS assignments (
    model       TEXT NOT NULL,
    node        TEXT NOT NULL,
    holdings    TEXT NOT NULL,
    budget      INTEGER NOT NULL,
    until       REAL NOT NULL,
    PRIMARY KEY (model, node)
);
"""


class _Held(Exception):
    """An unbacked event in a batch applied with ``hold``: roll the whole batch back."""


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
                cols = {r[1] for r in self._db.execute("PRAGMA table_info(events)")}
                if "void" not in cols:  # a ledger file from before voiding
                    self._db.execute("ALTER TABLE events ADD COLUMN void INTEGER NOT NULL DEFAULT 0")
                if not self._db.execute("SELECT 1 FROM node_totals LIMIT 1").fetchone():
                    # a ledger file without running totals: count them once, from its events
                    self._db.execute(
                        "INSERT INTO node_totals SELECT model, node, count(*), sum(rows), sum(reward) "
                        "FROM events WHERE void = 0 GROUP BY model, node")
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
                    self._add_totals(model, event.node, 1, event.rows, rate * event.rows)
                else:
                    duplicates += 1
        return accepted, duplicates

    def _add_totals(self, model: str, node: str, events: int, rows: int, reward: float) -> None:
        """Inside a transaction: move ``node``'s running totals (negative: voided)."""
        self._db.execute("INSERT INTO node_totals VALUES (?, ?, ?, ?, ?) ON CONFLICT (model, node) DO UPDATE "
                         "SET events = events + excluded.events, rows = rows + excluded.rows, "
                         "reward = reward + excluded.reward", (model, node, events, rows, reward))

    def totals(self, model: str | None = None) -> list[NodeTotals]:
        """Events, rows and reward per node (of one model, or of all), sorted by node: the
        running totals, kept as events are stored, voided and folded (a read of one row per
        node, whatever the ledger's size)."""
        if self._has("node_totals"):
            where, args = ("WHERE model = ?", [model]) if model else ("", [])
            rows = self._db.execute(
                f"SELECT node, sum(events), sum(rows), sum(reward) FROM node_totals {where} "
                "GROUP BY node HAVING sum(events) > 0 ORDER BY node", args).fetchall()
            return [NodeTotals(node, int(n), int(r or 0), max(0.0, float(w or 0.0))) for node, n, r, w in rows]
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(events)")}
        conds, args = (["model = ?"], [model]) if model else ([], [])
        if "void" in cols:  # void events (a quarantined node's) earn nothing and count nothing
            conds.append("void = 0")
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        rows = self._db.execute(
            f"SELECT node, count(*), sum(rows), sum(reward) FROM events {where} "
            "GROUP BY node ORDER BY node", args).fetchall()
        return [NodeTotals(node, int(n), int(r or 0), float(w or 0.0)) for node, n, r, w in rows]

    def _has(self, table: str) -> bool:
        return self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                (table,)).fetchone() is not None

    def models(self) -> list[str]:
        if self._has("node_totals"):
            return [m for (m,) in self._db.execute("SELECT DISTINCT model FROM node_totals ORDER BY 1")]
        return [m for (m,) in self._db.execute("SELECT DISTINCT model FROM events ORDER BY 1")]

    # -- folding ----------------------------------------------------------------------------
    def fold(self, before: float, keep: int = 100_000) -> int:
        """Fold the events recorded before ``before`` (the market's clock), and all but the
        newest ``keep``, into per (model, node, layer, expert) totals, and delete them: the file
        grows with nodes and ranges, not with calls. Returns the events folded.

        What a folded event can no longer do: be voided by a later quarantine (its node had
        passed its audits until then), or be told apart from a replay of itself: so each
        backbone's ``horizon``, the newest ``at`` folded of its events, refuses its events at or
        before it as ``late`` from then on."""
        if keep < 0:
            raise ValueError("keep must be >= 0")
        with self._db:
            n = self._db.execute("SELECT count(*) FROM events").fetchone()[0]
            cut = before
            if n > keep:
                got = self._db.execute("SELECT recorded_at FROM events ORDER BY recorded_at "
                                       "LIMIT 1 OFFSET ?", (n - keep,)).fetchone()
                cut = max(cut, got[0])
            self._db.execute(
                "INSERT INTO folded SELECT model, node, layer, expert, count(*), sum(rows), sum(reward) "
                "FROM events WHERE recorded_at < ? AND void = 0 GROUP BY model, node, layer, expert "
                "ON CONFLICT (model, node, layer, expert) DO UPDATE SET events = events + excluded.events, "
                "rows = rows + excluded.rows, reward = reward + excluded.reward", (cut,))
            self._db.execute(
                "INSERT INTO horizons SELECT model, source, max(at) FROM events WHERE recorded_at < ? "
                "GROUP BY model, source ON CONFLICT (model, source) DO UPDATE SET at = max(at, excluded.at)",
                (cut,))
            return self._db.execute("DELETE FROM events WHERE recorded_at < ?", (cut,)).rowcount

    def horizon(self, model: str, source: str) -> float | None:
        """The newest ``at`` folded of ``source``'s events (None: none folded)."""
        got = self._db.execute("SELECT at FROM horizons WHERE model = ? AND source = ?",
                               (model, source)).fetchone()
        return float(got[0]) if got else None

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

    # -- the ledger stream ------------------------------------------------------------------
    def stream_seq(self, name: str) -> int:
        """The highest stream sequence applied (0: none); a report, not a test of "applied"."""
        got = self._db.execute("SELECT seq FROM stream WHERE name = ?", (name,)).fetchone()
        return int(got[0]) if got else 0

    def _note_seq(self, name: str, seq: int) -> None:
        """Inside a transaction: remember ``seq`` if it is the highest applied so far."""
        self._db.execute("INSERT INTO stream VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET "
                         "seq = max(seq, excluded.seq)", (name, seq))

    def apply_routing(self, stream: str, seq: int, model: str, source: str,
                      remote: Iterable[tuple[int, int, int]], msg_id: str | None = None,
                      audits: Iterable[tuple[str, int, int]] = ()) -> bool:
        """Add ``(layer, expert, rows)`` won by workers to the bounds of ``source``, and
        ``(node, passed, failed)`` to each node's audit counts; False if a message with the same
        ``msg_id`` (``Nats-Msg-Id``; without one, the same stream sequence ``seq``) from that
        source was applied before: redelivered, or replayed from a spool after the stream's
        duplicate window, it adds its bound and its audits once."""
        key = msg_id or f"#{stream}:{seq}"
        with self._db:
            if self._db.execute("INSERT OR IGNORE INTO routing_ids VALUES (?, ?, ?)",
                                (model, source, key)).rowcount == 0:
                return False
            self._note_seq(stream, seq)
            self._db.executemany(
                "INSERT INTO bounds VALUES (?, ?, ?, ?, ?, 0) ON CONFLICT (model, source, layer, "
                "expert) DO UPDATE SET routed = routed + excluded.routed",
                [(model, source, layer, expert, rows) for layer, expert, rows in remote if rows > 0])
            self._add_audits(model, seq, audits)
        return True

    def _add_audits(self, model: str, seq: int, audits: Iterable[tuple[str, int, int]],
                    keep: int = MAX_NODES) -> None:
        """Inside a transaction: add audit counts per node, then keep the ``keep`` most recently
        audited nodes of ``model``."""
        rows = [(model, node, passed, failed, seq) for node, passed, failed in audits]
        if not rows:
            return
        self._db.executemany(
            "INSERT INTO audits VALUES (?, ?, ?, ?, ?) ON CONFLICT (model, node) DO UPDATE SET "
            "passed = passed + excluded.passed, failed = failed + excluded.failed, seq = max(seq, excluded.seq)", rows)
        (n,) = self._db.execute("SELECT count(*) FROM audits WHERE model = ?", (model,)).fetchone()
        if n > keep:
            self._db.execute("DELETE FROM audits WHERE model = ? AND node IN (SELECT node FROM audits WHERE "
                             "model = ? ORDER BY seq, node LIMIT ?)", (model, model, n - keep))

    def node(self, model: str, node: str) -> tuple[NodeTotals, NodeAudits]:
        """One node's running totals and audit counts (zeros when it has none): two lookups by key."""
        got = self._db.execute("SELECT sum(events), sum(rows), sum(reward) FROM node_totals WHERE model = ? AND "
                               "node = ?", (model, node)).fetchone() if self._has("node_totals") else None
        events, rows, reward = got if got and got[0] is not None else (0, 0, 0.0)
        audited = self._db.execute("SELECT passed, failed FROM audits WHERE model = ? AND node = ?",
                                   (model, node)).fetchone() if self._has("audits") else None
        return (NodeTotals(node, int(events), int(rows or 0), max(0.0, float(reward or 0.0))),
                NodeAudits(node, *(map(int, audited) if audited else (0, 0))))

    def audits(self, model: str, limit: int = MAX_NODES) -> list[NodeAudits]:
        """Audits passed and failed per node of ``model``, the most recently audited first."""
        if not self._has("audits"):  # a read-only file from before audit counts
            return []
        rows = self._db.execute("SELECT node, passed, failed FROM audits WHERE model = ? ORDER BY seq DESC, node "
                                "LIMIT ?", (model, limit)).fetchall()
        return [NodeAudits(node, int(p), int(f)) for node, p, f in rows]

    def apply_batch(self, stream: str, seq: int, model: str, source: str, batch_id: str,
                    priced: Iterable[tuple[LedgerEvent, float]], now: float, hold: bool = False
                    ) -> tuple[dict[str, int], list[LedgerEvent]] | None:
        """Store ``(event, rate)`` pairs that are backed by routed rows and not from a
        quarantined node; an event id stored before counts as a duplicate. Returns counts
        ``accepted``, ``duplicates``, ``unbacked``, ``quarantined`` and the accepted events.

        ``hold``: if any event is unbacked, store nothing and return None. The routing that
        backs it may still be on its way (the stream redelivers what a dead market took
        after what came later): the caller asks for the batch again later, and the last time
        without ``hold``."""
        out = dict(accepted=0, duplicates=0, unbacked=0, quarantined=0, late=0)
        accepted: list[LedgerEvent] = []
        try:
            with self._db:
                banned = self.quarantined(model)
                horizon = self.horizon(model, source)
                for event, rate in priced:
                    if event.node in banned:
                        out["quarantined"] += 1
                        continue
                    if horizon is not None and event.at <= horizon:
                        out["late"] += 1  # older than what was folded: it may be a replay of it
                        continue
                    if self._db.execute("SELECT 1 FROM events WHERE event_id = ?",
                                        (event.event_id,)).fetchone():
                        out["duplicates"] += 1
                        continue
                    got = self._db.execute(
                        "SELECT routed, credited FROM bounds WHERE model = ? AND source = ? AND "
                        "layer = ? AND expert = ?", (model, source, event.layer, event.expert)).fetchone()
                    if got is None or got[1] + event.rows > got[0]:
                        if hold:
                            raise _Held
                        out["unbacked"] += 1
                        continue
                    self._db.execute(
                        "UPDATE bounds SET credited = credited + ? WHERE model = ? AND source = ? AND "
                        "layer = ? AND expert = ?", (event.rows, model, source, event.layer, event.expert))
                    self._db.execute(
                        "INSERT INTO events (event_id, model, node, layer, expert, rows, at, rate, "
                        "reward, source, batch_id, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (event.event_id, model, event.node, event.layer, event.expert, event.rows,
                         event.at, rate, rate * event.rows, source, batch_id, now))
                    self._add_totals(model, event.node, 1, event.rows, rate * event.rows)
                    out["accepted"] += 1
                    accepted.append(event)
                self._note_seq(stream, seq)
        except _Held:  # the transaction is rolled back: nothing of this batch is stored
            return None
        return out, accepted

    def apply_quarantine(self, stream: str, seq: int, model: str, node: str, at: float,
                         since: float = 0.0) -> int | None:
        """Quarantine ``node``: its events won at or after ``since`` (the backbone's time of its
        last passed audit; 0: all of them) are void, audited work before stays credited, and it
        is refused from now on. Returns the rows voided (None if ``node`` was quarantined before)."""
        with self._db:
            if self._db.execute("INSERT OR IGNORE INTO quarantined VALUES (?, ?, ?)",
                                (model, node, at)).rowcount == 0:
                return None
            self._note_seq(stream, seq)
            got = self._db.execute("SELECT sum(rows), count(*), sum(reward) FROM events WHERE model = ? "
                                   "AND node = ? AND void = 0 AND at >= ?", (model, node, since)).fetchone()
            if got[1]:
                self._add_totals(model, node, -got[1], -int(got[0] or 0), -float(got[2] or 0.0))
            self._db.execute("UPDATE events SET void = 1, reward = 0 WHERE model = ? AND node = ? AND at >= ?",
                             (model, node, since))
        return int(got[0] or 0)

    def quarantined(self, model: str) -> set[str]:
        return {n for (n,) in self._db.execute("SELECT node FROM quarantined WHERE model = ?",
                                               (model,))}

    def served(self) -> list[tuple[str, str, int, int]]:
        """Every (model, node, layer, expert) with a credited event: who answered for what."""
        return list(self._db.execute("SELECT DISTINCT model, node, layer, expert FROM events "
                                     "WHERE void = 0 UNION SELECT model, node, layer, expert FROM folded"))

    def save_manifest(self, model: str, data: bytes) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO manifests VALUES (?, ?)", (model, data))

    def manifests(self) -> list[tuple[str, bytes]]:
        return [(m, bytes(d)) for m, d in self._db.execute("SELECT model, data FROM manifests")]
