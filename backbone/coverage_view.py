"""The dispatch's view of who covers what: experts nobody answered for, until a worker says so.

After "no responders" (the server's instant 503) for ``(layer, expert)`` the expert is
remembered as uncovered for ``ttl_s``: the next steps compute it locally without asking.
Two things end that: the time passing, or a worker's heartbeat on ``kvasir.<model>.coverage.*``
announcing the expert (a new replica is used at once, not a ttl later).
"""

from __future__ import annotations

import time
from typing import Callable

import structlog

from kvasir_bus import codec
from kvasir_bus.subjects import Subjects

log = structlog.get_logger("kvasir.coverage_view")


class CoverageView:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._uncovered: dict[tuple[int, int], float] = {}  # (layer, expert) -> until (clock)
        self._sub = None

    # -- the cache (the loop thread) ------------------------------------------------------------

    def is_uncovered(self, layer: int, expert: int) -> bool:
        return self._uncovered.get((layer, expert), float("-inf")) > self.clock()

    def mark_uncovered(self, layer: int, expert: int) -> None:
        self._uncovered[(layer, expert)] = self.clock() + self.ttl_s

    @property
    def uncovered(self) -> int:
        """Experts currently given up on (expired entries included until overwritten)."""
        now = self.clock()
        return sum(until > now for until in self._uncovered.values())

    def heard(self, heartbeat: codec.Heartbeat) -> None:
        """A worker announced its holdings: ask for every one of them again."""
        for h in heartbeat.holdings:
            for e in h.experts:
                self._uncovered.pop((h.layer, e), None)

    # -- the heartbeat listener -------------------------------------------------------------------

    async def start(self, nc, model: str) -> None:
        if self._sub is None:
            self._sub = await nc.subscribe(Subjects(model).coverage_all(), cb=self._on_heartbeat)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _on_heartbeat(self, msg) -> None:
        if not self._uncovered:
            return
        try:
            hb = codec.decode_heartbeat(msg.data)
        except codec.CodecError:
            return  # the market logs malformed heartbeats; dispatch only needs good ones
        self.heard(hb)
