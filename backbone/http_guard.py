"""What a slow or hostile HTTP client may hold of the OpenAI API server: bounded, and logged in one line.

aiohttp reads a request's headers and body for as long as the client takes, keeps every
connection a client opens, and logs each malformed request with a traceback at level error.
:func:`listen` serves an aiohttp ``web.Server`` through :class:`GuardedProtocol`, which adds:

* a **connection cap**, in all and per client address: one over it is answered ``503`` and
  closed before aiohttp sees it;
* a **header timeout**: from a connection's first byte of a request (or its opening) to the end
  of that request's headers, at most ``header_timeout_s``;
* a **body timeout**: the body its ``Content-Length`` announces (or a chunked body's last chunk)
  must have arrived ``body_timeout_s`` after its headers;
* once a request is whole nothing is timed here: a streamed answer takes as long as it takes, and
  aiohttp's keep-alive timeout closes a connection idle between requests.

A connection closed for being slow is logged as one line, ``http_slow_client``, at most one a
minute per client address. :class:`OneLineLog` is aiohttp's server logger: a bad request
(10,000 headers, a 1 MB header line, a bad ``Content-Length``) becomes one ``http_bad_request``
line, at most one a minute per kind, with no traceback.
"""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.http")

_REFUSED_BODY = b'{"error":{"message":"too many connections","type":"server_error"}}\n'
_REFUSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,19})[ \t]*\r\n", re.I)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r\n]*chunked", re.I)
_HEAD_KEEP = 1 << 16  # the header bytes kept to find their end (aiohttp refuses longer lines)


@dataclass(frozen=True)
class GuardConfig:
    max_connections: int = 1024
    max_per_address: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 15.0  # aiohttp's, between requests

    def __post_init__(self) -> None:
        if not (self.max_connections >= 1 and self.max_per_address >= 1):
            raise ValueError("connection caps must be >= 1")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.keepalive_timeout_s > 0):
            raise ValueError("timeouts must be > 0")


class OneLineLog:
    """aiohttp's ``logger``: a failure is one line, rate-limited per kind, never a traceback."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self._lines = ThrottledLog(log, interval_s)

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        kind = type(exc).__name__ if exc is not None else "error"
        text = (str(exc) if exc is not None else msg % args if args else msg).strip().splitlines()
        self._lines.warning(kind, "http_bad_request", kind=kind,
                            error=" ".join(t.strip() for t in text)[:200] if text else kind)

    error = warning = exception

    def info(self, *args: Any, **kw: Any) -> None:
        pass

    debug = info


class _Limits:
    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.open = 0
        self.by_address: dict[str, int] = {}
        self.refused = 0
        self.slow_closed = 0
        self.refusals = ThrottledLog(log, 60.0)

    def admit(self, address: str) -> bool:
        if self.open >= self.cfg.max_connections or self.by_address.get(address, 0) >= self.cfg.max_per_address:
            self.refused += 1
            self.refusals.warning(("cap", address), "http_connection_refused", client=address,
                                  open=self.open, of_client=self.by_address.get(address, 0), refused=self.refused)
            return False
        self.open += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        self.open -= 1
        left = self.by_address.get(address, 1) - 1
        if left > 0:
            self.by_address[address] = left
        else:
            self.by_address.pop(address, None)


class GuardedProtocol(asyncio.Protocol):
    """One connection: aiohttp's handler inside, the caps and read timeouts around it."""

    HEAD, BODY, CHUNKED, WHOLE = "headers", "body", "chunked body", "whole"

    def __init__(self, inner: asyncio.Protocol, limits: _Limits, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.limits, self.loop = inner, limits, loop
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.admitted = False
        self.state = self.HEAD
        self.head = b""
        self.need = 0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, forwarded ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.limits.admit(self.address):
            transport.write(_REFUSE)
            transport.close()
            return
        self.admitted = True
        self._arm(self.limits.cfg.header_timeout_s)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        self._track(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.admitted:
            self.admitted = False
            self.limits.release(self.address)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    # -- where in a request the client is --------------------------------------------------
    def _track(self, data: bytes) -> None:
        while data:
            if self.state == self.WHOLE:  # the first byte of the next request
                self.state, self.head = self.HEAD, b""
                self._arm(self.limits.cfg.header_timeout_s)
            if self.state == self.HEAD:
                self.head = (self.head + data)[-_HEAD_KEEP:]
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                rest = self.head[end + 4:]
                head = b"\r\n" + self.head[:end + 2]
                length = _CONTENT_LENGTH.search(head)
                if _CHUNKED.search(head):
                    self.state, self.head = self.CHUNKED, b""
                    self._arm(self.limits.cfg.body_timeout_s)
                elif length and int(length[1]) > 0:
                    self.state, self.need = self.BODY, int(length[1])
                    self._arm(self.limits.cfg.body_timeout_s)
                else:
                    self._whole()
                data = rest
            elif self.state == self.BODY:
                take = min(self.need, len(data))
                self.need -= take
                data = data[take:]
                if self.need == 0:
                    self._whole()
            elif self.state == self.CHUNKED:
                tail = (self.head + data)[-5:]
                found = (self.head + data).find(b"0\r\n\r\n")
                self.head = tail
                if found < 0:
                    return
                self._whole()
                return  # what follows the last chunk starts a request: its first byte re-arms

    def _whole(self) -> None:
        self.state = self.WHOLE
        self._disarm()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _too_slow(self) -> None:
        self.timer = None
        self.limits.slow_closed += 1
        self.limits.refusals.warning(("slow", self.address), "http_slow_client", client=self.address,
                                     phase=self.state, closed=self.limits.slow_closed)
        if self.transport is not None:
            self.transport.abort()


async def listen(server: Callable[[], asyncio.Protocol], host: str, port: int,
                 cfg: GuardConfig = GuardConfig()) -> tuple[asyncio.AbstractServer, _Limits]:
    """Serve aiohttp's ``web.Server`` (a protocol factory: ``runner.server``) on host:port
    through :class:`GuardedProtocol`; the asyncio server and its counters."""
    loop = asyncio.get_running_loop()
    limits = _Limits(cfg)
    srv = await loop.create_server(lambda: GuardedProtocol(server(), limits, loop), host, port,
                                   reuse_address=True)
    return srv, limits
