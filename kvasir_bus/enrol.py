"""Enrolment: a volunteer gets its own short-lived worker identity from the bus, with no file
from the operator and no server reload (NATS decentralised auth, :mod:`kvasir_bus.creds`).

The operator runs ``kvasir enrol DIR`` beside the market (DIR: a JWT deployment) and hands out
an *enrolment token*: a bearer user JWT signed by the deployment's account whose only rights
are to ask for enrolment (publish ``kvasir._enrol.hello`` / ``.join``) and read its own inbox
``_INBOX_<token key>``. nats-server in operator mode admits no anonymous client at all
(``no_auth_user not compatible with Trusted Operator``), so the token is also what lets a
volunteer reach the service; with ``--open`` the service prints an *open* token that anyone may
use (a join link), rate-limited as one source, and never banned.

The flow (msgpack maps, one request/reply each):

1. ``hello`` ``{"v": 1}`` -> ``{"nonce": 32 bytes}``: ``unix time (8, big endian) || random (8)
   || HMAC-SHA256(service secret, time || random)[:16]``. Stateless: a flood of hellos costs one
   HMAC each and no memory.
2. ``join`` ``{"v": 1, "token": JWT or absent, "nonce", "key": user nkey public, "box": X25519
   public key (32 bytes), "sig": ed25519 signature by "key" over JOIN_CONTEXT || nonce || box}``
   -> ``{"name", "jwt", "exp", "reply_key": sealed box}``. Checked in order of cost: size, nonce
   MAC and age, nonce unused, rate limits (per source, per token, then per service), the token's signature
   (cached), the key's own signature, the revocation list. The JWT is a worker's rights
   (:func:`kvasir_bus.creds.permissions`) for node name ``v<12 characters of the key>``, the same
   name on every renewal, expiring after ``ttl_s``; ``reply_key`` (sealed to "box", only the
   volunteer opens it) is HMAC-SHA256(reply secret, REPLY_KEY_CONTEXT || name): the key the
   volunteer's replies are attributed with, which a backbone holding the reply secret derives
   from the node name alone.
3. Renewal is a join without a token over the worker's own connection (a worker may publish
   hello and join): a key enrolled before and not revoked gets a fresh JWT.

A quarantine verdict (``kvasir.*.quarantine``, signed by the deployment's backbone key) for an
enrolled node revokes its key in the account and pushes the account JWT to the server
(``$SYS.REQ.CLAIMS.UPDATE``): the server drops the connection and refuses the key from then on,
and a closed token that enrolled it is banned too (its holder cannot mint a fresh key with it).
The service then publishes the revocation on ``kvasir._enrol.revoked`` and answers
``kvasir._enrol.revocations`` with the most recent (a market lists them in its status).

The same hello and join run over HTTP(S) with ``--http`` (:mod:`kvasir_bus.enrol_http`); a
source is there the peer's address, here the sender's inbox (:meth:`EnrolService.bus_source`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import structlog

from kvasir_bus import creds, jwt, subjects
from kvasir_bus.connect import inbox_prefix_for
from kvasir_bus.enrol_wire import (HTTP_PATH, JOIN_CONTEXT, MAX_REQUEST_BYTES, VERSION,  # noqa: F401
                                   EnrolError, Enrolled)
from kvasir_bus.errors import KvasirError, UsageError

log = structlog.get_logger("kvasir.enrol")

REPLY_KEY_CONTEXT = b"kvasir-reply-v1\0"
TOKEN_TAG = "kvasir-enrol"
OPEN_TAG = "kvasir-enrol-open"
NONCE_TTL_S = 30
STATE = "trust/enrolled.json"  # key -> {name, token, at}; banned tokens
REPLY_SECRET = "trust/reply.key"  # 32 random bytes (hex): every enrolled node's reply key derives from it




# -- keys and tokens -------------------------------------------------------------------------------
def reply_secret(directory: str | os.PathLike) -> bytes:
    """The deployment's reply secret (created on first use, mode 0600): :func:`creds.reply_secret`,
    the same file ``kvasir creds`` derives its workers' reply keys from."""
    return creds.reply_secret(directory)


def reply_key(secret: bytes, node: str) -> bytes:
    """The HMAC key of node ``node``'s replies (:mod:`kvasir_bus.attribution`)."""
    from kvasir_bus.attribution import reply_key as derive

    return derive(secret, node)


def node_name(public_key: str) -> str:
    """The node name enrolment gives key ``public_key``: ``v`` and 12 of its characters."""
    return "v" + public_key[1:13].lower()


def make_token(directory: str | os.PathLike, *, ttl_s: int = 7 * 86400, open_: bool = False) -> str:
    """An enrolment token (a bearer user JWT, see the module doc), valid for ``ttl_s``."""
    dep = creds.load(directory)
    if dep.auth != "jwt":
        raise UsageError(f"{directory} is an nkey deployment: enrolment needs JWTs "
                         "(kvasir creds migrate OLD NEW)")
    _, public = jwt.new_keypair("user")  # a bearer token: nobody needs its seed
    perms = creds.permissions("guest", "guest", public)
    tag = OPEN_TAG if open_ else TOKEN_TAG
    return jwt.user_jwt(creds.trust_seed(directory, "account"), public, tag, perms,
                        expires=int(time.time()) + ttl_s, bearer=True, tags=[tag],
                        payload=MAX_REQUEST_BYTES, subs=4)


# -- limits ------------------------------------------------------------------------------------------
class Bucket:
    """A token bucket: ``rate`` per second, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.level, self.t = burst, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level < 1:
            return False
        self.level -= 1
        return True


class Buckets:
    """One bucket per key, at most ``cap`` keys (the least recently used goes first)."""

    def __init__(self, rate: float, burst: float, cap: int = 10_000):
        self.rate, self.burst, self.cap = rate, burst, cap
        self._b: OrderedDict[str, Bucket] = OrderedDict()

    def take(self, key: str) -> bool:
        b = self._b.pop(key, None) or Bucket(self.rate, self.burst)
        self._b[key] = b
        while len(self._b) > self.cap:
            self._b.popitem(last=False)
        return b.take()


@dataclass(frozen=True)
class EnrolConfig:
    directory: str
    ttl_s: int = 3600  # a worker JWT's lifetime; the worker renews it at half
    allow_open: bool = False  # accept the open token (anyone with the join link)
    per_token_rate: float = 2.0  # joins per second per token (burst per_token_burst)
    per_token_burst: float = 20.0
    rate: float = 50.0  # joins per second the service verifies at most, all sources together
    burst: float = 100.0
    max_nonces: int = 100_000  # used nonces remembered (NONCE_TTL_S each); beyond: refuse
    max_keys_per_token: int = 1000  # distinct keys one closed token may enrol
    per_source_rate: float = 2.0  # joins per second per source (an HTTP peer's address, a bus sender's inbox)
    per_source_burst: float = 20.0  # (hellos per source: 10x both)
    trust_backbones: tuple[str, ...] = ()  # quarantine verdicts signed by these count (default: DIR's backbone)
    bus_url: str = ""  # the bus URL an HTTP(S) enrolment's answer names (default: the one the service dials)


class EnrolService:
    """``kvasir enrol``: answers hello and join; revokes quarantined nodes' keys."""

    def __init__(self, cfg: EnrolConfig):
        self.cfg = cfg
        self.dir = Path(cfg.directory)
        dep = creds.load(self.dir)
        if dep.auth != "jwt":
            raise UsageError(f"{cfg.directory} is an nkey deployment: enrolment needs JWTs "
                             "(kvasir creds migrate OLD NEW)")
        self.account_seed = creds.trust_seed(self.dir, "account")
        self.account = jwt.public_of(self.account_seed)
        self.client_keys = dep.client_keys()
        self.backbones = cfg.trust_backbones or tuple(i.public_key for i in dep.identities if i.role == "backbone")
        self.secret = os.urandom(32)  # nonces: valid for this process only
        self.reply_secret = reply_secret(self.dir)
        self.state = self._load_state()
        self.nonces: OrderedDict[bytes, float] = OrderedDict()
        self.per_token = Buckets(cfg.per_token_rate, cfg.per_token_burst)
        self.per_source = Buckets(cfg.per_source_rate, cfg.per_source_burst)
        self.source_hellos = Buckets(cfg.per_source_rate * 10, cfg.per_source_burst * 10)
        self.all = Bucket(cfg.rate, cfg.burst)
        self.hellos = Bucket(cfg.rate * 20, cfg.burst * 20)
        self._tokens: OrderedDict[str, dict] = OrderedDict()  # verified token JWT -> claims
        self.counts: dict[str, int] = {}
        self.nc = self.op = None
        self._subs: list = []
        self.revoked_nodes: list[str] = []
        self.http = None  # the HTTP(S) endpoint, once start_http ran (kvasir_bus.enrol_http)
        self.url = ""

    # -- state --
    def _load_state(self) -> dict:
        path = self.dir / STATE
        if path.exists():
            return {"revoked": [], **json.loads(path.read_text())}
        return {"keys": {}, "banned": [], "revoked": []}

    def _save_state(self) -> None:
        path = self.dir / STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)

    def key_of(self, node: str) -> str | None:
        for key, rec in self.state["keys"].items():
            if rec["name"] == node:
                return key
        return None

    # -- the bus --
    async def start(self, url: str) -> "EnrolService":
        import nats

        seed, public = jwt.new_keypair("user")  # the service signs its own identity
        token = jwt.user_jwt(self.account_seed, public, "enrol",
                             creds.permissions("enrol", "enrol", public), expires=None)
        path = self.dir / "trust" / ".enrol.creds"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(jwt.creds_text(token, seed))
        self.nc = await nats.connect(url, user_credentials=str(path), name="kvasir-enrol",
                                     inbox_prefix=inbox_prefix_for(public), error_cb=_quiet,
                                     max_reconnect_attempts=-1)
        self.op = await nats.connect(url, user_credentials=str(self.dir / "operator.creds"),
                                     name="kvasir-enrol-operator", error_cb=_quiet,
                                     inbox_prefix=inbox_prefix_for(
                                         jwt.decode(jwt.read_creds_jwt(self.dir / "operator.creds"))["sub"]),
                                     max_reconnect_attempts=-1)
        self.url = url
        self._subs = [await self.nc.subscribe(subjects.ENROL_HELLO, cb=self._on_hello),
                      await self.nc.subscribe(subjects.ENROL_JOIN, cb=self._on_join),
                      await self.nc.subscribe(subjects.ALL_QUARANTINE, cb=self._on_quarantine),
                      await self.nc.subscribe(subjects.ENROL_REVOCATIONS, cb=self._on_revocations)]
        await self.nc.flush()
        log.info("enrol_started", ttl_s=self.cfg.ttl_s, open=self.cfg.allow_open,
                 enrolled=len(self.state["keys"]))
        return self

    async def start_http(self, host: str, port: int, ssl_context=None) -> int:
        """Serve enrolment over HTTP(S) too (:mod:`kvasir_bus.enrol_http`); the port bound."""
        from kvasir_bus.enrol_http import EnrolHTTP

        self.http = EnrolHTTP(self)
        return await self.http.start(host, port, ssl_context)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
            self.http = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs.clear()
        for nc in (self.nc, self.op):
            if nc is not None and not nc.is_closed:
                await nc.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    @staticmethod
    def bus_source(reply: str) -> str:
        """Who sends a request on the bus: the first token of its reply subject. Under creds
        that is ``_INBOX_<the sender's key>``, the only inbox it can read: a sender naming
        another's inbox never gets the nonce a join needs, so per-source hellos bound its joins."""
        return "bus:" + reply.split(".", 1)[0][:80]

    def hello(self, source: str) -> bytes:
        """A fresh nonce for ``source`` (EnrolError rate_limited: none now)."""
        if not self.source_hellos.take(source):
            raise EnrolError("rate_limited", "too many hellos from this source")
        if not self.hellos.take():
            raise EnrolError("rate_limited", "too many hellos")
        return self.new_nonce()

    async def _on_hello(self, msg) -> None:
        if not msg.reply:
            return
        try:
            nonce = self.hello(self.bus_source(msg.reply))
        except EnrolError as exc:
            self._count(exc.code)
            await msg.respond(_refusal(exc.code, exc.detail))
            return
        await msg.respond(msgpack.packb({"nonce": nonce}))

    def new_nonce(self) -> bytes:
        head = int(time.time()).to_bytes(8, "big") + os.urandom(8)
        return head + hmac.new(self.secret, head, hashlib.sha256).digest()[:16]

    async def _on_join(self, msg) -> None:
        if not msg.reply:
            return
        try:
            out = self.join(msg.data, self.bus_source(msg.reply))
            self._count("enrolled")
            await msg.respond(msgpack.packb(out))
        except EnrolError as exc:
            self._count(exc.code)
            await msg.respond(_refusal(exc.code, exc.detail))

    def join(self, data: bytes, source: str = "bus:?") -> dict:
        """One msgpack join request's answer (EnrolError: why not). Cheapest checks first."""
        if len(data) > MAX_REQUEST_BYTES:
            raise EnrolError("bad_request", f"request of {len(data)} bytes (at most {MAX_REQUEST_BYTES})")
        try:
            req = msgpack.unpackb(data, raw=False)
            if not isinstance(req, dict):
                raise ValueError("not a map")
            fields = req["nonce"], req["key"], req["box"], req["sig"], req.get("token")
        except Exception as exc:
            raise EnrolError("bad_request", f"not a join request: {exc}"[:160]) from None
        return self.join_fields(*fields, source=source)

    def join_fields(self, nonce, key, box, sig, token, *, source: str) -> dict:
        """The join of the module doc, from its decoded fields (the bus's msgpack or HTTP's
        JSON); ``source``: who asks (rate-limited before any signature is checked)."""
        if not (isinstance(nonce, bytes) and len(nonce) == 32 and isinstance(box, bytes)
                and len(box) == 32 and isinstance(sig, bytes) and len(sig) == 64
                and isinstance(key, str) and len(key) == 56 and key.startswith("U")
                and (token is None or isinstance(token, str) and len(token) < 2048)):
            raise EnrolError("bad_request", "not a join request: field types")
        now = time.time()
        head, mac = nonce[:16], nonce[16:]
        if not hmac.compare_digest(mac, hmac.new(self.secret, head, hashlib.sha256).digest()[:16]) \
                or not 0 <= now - int.from_bytes(head[:8], "big") <= NONCE_TTL_S:
            raise EnrolError("bad_nonce", "ask kvasir._enrol.hello for a fresh nonce")
        self._expire_nonces(now)
        if nonce in self.nonces:
            raise EnrolError("bad_nonce", "nonce used already")
        if len(self.nonces) >= self.cfg.max_nonces:
            raise EnrolError("full", "too many enrolments in flight")
        known = self.state["keys"].get(key)
        holder = token or f"renew:{key}"
        if not self.per_source.take(source):
            raise EnrolError("rate_limited", "too many joins from this source")
        # An open token is everyone's: over HTTP(S), where each address is a source of its own,
        # one address must not spend it for all (the per-source and service-wide limits bound it).
        # On the bus its holders share one inbox, so there per token is per source anyway.
        seen = self._tokens.get(token) if token is not None else None
        everyone = seen is not None and OPEN_TAG in seen.get("nats", {}).get("tags", []) \
            and source.startswith("http:")
        if not everyone and not self.per_token.take(hashlib.sha256(holder.encode()).hexdigest()):
            raise EnrolError("rate_limited", "too many joins for this token")
        if not self.all.take():
            raise EnrolError("rate_limited", "the service is busy")
        self.nonces[nonce] = now
        token_id = None
        if token is not None:
            claims = self._token_claims(token, now)
            token_id = claims["sub"]
            if token_id in self.state["banned"]:
                raise EnrolError("banned", "this token enrolled a node that was quarantined")
        elif known is None:
            raise EnrolError("bad_token", "a first enrolment needs a token")
        try:
            jwt.verify_key(key).verify(JOIN_CONTEXT + nonce + box, sig)
        except Exception:
            raise EnrolError("bad_signature", "the signature does not verify with that key") from None
        if key in creds.revocations(self.dir):
            raise EnrolError("revoked", "this key was revoked (quarantined)")
        if known is None:
            if token_id is not None and OPEN_TAG not in claims.get("nats", {}).get("tags", []):
                used = sum(1 for r in self.state["keys"].values() if r.get("token") == token_id)
                if used >= self.cfg.max_keys_per_token:
                    raise EnrolError("full", "this token has enrolled as many keys as it may")
            name = node_name(key)
            if self.key_of(name) is not None:
                raise EnrolError("bad_request", "that key's node name is taken")
            known = self.state["keys"][key] = {"name": name, "token": token_id, "at": int(now)}
            self._save_state()
        name = known["name"]
        exp = int(now) + self.cfg.ttl_s
        user = jwt.user_jwt(self.account_seed, key, name,
                            creds.permissions("worker", name, key, self.client_keys), expires=exp)
        from nacl.public import PublicKey, SealedBox

        sealed = SealedBox(PublicKey(box)).encrypt(reply_key(self.reply_secret, name))
        log.info("enrolled", node=name, renewal=token is None, exp=exp)
        return {"name": name, "jwt": user, "exp": exp, "reply_key": bytes(sealed)}

    def _expire_nonces(self, now: float) -> None:
        while self.nonces:
            nonce, t = next(iter(self.nonces.items()))
            if now - t <= NONCE_TTL_S:
                break
            self.nonces.popitem(last=False)

    def _token_claims(self, token: str, now: float) -> dict:
        claims = self._tokens.get(token)
        if claims is None:
            try:
                claims = jwt.decode(token)
            except ValueError as exc:
                raise EnrolError("bad_token", str(exc)) from None
            tags = claims.get("nats", {}).get("tags", [])
            if claims.get("iss") != self.account or not ({TOKEN_TAG, OPEN_TAG} & set(tags)):
                raise EnrolError("bad_token", "not an enrolment token of this deployment")
            self._tokens[token] = claims
            while len(self._tokens) > 1000:
                self._tokens.popitem(last=False)
        if claims.get("exp") and claims["exp"] < now:
            raise EnrolError("bad_token", "the token has expired")
        if OPEN_TAG in claims.get("nats", {}).get("tags", []) and not self.cfg.allow_open:
            raise EnrolError("bad_token", "open enrolment is off (kvasir enrol --open)")
        return claims

    # -- quarantine locks the door --
    async def _on_quarantine(self, msg) -> None:
        from kvasir_bus import market_codec as mc
        from kvasir_bus.signing import SignatureError, Verifier

        try:
            Verifier(self.backbones).check(msg.data, msg.headers)
            event = mc.decode_quarantine(msg.data)
        except (SignatureError, ValueError, KvasirError) as exc:
            self._count("quarantine_refused")
            log.debug("quarantine_refused", error=str(exc)[:120])
            return
        why = (f"quarantined: its reply for layer {event.layer} expert {event.expert} failed an "
               f"audit (error {event.error:.3g})")
        await self.revoke_node(event.node, why, event.model)

    async def _on_revocations(self, msg) -> None:
        from kvasir_bus import market_codec as mc

        if msg.reply:
            await msg.respond(mc.RevocationList(self.revocations()).encode())

    def revocations(self) -> tuple:
        """The most recent revocations (:class:`kvasir_bus.market_codec.Revocation`), oldest first."""
        from kvasir_bus import market_codec as mc

        return tuple(mc.Revocation(**r) for r in self.state["revoked"][-mc.MAX_REVOKED_LISTED:])

    async def revoke_node(self, node: str, why: str = "revoked by the operator", model: str = "") -> bool:
        """Revoke the enrolled key of ``node``, push the account JWT and tell the market
        (``kvasir._enrol.revoked``); False if ``node`` was not enrolled here (a fixed identity:
        the operator revokes it by hand)."""
        from kvasir_bus import market_codec as mc

        key = self.key_of(node)
        if key is None or key in creds.revocations(self.dir):
            return False
        token = self.state["keys"][key].get("token")
        account = creds.revoke(self.dir, key)
        if token and token not in self.state["banned"]:
            claims = next((c for c in self._tokens.values() if c.get("sub") == token), {})
            if OPEN_TAG not in claims.get("nats", {}).get("tags", []):
                self.state["banned"].append(token)
                self._save_state()
        self.revoked_nodes.append(node)
        answer = await creds.push_account(self.op, account)
        event = mc.Revocation(node=node, key=key, at=time.time(), why=why[:200], model=model)
        self.state["revoked"].append(event.body() | {"model": model})
        del self.state["revoked"][:-mc.MAX_REVOKED_LISTED]
        self._save_state()
        await self.nc.publish(subjects.ENROL_REVOKED, event.encode(), headers=mc.headers_for(event))
        log.warning("node_revoked", node=node, why=why, server=str(answer)[:120])
        return True


def _refusal(code: str, message: str) -> bytes:
    return msgpack.packb({"error": code, "message": message[:200]})


async def _quiet(exc):
    pass


# -- the volunteer's side ---------------------------------------------------------------------------
async def request_identity(nc, seed: bytes, token: str | None, timeout: float = 5.0) -> Enrolled:
    """Hello and join over ``nc`` (a guest connection with ``token``, or the worker's own for a
    renewal): the identity of ``seed``'s key."""
    import nkeys
    from nacl.public import PrivateKey, SealedBox

    box = PrivateKey.generate()
    hello = msgpack.unpackb((await nc.request(subjects.ENROL_HELLO, msgpack.packb({"v": VERSION}),
                                               timeout=timeout)).data, raw=False)
    _raise_refusal(hello)
    kp = nkeys.from_seed(bytearray(seed))
    key = kp.public_key.decode()
    nonce = hello["nonce"]
    req = {"v": VERSION, "nonce": nonce, "key": key, "box": bytes(box.public_key),
           "sig": kp.sign(JOIN_CONTEXT + nonce + bytes(box.public_key))}
    if token is not None:
        req["token"] = token
    out = msgpack.unpackb((await nc.request(subjects.ENROL_JOIN, msgpack.packb(req),
                                             timeout=timeout)).data, raw=False)
    _raise_refusal(out)
    return Enrolled(out["name"], out["jwt"], int(out["exp"]), seed,
                    SealedBox(box).decrypt(out["reply_key"]))


def _raise_refusal(answer: dict) -> None:
    if "error" in answer:
        raise EnrolError(str(answer["error"]), str(answer.get("message", "")))


async def guest_connect(url: str, token: str, **kw):
    """A connection as an enrolment token's holder (a bearer JWT: no seed, no signature)."""
    import nats

    claims = jwt.decode(token, verify=False)
    return await nats.connect(url, user_jwt_cb=lambda: bytearray(token.encode()),
                              signature_cb=lambda nonce: b"", inbox_prefix=inbox_prefix_for(claims["sub"]),
                              allow_reconnect=False, max_reconnect_attempts=0, **kw)


async def enrol(url: str, token: str | None, seed: bytes | None = None, timeout: float = 5.0) -> Enrolled:
    """Enrol a fresh key (or ``seed``'s) with ``token`` at the bus ``url``."""
    if token is None:
        raise UsageError("enrolling needs a token (the operator's join link, or kvasir enrol --open's)")
    seed = seed or jwt.new_keypair("user")[0]
    try:
        if not isinstance(jwt.decode(token, verify=False).get("sub"), str):
            raise ValueError("no subject")
    except ValueError as exc:
        raise UsageError(f"the join link's token is not an enrolment token ({exc})") from None
    try:
        nc = await guest_connect(url, token, connect_timeout=timeout)
    except Exception as exc:
        raise KvasirError(f"cannot reach NATS at {url} with the enrolment token: {exc or type(exc).__name__}") from None
    try:
        return await request_identity(nc, seed, token, timeout)
    except (asyncio.TimeoutError, Exception) as exc:
        if isinstance(exc, KvasirError):
            raise
        raise KvasirError(f"no enrolment service answered at {url}: {type(exc).__name__}") from None
    finally:
        await nc.close()


def split_link(link: str) -> tuple[str, str | None]:
    """``nats://host:4222#TOKEN`` or ``https://host:8443/enrol#TOKEN`` (a join link) -> (URL,
    token); a bare URL -> (URL, None)."""
    url, _, token = link.partition("#")
    return url, token or None


def is_http(url: str) -> bool:
    return url.startswith(("https://", "http://"))


async def enrol_link(url: str, token: str | None, seed: bytes | None = None, timeout: float = 10.0) -> Enrolled:
    """Enrol at a join link's URL: over the bus (``nats://``, ``tls://``, ``ws(s)://``) or over
    HTTP(S) (``https://HOST:PORT/enrol``, :mod:`kvasir_bus.enrol_http`); ``bus_url`` of the
    answer is the bus to serve on either way."""
    if is_http(url):
        from kvasir_bus.enrol_http import enrol_http

        return await enrol_http(url.rstrip("/"), token, seed, timeout=timeout)
    me = await enrol(url, token, seed, timeout=min(timeout, 5.0))
    me.bus_url = url
    return me


# -- kvasir enrol ----------------------------------------------------------------------------------
def register(subparsers) -> None:
    import argparse

    p = subparsers.add_parser(
        "enrol", help="sign short-lived worker identities for volunteers (beside the market)",
        description="The enrolment service of a JWT deployment (kvasir creds init DIR): a "
        "volunteer holding an enrolment token proves it holds a fresh nkey (it signs a server "
        "nonce) and gets a worker JWT for its own node name, bundle subject and inbox, expiring "
        "after --ttl, which it renews while serving. No server reload, no file copied. A node "
        "the backbone quarantines (a signed verdict) has its key revoked: the server drops it "
        "and refuses it. --token prints a join link (nats://HOST:PORT#TOKEN) and exits. With --http "
        "the same flow runs over HTTP(S) as well (join links https://HOST:PORT/enrol#TOKEN).",
        epilog="examples: kvasir enrol /etc/kvasir --token --url nats://bus.example:4222\n"
        "          kvasir enrol /etc/kvasir --nats nats://127.0.0.1:4222 --open\n"
        "          kvasir enrol /etc/kvasir --http 0.0.0.0:8443 --tls-cert fullchain.pem --tls-key privkey.pem "
        "--bus-url tls://bus.example:4222\n"
        "          kvasir enrol /etc/kvasir --token --url https://enrol.example:8443/enrol\n"
        "          kvasir worker --enrol 'nats://bus.example:4222#eyJ0...' --budget 340MB --source URL",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="a JWT deployment (kvasir creds init)")
    p.add_argument("--nats", metavar="URL", default=None, help="the bus (default $NATS_URL)")
    p.add_argument("--token", action="store_true", help="print a new enrolment link and exit")
    p.add_argument("--url", metavar="URL", default=None,
                   help="with --token: the URL volunteers enrol at, a bus URL or an HTTPS one "
                   "(https://HOST:PORT/enrol; default --nats)")
    p.add_argument("--token-days", type=float, default=7.0, metavar="D",
                   help="with --token: days the token stays valid (default 7)")
    p.add_argument("--open", action="store_true",
                   help="admit anyone: print an open join link (rate-limited as one source) and "
                   "accept it")
    p.add_argument("--ttl", type=int, default=3600, metavar="S",
                   help="seconds a worker JWT lives (renewed at half; default 3600)")
    p.add_argument("--rate", type=float, default=50.0, metavar="N",
                   help="joins per second verified at most, all sources together (default 50)")
    p.add_argument("--per-token-rate", type=float, default=2.0, metavar="N",
                   help="joins per second per token (burst 10x; default 2)")
    p.add_argument("--per-source-rate", type=float, default=2.0, metavar="N",
                   help="joins per second per source: an HTTP(S) peer's address (an IPv6 /64), a bus "
                   "sender's inbox (burst 10x, hellos 10x that; default 2)")
    h = p.add_argument_group("enrolment over HTTP(S), beside the bus")
    h.add_argument("--http", metavar="HOST:PORT", default=None,
                   help="also serve POST /enrol/hello and /enrol/join here (port 0: any free port); "
                   "join links for it: --token --url https://HOST:PORT/enrol")
    h.add_argument("--tls-cert", metavar="FILE", default=None, help="with --http: serve https with this certificate chain")
    h.add_argument("--tls-key", metavar="FILE", default=None, help="with --http: the certificate's private key")
    h.add_argument("--bus-url", metavar="URL", default=None,
                   help="with --http: the bus URL an enrolled volunteer is told to dial (default --nats)")
    p.set_defaults(func=cmd_enrol)


def cmd_enrol(args) -> int:
    import sys

    from kvasir_bus.connect import resolve_url
    from kvasir_bus.logs import configure

    for flag, value in (("--ttl", args.ttl), ("--rate", args.rate), ("--per-token-rate", args.per_token_rate),
                        ("--per-source-rate", args.per_source_rate), ("--token-days", args.token_days)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    url = resolve_url(args.nats)
    if args.token:
        token = make_token(args.dir, ttl_s=int(args.token_days * 86400))
        print(f"{link_base(args.url) if args.url else resolve_url(args.nats)}#{token}")
        return 0
    listen = ssl_context = None
    if args.http is not None:
        from kvasir_bus.enrol_http import parse_listen, server_ssl

        listen = parse_listen(args.http)
        ssl_context = server_ssl(args.tls_cert, args.tls_key)
    elif args.tls_cert or args.tls_key or args.bus_url:
        raise UsageError("--tls-cert, --tls-key and --bus-url go with --http HOST:PORT")
    bus_url = resolve_url(args.bus_url) if args.bus_url else ""
    configure("info")
    cfg = EnrolConfig(args.dir, ttl_s=args.ttl, allow_open=args.open, rate=args.rate, burst=2 * args.rate,
                      per_token_rate=args.per_token_rate, per_token_burst=10 * args.per_token_rate,
                      per_source_rate=args.per_source_rate, per_source_burst=10 * args.per_source_rate,
                      bus_url=bus_url)
    service = EnrolService(cfg)
    if args.open:
        print(f"open join link: {url}#{make_token(args.dir, open_=True)}", file=sys.stderr)

    async def run() -> int:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await service.start(url)
        except Exception as exc:
            raise KvasirError(f"cannot reach NATS at {url} as the enrolment service: {exc or type(exc).__name__}") from None
        try:
            if listen is not None:
                try:
                    port = await service.start_http(*listen, ssl_context)
                except OSError as exc:
                    raise KvasirError(f"--http {args.http}: cannot listen: {exc.strerror or exc}") from None
                scheme = "https" if ssl_context is not None else "http"
                where = f"{scheme}://{listen[0]}:{port}{HTTP_PATH}"
                print(f"enrolment over {scheme}: {where}", file=sys.stderr, flush=True)
                if args.open:
                    print(f"open join link: {where}#{make_token(args.dir, open_=True)}", file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            await service.stop()
        return 0

    return asyncio.run(run())




def link_base(url: str) -> str:
    """What goes before ``#TOKEN`` in a join link: a bus URL, or an http(s) enrolment URL."""
    from urllib.parse import urlsplit

    from kvasir_bus.connect import resolve_url

    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        if not parts.hostname or parts.query or parts.fragment:
            raise UsageError(f"enrolment URL {url!r}: expected https://HOST:PORT{HTTP_PATH}")
        return url.rstrip("/")
    return resolve_url(url)
