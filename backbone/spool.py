"""The backbone's ledger spool: every won event on local disk until the ledger stream stores it.

:class:`~backbone.market_link.MarketLink` hands won events to the JetStream stream in batches
(within ``flush_s``). A backbone killed with SIGKILL in between would lose the wins not yet
stored; the spool closes that gap. One directory per backbone node (by default
``$XDG_STATE_HOME/kvasir/spool/<model fingerprint>/<node>``, :func:`default_dir`) holds

* ``spool.log``: an append-only file of framed records, each ``<u32 length><u32 crc32>`` (little
  endian) then a msgpack list:

  ===========================================  ==================================================
  ``["H", 1, model, node]``                    header: whose spool this is (first record)
  ``["E", event_id, node, layer, expert,``     a win, written the moment it is recorded
  ``  rows, at]``
  ``["R", msg_id, routing bytes]``             routing statistics that back later batches
                                               (the ``remote`` rows: the market's bound)
  ``["B", batch_id, [event_id, ...]]``         a batch cut from earlier ``E`` records
  ``["A", msg_id]``                            the stream stored that ``R`` or ``B``: the
                                               "acked up to" watermark
  ``["V", node, since]``                       an audit voided ``node``: its wins not yet in a
                                               batch, won at or after ``since``, are dropped
                                               (no ``since``: all of them)
  ===========================================  ==================================================

* ``lock``: held (``flock``) by the process using the spool, so two backbones never share one.

Each record is one ``os.write`` on a file opened ``O_APPEND``, with no ``fsync``: a SIGKILL ends
the process, not the kernel, and the page cache it wrote into survives it (only a power cut or
a kernel crash loses the newest records, and those take the backbone's host down anyway). A
record torn by such a crash is detected by its length and CRC; reading stops there.

:meth:`Spool.open` reads the file back into a :class:`Backlog`: routing statistics and batches
not yet acknowledged (to resend with the SAME ``Nats-Msg-Id``, so the stream's duplicate window
and the market's own idempotence count each once), and wins not yet in any batch (never sent).
:meth:`Spool.rewrite` compacts: it replaces the file with a snapshot of what is still unacked
(the market link calls it once the file passes ``compact_bytes``). ``max_bytes`` bounds the
file: a record that would pass it even after a compaction is refused (and the link says so).
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from kvasir_bus import market_codec as mc
from kvasir_bus.errors import KvasirError, UsageError

VERSION = 1
FILE = "spool.log"
LOCK = "lock"
DEFAULT_MAX_BYTES = 64 << 20       # ~800k wins at ~80 bytes each
DEFAULT_COMPACT_BYTES = 1 << 20
OFF = "off"
_FRAME = struct.Struct("<II")


def default_dir(model: str, node: str) -> Path:
    """``$XDG_STATE_HOME/kvasir/spool/<model>/<node>`` (``~/.local/state`` without it)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "kvasir" / "spool" / model / node


def resolve(flag: str | None, model: str, node: str) -> Path | None:
    """The ``--spool`` flag: None -> the default directory, ``off`` -> no spool, else DIR."""
    if flag is None:
        return default_dir(model, node)
    if flag == OFF:
        return None
    return Path(flag)


def frame(record: list) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def read_records(path: Path) -> tuple[list[list], bool]:
    """Every whole record of a spool file, and whether a torn or corrupt tail was cut off."""
    data = path.read_bytes() if path.exists() else b""
    out, pos = [], 0
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        body = data[pos + _FRAME.size: pos + _FRAME.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            return out, True
        try:
            record = msgpack.unpackb(body, raw=False)
        except Exception:
            return out, True
        if not isinstance(record, list) or not record or not isinstance(record[0], str):
            return out, True
        out.append(record)
        pos += _FRAME.size + length
    return out, pos != len(data)


def event_record(e: mc.LedgerEvent) -> list:
    return ["E", e.event_id, e.node, e.layer, e.expert, e.rows, e.at]


@dataclass
class Backlog:
    """What a spool file says is not yet stored by the stream, in the order it was recorded."""

    model: str = ""
    node: str = ""
    routing: list[tuple[str, bytes]] = field(default_factory=list)   # (msg_id, RoutingStats bytes)
    batches: list[tuple[str, tuple[mc.LedgerEvent, ...]]] = field(default_factory=list)
    pending: list[mc.LedgerEvent] = field(default_factory=list)       # in no batch: never sent
    wins: list[mc.LedgerEvent] = field(default_factory=list)          # every E record in the file
    torn: bool = False

    @property
    def events(self) -> int:
        return sum(len(events) for _, events in self.batches) + len(self.pending)


def parse(records: list[list]) -> Backlog:
    """Replay the records: what was sent and acknowledged drops out, the rest is the backlog."""
    out = Backlog()
    events: OrderedDict[str, mc.LedgerEvent] = OrderedDict()
    routing: OrderedDict[str, bytes] = OrderedDict()
    batches: OrderedDict[str, tuple[mc.LedgerEvent, ...]] = OrderedDict()
    batched: set[str] = set()
    for record in records:
        kind = record[0]
        if kind == "H":
            out.model, out.node = str(record[2]), str(record[3])
        elif kind == "E":
            try:
                event = mc.LedgerEvent(*record[1:7])
            except (TypeError, ValueError, mc.CodecError):
                continue  # not ours to send; a CRC-checked record never is
            events[event.event_id] = event
            out.wins.append(event)
        elif kind == "R":
            routing[record[1]] = bytes(record[2])
        elif kind == "B":
            ids = [i for i in record[2] if i in events]
            batches[record[1]] = tuple(events[i] for i in ids)
            batched.update(ids)
        elif kind == "A":
            routing.pop(record[1], None)
            batches.pop(record[1], None)
        elif kind == "V":
            since = float(record[2]) if len(record) > 2 else 0.0
            for event_id in [i for i, e in events.items()
                             if e.node == record[1] and e.at >= since and i not in batched]:
                del events[event_id]
    out.routing = list(routing.items())
    out.batches = list(batches.items())
    out.pending = [e for i, e in events.items() if i not in batched]
    return out


def read(directory: str | os.PathLike) -> Backlog:
    """Read a spool without taking it (a test, or ``kvasir ledger replay`` before it locks)."""
    path = Path(directory) / FILE
    if not path.exists():
        raise UsageError(f"no ledger spool at {path}")
    records, torn = read_records(path)
    backlog = parse(records)
    backlog.torn = torn
    return backlog


class Spool:
    """One backbone's spool directory. Not thread-safe: the market link calls it under its lock."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 compact_bytes: int = DEFAULT_COMPACT_BYTES) -> None:
        if not 0 < compact_bytes <= max_bytes:
            raise ValueError(f"need 0 < compact_bytes <= max_bytes, got {compact_bytes}, {max_bytes}")
        self.dir = Path(directory)
        self.max_bytes, self.compact_bytes = max_bytes, compact_bytes
        self.size = 0
        self._fd: int | None = None
        self._lock_fd: int | None = None

    @property
    def path(self) -> Path:
        return self.dir / FILE

    def open(self, model: str | None = None, node: str | None = None) -> Backlog:
        """Take the spool (refused if another process holds it) and read its backlog. With
        ``model``/``node``, a spool of another model or node is refused; without, the header
        says whose it is (``kvasir ledger replay``)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise KvasirError(f"ledger spool {self.dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise KvasirError(f"ledger spool {self.dir} is in use by another process (give each "
                              "backbone its own --node or --spool DIR)") from None
        records, torn = read_records(self.path)
        backlog = parse(records)
        backlog.torn = torn
        if records and ((model and backlog.model != model) or (node and backlog.node != node)):
            self.close()
            raise KvasirError(f"ledger spool {self.dir} belongs to model {backlog.model} node "
                              f"{backlog.node}, not {model} {node}: give another --spool DIR")
        backlog.model, backlog.node = model or backlog.model, node or backlog.node
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self._fd).st_size
        self.model, self.node = backlog.model, backlog.node
        return backlog

    def close(self) -> None:
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # closing the lock file releases the flock
                setattr(self, name, None)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fits(self, n: int) -> bool:
        return self.size + n <= self.max_bytes

    def append(self, data: bytes) -> None:
        """Write framed records (``frame``) at the end: one write, no fsync (see the module)."""
        os.write(self._fd, data)
        self.size += len(data)

    def rewrite(self, records: list[list]) -> None:
        """Replace the file by ``records`` (after the header): write a new file, rename it over
        the old one (atomic: a crash leaves one of the two whole)."""
        tmp = self.dir / (FILE + ".tmp")
        data = frame(["H", VERSION, self.model, self.node]) + b"".join(frame(r) for r in records)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = len(data)
