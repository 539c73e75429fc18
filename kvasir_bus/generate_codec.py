"""Wire records of the bus generation API: text generation without HTTP.

A client publishes a :class:`GenerateRequest` on ``kvasir.<model>.generate`` with a reply
inbox it has subscribed to. Every backbone serving the model listens in one NATS queue group,
so exactly one of them takes the request (a second backbone adds capacity with no
configuration). That backbone streams one :class:`GenerateToken` per generated token to the
inbox, in order (``index`` 0, 1, ...), then one :class:`GenerateDone` with the finish reason
and the token counts; or an ``e`` :class:`~kvasir_bus.wire.ErrorReply` instead (a request that
cannot run, a full queue: code ``overloaded``, an engine failure). With nobody serving the
model, the NATS server answers the inbox with a ``Status: 503`` header (no responders).

A client that leaves frees its sequence at the backbone's next engine step, either way:

* it says so: a :class:`GenerateCancel` with the request id on ``kvasir.<model>.generate.cancel``
  (every backbone of the model hears it; the one holding the request drops it, queued or
  running; the others ignore it). The request id is the capability: only the client and the
  backbone (and observers) ever see it.
* it just goes (disconnects, or unsubscribes its inbox): the backbone publishes every token
  with a reply subject of its own, so once nobody listens on the inbox the NATS server answers
  that reply subject with ``Status: 503`` (no responders), and the backbone drops the stream.

Messages (``t``):

* ``gq`` :class:`GenerateRequest` client -> backbone on ``kvasir.<model>.generate``
* ``gt`` :class:`GenerateToken`   backbone -> client inbox, one per token
* ``gd`` :class:`GenerateDone`    backbone -> client inbox, the last message
* ``e``  :class:`~kvasir_bus.wire.ErrorReply` backbone -> client inbox, instead of ``gd``
* ``gc`` :class:`GenerateCancel`  client -> every backbone on ``kvasir.<model>.generate.cancel``

The prompt is either token ids or text (the backbone tokenizes it, with its BOS); never both.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from kvasir_bus.wire import (  # noqa: F401 (the names callers know generate_codec by)
    DEFAULT_MAX_BYTES, ERR_BAD_REQUEST, ERR_INTERNAL, ERR_OVERLOADED, MAX_ERROR_MESSAGE, NO_LIMITS, CodecError,
    ErrorReply, Limits, Record, check_bool, check_float, check_id, check_int, check_node,
    check_str, decode, encode, fail, headers_for, need, record)

MAX_PROMPT_TOKENS = 1 << 20
MAX_PROMPT_CHARS = 4 << 20
MAX_NEW_TOKENS = 1 << 20
MAX_PIECE_CHARS = 4096  # one token's text (a token is at most a few hundred bytes)
FINISH_REASONS = ("stop", "length")
GENERATE_MAX_BYTES = 8 << 20  # a request; every reply is far smaller
_HASH_RE = re.compile(r"(?:[0-9a-f]{64})?")


def cancel_hash(token: str) -> str:
    """The ``cancel_hash`` a request carries for the secret ``token`` (sha256 of its UTF-8, hex)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_cancel_token() -> tuple[str, str]:
    """A fresh secret and its hash: ``(token, cancel_hash)``."""
    token = secrets.token_hex(16)
    return token, cancel_hash(token)
#: The NATS queue group every backbone serves ``kvasir.<model>.generate`` in (the
#: ``kvasir creds`` config lets a backbone subscribe to generate in this group only).
GENERATE_QUEUE = "kvasir-backbones"


@record
@dataclass(frozen=True)
class GenerateRequest(Record):
    """Generate up to ``max_tokens`` after ``prompt_ids`` or ``prompt_text``.

    Sampling as in :mod:`backbone.sampling`: ``temperature`` 0 is greedy; ``top_p`` in
    (0, 1]; ``seed`` makes a sampled stream reproducible. ``stop_on_eos`` False runs to
    ``max_tokens`` whatever the model says (llama-server's ``ignore_eos``)."""

    kind: ClassVar[str] = "gq"
    what: ClassVar[str] = "generate request"

    request_id: str
    prompt_ids: tuple[int, ...] = ()
    prompt_text: str = ""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_on_eos: bool = True
    # sha256 (hex) of a secret the client keeps: only a cancel that carries the secret drops
    # this request (empty: no cancel message can; the client leaving still ends it)
    cancel_hash: str = ""
    # the secret itself, kept by the client that made the request; never on the wire
    cancel_token: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        r, s = self.what, lambda name, value: object.__setattr__(self, name, value)
        check_id(r, "request_id", self.request_id)
        check_str(r, "cancel_hash", self.cancel_hash, _HASH_RE, max_len=64, what="64 lower-case hex digits")
        ids = self.prompt_ids
        if not isinstance(ids, (list, tuple)):
            raise fail(r, "prompt_ids", f"must be a list of token ids, got {type(ids).__name__}")
        if len(ids) > MAX_PROMPT_TOKENS:
            raise fail(r, "prompt_ids", f"has {len(ids)} tokens (max {MAX_PROMPT_TOKENS})")
        s("prompt_ids", tuple(check_int(r, "prompt_ids", t, 0, (1 << 31) - 1) for t in ids))
        check_str(r, "prompt_text", self.prompt_text, max_len=MAX_PROMPT_CHARS)
        if bool(self.prompt_ids) == bool(self.prompt_text):
            raise fail(r, "prompt_ids", "and prompt_text: exactly one must be given (and not empty)")
        s("max_tokens", check_int(r, "max_tokens", self.max_tokens, 1, MAX_NEW_TOKENS))
        temperature = check_float(r, "temperature", self.temperature)
        if temperature > 2.0:
            raise fail(r, "temperature", f"must be in [0, 2], got {temperature}")
        s("temperature", temperature)
        top_p = check_float(r, "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise fail(r, "top_p", f"must be in (0, 1], got {top_p}")
        s("top_p", top_p)
        s("seed", check_int(r, "seed", self.seed, 0, (1 << 64) - 1))
        s("stop_on_eos", check_bool(r, "stop_on_eos", self.stop_on_eos))

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
                "prompt_text": self.prompt_text, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "stop_on_eos": self.stop_on_eos, **({"cancel_hash": self.cancel_hash} if self.cancel_hash else {})}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> GenerateRequest:
        return cls(**{f: need(body, cls.what, f) for f in (
            "request_id", "prompt_ids", "prompt_text", "max_tokens", "temperature", "top_p", "seed",
            "stop_on_eos")}, cancel_hash=body.get("cancel_hash", ""))

    def may_cancel(self, token: str) -> bool:
        """Whether a cancel carrying ``token`` is this request's own (constant-time compare)."""
        return bool(self.cancel_hash) and hmac.compare_digest(cancel_hash(token), self.cancel_hash)

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Request": self.request_id, "Kvasir-Max-Tokens": str(self.max_tokens)}


@record
@dataclass(frozen=True)
class GenerateToken(Record):
    """Token number ``index`` of the stream (0-based) and the text it completes ("" while a
    multi-byte character is still incomplete)."""

    kind: ClassVar[str] = "gt"
    what: ClassVar[str] = "generated token"

    request_id: str
    index: int
    token: int
    text: str = ""

    def __post_init__(self) -> None:
        r = self.what
        check_id(r, "request_id", self.request_id)
        object.__setattr__(self, "index", check_int(r, "index", self.index, 0, MAX_NEW_TOKENS))
        object.__setattr__(self, "token", check_int(r, "token", self.token, 0, (1 << 31) - 1))
        check_str(r, "text", self.text, max_len=MAX_PIECE_CHARS)

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "index": self.index, "token": self.token, "text": self.text}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> GenerateToken:
        return cls(**{f: need(body, cls.what, f) for f in ("request_id", "index", "token", "text")})

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Request": self.request_id}


@record
@dataclass(frozen=True)
class GenerateDone(Record):
    """The end of a stream: why it ended (``stop``: end-of-sequence token; ``length``:
    ``max_tokens``), the usage counts, and which backbone ``node`` served it. ``text``: what the
    stream's end completes, a character cut short by the last token as U+FFFD (usually "")."""

    kind: ClassVar[str] = "gd"
    what: ClassVar[str] = "generation done"

    request_id: str
    node: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""

    def __post_init__(self) -> None:
        r = self.what
        check_id(r, "request_id", self.request_id)
        check_node(r, "node", self.node)
        if self.finish_reason not in FINISH_REASONS:
            raise fail(r, "finish_reason", f"is {self.finish_reason!r}, expected one of {', '.join(FINISH_REASONS)}")
        object.__setattr__(self, "prompt_tokens", check_int(r, "prompt_tokens", self.prompt_tokens))
        object.__setattr__(self, "completion_tokens", check_int(r, "completion_tokens", self.completion_tokens))
        check_str(r, "text", self.text, max_len=MAX_PIECE_CHARS)

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "node": self.node, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                **({"text": self.text} if self.text else {})}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> GenerateDone:
        return cls(**{f: need(body, cls.what, f) for f in (
            "request_id", "node", "finish_reason", "prompt_tokens", "completion_tokens")},
            text=body.get("text", ""))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Request": self.request_id, "Kvasir-Node": self.node,
                "Kvasir-Finish": self.finish_reason}


@record
@dataclass(frozen=True)
class GenerateCancel(Record):
    """Drop the stream of ``request_id`` (queued or running); no reply. Idempotent: a
    backbone that does not hold the request, or has finished it, ignores it."""

    kind: ClassVar[str] = "gc"
    what: ClassVar[str] = "generate cancel"

    request_id: str
    token: str = ""  # the secret whose sha256 the request carried as cancel_hash

    def __post_init__(self) -> None:
        check_id(self.what, "request_id", self.request_id)
        check_str(self.what, "token", self.token, max_len=128)

    def body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, **({"token": self.token} if self.token else {})}

    @classmethod
    def from_body(cls, body: dict, limits: Limits = NO_LIMITS) -> GenerateCancel:
        return cls(need(body, cls.what, "request_id"), body.get("token", ""))

    def headers(self) -> dict[str, str]:
        return {"Kvasir-Request": self.request_id}


def decode_generate_cancel(data: bytes) -> GenerateCancel:
    """Bytes -> :class:`GenerateCancel`."""
    return decode(data, ("gc",), GenerateCancel.what, max_bytes=4096)


def decode_generate_request(data: bytes, *, max_bytes: int = GENERATE_MAX_BYTES) -> GenerateRequest:
    """Bytes -> :class:`GenerateRequest`."""
    return decode(data, ("gq",), GenerateRequest.what, max_bytes=max_bytes)


def decode_generate_reply(data: bytes, *, max_bytes: int = 64 * 1024
                          ) -> Union[GenerateToken, GenerateDone, ErrorReply]:
    """Bytes -> one message of a generation stream: a token, the end, or a refusal."""
    return decode(data, ("gt", "gd", "e"), "generate reply", max_bytes=max_bytes)
