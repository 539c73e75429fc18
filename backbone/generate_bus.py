"""The generation API on the bus: ``kvasir.<model>.generate``, for NATS clients without HTTP.

:class:`GenerateBus` answers requests (:mod:`kvasir_bus.generate_codec`) by feeding them to
the backbone's continuous-batching :class:`~backbone.scheduler.Scheduler` (the same one the
HTTP server uses, so bus and HTTP streams share every engine step). Every backbone of a model
subscribes in the queue group :data:`QUEUE`, so NATS hands each request to exactly one of them:
a second backbone on the bus adds capacity with no configuration (and NATS prefers a member in
the requester's own cluster or leafnode).

:func:`generate` is the client: it publishes a request with an inbox of its own and yields the
streamed tokens, then the :class:`~kvasir_bus.generate_codec.GenerateDone`; a client that stops
early says so with a :class:`~kvasir_bus.generate_codec.GenerateCancel`.

A client that leaves frees its sequence at the next engine step, as an HTTP client that
disconnects does. Two ways, because a client may go without a word: a cancel message on
``kvasir.<model>.generate.cancel`` (every backbone hears it; the one holding the request drops
it), and the inbox itself: each token is published with a reply subject under this backbone's
own inbox (one per stream), so once the client's inbox has no subscriber (it unsubscribed, or its
connection closed) the NATS server answers that reply subject with a no-responders status and
the backbone drops the stream.

Everything async runs on one event loop (the HTTP server's); the scheduler's events arrive on
the engine thread and are handed to that loop.
"""

from __future__ import annotations

import asyncio
import re
import itertools
import uuid
from typing import AsyncIterator

import structlog

from backbone.sampling import SamplerConfig
from backbone.scheduler import GenRequest, LoopEvents, Overloaded, Scheduler
from backbone.tokenizer import StreamDecoder
from kvasir_bus import generate_codec as gc
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import ThrottledLog
from kvasir_bus.wire import encode, headers_for

log = structlog.get_logger("kvasir.generate_bus")

QUEUE = gc.GENERATE_QUEUE  # the queue group every backbone of a model joins

_INBOX_SUBJECT = re.compile(r"_INBOX(_[A-Z2-7]{1,64})?(\.[A-Za-z0-9_\-]{1,64}){1,8}")
_refusals = ThrottledLog(log, 60.0)


def reply_subject_ok(subject: str) -> bool:
    """Whether a generate request's reply subject is inbox-shaped: ``_INBOX.<tokens>`` (nats
    clients' default) or ``_INBOX_<nkey>.<tokens>`` (a ``kvasir creds`` identity's own prefix),
    never a ``kvasir.`` service subject, a ``$`` system subject or a wildcard."""
    return len(subject) <= 256 and _INBOX_SUBJECT.fullmatch(subject) is not None


#: While a request waits for a slot, every QUEUED_PROBE_S its client's inbox gets an empty
#: message with the header ``Kvasir-Kind: generate_queued`` and the stream's reply subject: a
#: client gone without a cancel is then found (NATS' no-responders) and its request leaves the
#: queue at once, not when it reaches the front. Clients skip it (an empty body, no record).
QUEUED_PROBE_S = 1.0
QUEUED_KIND = "generate_queued"


def is_queued_notice(msg) -> bool:
    """Whether a message on a generate client's inbox is the backbone's "still queued" notice."""
    return not msg.data and bool(msg.headers) and msg.headers.get("Kvasir-Kind") == QUEUED_KIND


def client_of(reply: str) -> str:
    """Who asked, for the scheduler's fair share, from an inbox-shaped reply subject: under
    ``kvasir creds`` the identity's own prefix ``_INBOX_<nkey>`` (the server lets no one else
    use it); on an open bus the connection's inbox prefix (``_INBOX.`` and the first 12
    characters of nats clients' NUID, fixed per connection), which a flooder can vary: the
    fair share holds against a stranger only where the bus names its clients."""
    head, _, rest = reply.partition(".")
    return head if head.startswith("_INBOX_") else f"{head}.{rest[:12]}"

class GenerateRefused(KvasirError):
    """The backbone answered with an error reply; ``code`` says why (``overloaded``: retry)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class NoBackbone(KvasirError):
    """No backbone serves this model on the bus (the server's no-responders status)."""


class GenerateBus:
    """``await start()`` subscribes in the queue group; ``await stop()`` unsubscribes and ends
    the streams still running (idempotent). ``served`` counts the requests this node took;
    ``dropped`` the streams ended because their client left: ``cancel`` (it said so) and
    ``gone`` (its inbox had no subscriber any more)."""

    def __init__(self, nc, model: str, node: str, scheduler: Scheduler, tokenizer, eos_id: int):
        self.nc, self.node, self.scheduler, self.tokenizer, self.eos_id = nc, node, scheduler, tokenizer, eos_id
        subjects = Subjects(model)
        self.subject, self.cancel_subject = subjects.generate(), subjects.generate_cancel()
        self.served = 0
        self.dropped = {"cancel": 0, "gone": 0}
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self._streams: dict[str, asyncio.Task] = {}  # request id -> the task streaming it
        self._requests: dict[str, gc.GenerateRequest] = {}  # request id -> the request (its cancel_hash)
        self.refused_cancels = 0  # cancels without the request's secret
        self._feedback = ""  # this backbone's no-responders inbox: "<it>.<n>" for stream n
        self.refused_subjects = 0  # requests whose reply subject is no inbox (dropped unanswered)
        self._feedback_ids: dict[str, str] = {}  # "<n>" -> request id (an id may hold dots)
        self._numbers = itertools.count()

    async def start(self) -> "GenerateBus":
        if not self._subs:
            self._feedback = self.nc.new_inbox()
            self._subs = [await self.nc.subscribe(self.subject, queue=QUEUE, cb=self._on_request),
                          await self.nc.subscribe(self.cancel_subject, cb=self._on_cancel),
                          await self.nc.subscribe(f"{self._feedback}.*", cb=self._on_no_responders)]
            await self.nc.flush()  # the subscriptions are live on the server when start() returns
            log.info("generate_bus_serving", subject=self.subject, queue=QUEUE, node=self.node)
        return self

    async def stop(self) -> None:
        if not self._subs:
            return
        subs, self._subs = self._subs, []
        for sub in subs:
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
        if not reply_subject_ok(msg.reply):
            self.refused_subjects += 1
            _refusals.warning(("reply_subject",), "generate_reply_subject_refused", reply=msg.reply[:80],
                              refused=self.refused_subjects, note="replies go only to _INBOX subjects")
            return  # never publish tokens on a service subject (or into someone's non-inbox subject)
        try:
            req = gc.decode_generate_request(msg.data)
        except gc.CodecError as exc:
            await self._refuse(msg.reply, "", gc.ERR_BAD_REQUEST, str(exc))
            return
        if req.request_id in self._streams:
            await self._refuse(msg.reply, req.request_id, gc.ERR_BAD_REQUEST,
                               "a stream with this request id is running here already")
            return
        number = str(next(self._numbers))
        task = asyncio.ensure_future(self._serve(req, msg.reply, f"{self._feedback}.{number}",
                                                 client_of(msg.reply)))
        self._tasks.add(task)
        self._streams[req.request_id] = task
        self._requests[req.request_id] = req
        self._feedback_ids[number] = req.request_id
        task.add_done_callback(lambda t, rid=req.request_id, n=number: self._forget(rid, n, t))

    def _forget(self, request_id: str, number: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._feedback_ids.pop(number, None)
        if self._streams.get(request_id) is task:
            del self._streams[request_id]
            self._requests.pop(request_id, None)

    def _drop(self, request_id: str, why: str) -> None:
        """End the stream of ``request_id`` if this backbone runs it: its task's ``finally``
        cancels the job, and the scheduler frees the sequence at its next step."""
        task = self._streams.pop(request_id, None)
        self._requests.pop(request_id, None)
        if task is not None and not task.done():
            self.dropped[why] += 1
            log.info("generate_dropped", request_id=request_id, why=why, node=self.node)
            task.cancel()

    async def _on_cancel(self, msg) -> None:
        try:
            cancel = gc.decode_generate_cancel(msg.data)
        except gc.CodecError as exc:  # no reply: a cancel is fire and forget
            log.warning("generate_bad_cancel", error=str(exc))
            return
        request = self._requests.get(cancel.request_id)
        if request is None:
            return  # not held here (another backbone's, or finished): ignored
        if not request.may_cancel(cancel.token):  # only the requester holds the secret
            self.refused_cancels += 1
            _refusals.warning(("cancel",), "generate_cancel_refused", request_id=cancel.request_id,
                              refused=self.refused_cancels,
                              why="no token" if not cancel.token else "wrong token" if request.cancel_hash
                              else "the request carried no cancel_hash")
            return
        self._drop(cancel.request_id, "cancel")

    async def _on_no_responders(self, msg) -> None:
        # Only the NATS server writes here (under `kvasir creds` nobody else may publish to
        # this backbone's inbox): a token of stream <n> found no subscriber on its client's inbox.
        if msg.headers and msg.headers.get("Status") == "503":
            request_id = self._feedback_ids.get(msg.subject.rsplit(".", 1)[-1])
            if request_id is not None:
                self._drop(request_id, "gone")

    async def _refuse(self, inbox: str, request_id: str, code: str, message: str) -> None:
        reply = gc.ErrorReply(request_id, self.node, code, message[:gc.MAX_ERROR_MESSAGE])
        await self.nc.publish(inbox, encode(reply), headers=headers_for(reply))

    async def _send(self, inbox: str, record, feedback: str = "") -> None:
        await self.nc.publish(inbox, encode(record), reply=feedback, headers=headers_for(record))

    async def _serve(self, req: gc.GenerateRequest, inbox: str, feedback: str, client: str = "") -> None:
        rid = req.request_id
        try:
            prompt = list(req.prompt_ids) or self.tokenizer.encode(req.prompt_text)
            n_vocab = self.scheduler.engine.cfg.n_vocab
            if any(t >= n_vocab for t in prompt):
                raise UsageError(f"prompt token ids must be in 0..{n_vocab - 1}")
            request = GenRequest(tuple(prompt), req.max_tokens,
                                 SamplerConfig(req.temperature, req.top_p, req.seed), req.stop_on_eos,
                                 client=client)
            events = LoopEvents()
            job = self.scheduler.submit(request, events.push)
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
                if job.seq is not None or index:  # running: no timer on the hot path
                    kind, value = await events.next()
                else:
                    try:
                        kind, value = await asyncio.wait_for(events.next(), QUEUED_PROBE_S)
                    except asyncio.TimeoutError:
                        if job.seq is None and not job.cancelled:  # still waiting for a slot: is the client there?
                            await self.nc.publish(inbox, b"", reply=feedback, headers={
                                "Kvasir-Kind": QUEUED_KIND, "Kvasir-Request": rid, "Kvasir-Node": self.node})
                        continue
                if kind == "token":
                    text = "" if (req.stop_on_eos and value == self.eos_id) else decoder.push(value)
                    await self._send(inbox, gc.GenerateToken(rid, index, value, text[:gc.MAX_PIECE_CHARS]), feedback)
                    index += 1
                elif kind == "done":
                    finished = True
                    rest = decoder.flush()[:gc.MAX_PIECE_CHARS]  # a character the last token cut short
                    await self._send(inbox, gc.GenerateDone(rid, self.node, value, len(prompt), index, rest))
                    return
                else:
                    finished = True
                    await self._refuse(inbox, rid, gc.ERR_INTERNAL, str(value))
                    return
        finally:
            if not finished:  # the client left, we stopped, or the connection failed: free the sequence
                self.scheduler.cancel(job)


async def generate(nc, model: str, request: gc.GenerateRequest, timeout_s: float = 60.0
                   ) -> AsyncIterator[gc.GenerateToken | gc.GenerateDone]:
    """Ask whichever backbone of ``model`` the queue group picks; yields each token, then the
    done record. Raises :class:`NoBackbone`, :class:`GenerateRefused`, or
    ``asyncio.TimeoutError`` when ``timeout_s`` pass without a message. A caller that stops
    early (breaks out, is cancelled, times out) cancels the request on the backbone."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    ended = False  # the backbone has nothing more to do for this request
    try:
        await nc.publish(Subjects(model).generate(), encode(request), reply=inbox, headers=headers_for(request))
        expected = 0
        while True:
            msg = await sub.next_msg(timeout=timeout_s)
            if msg.headers and msg.headers.get("Status") == "503":
                ended = True
                raise NoBackbone(f"no backbone serves model {model} on this bus")
            if is_queued_notice(msg):
                continue  # still waiting for a slot on the backbone (it checks we are here)
            rec = gc.decode_generate_reply(msg.data)
            if isinstance(rec, gc.ErrorReply):
                ended = True
                raise GenerateRefused(rec.code, rec.message)
            if rec.request_id != request.request_id:
                continue  # not ours (cannot happen on a private inbox; cheap to check)
            if isinstance(rec, gc.GenerateToken):
                if rec.index != expected:
                    raise KvasirError(f"token {expected} of the stream was lost (got {rec.index})")
                expected += 1
            if isinstance(rec, gc.GenerateDone):
                ended = True
            yield rec
            if ended:
                return
    finally:
        try:
            # The cancel goes out before the inbox closes: the backbone then reads it ahead of
            # any no-responders status for a later token, and counts the stream as cancelled,
            # not as gone (tokens that come in between are dropped with the subscription).
            if not ended:
                await cancel(nc, model, request)
            await sub.unsubscribe()
        except Exception:  # the connection closed under us: the subscription went with it
            pass


async def cancel(nc, model: str, request: gc.GenerateRequest) -> None:
    """Tell the backbones of ``model`` to drop ``request``'s stream (fire and forget): the
    cancel carries the request's secret, so no one else can."""
    msg = gc.GenerateCancel(request.request_id, request.cancel_token)
    await nc.publish(Subjects(model).generate_cancel(), encode(msg), headers=headers_for(msg))


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
            text.append(rec.text)
    return tokens, "".join(text), done


def new_request(prompt: str | list[int], max_tokens: int = 16, **sampling) -> gc.GenerateRequest:
    """A request with a fresh id; ``prompt`` text or token ids."""
    ids, text = (list(prompt), "") if isinstance(prompt, (list, tuple)) else ((), prompt)
    token, digest = gc.new_cancel_token()
    return gc.GenerateRequest(uuid.uuid4().hex, tuple(ids), text, max_tokens, **sampling,
                              cancel_hash=digest, cancel_token=token)
