"""The generation API on the bus: ``kvasir.<model>.generate``, for NATS clients without HTTP.

:class:`GenerateBus` answers requests (:mod:`kvasir_bus.generate_codec`) by feeding them to
the backbone's continuous-batching :class:`~backbone.scheduler.Scheduler` (the same one the
HTTP server uses, so bus and HTTP streams share every engine step). Every backbone of a model
subscribes in the queue group :data:`QUEUE`, so NATS hands each request to exactly one of them:
a second backbone on the bus adds capacity with no configuration (and NATS prefers a member in
the requester's own cluster or leafnode).

:func:`generate` is the client: it publishes a request with an inbox of its own and yields the
streamed tokens, then the :class:`~kvasir_bus.generate_codec.GenerateDone`.

Everything async runs on one event loop (the HTTP server's); the scheduler's events arrive on
the engine thread and are handed to that loop.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import structlog

from backbone.sampling import SamplerConfig
from backbone.scheduler import GenRequest, Overloaded, Scheduler
from backbone.tokenizer import StreamDecoder
from kvasir_bus import generate_codec as gc
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.subjects import Subjects
from kvasir_bus.wire import encode, headers_for

log = structlog.get_logger("kvasir.generate_bus")

QUEUE = "kvasir-backbones"  # the queue group every backbone of a model joins


class GenerateRefused(KvasirError):
    """The backbone answered with an error reply; ``code`` says why (``overloaded``: retry)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class NoBackbone(KvasirError):
    """No backbone serves this model on the bus (the server's no-responders status)."""


class GenerateBus:
    """``await start()`` subscribes in the queue group; ``await stop()`` unsubscribes and ends
    the streams still running (idempotent). ``served`` counts the requests this node took."""

    def __init__(self, nc, model: str, node: str, scheduler: Scheduler, tokenizer, eos_id: int):
        self.nc, self.node, self.scheduler, self.tokenizer, self.eos_id = nc, node, scheduler, tokenizer, eos_id
        self.subject = Subjects(model).generate()
        self.served = 0
        self._sub = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "GenerateBus":
        if self._sub is None:
            self._sub = await self.nc.subscribe(self.subject, queue=QUEUE, cb=self._on_request)
            await self.nc.flush()  # the subscription is live on the server when start() returns
            log.info("generate_bus_serving", subject=self.subject, queue=QUEUE, node=self.node)
        return self

    async def stop(self) -> None:
        if self._sub is None:
            return
        sub, self._sub = self._sub, None
        try:
            await sub.unsubscribe()
        except Exception as exc:  # the connection is gone already: nothing left to undo
            log.warning("generate_unsubscribe_failed", error=f"{type(exc).__name__}: {exc}")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_request(self, msg) -> None:
        if not msg.reply:
            return  # nowhere to answer: a publish without an inbox is not a request
        try:
            req = gc.decode_generate_request(msg.data)
        except gc.CodecError as exc:
            await self._refuse(msg.reply, "", gc.ERR_BAD_REQUEST, str(exc))
            return
        task = asyncio.ensure_future(self._serve(req, msg.reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refuse(self, inbox: str, request_id: str, code: str, message: str) -> None:
        reply = gc.ErrorReply(request_id, self.node, code, message[:gc.MAX_ERROR_MESSAGE])
        await self.nc.publish(inbox, encode(reply), headers=headers_for(reply))

    async def _send(self, inbox: str, record) -> None:
        await self.nc.publish(inbox, encode(record), headers=headers_for(record))

    async def _serve(self, req: gc.GenerateRequest, inbox: str) -> None:
        rid = req.request_id
        try:
            prompt = list(req.prompt_ids) or self.tokenizer.encode(req.prompt_text)
            n_vocab = self.scheduler.engine.cfg.n_vocab
            if any(t >= n_vocab for t in prompt):
                raise UsageError(f"prompt token ids must be in 0..{n_vocab - 1}")
            request = GenRequest(tuple(prompt), req.max_tokens,
                                 SamplerConfig(req.temperature, req.top_p, req.seed), req.stop_on_eos)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job = self.scheduler.submit(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except Overloaded as exc:
            await self._refuse(inbox, rid, gc.ERR_OVERLOADED, f"the backbone is busy ({exc}); retry later")
            return
        except (UsageError, KvasirError) as exc:
            await self._refuse(inbox, rid, gc.ERR_BAD_REQUEST, str(exc))
            return
        self.served += 1
        decoder, index, finished = StreamDecoder(self.tokenizer), 0, False
        try:
            while True:
                kind, value = await events.get()
                if kind == "token":
                    text = "" if (req.stop_on_eos and value == self.eos_id) else decoder.push(value)
                    await self._send(inbox, gc.GenerateToken(rid, index, value, text[:gc.MAX_PIECE_CHARS]))
                    index += 1
                elif kind == "done":
                    finished = True
                    await self._send(inbox, gc.GenerateDone(rid, self.node, value, len(prompt), index))
                    return
                else:
                    finished = True
                    await self._refuse(inbox, rid, gc.ERR_INTERNAL, str(value))
                    return
        finally:
            if not finished:  # stopped (or the connection failed): free the sequence
                self.scheduler.cancel(job)


async def generate(nc, model: str, request: gc.GenerateRequest, timeout_s: float = 60.0
                   ) -> AsyncIterator[gc.GenerateToken | gc.GenerateDone]:
    """Ask whichever backbone of ``model`` the queue group picks; yields each token, then the
    done record. Raises :class:`NoBackbone`, :class:`GenerateRefused`, or
    ``asyncio.TimeoutError`` when ``timeout_s`` pass without a message."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(Subjects(model).generate(), encode(request), reply=inbox, headers=headers_for(request))
        expected = 0
        while True:
            msg = await sub.next_msg(timeout=timeout_s)
            if msg.headers and msg.headers.get("Status") == "503":
                raise NoBackbone(f"no backbone serves model {model} on this bus")
            rec = gc.decode_generate_reply(msg.data)
            if isinstance(rec, gc.ErrorReply):
                raise GenerateRefused(rec.code, rec.message)
            if rec.request_id != request.request_id:
                continue  # not ours (cannot happen on a private inbox; cheap to check)
            if isinstance(rec, gc.GenerateToken):
                if rec.index != expected:
                    raise KvasirError(f"token {expected} of the stream was lost (got {rec.index})")
                expected += 1
            yield rec
            if isinstance(rec, gc.GenerateDone):
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection closed under us: the subscription went with it
            pass


async def generate_all(nc, model: str, request: gc.GenerateRequest, timeout_s: float = 60.0
                       ) -> tuple[list[int], str, gc.GenerateDone]:
    """The whole stream: (token ids, text, done record)."""
    tokens, text, done = [], [], None
    async for rec in generate(nc, model, request, timeout_s):
        if isinstance(rec, gc.GenerateToken):
            tokens.append(rec.token)
            text.append(rec.text)
        else:
            done = rec
    return tokens, "".join(text), done


def new_request(prompt: str | list[int], max_tokens: int = 16, **sampling) -> gc.GenerateRequest:
    """A request with a fresh id; ``prompt`` text or token ids."""
    ids, text = (list(prompt), "") if isinstance(prompt, (list, tuple)) else ((), prompt)
    return gc.GenerateRequest(uuid.uuid4().hex, tuple(ids), text, max_tokens, **sampling)
