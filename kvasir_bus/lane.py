"""Inline delivery and direct writes: hot subscriptions handled where nats.py's reader parses them.

nats.py hands every message of a subscription with a callback to a queue, from which a task per
subscription takes it: per message a queue put, a task wake-up on the next loop turn, a queue
get and an eleven-field ``Msg``. A worker's handlers never wait on the bus (they decode, compute
or hand off to the pool, and publish), so they can run right where the parser has the message.
:class:`InlineDelivery` wraps the client's per-message hook for the subscriptions registered
with it; every other message (another subscription's, one with headers) goes the ordinary way,
and a registered subscription keeps its ordinary callback for those. An echo responder answering
one message at a time on the shared 2-core machine spent ~150-185 µs of CPU per message so,
~185-220 through the queue and task (nine runs each, interleaved).

It relies on nats-py 2.x calling ``client._process_msg(sid, subject, reply, data, headers)`` for
every MSG and on ``Subscription._id``; :func:`supported` checks both, and a client without them
keeps the ordinary delivery (``WorkerConfig.inline_delivery`` turns it off). A handler's
exception is caught and reported here: one raised into the reader would end the connection's
reads.

:class:`DirectPublish` is the other end: a worker's reply, or a backbone's whole layer step,
written to the socket in one transport write, where nats.py's ``publish`` would queue each
message for its flusher task.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

_HOOK = "_process_msg"
_HOOK_PARAMS = ["self", "sid", "subject", "reply", "data", "headers"]

Handler = Callable[[Any], Awaitable[None]]


class Delivered:
    """What a handler reads of a message delivered inline: as nats.py's ``Msg``, without headers
    (a message with headers takes the ordinary path)."""

    __slots__ = ("subject", "reply", "data")
    headers = None

    def __init__(self, subject: str, reply: str, data: bytes):
        self.subject, self.reply, self.data = subject, reply, data


def supported(nc: Any) -> bool:
    """Whether ``nc`` has the per-message hook this module wraps, with the signature it expects."""
    hook = getattr(type(nc), _HOOK, None)
    if not inspect.iscoroutinefunction(hook):
        return False
    try:
        return list(inspect.signature(hook).parameters) == _HOOK_PARAMS
    except (TypeError, ValueError):
        return False


class InlineDelivery:
    """Route the messages of registered subscriptions on ``nc`` to their handlers inline.

    ``on_error(exc)`` is told of an exception a handler let through (the message is dropped;
    the reader goes on). :meth:`close` unregisters everything; the hook stays in place as a
    pass-through, so that lanes installed on one client after this one keep working."""

    def __init__(self, nc: Any, on_error: Callable[[BaseException], None]):
        if not supported(nc):
            raise TypeError(f"{type(nc).__name__} has no {_HOOK}(sid, subject, reply, data, headers) to wrap")
        self._nc, self._on_error = nc, on_error
        self._handlers: dict[int, Handler] = {}
        self.delivered = 0  # messages handled inline (tests and benches read it)
        self._ordinary = getattr(nc, _HOOK)  # bound: the class's, or a lane installed earlier
        setattr(nc, _HOOK, self._process_msg)  # the instance attribute shadows the class's method

    def add(self, sub: Any, handler: Handler) -> bool:
        """Deliver ``sub``'s messages to ``handler`` inline; False (ordinary delivery) if the
        subscription has no id this hook sees."""
        sid = getattr(sub, "_id", None)
        if type(sid) is not int:
            return False
        self._handlers[sid] = handler
        return True

    def close(self) -> None:
        self._handlers.clear()

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers) -> None:
        handler = self._handlers.get(sid)
        if handler is None or headers:
            return await self._ordinary(sid, subject, reply, data, headers)
        stats = self._nc.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        self.delivered += 1
        try:
            await handler(Delivered(subject.decode(), reply.decode(), data))
        except Exception as exc:  # never into the reader
            self._on_error(exc)


# -- direct replies -------------------------------------------------------------------------------

#: A reply goes straight to the socket only while the transport's own buffer holds less than this
#: (asyncio's default high-water mark): below it nats.py's flusher would not wait on a drain
#: either, above it the ordinary path keeps the backpressure.
DIRECT_BUFFER_LIMIT = 64 * 1024
#: Replies at least this large go out as head, payload and tail in one ``writelines`` (one
#: ``writev`` on uvloop, no copy of the payload); smaller ones are joined into one ``write``.
DIRECT_JOIN_LIMIT = 16 * 1024
_CRLF = b"\r\n"

try:  # the plain TCP / TLS transport of nats-py 2.x; a websocket one frames what it writes
    from nats.aio.transport import TcpTransport as _NatsTcp
except ImportError:  # pragma: no cover - another nats-py: every reply takes the ordinary path
    _NatsTcp = None


def direct_unsupported(nc: Any) -> str | None:
    """Why :class:`DirectPublish` cannot write for ``nc`` (None: it can).

    Checks every piece of nats.py's state a direct write reads, with its type: the status and
    its ``CONNECTED`` value, the pending buffer and its size, the maximum payload, the
    statistics, and a transport that is nats.py's TCP one (plain or TLS) over an asyncio
    stream writer. A websocket transport frames what it writes: ordinary path."""
    cls = type(nc)
    if type(getattr(cls, "CONNECTED", None)) is not int or type(getattr(nc, "_status", None)) is not int:
        return "no integer _status / CONNECTED"
    if type(getattr(nc, "_pending", None)) is not list or type(getattr(nc, "_pending_data_size", None)) is not int:
        return "no _pending list / _pending_data_size"
    if type(getattr(nc, "_max_payload", None)) is not int:
        return "no integer _max_payload"
    stats = getattr(nc, "stats", None)
    if not isinstance(stats, dict) or type(stats.get("out_msgs")) is not int or type(stats.get("out_bytes")) is not int:
        return "no stats out_msgs / out_bytes"
    if _NatsTcp is None:
        return "nats.aio.transport has no TcpTransport"
    transport = getattr(nc, "_transport", None)
    if type(transport) is not _NatsTcp:
        return f"transport is {type(transport).__name__}, not TcpTransport (websocket frames its writes)"
    writer = getattr(transport, "_io_writer", None)
    if not isinstance(writer, asyncio.StreamWriter):
        return "TcpTransport has no asyncio.StreamWriter _io_writer"
    return None


def _token(subject: str) -> bool:
    """Whether ``subject`` can stand in a PUB line as one field: non-empty, printable, no space."""
    return bool(subject) and subject.isprintable() and " " not in subject


class DirectPublish:
    """Write messages (``PUB <subject> [<reply>] <len>\\r\\n<payload>\\r\\n``) straight to the
    client's socket.

    ``nc.publish`` appends the command to nats.py's pending list, wakes its flusher task (a queue
    put and a task switch on the next loop turn) and that task calls ``writelines``: ~20-25 µs of
    CPU per message on the shared 2-core machine. :meth:`write` (one message: a worker's reply)
    and :meth:`write_all` (a backbone's layer step: every request in one transport write, as
    nats.py's one flush of the step would) do the write themselves when that keeps every
    guarantee of the ordinary path, and return False (the caller publishes the ordinary way,
    every message) otherwise:

    - the client is CONNECTED (not connecting, reconnecting, draining or closed: nats.py buffers
      then, and a reconnect flushes that buffer first),
    - nothing is pending in nats.py's buffer (whatever is there was published earlier and goes
      first; with it empty, every earlier byte is already in the transport, so order holds),
    - the transport is open and its buffer under :data:`DIRECT_BUFFER_LIMIT` (else the flusher's
      drain keeps the backpressure),
    - every payload is ``bytes`` within the server's max payload, every subject (and reply
      subject, if any) a non-empty token without whitespace or control characters, and there are
      no headers (the caller's choice).

    ``out_msgs`` and ``out_bytes`` count what it writes, as ``publish`` would. Build it with
    :meth:`attach`, which checks nats.py's state once (:func:`direct_unsupported`).

    ``bench/dispatch.py --overhead --bundles on --rounds 6`` (two calls per message), six A/B
    pairs interleaved on the shared machine: worker CPU per call outside the kernel 128-167 µs
    (mean 146) through ``publish``, 111-154 (mean 126) written directly; the reply also leaves a
    loop turn earlier (sharded tok/s 184-279 -> 164-348, noisy)."""

    __slots__ = ("_nc", "_connected", "_stats", "written")

    def __init__(self, nc: Any):
        reason = direct_unsupported(nc)
        if reason is not None:
            raise TypeError(f"no direct writes on {type(nc).__name__}: {reason}")
        self._nc, self._connected, self._stats = nc, type(nc).CONNECTED, nc.stats
        self.written = 0  # messages that took the direct path (tests and benches read it)

    @classmethod
    def attach(cls, nc: Any) -> tuple[DirectPublish | None, str | None]:
        """``(a DirectPublish, None)``, or ``(None, why not)``."""
        reason = direct_unsupported(nc)
        return (None, reason) if reason is not None else (cls(nc), None)

    def _socket(self):
        """The transport to write to if nats.py's state allows a direct write now, else None."""
        nc = self._nc
        if nc._status != self._connected or nc._pending_data_size:
            return None
        transport = nc._transport
        writer = getattr(transport, "_io_writer", None) if type(transport) is _NatsTcp else None
        if writer is None:
            return None
        sock = writer.transport
        if sock.is_closing() or sock.get_write_buffer_size() >= DIRECT_BUFFER_LIMIT:
            return None
        return sock

    def write(self, subject: str, payload: bytes, reply: str = "") -> bool:
        """Write one message without headers if it is safe now (True), else nothing (False)."""
        if type(payload) is not bytes:
            return False
        size = len(payload)
        if size > self._nc._max_payload or not _token(subject) or (reply and not _token(reply)):
            return False
        sock = self._socket()
        if sock is None:
            return False
        head = b"PUB %s %s %d\r\n" % (subject.encode(), reply.encode(), size) if reply else \
            b"PUB %s %d\r\n" % (subject.encode(), size)
        if size < DIRECT_JOIN_LIMIT:
            sock.write(b"".join((head, payload, _CRLF)))
        else:
            sock.writelines((head, payload, _CRLF))
        stats = self._stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        self.written += 1
        return True

    def write_all(self, messages: list[tuple[str, str, bytes]]) -> bool:
        """Write every ``(subject, reply, payload)`` (reply may be empty) in one transport write if
        that is safe now for all of them (True), else nothing (False): all or none, so that the
        caller's ordinary publishes keep the order."""
        limit = self._nc._max_payload
        parts: list[bytes] = []
        total = 0
        for subject, reply, payload in messages:
            if type(payload) is not bytes or len(payload) > limit or not _token(subject) \
                    or (reply and not _token(reply)):
                return False
            size = len(payload)
            parts.append(b"PUB %s %s %d\r\n" % (subject.encode(), reply.encode(), size) if reply else
                         b"PUB %s %d\r\n" % (subject.encode(), size))
            parts.append(payload)
            parts.append(_CRLF)
            total += size
        if not parts:
            return True
        sock = self._socket()
        if sock is None:
            return False
        if total < DIRECT_JOIN_LIMIT:
            sock.write(b"".join(parts))
        else:
            sock.writelines(parts)
        stats = self._stats
        stats["out_msgs"] += len(messages)
        stats["out_bytes"] += total
        self.written += len(messages)
        return True


#: The worker's name for it: its replies are what it writes.
DirectReply = DirectPublish
