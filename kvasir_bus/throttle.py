"""Bounded, per-sender throttles: one log line per sender per minute, and request rate limits.

Anything on the bus can send as many messages as it likes under as many names as it likes, so
both helpers keep at most ``max_keys`` senders (the least recently seen is forgotten first):
their memory is bounded whatever arrives. Both take ``now`` from a monotonic clock they are
given (tests walk time by hand).

    warn = ThrottledLog(log, interval_s=60)
    warn.warning(node, "heartbeat_refused", node=node, error=str(exc))   # at most 1/min/node

    limit = RateLimiter(rate=20, burst=40)
    if not limit.allow(sender):
        return                                 # over its budget: dropped (and counted)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_MAX_KEYS = 4096


class ThrottledLog:
    """Log at most one line per key per ``interval_s``; the next line that gets through says
    how many were suppressed meanwhile (``suppressed=N``)."""

    def __init__(self, logger: Any, interval_s: float = 60.0, *, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError(f"interval_s must be >= 0 and max_keys >= 1, got {interval_s}, {max_keys}")
        self.logger, self.interval_s, self.max_keys, self.clock = logger, interval_s, max_keys, clock
        self._last: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # key -> (logged at, suppressed)
        self.suppressed = 0  # lines not written, for all time

    def _due(self, key: Hashable) -> int | None:
        """Suppressed count to report if a line for ``key`` may be written now, else None."""
        now = self.clock()
        got = self._last.get(key)
        if got is not None and now - got[0] < self.interval_s:
            self._last[key] = (got[0], got[1] + 1)
            self._last.move_to_end(key)
            self.suppressed += 1
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return got[1] if got is not None else 0

    def log(self, level: str, key: Hashable, event: str, **kw: Any) -> bool:
        """Write ``event`` at ``level`` unless ``key`` had a line within ``interval_s``;
        True if written."""
        missed = self._due(key)
        if missed is None:
            return False
        if missed:
            kw["suppressed"] = missed
        getattr(self.logger, level)(event, **kw)
        return True

    def info(self, key: Hashable, event: str, **kw: Any) -> bool:
        return self.log("info", key, event, **kw)

    def warning(self, key: Hashable, event: str, **kw: Any) -> bool:
        return self.log("warning", key, event, **kw)

    def error(self, key: Hashable, event: str, **kw: Any) -> bool:
        return self.log("error", key, event, **kw)


class RateLimiter:
    """A token bucket per key: ``rate`` requests per second sustained, ``burst`` at once.

    ``allow(key)`` takes one token; False (and ``dropped`` += 1) when the key's bucket is
    empty. A ``total`` bucket (``total_rate``, default 20x ``rate``) bounds all keys together,
    so a flood under ever new names is limited too.
    """

    def __init__(self, rate: float, burst: float | None = None, *, total_rate: float | None = None,
                 max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or max_keys < 1:
            raise ValueError(f"rate must be > 0 and max_keys >= 1, got {rate}, {max_keys}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(1.0, 2 * rate))
        self.total_rate = float(total_rate if total_rate is not None else 20 * rate)
        self.max_keys, self.clock = max_keys, clock
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._total = (self.total_rate * self.burst / self.rate, clock())
        self.dropped = 0

    @staticmethod
    def _take(bucket: tuple[float, float], rate: float, cap: float, now: float) -> tuple[bool, tuple[float, float]]:
        tokens, at = bucket
        tokens = min(cap, tokens + (now - at) * rate)
        if tokens < 1.0:
            return False, (tokens, now)
        return True, (tokens - 1.0, now)

    def allow(self, key: Hashable) -> bool:
        now = self.clock()
        bucket = self._buckets.get(key, (self.burst, now))
        ok, bucket = self._take(bucket, self.rate, self.burst, now)
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        if ok:
            ok, self._total = self._take(self._total, self.total_rate,
                                         self.total_rate * self.burst / self.rate, now)
        if not ok:
            self.dropped += 1
        return ok
