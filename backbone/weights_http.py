"""The backbone serves its own GGUF over HTTP, with byte ranges, for volunteers to download from.

``GET /<filename>`` and ``HEAD /<filename>`` with a single ``Range: bytes=a-b`` (also ``a-``
and ``-n``) answer 206 with ``Content-Range``; no ``Range`` answers 200 with the whole file; a
range that starts past the end (or ``-0``) answers 416 with ``Content-Range: bytes */SIZE``.
Several ranges in one header (``bytes=0-1,5-9``) are refused with 416 too (ask one range per
request); a malformed header gets 400. Every answer says ``Accept-Ranges: bytes``. A part
of a split GGUF (``name-00002-of-00003.gguf``) serves every part, each under its own name, and
:attr:`WeightsServer.url` names the first.

With node tokens configured, a request must carry one (``Authorization: Bearer TOKEN``, or
``?token=TOKEN`` for tools that cannot set headers), else it gets 401. Tokens are compared in
constant time and never logged; logs and counters name a token by the first 8 hex digits of
its SHA-256.

``GET /worker`` serves the browser volunteer page (built from ``browser/`` into
``backbone/static/worker/`` by ``make install``; ``/worker/config.json`` tells it the model
fingerprint and the file name): open ``/worker?nats=ws://BUS:WSPORT&budget=64MB&node=NAME``.

The server counts the file bytes it sends (as they are handed to the connection), in all, per
client (the ``X-Kvasir-Node`` header a worker sends, else the peer address) and per token, so
tests can check what a volunteer downloaded. It runs on its own threads (``http.server``; no
event loop needed) with a ``start()``/``stop()`` lifecycle; port 0 picks a free port::

    with WeightsServer("model.gguf", port=0, tokens=["s3cret"]) as srv:
        print(srv.url)        # http://127.0.0.1:PORT/model.gguf
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import socket
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import structlog

from kvasir_bus import __version__
from kernels.tensors import split_part_paths
from kvasir_bus.errors import UsageError
from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.weights")

CHUNK_BYTES = 1 << 20
IDLE_TIMEOUT_S = 60.0  # a kept-alive connection idle this long is closed
MAX_CONNECTIONS = 512  # open connections (one thread each) at most; more are closed at accept
MAX_CONNECTIONS_PER_ADDRESS = 256  # of them, from one client address (loopback swarms share one: 200 concurrent range reads stay served)
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_NODE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_WILDCARD = {"", "0.0.0.0", "::", "[::]"}
#: The browser worker page's files (built from browser/ into this package folder).
WORKER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static", "worker")
WORKER_ASSETS = {"index.html": "text/html; charset=utf-8", "worker.js": "text/javascript; charset=utf-8",
                 "kernel.mjs": "text/javascript; charset=utf-8"}


def token_label(token: str) -> str:
    """How a token is named in logs and counters: never the token itself."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_range(header: str, size: int) -> tuple[int, int] | str:
    """A ``Range`` header against a file of ``size`` bytes (pure).

    Returns ``(first, last)`` inclusive, or ``"unsatisfiable"``, ``"multiple"`` or
    ``"malformed"``.
    """
    header = header.strip().replace(" ", "")
    if "," in header:
        return "multiple"
    m = _RANGE.match(header)
    if m is None or (not m.group(1) and not m.group(2)):
        return "malformed"
    first, last = m.group(1), m.group(2)
    if not first:  # suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    a = int(first)
    if last and int(last) < a:
        return "malformed"
    if a >= size:
        return "unsatisfiable"
    return a, (min(int(last), size - 1) if last else size - 1)


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class WeightsServer:
    """Serve one GGUF file over HTTP with Range support and optional node tokens.

    Args:
        path: the file to serve (as ``/<its file name>``).
        host: address to bind (default loopback); port: 0 = a free port.
        tokens: node tokens; empty = no authentication.
        advertise_host: host name to put in :attr:`url` (default: ``host``, or 127.0.0.1
            when binding every interface).
    """

    def __init__(self, path: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 tokens: Iterable[str] = (), advertise_host: str | None = None,
                 model: str | None = None) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise UsageError(f"{path}: no such file to serve")
        parts = split_part_paths(path) or [path]
        missing = [p for p in parts if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"{missing[0]}: no such file to serve (a part of split GGUF {path})")
        path = parts[0]
        if not 0 <= port <= 65535:
            raise UsageError(f"port {port} is out of range (0..65535; 0 = any free port)")
        self.path = path
        self.filename = os.path.basename(path)
        self.files = {os.path.basename(p): p for p in parts}  # served name -> path
        self.host = host
        self.requested_port = port
        self.tokens = tuple(t for t in tokens if t)
        self.advertise_host = advertise_host
        self.model = model  # the fingerprint, told to the browser worker page (/worker/config.json)
        # Tests only: the page then honours ``&lie=1`` (its replies corrupted, to be caught by the
        # audit). Off unless set here or by env KVASIR_WORKER_TEST_LIES=1; never a CLI flag.
        self.worker_test_lies = os.environ.get("KVASIR_WORKER_TEST_LIES") == "1"
        self.state = State.NEW
        self.port: int | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}  # open connections, their threads
        self._drop_after: int | None = None
        # counters (under _lock)
        self.bytes_served = 0
        self.requests = 0
        self.unauthorized = 0
        self.by_client: dict[str, int] = {}
        self.by_token: dict[str, int] = {}
        self.refused_connections = 0  # over the connection caps (see _admit)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "WeightsServer":
        if self.state is not State.NEW:
            raise UsageError(f"WeightsServer.start(): the server is {self.state.value}")
        handler = type("_BoundHandler", (_Handler,), {"owner": self})
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_cls = type("_Server", (ThreadingHTTPServer,), {"address_family": family,
                                                              "daemon_threads": True,
                                                              "handle_error": _handle_error,
                                                              "verify_request": self._admit})
        try:
            self._httpd = server_cls((self.host, self.requested_port), handler)
        except OSError as exc:
            raise UsageError(f"cannot listen on {self.host}:{self.requested_port}: "
                             f"{exc.strerror or exc}") from None
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"weights-http-{self.port}", daemon=True)
        self._thread.start()
        self.state = State.RUNNING
        log.info("weights_serving", url=self.url, file=self.path, size=os.path.getsize(self.path),
                 auth=bool(self.tokens))
        return self

    def _admit(self, request, client_address) -> bool:
        """Whether a new connection gets a thread: at most :data:`MAX_CONNECTIONS` open, and
        :data:`MAX_CONNECTIONS_PER_ADDRESS` of them from one address (a slow client holds no more
        than that; each is closed after :data:`IDLE_TIMEOUT_S` of silence). Refused: closed at once."""
        with self._lock:
            conns = list(self._conns)
        mine = 0
        for conn in conns:
            try:
                mine += conn.getpeername()[0] == client_address[0]
            except OSError:
                pass
        if len(conns) < MAX_CONNECTIONS and mine < MAX_CONNECTIONS_PER_ADDRESS:
            return True
        self.refused_connections += 1
        _refusals.warning(("connections", client_address[0]), "weights_connection_refused",
                          client=client_address[0], open=len(conns), from_client=mine,
                          refused=self.refused_connections)
        return False

    def stop(self) -> None:
        """Stop listening and close every open connection (idempotent)."""
        if self.state is not State.RUNNING:
            self.state = State.STOPPED if self.state is State.NEW else self.state
            return
        assert self._httpd is not None and self._thread is not None
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in conns:  # their handlers see the socket closed and finish at once
            thread.join(timeout=5)
        self._thread.join()
        self.state = State.STOPPED
        log.info("weights_stopped", url=self.url, bytes_served=self.bytes_served, requests=self.requests)

    def __enter__(self) -> "WeightsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what clients and tests need ----------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise UsageError("WeightsServer.url: the server is not started")
        host = self.advertise_host or (self.host if self.host not in _WILDCARD else "127.0.0.1")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}/{quote(self.filename)}"

    def served_to(self, client: str) -> int:
        """Body bytes sent to one client (its X-Kvasir-Node name, or its address)."""
        with self._lock:
            return self.by_client.get(client, 0)

    def drop_after(self, nbytes: int | None) -> None:
        """Fault injection for tests: once ``nbytes`` more body bytes have been sent, cut the
        connection in the middle of the answer (one time). None cancels."""
        with self._lock:
            self._drop_after = nbytes

    # -- used by the handler ------------------------------------------------------------------
    def _authorized(self, handler: "_Handler", query: str) -> str | None | bool:
        """The matching token's label, None when no tokens are configured, False if refused."""
        if not self.tokens:
            return None
        offered = []
        auth = handler.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
        offered += [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"]
        for candidate in offered:
            for token in self.tokens:
                if hmac.compare_digest(candidate.encode(), token.encode()):
                    return token_label(token)
        return False

    def _count(self, client: str, token: str | None, n: int) -> None:
        """Record ``n`` file bytes sent."""
        with self._lock:
            self.bytes_served += n
            self.by_client[client] = self.by_client.get(client, 0) + n
            if token:
                self.by_token[token] = self.by_token.get(token, 0) + n
            if self._drop_after is not None:
                self._drop_after -= n

    def _until_drop(self) -> int | None:
        """Bytes that may still go before an injected drop (None: no drop pending)."""
        with self._lock:
            return self._drop_after


def _handle_error(server, request, client_address) -> None:
    """A client that vanished mid-request is routine: one debug line, not a traceback."""
    import sys

    exc = sys.exc_info()[1]
    log.debug("weights_connection_error", client=client_address[0],
              error=f"{type(exc).__name__}: {exc}")


_refusals = ThrottledLog(log, 60.0)

class _Handler(BaseHTTPRequestHandler):
    owner: WeightsServer
    protocol_version = "HTTP/1.1"
    server_version = f"kvasir-weights/{__version__}"
    timeout = IDLE_TIMEOUT_S
    disable_nagle_algorithm = True  # headers and body go in separate writes: no 40 ms stalls

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._conns[self.connection] = threading.current_thread()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.owner._lock:
                self.owner._conns.pop(self.connection, None)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # one structlog line per request instead (see _serve)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _client(self) -> str:
        node = self.headers.get("X-Kvasir-Node", "")
        return node if _NODE.fullmatch(node) else self.client_address[0]

    def _serve(self, body: bool) -> None:
        t0 = time.perf_counter()
        owner = self.owner
        with owner._lock:
            owner.requests += 1
        url = urlsplit(self.path)
        client = self._client()
        rng = self.headers.get("Range")
        status, sent, token = 0, 0, None
        try:
            path = owner.files.get(unquote(url.path)[1:])
            if path is None and (url.path == "/worker" or url.path.startswith("/worker/")):
                status = self._worker_page(url.path, body)
                return
            if path is None:
                status = self._plain(404, f"not found: this server serves /{owner.filename}\n", body)
                return
            token = owner._authorized(self, url.query)
            if token is False:
                with owner._lock:
                    owner.unauthorized += 1
                status = self._plain(401, "401 Unauthorized: a valid node token is required "
                                          "(Authorization: Bearer TOKEN)\n", body,
                                     {"WWW-Authenticate": 'Bearer realm="kvasir"'})
                log.info("weights_unauthorized", client=client, path=url.path)
                return
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                common = {"Accept-Ranges": "bytes",
                          "ETag": f'"{size:x}-{st.st_mtime_ns:x}"',
                          "Last-Modified": formatdate(st.st_mtime, usegmt=True)}
                if rng is None:
                    first, last, status = 0, size - 1, 200
                else:
                    parsed = parse_range(rng, size)
                    if parsed == "malformed":
                        status = self._plain(400, f"bad Range header {rng!r}: expected bytes=a-b, "
                                                  "bytes=a- or bytes=-n\n", body, common)
                        return
                    if parsed in ("unsatisfiable", "multiple"):
                        why = ("only one range per request is supported" if parsed == "multiple"
                               else f"the file has {size} bytes")
                        status = self._plain(416, f"416 Range Not Satisfiable: {rng}: {why}\n", body,
                                             {**common, "Content-Range": f"bytes */{size}"})
                        return
                    (first, last), status = parsed, 206
                length = last - first + 1
                self.send_response(status)
                for k, v in common.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
                self.end_headers()
                if body:
                    sent = self._send_body(f.fileno(), first, length, client, token)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        finally:
            log.debug("weights_request", method=self.command, status=status, client=client,
                      range=rng, bytes=sent, ms=round(1000 * (time.perf_counter() - t0), 2))

    def _send_body(self, fd: int, offset: int, length: int, client: str, token: str | None) -> int:
        sent = 0
        while sent < length:
            data = os.pread(fd, min(CHUNK_BYTES, length - sent), offset + sent)
            if not data:
                self.close_connection = True  # the file shrank under us
                return sent
            left = self.owner._until_drop()
            if left is not None and left < len(data):
                # fault injection: send part of this chunk, then cut the connection
                part = data[:max(0, left)]
                self.owner._count(client, token, len(part))
                self.wfile.write(part)
                self.wfile.flush()
                self.owner.drop_after(None)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return sent + len(part)
            # counted before the write, so that a client holding the bytes sees them counted
            self.owner._count(client, token, len(data))
            self.wfile.write(data)
            sent += len(data)
        return sent

    def _worker_page(self, path: str, body: bool) -> int:
        """``GET /worker``: the browser volunteer page; ``/worker/config.json``: the model it serves
        and the file to fetch; ``/worker/<asset>``: the built page's files (backbone/static/worker,
        built by ``make install`` from browser/). No token is needed to load the page itself: the
        weights still need one."""
        if path == "/worker/config.json":
            import json

            config = {"model": self.owner.model, "file": self.owner.filename,
                      "size": os.path.getsize(self.owner.path)}
            if self.owner.worker_test_lies:
                config["test_lies"] = True
            payload = json.dumps(config).encode()
            return self._bytes(200, payload, "application/json", body)
        name = "index.html" if path in ("/worker", "/worker/") else path[len("/worker/"):]
        if name not in WORKER_ASSETS:
            return self._plain(404, f"not found: {path}\n", body)
        asset = os.path.join(WORKER_DIR, name)
        if not os.path.isfile(asset):
            return self._plain(404, "the browser worker is not built: run `make install` (needs npm), "
                                    "or `npm ci && node build.mjs` in browser/\n", body)
        with open(asset, "rb") as f:
            return self._bytes(200, f.read(), WORKER_ASSETS[name], body)

    def _bytes(self, status: int, payload: bytes, ctype: str, body: bool) -> int:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        if body:
            self.wfile.write(payload)
        return status

    def _plain(self, status: int, text: str, body: bool, headers: dict[str, str] | None = None) -> int:
        payload = text.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Accept-Ranges" not in (headers or {}):
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)
        return status
