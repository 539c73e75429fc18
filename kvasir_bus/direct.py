"""A blocking NATS connection owned by one thread: publish a step in one ``sendall``, read its
replies with a deadline, no event loop in between.

The backbone's engine thread hands every layer step to the bus thread (an eventfd wake-up) and
waits for it to come back (a queue and the GIL hand-over): ~50 µs of CPU in place, more when
the GIL is contended. :class:`DirectConnection` does without: the thread that has the requests
writes them and reads the answers itself (``backbone.dispatch.RemoteExperts``, steps whose every
call is in a bundle; anything unusual goes back to the bus thread's nats.py client).

It speaks the client protocol of https://docs.nats.io/reference/reference-protocols/nats-protocol
with the same identity as :func:`kvasir_bus.connect.connect` (URL, nkey seed or JWT creds, TLS
files): INFO, CONNECT (the nonce signed for creds), PING/PONG, SUB to its own inbox; it reads
MSG, HMSG, PING (answered PONG), PONG, +OK, -ERR and INFO, every size bounded (a line at most
:data:`MAX_LINE`, a payload at most the server's ``max_payload``). Anything else, or a closed
socket, raises :class:`DirectError`, after which the connection is closed and its owner goes
back to the ordinary path. It never reconnects: a new one is made when wanted.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import struct
import time
from typing import NamedTuple
from urllib.parse import urlsplit

from kvasir_bus.connect import ConnectOptions, inbox_prefix_for, read_seed

MAX_LINE = 64 * 1024  # the longest protocol line (INFO included) we accept
RECV_BYTES = 256 * 1024  # read at most this much per system call (a bigger message takes several)
# A plain TCP socket stays blocking, with kernel timeouts instead of Python's: a read is one
# recvfrom, not an ioctl, a poll and a recvfrom (Python's settimeout); a write one sendto, not
# a poll and a sendto. SO_RCVTIMEO is this slice while the deadline is further away, the time
# left once it is nearer (a system call only then); SO_SNDTIMEO bounds a write to a server that
# stopped reading.
RECV_SLICE_S = 0.01
SEND_TIMEOUT_S = 5.0
_CRLF = b"\r\n"


class DirectError(Exception):
    """The connection cannot go on (closed, refused, or a protocol violation). ``permanent``:
    another attempt would fail the same way (a URL scheme it does not speak)."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


class Message(NamedTuple):
    subject: str
    reply: str
    data: bytes
    status: str | None  # HMSG: the status code of the header block ("503"), None for MSG


def _status(header: bytes) -> str:
    """The status code of a ``NATS/1.0 503`` header block, or "" if it has none."""
    first = header.split(b"\r\n", 1)[0]
    parts = first.split()
    return parts[1].decode("ascii", "replace") if len(parts) >= 2 and parts[0] == b"NATS/1.0" else ""


class Parser:
    """Bytes from the server -> protocol events, with every size bounded. Pure: no socket."""

    def __init__(self, max_payload: int = 1024 * 1024):
        self.buf = bytearray()
        self.max_payload = max_payload

    def feed(self, data: bytes) -> list[tuple]:
        """Events: ("msg", Message), ("ping",), ("pong",), ("ok",), ("err", text), ("info", dict)."""
        self.buf += data
        events = []
        while True:
            end = self.buf.find(_CRLF)
            if end < 0:
                if len(self.buf) > MAX_LINE:
                    raise DirectError(f"protocol line longer than {MAX_LINE} bytes")
                return events
            if end > MAX_LINE:
                raise DirectError(f"protocol line longer than {MAX_LINE} bytes")
            line = bytes(self.buf[:end])
            op = line[:4].upper()
            if op in (b"MSG ", b"HMSG"):
                args = line.split()
                headed = op == b"HMSG"
                if len(args) not in ((5, 6) if headed else (4, 5)):
                    raise DirectError(f"malformed {args[0].decode(errors='replace')} line")
                try:
                    sizes = [int(a) for a in args[-2:]] if headed else [0, int(args[-1])]
                except ValueError:
                    raise DirectError("non-numeric size in a message line") from None
                hdr, total = sizes
                if not 0 <= hdr <= total or total > self.max_payload + MAX_LINE:
                    raise DirectError(f"message size {total} out of bounds")
                if len(self.buf) < end + 2 + total + 2:
                    return events  # wait for the rest
                body = bytes(self.buf[end + 2:end + 2 + total])
                if self.buf[end + 2 + total:end + 4 + total] != _CRLF:
                    raise DirectError("message payload not followed by CRLF")
                del self.buf[:end + 4 + total]
                reply = args[3].decode() if len(args) == (6 if headed else 5) else ""  # op subject sid [reply] sizes
                status = _status(body[:hdr]) if headed else None
                events.append(("msg", Message(args[1].decode(), reply, body[hdr:], status)))
                continue
            del self.buf[:end + 2]
            if line == b"PING":
                events.append(("ping",))
            elif line == b"PONG":
                events.append(("pong",))
            elif line == b"+OK":
                events.append(("ok",))
            elif line.startswith(b"-ERR"):
                events.append(("err", line[4:].strip().decode(errors="replace")))
            elif line.startswith(b"INFO "):
                try:
                    events.append(("info", json.loads(line[5:])))
                except ValueError:
                    raise DirectError("INFO is not JSON") from None
            else:
                raise DirectError(f"unknown protocol line {line[:32]!r}")


class DirectConnection:
    """One blocking connection: :meth:`send` a step, :meth:`receive` until a deadline."""

    def __init__(self, url: str, name: str = "kvasir-direct", options: ConnectOptions | None = None,
                 connect_timeout_s: float = 5.0):
        parts = urlsplit(url.split(",")[0])
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise DirectError(f"a direct connection needs a nats:// or tls:// URL, not {parts.scheme}://",
                              permanent=True)
        options = options if options is not None else ConnectOptions.from_env()
        self.sock: socket.socket | ssl.SSLSocket = socket.create_connection(
            (parts.hostname, parts.port or 4222), timeout=connect_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = Parser()
        # One receive buffer for the connection's life: recv(n) would allocate n bytes per call
        # (an mmap, a shrink and an munmap for any n past malloc's threshold, strace: three
        # system calls per reply) and fault its pages in; the parser copies what came anyway.
        self._rbuf = bytearray(RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._kernel_timeouts = False  # Python's timeouts while connecting
        try:
            info = self._expect_info(connect_timeout_s)
            self.parser.max_payload = int(info.get("max_payload", 1024 * 1024))
            ctx = options.ssl_context()
            if parts.scheme == "tls" or info.get("tls_required") or ctx is not None:
                ctx = ctx or ssl.create_default_context()
                self.sock = ctx.wrap_socket(self.sock, server_hostname=parts.hostname)
            connect = {"verbose": False, "pedantic": False, "lang": "python-kvasir-direct", "version": "1",
                       "protocol": 1, "headers": True, "no_responders": True, "name": name}
            prefix = "_INBOX"
            if options.creds is not None:
                import nkeys

                seed = bytearray(read_seed(options.creds))
                kp = nkeys.from_seed(seed)
                nonce = info.get("nonce", "").encode()
                import base64

                connect["sig"] = base64.urlsafe_b64encode(kp.sign(nonce)).decode().rstrip("=")
                if "BEGIN NATS USER JWT" in open(options.creds).read():
                    connect["jwt"] = _read_jwt(options.creds)
                else:
                    connect["nkey"] = kp.public_key.decode()
                prefix = inbox_prefix_for(kp.public_key.decode())
            elif parts.username and parts.password is not None:
                connect["user"], connect["pass"] = parts.username, parts.password
            elif parts.username:  # nats://TOKEN@host, as nats.py reads it
                connect["auth_token"] = parts.username
            self.inbox = f"{prefix}.{_nuid()}"
            self.sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nSUB "
                              + self.inbox.encode() + b".* 1\r\nPING\r\n")
            self._until_pong(time.monotonic() + connect_timeout_s)
        except BaseException:
            self.close()
            raise
        self.sock.settimeout(None)
        # TLS keeps Python's timeouts: its blocking read retries a kernel timeout forever.
        self._kernel_timeouts = not isinstance(self.sock, ssl.SSLSocket)
        self._rcvtimeo = 0.0  # SO_RCVTIMEO as last set (0: never)
        if self._kernel_timeouts:
            self._set_timeout(socket.SO_SNDTIMEO, SEND_TIMEOUT_S)
        self.closed = False

    def _set_timeout(self, option: int, seconds: float) -> None:
        usec = max(1, round(seconds * 1e6))  # a zero timeval would mean "never time out"
        self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", usec // 1_000_000, usec % 1_000_000))

    def _recv(self, deadline: float) -> memoryview | bytes:
        """What the server sent by ``deadline`` (b"" if nothing): a view of the receive buffer,
        valid until the next call (:meth:`Parser.feed` copies it)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return b""
        try:
            if not self._kernel_timeouts:
                self.sock.settimeout(left)
            elif left < self._rcvtimeo or self._rcvtimeo < min(left, RECV_SLICE_S):
                self._rcvtimeo = min(left, RECV_SLICE_S)
                self._set_timeout(socket.SO_RCVTIMEO, self._rcvtimeo)
            n = self.sock.recv_into(self._rbuf)
        except (socket.timeout, BlockingIOError, ssl.SSLWantReadError):  # BlockingIOError: SO_RCVTIMEO
            return b""
        except OSError as exc:
            raise DirectError(f"connection lost: {exc}") from None
        if not n:
            raise DirectError("connection closed by the server")
        return self._rview[:n]

    def _expect_info(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.parser.feed(self._recv(deadline)):
                if ev[0] == "info":
                    return ev[1]
                raise DirectError(f"expected INFO, got {ev[0]}")
        raise DirectError("no INFO from the server")

    def _until_pong(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            for ev in self.parser.feed(self._recv(deadline)):
                if ev[0] == "pong":
                    return
                if ev[0] == "err":
                    raise DirectError(f"server refused: {ev[1]}")
                if ev[0] == "ping":
                    self.sock.sendall(b"PONG\r\n")
        raise DirectError("no PONG from the server")

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.close()
            raise DirectError(f"connection lost: {exc}") from None

    def receive(self, deadline: float) -> list[Message]:
        """Messages that came by ``deadline`` (monotonic seconds): at least one, or none at the
        deadline. PINGs are answered; -ERR closes the connection and raises."""
        while True:
            try:
                events = self.parser.feed(self._recv(deadline))
            except DirectError:
                self.close()
                raise
            out = []
            for ev in events:
                if ev[0] == "msg":
                    out.append(ev[1])
                elif ev[0] == "ping":
                    self.send(b"PONG\r\n")
                elif ev[0] == "err":
                    self.close()
                    raise DirectError(f"server error: {ev[1]}")
                elif ev[0] == "info":
                    self.parser.max_payload = int(ev[1].get("max_payload", self.parser.max_payload))
            if out or time.monotonic() >= deadline:
                return out

    def poll(self) -> list[Message]:
        """What has arrived since the last read, without waiting (PINGs answered): the
        connection is checked before a step is sent on it, so that one the server closed while
        it was idle is made again instead of losing the step."""
        out = []
        while not self.closed and select.select([self.sock], [], [], 0)[0] or self._pending_tls():
            out += self.receive(time.monotonic() + 0.001)
        return out

    def _pending_tls(self) -> bool:
        return isinstance(self.sock, ssl.SSLSocket) and not self.closed and self.sock.pending() > 0

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _read_jwt(path: str) -> str:
    text = open(path).read()
    start = text.index("-----BEGIN NATS USER JWT-----")
    block = text[start:].split("\n")[1:]
    return next(line.strip() for line in block if line.strip() and not line.startswith("---"))


def _nuid() -> str:
    import secrets

    return secrets.token_hex(11)
