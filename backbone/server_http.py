"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (aiohttp).

    POST /v1/completions        prompt (text or token ids) -> text; stream: true as SSE
    POST /v1/chat/completions   messages -> the model's chat template -> assistant text
    GET  /v1/models             the one model served
    GET  /health                liveness plus the scheduler's counters

Supported fields: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature``, ``top_p``, ``seed``, ``stop`` (up to 4 strings), ``stream``,
``stream_options.include_usage``, ``n`` (1 only) and llama-server's ``ignore_eos``. Replies
carry ``usage`` and ``finish_reason`` ("stop": end-of-sequence token or a stop string;
"length": ``max_tokens`` reached). Errors are OpenAI's JSON body ``{"error": {"message",
"type", "param", "code"}}``: 400 for a request that cannot run (bad JSON, a bad field, a prompt
longer than the context, ``max_tokens`` out of range), 404 for an unknown model or route, 429
with ``Retry-After`` when the queue is full, 500 when the engine fails.

With ``ServerConfig.bus_model`` set (``kvasir serve --http --nats``), the same scheduler also
serves the bus API ``kvasir.<model>.generate`` (:mod:`backbone.generate_bus`): HTTP and bus
streams share every engine step. Whether the experts are local or on the swarm is the engine's
business (:class:`backbone.service.BackboneService` hands it the remote experts).

A client that goes away (aiohttp cancels its handler) has its sequence dropped at the next
engine step. Text is streamed as it becomes whole UTF-8 and cannot still turn into a stop
string; a stop string ends the sequence without being sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import structlog
from aiohttp import web

from backbone.http_guard import GuardConfig, OneLineLog, listen
from backbone.metrics import DispatchCollector, backbone_registry
from backbone.chat import parse_messages, template_for
from backbone.sampling import SamplerConfig
from backbone.scheduler import GenRequest, LoopEvents, Overloaded, Scheduler, SchedulerConfig
from backbone.tokenizer import StreamDecoder
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.metrics import metrics_handler

log = structlog.get_logger("kvasir.serve")

MAX_STOPS = 4
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see HttpServer.url)
    model_name: str = "model"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_body_bytes: int = 8 << 20
    guard: GuardConfig = GuardConfig()  # connection caps, header/body read timeouts
    # The bus API (backbone.generate_bus): with a model fingerprint, the server also answers
    # kvasir.<bus_model>.generate on the bus at bus_url (None: $NATS_URL, else the default).
    bus_model: str | None = None
    bus_url: str | None = None
    node: str = "backbone"


class ApiError(Exception):
    """An error reply: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


# -- request parsing: the wire becomes a typed record here, or a 400 ------------------------------

@dataclass(frozen=True)
class Params:
    prompt: tuple[int, ...]
    max_tokens: int
    sampler: SamplerConfig
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    stop_on_eos: bool = True


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number", name)
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
        raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(f"'{name}' must be an integer", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"'stop' must be a string or an array of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


def _prompt_ids(prompt, tokenizer, n_vocab: int) -> list[int]:
    """OpenAI's prompt forms: a string, one string in an array, token ids, or one id array."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < n_vocab for t in prompt):
            raise _bad(f"prompt token ids must be in 0..{n_vocab - 1}", "prompt")
        return list(prompt)
    raise _bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")


# -- the server ----------------------------------------------------------------------------------

class HttpServer:
    """``await start()`` binds and starts the engine thread; ``await stop()`` undoes both
    (idempotent). ``url`` is known once started (port 0 picks a free port)."""

    def __init__(self, engine, tokenizer, cfg: ServerConfig = ServerConfig(), *,
                 metrics: DispatchCollector | None = None):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.template = template_for(engine.reader)  # a broken template fails here, at startup
        self.scheduler = Scheduler(engine, cfg.scheduler)
        self.metrics = metrics or _collector(engine)
        self.scheduler.on_step = self._count_step
        self.created = int(time.time())
        self.url: str | None = None
        self._runner = None
        self._listener = None  # the asyncio server in front of aiohttp's (backbone/http_guard.py)
        self.http_limits = None
        self.bus = None  # the GenerateBus, when cfg.bus_model is set
        self._nc = None

    async def start(self) -> str:
        if self._runner is not None:
            return self.url
        app = web.Application(middlewares=[self._errors], client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", metrics_handler(backbone_registry(self.metrics)))
        # Cancel the handler of a client that disconnects: its sequence is dropped at once.
        # aiohttp's malformed-request tracebacks become one line each (backbone/http_guard.py)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=OneLineLog(),
                               keepalive_timeout=self.cfg.guard.keepalive_timeout_s)
        await runner.setup()
        try:  # connection caps and header/body read timeouts around aiohttp's handler
            self._listener, self.http_limits = await listen(runner.server, self.cfg.host, self.cfg.port,
                                                            self.cfg.guard)
        except OSError as exc:
            await runner.cleanup()
            raise UsageError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc.strerror or exc}") from None
        self._runner = runner
        self.scheduler.start()
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        if self.cfg.bus_model is not None:
            try:
                await self._start_bus()
            except BaseException:
                await self.stop()
                raise
        cost = self.scheduler.stream_cost()  # admission is by memory: say what one stream costs
        log.info("http_serving", url=self.url, model=self.cfg.model_name, n_ctx=self.engine.n_ctx,
                 max_active=self.cfg.scheduler.max_active, deterministic=self.cfg.scheduler.deterministic,
                 kv_bytes_per_token=cost["per_token"], state_bytes_per_stream=cost["state"],
                 full_context_stream_mib=round(cost["total"] / 2**20, 2),
                 kv_bound_mib=round(cost["bound"] / 2**20, 1), full_context_streams=cost["full_context_streams"])
        return self.url

    def _count_step(self, tokens: int) -> None:
        self.metrics.steps.inc()
        self.metrics.tokens.inc(tokens)

    async def _start_bus(self) -> None:
        from backbone.generate_bus import GenerateBus
        from kvasir_bus.connect import connect

        self._nc = await connect(self.cfg.bus_url, name=f"kvasir-{self.cfg.node}-generate")
        self.bus = await GenerateBus(self._nc, self.cfg.bus_model, self.cfg.node, self.scheduler, self.tokenizer,
                                     self.engine.cfg.eos_id).start()

    async def stop(self) -> None:
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        if self._listener is not None:  # no new connections; runner.cleanup() closes the open ones
            self._listener.close()
        if self.bus is not None:
            await self.bus.stop()
        self.scheduler.stop()
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.drain(), 10)
            except Exception as exc:  # leaving anyway
                log.warning("bus_disconnect_failed", error=f"{type(exc).__name__}: {exc}")
            self._nc = None
        await runner.cleanup()

    # -- middleware: every failure is an OpenAI error body ---------------------------------

    @staticmethod
    def _status_type(status: int) -> str:
        return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:  # unknown route, wrong method, body too large
            if exc.status < 400:
                raise
            return ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                            type=self._status_type(exc.status)).response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # a bug: still a JSON reply, and the server keeps serving
            log.exception("request_failed", path=request.path)
            return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    # -- routes -----------------------------------------------------------------------------

    async def models(self, request):
        c = self.engine.cfg
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "kvasir",
            "meta": {"arch": c.arch, "n_ctx": self.engine.n_ctx, "n_layer": c.n_layer, "n_expert": c.n_expert,
                     "n_vocab": c.n_vocab}}]})

    async def health(self, request):
        bus = {"bus": {"subject": self.bus.subject, "served": self.bus.served}} if self.bus is not None else {}
        return web.json_response({"status": "ok", "model": self.cfg.model_name,
                                  "deterministic": self.cfg.scheduler.deterministic, **self.scheduler.snapshot(),
                                  **bus})

    async def _body(self, request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _bad(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.cfg.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server has {self.cfg.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        if body.get("n") not in (None, 1):
            raise _bad("only n = 1 is supported", "n")
        for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
            if body.get(unsupported) not in (None, False, 0, []):
                raise _bad(f"'{unsupported}' is not supported by this server", unsupported)
        return body

    def _params(self, body: dict, prompt: list[int], chat: bool) -> Params:
        n_ctx = self.engine.n_ctx
        if not prompt:
            raise _bad("the prompt is empty", "messages" if chat else "prompt")
        if len(prompt) >= n_ctx:
            raise _bad(f"the prompt is {len(prompt)} tokens; the context is {n_ctx}",
                       "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, name)
        if max_tokens is None:
            max_tokens = n_ctx - len(prompt) if chat else min(DEFAULT_COMPLETION_TOKENS, n_ctx - len(prompt))
        if max_tokens < 1:
            raise _bad(f"'{name}' must be >= 1, got {max_tokens}", name)
        if len(prompt) + max_tokens > n_ctx:
            raise _bad(f"the prompt ({len(prompt)} tokens) plus {name} ({max_tokens}) exceeds the context of "
                       f"{n_ctx} tokens", name, "context_length_exceeded")
        seed = _integer(body, "seed")
        sampler = SamplerConfig(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            seed=(seed if seed is not None else uuid.uuid4().int) % 2**64)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        return Params(tuple(prompt), max_tokens, sampler, _stops(body), stream=_flag(body, "stream"),
                      include_usage=_flag(options, "include_usage"), stop_on_eos=not _flag(body, "ignore_eos"))

    async def completions(self, request):
        body = await self._body(request)
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        try:
            prompt = _prompt_ids(body["prompt"], self.tokenizer, self.engine.cfg.n_vocab)
        except KvasirError as exc:
            raise _bad(str(exc), "prompt") from None
        return await self._respond(request, self._params(body, prompt, chat=False), chat=False)

    async def chat_completions(self, request):
        body = await self._body(request)
        try:
            text = self.template.render(parse_messages(body.get("messages")))
        except KvasirError as exc:
            raise _bad(str(exc), "messages") from None
        prompt = self.tokenizer.encode(text, add_bos=False, special=True)
        return await self._respond(request, self._params(body, prompt, chat=True), chat=True)

    # -- generation -------------------------------------------------------------------------

    @staticmethod
    def _client(request) -> str:
        """Who asks, for the scheduler's fair share: the API key's hash when one is sent, else
        the client's address."""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and len(auth) > 7:
            import hashlib

            return "key:" + hashlib.sha256(auth[7:].encode()).hexdigest()[:16]
        return "addr:" + str(request.remote or "?")

    async def _generate(self, p: Params, counts: dict, client: str = "") -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text piece, None) while generating, then ("", finish_reason). The job is
        submitted before the first yield, so a refusal is still a plain error reply."""
        events = LoopEvents()
        try:
            job = self.scheduler.submit(GenRequest(p.prompt, p.max_tokens, p.sampler, p.stop_on_eos, client=client),
                                        events.push)
        except Overloaded as exc:
            retry = self.cfg.scheduler.retry_after_s
            raise ApiError(429, f"the server is busy ({exc}); retry in {retry} s", type="rate_limit_error",
                           code="server_overloaded", headers={"Retry-After": str(retry)}) from None
        except UsageError as exc:
            raise _bad(str(exc)) from None
        decoder, stops = StreamDecoder(self.tokenizer), StopText(p.stops)
        eos = self.engine.cfg.eos_id
        finished = False
        try:
            while True:
                kind, value = await events.next()
                if kind == "token":
                    counts["completion_tokens"] += 1
                    if p.stop_on_eos and value == eos:
                        continue
                    piece, hit = stops.push(decoder.push(value))
                    if piece:
                        yield piece, None
                    if hit:
                        finished = True
                        self.scheduler.cancel(job)
                        yield "", "stop"
                        return
                elif kind == "done":
                    finished = True
                    rest, hit = stops.push(decoder.flush())  # a truncated character: U+FFFD, not dropped
                    rest = rest if hit else rest + stops.flush()
                    if rest:
                        yield rest, None
                    yield "", value
                    return
                else:
                    finished = True
                    raise ApiError(500, str(value), type="server_error")
        finally:
            if not finished:  # the client went away (cancelled handler) or the write failed
                self.scheduler.cancel(job)

    async def _respond(self, request, p: Params, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        counts = {"prompt_tokens": len(p.prompt), "completion_tokens": 0}
        t0 = time.perf_counter()
        gen = self._generate(p, counts, self._client(request))

        def usage() -> dict:
            return {**counts, "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if not p.stream:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        def envelope(**kw) -> dict:
            return {"id": rid, "object": obj + (".chunk" if chat and p.stream else ""), "created": int(time.time()),
                    "model": self.cfg.model_name, **kw}

        finish = None
        if not p.stream:
            pieces = []
            async for piece, finish in gen:
                pieces.append(piece)
            self._log(rid, chat, counts, finish, t0)
            return web.json_response(envelope(choices=[choice("".join(pieces), finish)], usage=usage()))

        first = await gen.__anext__()  # submits (a refusal is still a JSON error) and waits for a token
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(data: dict | str) -> None:
            await resp.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

        try:
            if chat:
                await send(envelope(choices=[choice(None, None, first=True)]))

            async def rest():
                yield first
                async for item in gen:
                    yield item

            async for piece, finish in rest():
                if piece or finish:
                    chunk = envelope(choices=[choice(piece, finish)])
                    if p.include_usage:
                        chunk["usage"] = None
                    await send(chunk)
            if p.include_usage:
                await send(envelope(choices=[], usage=usage()))
        except ApiError as exc:  # the engine failed after the stream began: say so in the stream
            await send({"error": {"message": exc.message, "type": exc.type, "param": None, "code": None}})
        finally:
            await gen.aclose()
        await send("[DONE]")
        await resp.write_eof()
        self._log(rid, chat, counts, finish, t0)
        return resp

    def _log(self, rid: str, chat: bool, counts: dict, finish: str | None, t0: float) -> None:
        log.info("request", id=rid, api="chat" if chat else "completions", finish=finish,
                 seconds=round(time.perf_counter() - t0, 3), **counts)


def _collector(engine) -> DispatchCollector:
    """The backbone's metrics over whatever computes its experts now: the dispatch statistics
    when the engine asks workers (a ``RemoteExperts``), none while every expert is local."""
    from kvasir_bus.fingerprint import model_fingerprint

    collector = DispatchCollector(lambda: getattr(engine.experts, "stats", None),
                                  model_fingerprint(engine.reader))
    if hasattr(engine.experts, "observe_reply"):
        engine.experts.observe_reply = collector.observe_reply
    return collector


class StopText:
    """Holds back text that may still become a stop string; cuts the text at the first one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.buf = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        """-> (text safe to send, whether a stop string was reached)."""
        self.buf += piece
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(self.buf)) + 1)
                    if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


# -- running it --------------------------------------------------------------------------------

class ServerThread:
    """The server on a background event loop (tests, benchmarks): ``with ServerThread(...) as s:
    s.url``."""

    def __init__(self, engine, tokenizer, cfg: ServerConfig = ServerConfig()):
        from kvasir_bus.loopthread import LoopThread

        self.server = HttpServer(engine, tokenizer, cfg)
        self._loop = LoopThread("kvasir-http")
        try:
            self.url = self._loop.run(self.server.start(), timeout=30)
        except BaseException:
            self._loop.stop()
            raise

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run(self.server.stop(), timeout=30)
            self._loop.stop()
            self._loop = None

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_forever(engine, tokenizer, cfg: ServerConfig, on_ready=None) -> None:
    """Serve until Ctrl-C / SIGTERM; ``on_ready(url)`` once listening."""
    import signal

    async def main() -> None:
        server = HttpServer(engine, tokenizer, cfg)
        await server.start()
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        try:
            if on_ready:
                on_ready(server.url)
            await done.wait()
        finally:
            await server.stop()

    asyncio.run(main())


def parse_http(spec: str) -> tuple[str, int]:
    """``PORT``, ``:PORT`` or ``HOST:PORT`` -> (host, port); the host defaults to 127.0.0.1."""
    host, _, port = spec.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--http wants PORT or HOST:PORT, got {spec!r}") from None
    if not 0 <= number <= 65535:
        raise UsageError(f"--http port must be 0..65535, got {number}")
    return host.strip("[]") or "127.0.0.1", number
