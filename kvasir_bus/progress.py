"""Progress of long work as log lines, for when nobody watches a terminal.

On a terminal a command redraws one ``\\r`` line (``workers.download.TerminalProgress``,
``kvasir synth``'s own); in a log file (``kvasir up --logs``, CI, systemd) that line would be
noise or nothing. :class:`LogProgress` is the same callback, ``progress(done, total)``, turned
into one structlog line now and then::

    {"event": "synth_progress", "done": 52428800, "total": 118489088, "pct": 44.2,
     "rate": 24.3, "unit": "bytes", "rate_unit": "MB/s", "elapsed_s": 2.2, ...}

A line is written on the first call (or once ``after_s`` passed: work done sooner stays
quiet), whenever another ``step`` of the total is done (10% by
default), when ``every_s`` seconds passed since the last line (a stall still says it is alive),
and once at the end (``done >= total``). ``rate`` is units per second since the first call
(what was done before it, a resumed download's bytes, does not count), in MB/s for bytes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import structlog

__all__ = ["LogProgress"]


class LogProgress:
    """``progress(done, total[, what])`` -> an info line every ``step`` of the total or every
    ``every_s`` seconds, whichever comes first; none before ``after_s`` seconds. ``unit``:
    "bytes" (rate in MB/s) or a word for what is counted ("steps", "workers"). ``context``:
    fields bound to every line."""

    def __init__(self, event: str, *, unit: str = "bytes", every_s: float = 10.0, step: float = 0.1,
                 after_s: float = 0.0, clock: Callable[[], float] | None = None, **context: Any) -> None:
        if not every_s > 0 or not 0 < step <= 1 or after_s < 0:
            raise ValueError(f"every_s must be > 0, step in (0, 1], after_s >= 0; got {every_s}, {step}, "
                             f"{after_s}")
        self.event, self.unit, self.every_s, self.step, self.after_s = event, unit, every_s, step, after_s
        self.clock, self.context = clock or time.monotonic, context
        self.shown = False
        self.t0: float | None = None
        self.first = 0
        self.last_t = 0.0
        self.next_tick = 0  # the next multiple of ``step`` that earns a line
        self.finished = False

    def __call__(self, done: int, total: int, what: str | None = None) -> None:
        now = self.clock()
        if self.t0 is None:
            self.t0, self.first = now, done
        elif self.finished:
            return
        frac = done / total if total > 0 else 1.0
        tick = int(frac / self.step + 1e-9)  # whole steps done (3/10 is 3 steps of 0.1, not 2.99..)
        end = done >= total
        if now - self.t0 < self.after_s and not self.shown:
            return  # quick work stays quiet, its end too
        if self.shown and not (end or tick >= self.next_tick or now - self.last_t >= self.every_s):
            return
        self.shown = True
        self.last_t = now
        self.next_tick = tick + 1
        self.finished = end
        elapsed = now - self.t0
        scale = 1e6 if self.unit == "bytes" else 1.0
        fields: dict[str, Any] = {
            "done": done, "total": total, "pct": round(100.0 * frac, 1),
            "rate": round((done - self.first) / scale / elapsed, 2) if elapsed > 0 else None,
            "unit": self.unit, "rate_unit": ("MB" if self.unit == "bytes" else self.unit) + "/s",
            "elapsed_s": round(elapsed, 1)}
        if what is not None:
            fields["what"] = what
        structlog.get_logger("kvasir.progress").info(self.event, **self.context, **fields)

    def close(self) -> None:
        """Nothing to erase (the same interface as the terminal line)."""
