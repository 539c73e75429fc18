"""``kvasir up`` supervises what it started: a dead worker or market is restarted with back-off.

Each child is a *slot*: a name and a function that starts it (a :class:`~launch.swarm.WorkerProcess`
or the market's process; anything with ``proc`` and ``stop()``). A pass (:meth:`Supervisor.check`,
every ``poll_s`` from a thread while the swarm runs) reaps each exited child (``poll()``: no
zombie stays under ``up``), logs it once with its exit status, and starts it again after its
back-off: ``backoff_s`` doubled at each restart up to ``max_backoff_s``, back to ``backoff_s``
once a child has stayed up ``stable_s``. A child that cannot even be started (the start
function raises) is retried the same way. :meth:`Supervisor.stop` ends the thread first, then
stops every child, so Ctrl-C never races a restart.

While a worker is down its experts run on the backbone (the fallback is exact), so a restart
changes no token; the market rebuilds its books from its ledger file and the heartbeats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("kvasir.up")


@dataclass
class _Slot:
    name: str
    start: Callable[[], Any]
    child: Any = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    due_at: float | None = None  # when a dead child is started again
    on_start: Callable[[Any], None] | None = field(default=None, repr=False)


class Supervisor:
    """Restart dead children with back-off; see the module docstring."""

    def __init__(self, *, backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 60.0,
                 poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        self.backoff_s, self.max_backoff_s, self.stable_s, self.poll_s = backoff_s, max_backoff_s, stable_s, poll_s
        self.clock = clock
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, start: Callable[[], Any], child: Any = None,
            on_start: Callable[[Any], None] | None = None) -> Any:
        """Supervise ``name``: ``child`` if it is already running, else ``start()`` now.
        ``on_start(child)`` is called with every (re)started child."""
        slot = _Slot(name, start, child, self.clock(), backoff_s=self.backoff_s, on_start=on_start)
        if slot.child is None:
            slot.child = start()
        with self._lock:
            self._slots[name] = slot
        return slot.child

    def child(self, name: str) -> Any:
        return self._slots[name].child

    def restarts(self) -> dict[str, int]:
        return {name: s.restarts for name, s in self._slots.items()}

    def check(self) -> list[str]:
        """One pass; the names (re)started in it."""
        started = []
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            if self._stop.is_set():
                break
            now = self.clock()
            child = slot.child
            if child is not None:
                code = child.proc.poll()  # reaps an exited child
                if code is None:
                    if now - slot.started_at >= self.stable_s:
                        slot.backoff_s = self.backoff_s
                    continue
                slot.child = None
                slot.due_at = now + slot.backoff_s
                log.warning("child_exited", child=slot.name, exit=code, up_s=round(now - slot.started_at, 1),
                            restart_in_s=slot.backoff_s, restarts=slot.restarts)
            if slot.due_at is None or now < slot.due_at:
                continue
            try:
                slot.child = slot.start()
            except Exception as exc:  # noqa: BLE001 - a start that fails is retried, never fatal to up
                slot.due_at = now + self._grow(slot)
                log.warning("child_start_failed", child=slot.name, error=f"{type(exc).__name__}: {exc}"[:200],
                            retry_in_s=slot.backoff_s)
                continue
            slot.started_at, slot.due_at = now, None
            slot.restarts += 1
            self._grow(slot)
            log.warning("child_restarted", child=slot.name, restarts=slot.restarts,
                        pid=getattr(slot.child.proc, "pid", None))
            if slot.on_start is not None:
                slot.on_start(slot.child)
            started.append(slot.name)
        return started

    def _grow(self, slot: _Slot) -> float:
        slot.backoff_s = min(self.max_backoff_s, slot.backoff_s * 2)
        return slot.backoff_s

    def start(self) -> Supervisor:
        """Run :meth:`check` every ``poll_s`` in a daemon thread until :meth:`stop`."""
        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                self.check()

        self._thread = threading.Thread(target=loop, name="kvasir-up-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the restarts, then stop every child (each child's own ``stop()``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            if slot.child is not None:
                slot.child.stop()
