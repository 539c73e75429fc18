"""Prometheus metrics for every role: a registry per service, ``/metrics`` over aiohttp.

Each role defines its metrics next to itself (``market/metrics.py``, ``backbone/metrics.py``,
``workers/metrics.py``) and registers them in a :func:`registry`. Most of them are custom
collectors that read what the role already keeps (the market's coverage map and ledger, the
dispatch statistics, the worker's counters) at scrape time, so the hot paths carry no
instrumentation and a scrape always sees the role's own numbers.

A collector whose data needs ``await`` (the ledger lives on the market's database thread)
implements :class:`Refreshing`: :func:`metrics_handler` awaits every ``refresh()`` before
``generate_latest`` runs ``collect()`` synchronously on the snapshot.

aiohttp is imported only by the functions that serve HTTP: a worker that is never asked for
``/metrics`` does not need it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvasir_bus.errors import DependencyError, UsageError

__all__ = ["CONTENT_TYPE_LATEST", "MetricsServer", "Refreshing", "Registry", "metrics_handler",
           "parse_listen", "registry", "render"]

#: Histogram buckets for one expert round trip or one expert computation, in seconds: from
#: a LAN reply (~0.5 ms) to the dispatch's timeout ceiling (2 s).
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

_HOSTPORT = re.compile(r"^(?:(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):)?(?P<port>\d{1,5})$")


@runtime_checkable
class Refreshing(Protocol):
    """A collector that takes an asynchronous snapshot before each scrape."""

    async def refresh(self) -> None: ...

    def collect(self) -> Iterable[Any]: ...


class Registry(CollectorRegistry):
    """A registry that remembers its collectors, so a scrape can refresh them first
    (prometheus_client keeps that list private)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectors: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Any) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


def registry(*collectors: Any) -> Registry:
    """A fresh registry (never the process-global one: two services in one process, as in the
    tests and ``kvasir up``, must not collide) holding ``collectors``."""
    reg = Registry()
    for c in collectors:
        reg.register(c)
    return reg


def parse_listen(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port). Port 0 picks a free port. ``[::1]:9100`` for IPv6.

    Raises :class:`UsageError` with the value in the message."""
    m = _HOSTPORT.match(value.strip())
    if not m or int(m["port"]) > 65535:
        raise UsageError(f"{value!r} is not [HOST:]PORT (e.g. 9100, 0.0.0.0:9100, [::1]:9100)")
    host = (m["host"] or default_host).strip("[]")
    return host, int(m["port"])


async def render(reg: CollectorRegistry) -> bytes:
    """The text exposition of ``reg``, after refreshing every :class:`Refreshing` in it."""
    for collector in list(getattr(reg, "collectors", ())):
        if isinstance(collector, Refreshing):
            await collector.refresh()
    return generate_latest(reg)


def metrics_handler(reg: CollectorRegistry):
    """An aiohttp handler that answers ``GET /metrics`` with ``reg``'s exposition."""
    web = _web()

    async def handle(request: Any) -> Any:
        body = await render(reg)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
    return handle


def _web():
    try:
        from aiohttp import web
    except ImportError:
        raise DependencyError("serving /metrics needs aiohttp: pip install aiohttp") from None
    return web


class MetricsServer:
    """``GET /metrics`` (and ``GET /`` pointing there) on ``host:port``; port 0 picks one.

    ``start()``/``stop()`` are idempotent; ``app`` may be given to serve more routes (the
    market's dashboard) on the same port. ``port`` is the port actually bound."""

    def __init__(self, reg: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 app: Any = None) -> None:
        self.registry, self.host, self.port = reg, host, port
        web = _web()
        self.app = app if app is not None else web.Application()
        self.app.router.add_get("/metrics", metrics_handler(reg))
        if app is None:
            self.app.router.add_get("/", self._index)
        self._runner = None

    async def _index(self, request: Any) -> Any:
        return _web().Response(text="kvasir: metrics at /metrics\n")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> MetricsServer:
        if self._runner is not None:
            return self
        web = _web()
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            # asyncio's bind error repeats the address; the errno's text says it once.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise UsageError(f"cannot listen on {self.host}:{self.port}: {reason}") from None
        self._runner = runner
        self.port = runner.addresses[0][1]  # port 0 -> the one the system picked
        return self

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> MetricsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
