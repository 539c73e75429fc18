"""Inline delivery: a worker's hot subscriptions handled where nats.py's reader parses them.

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
"""

from __future__ import annotations

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
        try:
            await handler(Delivered(subject.decode(), reply.decode(), data))
        except Exception as exc:  # never into the reader
            self._on_error(exc)
