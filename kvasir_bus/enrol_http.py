"""Enrolment over HTTP(S): the hello/join flow of :mod:`kvasir_bus.enrol` for a volunteer that
reaches the service by URL rather than over the bus (``kvasir enrol DIR --http HOST:PORT
[--tls-cert F --tls-key F]``). The checks, limits and identities are the bus side's own
(:meth:`kvasir_bus.enrol.EnrolService.join_fields`); only the transport and the source differ.

A join link for it is ``https://HOST:PORT/enrol#TOKEN``: the fragment never leaves the
volunteer (HTTP clients do not send it), and the token travels in the join's body. JSON, bytes
as standard base64::

    POST /enrol/hello  {"v": 1}                                   -> 200 {"nonce"}
    POST /enrol/join   {"v": 1, "token", "nonce", "key", "box", "sig"}
                       -> 200 {"name", "jwt", "exp", "reply_key", "nats"}

``nats`` is the bus URL the volunteer dials with its JWT (``kvasir enrol --bus-url``, default
the URL the service itself dials). A refusal is ``{"error": code, "message"}`` with a status
per code: 400 ``bad_request``/``bad_nonce``, 401 ``bad_token``/``bad_signature``, 403
``revoked``/``banned``, 429 ``rate_limited`` (``Retry-After: 1``), 503 ``full``; 413 for a body
over 8 KiB, 404 and 405 for other paths and methods (aiohttp's own).

What a flood costs: a body is at most 8 KiB and read only by a join; at most ``MAX_INFLIGHT``
requests are handled at once (503 beyond); a hello is one HMAC and no state, limited per
source (the peer's address, an IPv6 address by its /64: one host holds a whole /64) and in
all; a join is limited per source, per token and in all before any signature is checked. No
request is logged (aiohttp's access log is off): refusals are counted (``EnrolService.counts``).
The peer address is the TCP peer's: behind a reverse proxy every volunteer would be one source,
so serve this port directly (it terminates TLS itself).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import ssl
from pathlib import Path

import structlog

from kvasir_bus.enrol_wire import HTTP_PATH, JOIN_CONTEXT, MAX_REQUEST_BYTES, VERSION, Enrolled, EnrolError
from kvasir_bus.errors import KvasirError, UsageError

log = structlog.get_logger("kvasir.enrol")

MAX_BODY = 8192  # a join is ~1.7 KB of JSON with its token
MAX_INFLIGHT = 256
STATUS = {"bad_request": 400, "bad_nonce": 400, "bad_token": 401, "bad_signature": 401,
          "revoked": 403, "banned": 403, "rate_limited": 429, "full": 503}


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (port 0: any free one) -> (host, port); UsageError otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--http {value!r}: expected HOST:PORT, e.g. 0.0.0.0:8443")
    return host.strip("[]"), int(port)


def server_ssl(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The TLS context of ``--tls-cert``/``--tls-key`` (None: plain http)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise UsageError("--tls-cert and --tls-key go together (the certificate chain and its key)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: not a certificate and its key ({exc})") from None
    return ctx


def source_of(peer: str | None) -> str:
    """The rate-limit source of a peer address: the address, an IPv6 one by its /64."""
    try:
        ip = ipaddress.ip_address((peer or "").split("%", 1)[0])
    except ValueError:
        return "http:?"
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return f"http:{ip.ipv4_mapped}"
        return "http:" + str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return f"http:{ip}"


def _b64(value, field: str) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * MAX_REQUEST_BYTES:
        raise EnrolError("bad_request", f"field {field!r} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise EnrolError("bad_request", f"field {field!r} is not base64") from None


class EnrolHTTP:
    """The HTTP(S) endpoint of one :class:`~kvasir_bus.enrol.EnrolService`; ``start``/``stop``."""

    def __init__(self, service) -> None:
        self.service = service
        self.inflight = 0
        self._runner = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        from aiohttp import web

        @web.middleware
        async def one_line(request, handler):  # a bug is one log line and a 500, never a traceback
            try:
                return await handler(request)
            except web.HTTPException:
                raise
            except Exception as exc:
                log.error("enrol_http_failed", path=request.path, error=f"{type(exc).__name__}: {exc}"[:200])
                return self._answer({"error": "internal", "message": type(exc).__name__}, 500)

        app = web.Application(client_max_size=MAX_BODY, middlewares=[one_line])
        app.router.add_post(f"{HTTP_PATH}/hello", self._hello)
        app.router.add_post(f"{HTTP_PATH}/join", self._join)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, backlog=128)
        await site.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _answer(self, body: dict, status: int = 200):
        from aiohttp import web

        headers = {"Cache-Control": "no-store"}
        if status == 429:
            headers["Retry-After"] = "1"
        return web.json_response(body, status=status, headers=headers)

    def _refuse(self, exc: EnrolError):
        self.service._count(exc.code)
        return self._answer({"error": exc.code, "message": exc.detail[:200]}, STATUS.get(exc.code, 400))

    async def _hello(self, request):
        if self.inflight >= MAX_INFLIGHT:
            return self._refuse(EnrolError("full", "too many requests in flight"))
        try:
            nonce = self.service.hello(source_of(request.remote))
        except EnrolError as exc:
            return self._refuse(exc)
        return self._answer({"v": VERSION, "nonce": base64.b64encode(nonce).decode()})

    async def _join(self, request):
        if self.inflight >= MAX_INFLIGHT:
            return self._refuse(EnrolError("full", "too many requests in flight"))
        self.inflight += 1
        try:
            raw = await request.read()  # over MAX_BODY: aiohttp answers 413
            try:
                req = json.loads(raw)
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                raise EnrolError("bad_request", f"the body is not a JSON object: {exc}"[:160]) from None
            if req.get("v") != VERSION:
                raise EnrolError("bad_request", f"field 'v' must be {VERSION}")
            token = req.get("token")
            out = self.service.join_fields(
                _b64(req.get("nonce"), "nonce"), req.get("key"), _b64(req.get("box"), "box"),
                _b64(req.get("sig"), "sig"), token, source=source_of(request.remote))
        except EnrolError as exc:
            return self._refuse(exc)
        finally:
            self.inflight -= 1
        self.service._count("enrolled")
        return self._answer({"name": out["name"], "jwt": out["jwt"], "exp": out["exp"],
                             "reply_key": base64.b64encode(out["reply_key"]).decode(),
                             "nats": self.service.cfg.bus_url or self.service.url})


# -- the volunteer's side ---------------------------------------------------------------------------
async def enrol_http(base: str, token: str | None, seed: bytes | None = None, *, timeout: float = 10.0,
                     ssl_context: ssl.SSLContext | None = None) -> Enrolled:
    """Hello and join at the enrolment URL ``base`` (``https://HOST:PORT/enrol``): the identity
    of ``seed``'s key (a fresh one if None), with the bus URL to dial in ``bus_url``. The
    server's certificate is checked against the system's CAs (``$SSL_CERT_FILE`` for a private
    one) unless ``ssl_context`` says otherwise."""
    import aiohttp
    import nkeys
    from nacl.public import PrivateKey, SealedBox

    from kvasir_bus import jwt

    if token is None:
        raise UsageError("enrolling needs a token (the operator's join link, or kvasir enrol --open's)")
    seed = seed or jwt.new_keypair("user")[0]
    kp = nkeys.from_seed(bytearray(seed))
    box = PrivateKey.generate()
    tls = (ssl_context or ssl.create_default_context()) if base.startswith("https://") else None

    async def post(session, what: str, body: dict) -> dict:
        try:
            async with session.post(f"{base}/{what}", json=body, ssl=tls) as resp:
                try:
                    answer = await resp.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    answer = None
                if isinstance(answer, dict) and "error" in answer:
                    raise EnrolError(str(answer["error"]), str(answer.get("message", "")))
                if resp.status != 200 or not isinstance(answer, dict):
                    raise KvasirError(f"the enrolment service at {base} answered HTTP {resp.status} to {what}")
                return answer
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KvasirError(f"cannot reach the enrolment service at {base}: "
                              f"{exc or type(exc).__name__}"[:300]) from None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        hello = await post(session, "hello", {"v": VERSION})
        try:
            nonce = base64.b64decode(hello["nonce"], validate=True)
            pub = bytes(box.public_key)
            req = {"v": VERSION, "token": token, "nonce": hello["nonce"], "key": kp.public_key.decode(),
                   "box": base64.b64encode(pub).decode(),
                   "sig": base64.b64encode(kp.sign(JOIN_CONTEXT + nonce + pub)).decode()}
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise KvasirError(f"the enrolment service at {base} sent a malformed hello") from None
        out = await post(session, "join", req)
    try:
        return Enrolled(str(out["name"]), str(out["jwt"]), int(out["exp"]), seed,
                        SealedBox(box).decrypt(base64.b64decode(out["reply_key"], validate=True)),
                        bus_url=str(out["nats"]))
    except Exception:
        raise KvasirError(f"the enrolment service at {base} sent a malformed identity") from None
