"""``kvasir tap``: the bus traffic as one readable line per message.

What ``nats sub 'kvasir.>'`` shows, decoded: the time, the subject, the Kvasir headers, and a
summary of the payload::

    12:00:01.234 kvasir.0123456789abcdef.x.3.17 {layer=3 expert=17 rows=4} req x.3.17 rows=4 f32 id=1a

Every message type of the bus is decoded (dispatch requests, replies and errors, heartbeats,
manifests, volunteering, routing statistics, demand, ledger, status, and the generate API's
requests, tokens, ends and cancels: prompts and token texts cut short, each on one line, control
characters escaped). A payload that is not a
Kvasir message prints its size and a hex prefix; one that claims to be but does not validate
prints why. :func:`summarize` never raises.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgpack

from kvasir_bus import codec, generate_codec as gc, market_codec as mc, wire
from market.show import holdings_text, size

_DTYPE = {"float32": "f32", "float16": "f16"}
_HEX = 16


def _raw(data: bytes) -> str:
    if not data:
        return "(empty)"
    prefix = bytes(data[:_HEX]).hex()
    return f"{len(data)} bytes {prefix}{'...' if len(data) > _HEX else ''}"


def _short(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _text(text: str, n: int = 40) -> str:
    """A prompt or token text as one bounded, quoted line: ``"a\\nb"``."""
    quoted = repr(text[:n + 1])[1:-1]
    return f'"{quoted[:n]}{"..." if len(quoted) > n else ""}"'


def _summary(msg: Any) -> str:
    if isinstance(msg, gc.GenerateRequest):
        prompt = (f"prompt={len(msg.prompt_ids)} ids" if msg.prompt_ids
                  else f"prompt={_text(msg.prompt_text)} ({len(msg.prompt_text)} chars)")
        sampling = "greedy" if msg.temperature == 0 else f"t={msg.temperature:g} top_p={msg.top_p:g} seed={msg.seed}"
        eos = "" if msg.stop_on_eos else " ignore_eos"
        return f"generate {prompt} max={msg.max_tokens} {sampling}{eos} id={msg.request_id}"
    if isinstance(msg, gc.GenerateToken):
        return f"token #{msg.index} {msg.token} {_text(msg.text, 24)} id={msg.request_id}"
    if isinstance(msg, gc.GenerateDone):
        return (f"generate-done node={msg.node} finish={msg.finish_reason} prompt={msg.prompt_tokens} "
                f"completion={msg.completion_tokens} id={msg.request_id}")
    if isinstance(msg, gc.GenerateCancel):
        return f"generate-cancel id={msg.request_id}"
    if isinstance(msg, codec.DispatchRequest):
        return (f"req x.{msg.layer}.{msg.expert} rows={msg.rows.shape[0]} "
                f"{_DTYPE.get(msg.rows.dtype.name, msg.rows.dtype.name)} id={msg.request_id}")
    if isinstance(msg, codec.DispatchReply):
        return (f"reply node={msg.node} rows={msg.rows.shape[0]} "
                f"{_DTYPE.get(msg.rows.dtype.name, msg.rows.dtype.name)} id={msg.request_id}")
    if isinstance(msg, codec.BundleRequest):
        calls = " ".join(f"{e}x{n}" for e, n in zip(msg.experts[:8], msg.counts[:8]))
        more = f" +{len(msg.ids) - 8}" if len(msg.ids) > 8 else ""
        return (f"bundle L{msg.layer} calls={len(msg.ids)} [{calls}{more}] rows={msg.rows.shape[0]} "
                f"{_DTYPE.get(msg.rows.dtype.name, msg.rows.dtype.name)} id={msg.bundle_id}")
    if isinstance(msg, codec.BundleReply):
        codes = sorted({code for _, code, _ in msg.errors})
        errors = f" errors={len(msg.errors)}({','.join(codes[:4])})" if msg.errors else ""
        return f"bundle-reply node={msg.node} answered={len(msg.ids)} rows={msg.rows.shape[0]}{errors} id={msg.bundle_id}"
    if isinstance(msg, codec.ErrorReply):
        rid = f" id={msg.request_id}" if msg.request_id else ""
        return f"error node={msg.node} code={msg.code}{rid} \"{_short(msg.message)}\""
    if isinstance(msg, codec.Heartbeat):
        return (f"heartbeat node={msg.node} holds {holdings_text(msg.holdings, 4)} "
                f"budget={size(msg.budget_bytes)} load={msg.load:g} served={msg.served} "
                f"v{msg.version} {msg.kernel}")
    if isinstance(msg, mc.Manifest):
        return (f"manifest {msg.arch} layers={msg.n_layer} experts={msg.n_expert} "
                f"slabs={len(msg.slabs)} file={size(msg.file_bytes)}")
    if isinstance(msg, mc.VolunteerRequest):
        return f"volunteer node={msg.node} budget={size(msg.budget_bytes)}"
    if isinstance(msg, mc.Assignment):
        return (f"assignment node={msg.node} holds {holdings_text(msg.holdings, 4)} "
                f"({size(msg.bytes)}) rate={msg.reward_rate:.3f}")
    if isinstance(msg, mc.RoutingStats):
        fb = "" if msg.fallback_rate is None else f" fallback={100 * msg.fallback_rate:.1f}%"
        rows = sum(h[2] for h in msg.hits)
        return (f"routing node={msg.node} window={msg.window_s:g}s experts={len(msg.hits)} "
                f"rows={rows}{fb}")
    if isinstance(msg, mc.DemandMap):
        short = [e for e in msg.entries if e.missing]
        top = max(msg.entries, key=lambda e: (e.replicas == 0, e.demand), default=None)
        hot = (f" top={top.holding}({top.replicas}/{top.target} "
               f"d={top.demand:.2f})") if top is not None and top.demand > 0 else ""
        return (f"demand ranges={len(msg.entries)} holes={len(msg.holes)} "
                f"short={len(short)}{hot}")
    if isinstance(msg, mc.LedgerBatch):
        return (f"ledger batch={msg.batch_id} source={msg.source} events={len(msg.events)} "
                f"rows={sum(e.rows for e in msg.events)}")
    if isinstance(msg, mc.LedgerAck):
        return f"ledger-ack batch={msg.batch_id} accepted={msg.accepted} dup={msg.duplicates}"
    if isinstance(msg, mc.MarketStatus):
        return (f"status model={msg.model} nodes={len(msg.nodes)} ranges={len(msg.demand)} "
                f"holes={sum(1 for e in msg.demand if e.replicas == 0)}")
    if isinstance(msg, mc.MarketOverview):
        return f"overview models={len(msg.models)}"
    return type(msg).__name__


_BIG = 1 << 30  # tap shows what flows; size limits are the receivers' business


def summarize_payload(data: bytes) -> str:
    """One-line summary of any payload; never raises."""
    try:
        data = bytes(data or b"")
        if not data:
            return "(empty)"
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:
            return _raw(data)
        kind = body.get("t") if isinstance(body, dict) else None
        if not isinstance(kind, str) or kind not in wire.RECORDS:
            return f"? {_raw(data)}"
        try:
            return _summary(wire.decode_any(data, max_bytes=_BIG))
        except codec.CodecError as exc:
            return f"invalid {kind!r}: {_short(exc, 120)} | {_raw(data)}"
    except Exception as exc:  # a summary must never take the tap down
        return f"? ({type(exc).__name__}) {_raw(data or b'')}"


def headers_text(headers: dict[str, str] | None) -> str:
    """``{layer=3 expert=17}``: Kvasir headers without prefix, version, kind and model (the
    subject and the summary say those); others as they are."""
    if not headers:
        return ""
    parts = []
    for key, value in headers.items():
        if key in ("Kvasir-Version", "Kvasir-Kind", "Kvasir-Model"):  # the line shows them already
            continue
        name = key[len("Kvasir-"):].lower() if key.startswith("Kvasir-") else key
        parts.append(f"{name}={_short(value, 40)}")
    return "{" + " ".join(parts) + "}" if parts else ""


def line(subject: str, headers: dict[str, str] | None, data: bytes,
         at: float | None = None) -> str:
    """The tap's line for one message."""
    t = time.time() if at is None else at
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    try:
        head = headers_text(headers)
    except Exception:
        head = "{?}"
    return " ".join(p for p in (stamp, subject, head, summarize_payload(data)) if p)


async def tap(nc: Any, subject: str, emit: Callable[[str], None], *, count: int | None = None,
              duration: float | None = None, ready: Callable[[], None] | None = None) -> int:
    """Subscribe to ``subject`` and ``emit`` one line per message until ``count`` messages or
    ``duration`` seconds (None: no limit). ``ready`` is called once the subscription is live.
    Returns the number of messages shown."""
    shown = 0
    done = asyncio.Event()

    async def on_message(msg: Any) -> None:
        nonlocal shown
        if done.is_set():
            return
        emit(line(msg.subject, msg.headers, msg.data))
        shown += 1
        if count is not None and shown >= count:
            done.set()

    sub = await nc.subscribe(subject, cb=on_message)
    try:
        # A barrier on a client from kvasir_bus.connect: the SUB is at the server before the PONG,
        # so nothing published on ``ready`` is missed.
        await nc.flush()
        if ready is not None:
            ready()
        try:
            await asyncio.wait_for(done.wait(), duration)
        except asyncio.TimeoutError:
            pass
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    return shown
