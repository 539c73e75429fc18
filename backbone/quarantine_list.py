"""A quarantine outlives the process that made it: every backbone of a model distrusts a node that
any trusted backbone caught.

* **At start**, the backbone asks the market for the model's status, whose ``quarantined`` field
  lists the nodes the market holds quarantined (its ledger file keeps them for good; with
  ``--trust-backbone`` only verdicts signed by a trusted backbone got there). Without a market
  (or when it does not answer within ``timeout_s``) the backbone starts with its own list and
  asks again, 1 s later, then 2, 4 ... up to every 30 s, until a market answers once (a market
  started later, or one too busy to answer in time, still gets its list here).
* **On the bus**, it follows ``kvasir.<model>.quarantine``: a verdict counts when its signature
  (:mod:`kvasir_bus.signing`) is by this backbone's own key or one in ``trusted``. An unsigned or
  unknown-key verdict is ignored (one log line a minute): a forger cannot make a backbone drop an
  honest worker.

A node distrusted this way is in :class:`backbone.audit.Auditor`'s quarantine (bounded, see
there) but not in its ``stats.quarantined`` (the nodes this process caught itself). Under
``kvasir creds`` the backbone identity needs subscribe rights on ``kvasir.*.quarantine`` to follow
the bus (its permissions, kvasir_bus/creds.py); loading from the market needs only the status request it has.
"""

from __future__ import annotations

import asyncio

import structlog

from kvasir_bus import market_codec as mc
from kvasir_bus.signing import SignatureError, Verifier
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.quarantine_list")


class QuarantineList:
    def __init__(self, nc, model: str, auditor, *, own_key: str | None = None, trusted: tuple[str, ...] = ()):
        self.nc, self.model, self.auditor = nc, model, auditor
        self.subjects = Subjects(model)
        self.verifier = Verifier(tuple(k for k in (own_key, *trusted) if k))
        self.refusals = ThrottledLog(log, 60.0)
        self.loaded = 0  # nodes taken from the market's list at start
        self.followed = 0  # verdicts taken from the bus
        self.ignored = 0  # verdicts refused for their signature
        self._sub = None
        self._stopped = None  # asyncio.Event, made on the loop by start()

    async def start(self, *, load: bool = True, timeout_s: float = 1.0, retry_max_s: float = 30.0) -> None:
        """Follow the verdicts on the bus, then (``load``) take the market's list, asking again
        with back-off until one answer came or :meth:`stop`."""
        self._stopped = asyncio.Event()
        self._sub = await self.nc.subscribe(self.subjects.quarantine(), cb=self._on_verdict)
        wait = 1.0
        while load and await self.load(timeout_s) is None and not self._stopped.is_set():
            try:
                await asyncio.wait_for(self._stopped.wait(), wait)
            except asyncio.TimeoutError:
                pass
            wait = min(retry_max_s, 2 * wait)

    async def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def load(self, timeout_s: float = 1.0) -> int | None:
        """Take the market's quarantine list; how many nodes were new here (None: no list came)."""
        try:
            msg = await self.nc.request(self.subjects.status(), b"", timeout=timeout_s)
            status = mc.decode_status_reply(msg.data)
        except Exception as exc:  # no market, or its answer is no status
            self.refusals.info(("not_loaded",), "quarantine_list_not_loaded", model=self.model,
                               error=f"{type(exc).__name__}: {exc}"[:200], note="asking again with back-off")
            return None
        if not isinstance(status, mc.MarketStatus):
            return None
        new = sum(self.auditor.quarantine(node, caught_here=False) for node in status.quarantined)
        self.loaded += new
        log.info("quarantine_list_loaded", model=self.model, nodes=len(status.quarantined), new=new)
        return new

    async def _on_verdict(self, msg) -> None:
        try:
            self.verifier.check(msg.data, msg.headers)
            event = mc.decode_quarantine(msg.data)
        except (SignatureError, mc.CodecError) as exc:
            self.ignored += 1
            self.refusals.info(("verdict", type(exc).__name__), "quarantine_verdict_ignored", error=str(exc)[:200])
            return
        if event.model == self.model and self.auditor.quarantine(event.node, caught_here=False):
            self.followed += 1
            log.warning("node_quarantined_elsewhere", node=event.node, layer=event.layer, expert=event.expert)
