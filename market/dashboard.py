"""The market's HTTP port: a live coverage dashboard, its data as JSON and SSE, and /metrics.

``kvasir market --http [HOST:]PORT`` serves, on one aiohttp server beside the market:

==================  ===========================================================================
``GET /``           the dashboard (``market/static/``: one HTML page, a script and a style
                    sheet; no build step, nothing from a CDN)
``GET /api/state``  the current snapshot as JSON (what the page draws)
``GET /events``     the same snapshot every ``interval_s`` as server-sent events
                    (``event: state``); the page redraws on each
``GET /metrics``    Prometheus exposition (:mod:`market.metrics`)
==================  ===========================================================================

A snapshot is :func:`market.show.status_json` of every model the market knows (coverage per
range, demand, workers, rewards, fallback rate; the record ``kvasir status --json`` prints)
plus, per model, the live and pending replicas of every single expert (the heatmap) and a
short history of the fallback rate, tokens per second and routed rows per second (history
points ``fallback_rate``, ``tokens_per_s``, ``rows_per_s``). Both rates come from the
backbones' routing statistics, which the dashboard reads on its own subscription: tokens are
what each backbone counted on its first MoE layer (``RoutingStats.tokens``; a backbone that
does not count them adds 0), rows are router hits per MoE layer, tokens x top-k.

Quarantines (a backbone's audit caught a node lying, ``kvasir.<model>.quarantine``) are read
on a second subscription of the dashboard's own and listed per model under ``quarantined``:
node, the expert it was caught on, the error, when. A backbone ignores that node from then on
and the market drops it from its workers (the quarantine reaches it through the ledger stream);
the page keeps a row for it in the workers table, marked, so people see who was caught.

Each worker's reply latency (``latency_ms`` of its node status, None when it has not served
lately) is the mean the backbones measured in their last routing window that named it.
The list lives as long as the market process (the backbones keep theirs in memory too).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from kvasir_bus import market_codec as mc, subjects
from kvasir_bus.codec import CodecError
from kvasir_bus.metrics import MetricsServer, registry
from market.metrics import MarketCollector, expert_pending, expert_replicas
from market.show import status_json

log = structlog.get_logger("kvasir.dashboard")

STATIC = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True)
class DashboardConfig:
    host: str = "127.0.0.1"
    port: int = 0                 # 0: a free port (see Dashboard.url)
    interval_s: float = 1.0       # one snapshot per interval to every open page
    history: int = 300            # points kept per model for the charts

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.history < 2 or not 0 <= self.port <= 65535:
            raise ValueError(f"interval_s must be > 0, history >= 2, port 0..65535; got "
                             f"{self.interval_s}, {self.history}, {self.port}")


class _Throughput:
    """Tokens and rows (per MoE layer) routed per second by each backbone, from its last
    routing window; a model's rate is the sum over the backbones heard from lately."""

    def __init__(self) -> None:
        self.rates: dict[tuple[str, str], tuple[float, float, float]] = {}  # (model, backbone)
        # -> (tokens/s, rows/s per MoE layer, valid until)

    def add(self, stats: mc.RoutingStats, now: float) -> None:
        layers = {layer for layer, _e, _rows in stats.hits}
        rows = sum(r for _l, _e, r in stats.hits)
        window = stats.window_s if stats.window_s > 0 else float("inf")
        rows_rate = rows / window / len(layers) if layers else 0.0
        self.rates[(stats.model, stats.node)] = (stats.tokens / window, rows_rate,
                                                 now + 3 * max(stats.window_s, 1.0))

    def _live(self, model: str, now: float) -> list[tuple[float, float, float]]:
        return [r for (m, _b), r in self.rates.items() if m == model and r[2] >= now]

    def tokens(self, model: str, now: float) -> float | None:
        got = self._live(model, now)
        return sum(t for t, _r, _u in got) if got else None

    def rate(self, model: str, now: float) -> float | None:
        """Rows per second per MoE layer."""
        got = self._live(model, now)
        return sum(r for _t, r, _u in got) if got else None


MAX_QUARANTINED = 1000  # per model: a flood of fake events cannot grow the page without end


def quarantine_json(q: mc.Quarantine) -> dict[str, Any]:
    """One quarantine as the page reads it; a non-finite error (a misshaped or NaN reply)
    becomes None, since JSON has no inf."""
    return {"node": q.node, "layer": q.layer, "expert": q.expert, "kernel": q.kernel,
            "exact": q.exact, "error": q.error if math.isfinite(q.error) else None, "at": q.at}


class Dashboard:
    """The market's HTTP server. ``start()``/``stop()`` are idempotent; ``async with`` works.

    ``market``: a running :class:`market.service.Market` (read through ``models`` and
    ``status()`` only); its NATS connection carries the dashboard's routing subscription.
    """

    def __init__(self, market: Any, cfg: DashboardConfig | None = None) -> None:
        self.market = market
        self.cfg = cfg or DashboardConfig()
        self.collector = MarketCollector(market)
        self.registry = registry(self.collector)
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/events", self._events)
        app.router.add_static("/static/", STATIC)
        self.server = MetricsServer(self.registry, self.cfg.host, self.cfg.port, app=app)
        self.throughput = _Throughput()
        self.quarantined: dict[str, dict[str, mc.Quarantine]] = {}  # model -> node -> first catch
        self.history: dict[str, deque] = {}
        self.snapshot: dict[str, Any] = {"sent_at": time.time(), "models": []}
        self._tick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._subs: list[Any] = []
        self._running = False

    @property
    def url(self) -> str:
        return self.server.url

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> Dashboard:
        if self._running:
            return self
        self._running = True
        try:
            nc = self.market.nc
            self._subs.append(await nc.subscribe(subjects.ALL_ROUTING, cb=self._on_routing))
            self._subs.append(await nc.subscribe(subjects.ALL_QUARANTINE, cb=self._on_quarantine))
            await self.take_snapshot()
            await self.server.start()
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.ensure_future(self._loop())
        log.info("dashboard_started", url=self.url)
        return self

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._tick.set()  # open event streams see _running is False and end
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be closed already
                pass
        await self.server.stop()

    async def __aenter__(self) -> Dashboard:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- data -------------------------------------------------------------------------------
    async def _on_routing(self, msg: Any) -> None:
        try:
            stats = mc.decode_routing(msg.data)
        except CodecError:
            return  # the market logs bad routing messages; the chart only needs good ones
        self.throughput.add(stats, time.time())

    async def _on_quarantine(self, msg: Any) -> None:
        try:
            q = mc.decode_quarantine(msg.data)
            model = subjects.model_of(msg.subject)
        except (CodecError, ValueError) as exc:
            log.warning("bad_quarantine_event", subject=msg.subject, error=str(exc))
            return
        if model != q.model:
            log.warning("bad_quarantine_event", subject=msg.subject, model=q.model,
                        error="the record names another model than its subject")
            return
        caught = self.quarantined.setdefault(q.model, {})
        if q.node not in caught and len(caught) < MAX_QUARANTINED:
            caught[q.node] = q  # the first catch says when it began; later ones add nothing
            log.info("node_quarantined", model=q.model, node=q.node, layer=q.layer, expert=q.expert)

    async def take_snapshot(self) -> dict[str, Any]:
        """Build the snapshot every page gets next (and remember a history point)."""
        now = time.time()
        models = []
        for name in sorted(self.market.models):
            st = await self.market.status(name)
            doc = status_json(st)
            doc["replicas"] = expert_replicas(st).tolist()
            doc["pending"] = expert_pending(st).tolist()
            doc["quarantined"] = [quarantine_json(q) for q in sorted(
                self.quarantined.get(name, {}).values(), key=lambda q: (q.at, q.node))]
            point = {"t": now, "fallback_rate": st.fallback_rate,
                     "tokens_per_s": self.throughput.tokens(name, now),
                     "rows_per_s": self.throughput.rate(name, now),
                     "reward": doc["rewards"]["total"]["reward"]}
            hist = self.history.setdefault(name, deque(maxlen=self.cfg.history))
            hist.append(point)
            doc["history"] = list(hist)
            models.append(doc)
        self.snapshot = {"sent_at": now, "interval_s": self.cfg.interval_s, "models": models}
        return self.snapshot

    async def _loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.take_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving the last good snapshot
                log.warning("dashboard_snapshot_failed", error=f"{type(exc).__name__}: {exc}")
                continue
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()

    # -- routes -----------------------------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            while self._running:
                body = json.dumps(self.snapshot, separators=(",", ":"))
                await resp.write(f"event: state\ndata: {body}\n\n".encode())
                await self._tick.wait()
        except ConnectionResetError:
            pass  # the page went away
        return resp
