"""Connecting to the bus: one place for the URL rule, reconnect settings and error reporting.

``await connect(url, name="worker-a1")`` returns a connected :class:`nats.aio.client.Client`.
The URL is the argument, else ``$NATS_URL``, else ``nats://127.0.0.1:4222``. A node that cannot
reach the bus within ``connect_deadline`` gets one :class:`KvasirError` line
("cannot reach NATS at nats://...: ..."), not a traceback; once connected, the client
reconnects forever (a phone on a flaky network must come back by itself), and every connection
event is a structlog line rather than nats-py's default traceback print.

Identity and TLS come from a :class:`ConnectOptions`, never from the command line's URL: every
command that connects calls :func:`add_connection_flags` (``--creds FILE``, ``--tls-ca FILE``,
``--tls-cert FILE``, ``--tls-key FILE``) and ``ConnectOptions.from_args(args).install()``, which
puts the files into the environment variables the ``nats`` CLI also reads (``NATS_CREDS``,
``NATS_CA``, ``NATS_CERT``, ``NATS_KEY``). :func:`connect` reads them there, so processes a
command starts (``kvasir up``'s market and workers) inherit them, and no secret ever appears in
``/proc/PID/cmdline``: only the path of a file does.

A credentials file is an nkey seed file (``kvasir creds`` writes them, as ``nk -gen user``
does) or a JWT ``.creds`` file (as ``nsc`` writes them). With an nkey seed, the client's reply
inbox is ``_INBOX_<public key>``: the server lets each identity read only its own replies
(see :mod:`kvasir_bus.creds`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog

from kvasir_bus.errors import DependencyError, KvasirError, UsageError

if TYPE_CHECKING:  # nats is imported when connecting: `kvasir --help` stays fast
    from nats.aio.client import Client

ENV_URL = "NATS_URL"
ENV_CREDS = "NATS_CREDS"
ENV_TLS_CA = "NATS_CA"
ENV_TLS_CERT = "NATS_CERT"
ENV_TLS_KEY = "NATS_KEY"
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


def inbox_prefix_for(public_key: str) -> str:
    """The reply inbox prefix of the identity whose nkey is ``public_key`` (``_INBOX_U...``).

    The server config grants each identity ``subscribe: _INBOX_<its key>.>`` and nothing
    under ``_INBOX.>``, so nobody reads another node's replies.
    """
    return f"_INBOX_{public_key}"


#: First line of a credentials file that ``kvasir creds`` writes: ``# kvasir identity: NAME (ROLE)``.
IDENTITY_HEADER = "# kvasir identity:"


def identity_name(path: str | os.PathLike) -> str | None:
    """The name of the identity in credentials file ``path``: the ``kvasir creds`` header's, or
    the ``name`` claim of a JWT ``.creds`` file's user JWT; None if the file names none."""
    import base64

    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read credentials file {path}: {exc.strerror or exc}") from None
    for i, line in enumerate(lines):
        if line.startswith(IDENTITY_HEADER):
            name = line[len(IDENTITY_HEADER):].strip().split(" ")[0]
            return name or None
        if "BEGIN NATS USER JWT" in line and i + 1 < len(lines):
            try:  # header.payload.signature, base64url without padding
                payload = lines[i + 1].strip().split(".")[1]
                claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            except (IndexError, ValueError):
                return None
            return claims.get("name") or None
    return None


def node_for(node: str | None, options: ConnectOptions) -> str | None:
    """A worker's node id: ``node``, else its identity's name (``--creds``), else None.

    A ``node`` that differs from the identity's name is refused here, before connecting: the
    server lets a worker heartbeat only as itself, so it would be connected and never heard.
    """
    named = identity_name(options.creds) if options.creds else None
    if node is not None and named is not None and node != named:
        raise UsageError(f"--node {node} does not match the identity in {options.creds} "
                         f"({named}): leave out --node, or give the credentials of {node}")
    return node or named


def read_seed(path: str | os.PathLike) -> bytes:
    """The nkey seed in ``path``: a bare seed file, or the seed block of a JWT ``.creds`` file."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read credentials file {path}: {exc.strerror or exc}") from None
    lines = [line.strip() for line in text.splitlines()]
    seeds = [line for line in lines if line.startswith(b"SU") and len(line) == 58]
    if not seeds:
        raise UsageError(f"credentials file {path} holds no user nkey seed (a line SU...): "
                         "expected a file written by `kvasir creds` or `nsc`")
    return seeds[0]


def _is_jwt_creds(path: str) -> bool:
    return b"BEGIN NATS USER JWT" in Path(path).read_bytes()


@dataclass(frozen=True)
class ConnectOptions:
    """Who a process is on the bus and which certificates it trusts (files, never secrets).

    ``creds``: an nkey seed or JWT creds file. ``tls_ca``: CA bundle that signs the server's
    certificate (for ``tls://`` and ``wss://`` servers with a private CA). ``tls_cert`` and
    ``tls_key``: this client's certificate, for servers that verify clients (mutual TLS).
    """

    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--creds", self.creds), ("--tls-ca", self.tls_ca),
                            ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if value is not None and not Path(value).is_file():
                raise UsageError(f"{flag} {value}: no such file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together (the client certificate "
                             "and its private key)")
        if self.creds is not None:
            read_seed(self.creds)  # a bad file fails here, at the edge, with its name

    @classmethod
    def from_env(cls) -> ConnectOptions:
        """From ``$NATS_CREDS``, ``$NATS_CA``, ``$NATS_CERT``, ``$NATS_KEY`` (unset = none)."""
        env = os.environ
        return cls(creds=env.get(ENV_CREDS) or None, tls_ca=env.get(ENV_TLS_CA) or None,
                   tls_cert=env.get(ENV_TLS_CERT) or None, tls_key=env.get(ENV_TLS_KEY) or None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConnectOptions:
        """The flags of :func:`add_connection_flags`, each falling back to its variable."""
        env = cls.from_env()
        return cls(creds=getattr(args, "creds", None) or env.creds,
                   tls_ca=getattr(args, "tls_ca", None) or env.tls_ca,
                   tls_cert=getattr(args, "tls_cert", None) or env.tls_cert,
                   tls_key=getattr(args, "tls_key", None) or env.tls_key)

    def install(self) -> ConnectOptions:
        """Make these the process' defaults (and its children's): set the variables."""
        for var, value in ((ENV_CREDS, self.creds), (ENV_TLS_CA, self.tls_ca),
                           (ENV_TLS_CERT, self.tls_cert), (ENV_TLS_KEY, self.tls_key)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = str(Path(value).resolve())
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting ``tls_ca`` (else the system store), or None if no
        TLS option is set (nats-py then uses the system store for tls:// and wss://)."""
        if self.tls_ca is None and self.tls_cert is None:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert is not None:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise UsageError(f"cannot load TLS files (--tls-ca {self.tls_ca}, --tls-cert "
                             f"{self.tls_cert}, --tls-key {self.tls_key}): {exc}") from None
        return ctx

    def nats_kwargs(self) -> dict[str, Any]:
        """What :func:`nats.connect` needs for this identity: credentials, TLS, inbox prefix."""
        kw: dict[str, Any] = {}
        ctx = self.ssl_context()
        if ctx is not None:
            kw["tls"] = ctx
        if self.creds is not None:
            import nkeys

            seed = bytearray(read_seed(self.creds))
            try:
                public = nkeys.from_seed(seed).public_key.decode()
            except Exception as exc:
                raise UsageError(f"credentials file {self.creds}: not a valid nkey seed "
                                 f"({exc or type(exc).__name__})") from None
            if _is_jwt_creds(self.creds):
                kw["user_credentials"] = self.creds
            else:  # the seed line alone: the file may begin with a comment naming the identity
                kw["nkeys_seed_str"] = read_seed(self.creds).decode()
            kw["inbox_prefix"] = inbox_prefix_for(public)
        return kw


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """``--creds``, ``--tls-ca``, ``--tls-cert``, ``--tls-key`` for a command that connects."""
    g = parser.add_argument_group("bus identity and TLS (files only: no secret on the command line)")
    g.add_argument("--creds", metavar="FILE", default=None,
                   help=f"credentials of this node (nkey seed or JWT .creds; default ${ENV_CREDS})")
    g.add_argument("--tls-ca", metavar="FILE", default=None,
                   help=f"CA certificate(s) that sign the server's (default ${ENV_TLS_CA})")
    g.add_argument("--tls-cert", metavar="FILE", default=None,
                   help=f"client certificate for mutual TLS (default ${ENV_TLS_CERT})")
    g.add_argument("--tls-key", metavar="FILE", default=None,
                   help=f"private key of --tls-cert (default ${ENV_TLS_KEY})")


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
                  connect_deadline: float = 5.0, options: ConnectOptions | None = None,
                  **kw: Any) -> Client:
    """Connect to the bus as ``name`` (shown by ``nats server report connections``).

    ``options``: identity and TLS files (default :meth:`ConnectOptions.from_env`). ``kw`` goes
    to :func:`nats.connect` over :data:`DEFAULTS` and ``options`` (e.g. ``pending_size``, or
    your own callbacks). The first connection is retried until ``connect_deadline`` seconds
    have passed, which covers a server started alongside.
    """
    import nats
    import nats.errors

    servers = resolve_url(url).split(",")
    identity = (options if options is not None else ConnectOptions.from_env()).nats_kwargs()
    if servers[0].startswith(("ws://", "wss://")):
        try:
            import aiohttp  # noqa: F401  (nats-py's WebSocket transport)
        except ImportError:
            raise DependencyError("a ws:// or wss:// NATS URL needs aiohttp: "
                                  "pip install 'nats-py[aiohttp]'") from None
    shown = ",".join(_redact(s) for s in servers)
    log = structlog.get_logger("kvasir.nats").bind(conn=name)
    state = {"connected": False, "last_error": None, "refused": None}
    from kvasir_bus.throttle import ThrottledLog
    throttled = ThrottledLog(log, 60.0)  # a flood makes one slow-consumer error per message

    async def error_cb(exc: Exception) -> None:
        state["last_error"] = exc
        if "authorization" in str(exc).lower():  # the reason to report, whatever follows it
            state["refused"] = exc
        if state["connected"]:
            throttled.warning(type(exc).__name__, "nats error",
                              error=f"{type(exc).__name__}: {exc}".rstrip(": "))
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

    settings: dict[str, Any] = {**DEFAULTS, "error_cb": error_cb,
                                "disconnected_cb": disconnected_cb,
                                "reconnected_cb": reconnected_cb, "closed_cb": closed_cb}
    settings.update(identity)
    settings.update(kw)
    nc = _client_class()()
    try:
        await asyncio.wait_for(nc.connect(servers=servers, name=name, **settings),
                               timeout=connect_deadline)
    except asyncio.CancelledError:
        await _quiet_close(nc)
        raise
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
        await _quiet_close(nc)
        cause = state["last_error"] if isinstance(exc, asyncio.TimeoutError) else exc
        # The server refused the identity: say so, not the reset of the socket that followed.
        cause = state["refused"] or cause
        if cause is None or isinstance(cause, asyncio.TimeoutError):
            why = f"no answer within {connect_deadline:g} s"
        else:
            why = str(cause) or type(cause).__name__
        raise KvasirError(f"cannot reach NATS at {shown}: {why}") from None
    state["connected"] = True
    log.debug("nats connected", url=shown, max_payload=nc.max_payload)
    return nc


_CLIENT: type | None = None


def _client_class() -> type:
    """nats-py's client with a ``flush()`` that is a barrier for everything written before it.

    nats-py (2.16) queues commands (SUB, PUB, UNSUB) for a flusher task but writes ``flush()``'s
    PING straight to the socket, ahead of them: the PONG can come back before the server has
    the SUB, so "subscribe, flush, then tell the other side" could miss the first message (a
    request met "no responders" in CI). Here ``flush()`` first lets the flusher hand the queued
    commands to the socket (bounded by the same timeout), then sends its PING behind them."""
    global _CLIENT
    if _CLIENT is None:
        import nats.aio.client
        import nats.errors

        class BarrierFlushClient(nats.aio.client.Client):
            async def flush(self, timeout: int = nats.aio.client.DEFAULT_FLUSH_TIMEOUT) -> None:
                if self.is_connected and self._pending_data_size:
                    deadline = asyncio.get_running_loop().time() + timeout
                    await self._flush_pending()  # kick the flusher
                    turns = 0
                    while self.is_connected and self._pending_data_size:
                        if asyncio.get_running_loop().time() > deadline:
                            raise nats.errors.FlushTimeoutError
                        # The flusher writes on its next turn; a socket the server is slow to
                        # drain holds it longer, and then this waits without spinning.
                        await asyncio.sleep(0 if turns < 50 else 0.001)
                        turns += 1
                await super().flush(timeout)

        _CLIENT = BarrierFlushClient
    return _CLIENT


async def _quiet_close(nc: Client) -> None:
    try:
        await asyncio.wait_for(nc.close(), timeout=1.0)
    except Exception:  # a half-open client: nothing more to release
        pass


async def connect_or_stop(stop: asyncio.Event, url: str | None = None, name: str = "kvasir",
                          **kw: Any) -> Client | None:
    """:func:`connect`, unless ``stop`` is set first (SIGTERM while the bus is unreachable):
    then the attempt is abandoned and None returned, so a service can exit 0 at once."""
    connecting = asyncio.ensure_future(connect(url, name, **kw))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if connecting.done():
        return connecting.result()
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    return None


async def shutdown(nc: Client, timeout: float = 5.0) -> None:
    """Drain ``nc`` if it is connected, else just close it; never raises.

    A service stopping while the bus is down must still exit cleanly: nats-py's ``drain()``
    raises ``ConnectionReconnectingError`` then, and would wait for a server that is gone.
    """
    import nats.errors

    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout=timeout)
            return
    except (asyncio.TimeoutError, nats.errors.Error, OSError):
        pass
    await _quiet_close(nc)
