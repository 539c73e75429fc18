"""Connecting to the bus: one place for the URL rule, reconnect settings and error reporting.

``await connect(url, name="worker-a1")`` returns a connected :class:`nats.aio.client.Client`.
The URL is the argument, else ``$NATS_URL``, else ``nats://127.0.0.1:4222``. A node that cannot
reach the bus within ``connect_deadline`` gets one :class:`KvasirError` line
("cannot reach NATS at nats://...: ..."), not a traceback; once connected, the client
reconnects forever (a phone on a flaky network must come back by itself), and every connection
event is a structlog line rather than nats-py's default traceback print.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import structlog
from nats.aio.client import Client

from kvasir_bus.errors import DependencyError, KvasirError, UsageError

ENV_URL = "NATS_URL"
DEFAULT_URL = "nats://127.0.0.1:4222"
_SCHEMES = ("nats", "tls", "ws", "wss")

# Settings every role shares; any of them can be overridden through connect(**kw).
DEFAULTS: dict[str, Any] = {
    "connect_timeout": 2,          # per attempt, seconds
    "reconnect_time_wait": 1,      # between attempts to one server, seconds
    "max_reconnect_attempts": -1,  # after the first connect: forever
    "ping_interval": 20,           # notice a dead link in ~1 min, not nats-py's 4 min
    "max_outstanding_pings": 3,
}


def resolve_url(arg: str | None = None) -> str:
    """The bus URL: ``arg``, else ``$NATS_URL``, else :data:`DEFAULT_URL`.

    ``host:port`` without a scheme becomes ``nats://host:port``; a comma-separated list of
    servers is kept (normalised element by element). Raises :class:`UsageError` for a scheme
    other than nats, tls, ws, wss.
    """
    raw = arg if arg else os.environ.get(ENV_URL) or DEFAULT_URL
    urls = [_normalise(part.strip()) for part in raw.split(",") if part.strip()]
    if not urls:
        raise UsageError(f"NATS URL {raw!r} is empty")
    return ",".join(urls)


def _normalise(url: str) -> str:
    if "://" not in url:
        url = f"nats://{url}"
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise UsageError(f"NATS URL {url!r} has scheme {parts.scheme!r}; expected one of "
                         f"{', '.join(s + '://' for s in _SCHEMES)}")
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise UsageError(f"NATS URL {url!r} has an invalid port") from None
    if not parts.hostname:
        raise UsageError(f"NATS URL {url!r} has no host")
    return url


def _redact(url: str) -> str:
    """The URL without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return parts._replace(netloc=f"***@{host}").geturl()
    return url


async def connect(url: str | None = None, name: str = "kvasir", *,
                  connect_deadline: float = 5.0, **kw: Any) -> Client:
    """Connect to the bus as ``name`` (shown by ``nats server report connections``).

    ``kw`` goes to :func:`nats.connect` over :data:`DEFAULTS` (e.g. ``inbox_prefix``,
    ``pending_size``, ``token``, or your own callbacks). The first connection is retried until
    ``connect_deadline`` seconds have passed, which covers a server started alongside.
    """
    servers = resolve_url(url).split(",")
    if servers[0].startswith(("ws://", "wss://")):
        try:
            import aiohttp  # noqa: F401  (nats-py's WebSocket transport)
        except ImportError:
            raise DependencyError("a ws:// or wss:// NATS URL needs aiohttp: "
                                  "pip install 'nats-py[aiohttp]'") from None
    shown = ",".join(_redact(s) for s in servers)
    log = structlog.get_logger("kvasir.nats").bind(conn=name)
    state = {"connected": False, "last_error": None}

    async def error_cb(exc: Exception) -> None:
        state["last_error"] = exc
        if state["connected"]:
            log.warning("nats error", error=f"{type(exc).__name__}: {exc}".rstrip(": "))
        else:
            log.debug("nats connect attempt failed", url=shown, error=str(exc) or repr(exc))

    async def disconnected_cb() -> None:
        if state["connected"] and nc.is_reconnecting:  # not on our own close()
            log.warning("nats disconnected, reconnecting", url=shown)

    async def reconnected_cb() -> None:
        url = nc.connected_url
        log.info("nats reconnected", url=_redact(url.geturl()) if url else shown)

    async def closed_cb() -> None:
        if not state["connected"]:
            return
        if nc.last_error is not None:
            log.warning("nats connection closed", error=str(nc.last_error) or
                        type(nc.last_error).__name__)
        else:
            log.debug("nats connection closed")

    options: dict[str, Any] = {**DEFAULTS, "error_cb": error_cb,
                               "disconnected_cb": disconnected_cb,
                               "reconnected_cb": reconnected_cb, "closed_cb": closed_cb}
    options.update(kw)
    nc = nats.NATS()
    try:
        await asyncio.wait_for(nc.connect(servers=servers, name=name, **options),
                               timeout=connect_deadline)
    except asyncio.CancelledError:
        await _quiet_close(nc)
        raise
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
        await _quiet_close(nc)
        cause = state["last_error"] if isinstance(exc, asyncio.TimeoutError) else exc
        if cause is None or isinstance(cause, asyncio.TimeoutError):
            why = f"no answer within {connect_deadline:g} s"
        else:
            why = str(cause) or type(cause).__name__
        raise KvasirError(f"cannot reach NATS at {shown}: {why}") from None
    state["connected"] = True
    log.debug("nats connected", url=shown, max_payload=nc.max_payload)
    return nc


async def _quiet_close(nc: Client) -> None:
    try:
        await asyncio.wait_for(nc.close(), timeout=1.0)
    except Exception:  # a half-open client: nothing more to release
        pass
