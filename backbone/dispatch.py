"""Expert dispatch over NATS with a local fallback: the sharded :class:`ExpertBackend`.

Per MoE layer step the engine hands over every selected expert with all the rows that chose
it. Each becomes one request on ``kvasir.<model>.x.<layer>.<expert>``, all sent at once:

* the first reply wins (replicas on plain subscriptions race; later replies are counted and
  dropped);
* "no responders" (the server's instant 503) means compute locally at once, and the expert is
  remembered as uncovered for a short while so the next steps do not even ask, until that
  time passes or a worker's heartbeat announces the expert;
* a timeout (fixed, or adaptive from observed latency between a floor and a ceiling) means
  compute locally; a reply that comes after it is counted as late and dropped;
* an error reply or an invalid one (wrong id, shape or dtype, NaN/Inf) is counted, dropped,
  and the expert is computed locally;
* an expert that timed out is *silent* (:mod:`backbone.coverage_view`): computed locally at
  once, its request still sent as a probe whose first valid reply makes it worth waiting for again;
* a reply is *audited* as :mod:`backbone.audit` decides: recomputed here, compared, and replaced
  by the local result; a failed audit quarantines its node: the market is told
  (``kvasir.<model>.quarantine``), its replies are ignored from then on (another replica may still
  win the race) and it is never credited again.

Local fallbacks run on the calling thread as soon as they are known, while the remote calls
are still in flight. Whoever computes an expert, the function and its input are the same (the
wire rounding is applied by the engine before dispatch), so the output is bit-identical.

Replies come back on one wildcard inbox per backbone, matched by request id: that is how a
late reply can be told from a racing replica's, which ``nc.request`` cannot do.

Around it: the counters are :mod:`backbone.dispatch_stats`, the uncovered cache and the
heartbeat listener :mod:`backbone.coverage_view`, the market's share (routing statistics,
ledger events) a recorder, :mod:`backbone.market_link`. The connection, its loop thread and
their lifecycle belong to :class:`backbone.service.BackboneService`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import structlog

from backbone.audit import AuditConfig, Auditor, relative_error, rerun_backend
from backbone.coverage_view import CoverageView
from backbone.dispatch_stats import DispatchStats, LayerStats  # noqa: F401  (LayerStats: re-exported)
from kvasir_bus import codec, market_codec
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.dispatch")

_ENVELOPE_BYTES = 1024  # msgpack map, ids and headers around the rows, generously


@dataclass(frozen=True)
class DispatchConfig:
    timeout_s: float | None = None  # fixed per-request timeout; None: adaptive
    timeout_floor_s: float = 0.05
    timeout_ceiling_s: float = 2.0
    initial_timeout_s: float = 0.5  # before any latency has been observed
    uncovered_ttl_s: float = 1.0  # after "no responders", compute locally without asking this long
    audit: AuditConfig = AuditConfig()  # which remote replies are recomputed here


class AdaptiveTimeout:
    """TCP-style retransmission timeout: smoothed latency + 4 x its mean deviation, clamped."""

    def __init__(self, cfg: DispatchConfig):
        self.cfg = cfg
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.initial_s = cfg.initial_timeout_s

    def observe(self, seconds: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds

    def timed_out(self) -> None:
        """A request got no reply in time. Before any reply was seen, halve the initial guess (down
        to the floor): a bus where nobody answers should not cost the initial timeout forever."""
        if self.srtt is None:
            self.initial_s = max(self.cfg.timeout_floor_s, self.initial_s / 2)

    def current(self) -> float:
        if self.cfg.timeout_s is not None:
            return self.cfg.timeout_s
        if self.srtt is None:
            return self.initial_s
        return min(self.cfg.timeout_ceiling_s, max(self.cfg.timeout_floor_s, self.srtt + 4 * self.rttvar))


class _NoResponders(Exception):
    pass


class _OnlyLiars(Exception):
    """Only quarantined nodes answered, and no honest replica within a short grace after."""


class Local(Protocol):
    """The fallback replica (:class:`backbone.experts.LocalExperts`)."""

    backend: str  # the kernel it computes with ("ggml" or "numpy")

    def compute(self, layer: int, expert: int, rows: np.ndarray, *, backend: str | None = None) -> np.ndarray: ...

    def weight_type(self, layer: int) -> int: ...


@dataclass(frozen=True)
class _Part:
    """One chunk of a won call: which rows, what came back, who computed it with what."""

    rows: slice
    out: np.ndarray
    node: str
    kernel: str


@dataclass(frozen=True)
class _Won:
    parts: tuple[_Part, ...]
    latency_s: float = 0.0  # request to last reply chunk

    @property
    def out(self) -> np.ndarray:
        return self.parts[0].out if len(self.parts) == 1 else np.concatenate([p.out for p in self.parts])


class Recorder(Protocol):
    """Who wants to hear about every call and every win (:class:`backbone.market_link.MarketLink`)."""

    def record_call(self, layer: int, expert: int, rows: int, remote: bool) -> None: ...

    def record_win(self, node: str, layer: int, expert: int, rows: int, latency_s: float | None = None) -> None: ...

    def void(self, node: str) -> None: ...


class RemoteExperts:
    """An :class:`~backbone.experts.ExpertBackend` that asks the workers on the bus first.

    ``bus`` runs ``nc``'s loop; ``local`` computes whatever no worker delivers; ``coverage``
    remembers the experts nobody answered for; ``recorder`` (optional) hears every call and win.
    """

    def __init__(self, bus: LoopThread, nc, model: str, local: Local, n_embd: int,
                 cfg: DispatchConfig = DispatchConfig(), *, coverage: CoverageView | None = None,
                 recorder: Recorder | None = None, auditor: Auditor | None = None):
        self.bus, self.nc, self.local, self.n_embd, self.cfg = bus, nc, local, n_embd, cfg
        self.auditor = auditor or Auditor(cfg.audit)
        self.refusals = ThrottledLog(log, 60.0)
        self.coverage = coverage or CoverageView(cfg.uncovered_ttl_s)
        self.recorder = recorder
        self.subjects = Subjects(model)
        self.model = model
        self.stats = DispatchStats()
        self.timeout = AdaptiveTimeout(cfg)
        self.observe_reply = None  # metrics hook (backbone.metrics): (layer, seconds) of each winning reply
        self.replicas = None  # backbone.replicas.Replicas: the wait for a call (hedging, per-expert latency)
        self._audit_lock = threading.Lock()  # two micro-batches accept replies at once; the audit windows count
        self._pending: dict[str, tuple[asyncio.Future, int, int]] = {}  # token -> (future, layer, expert)
        self._finished: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # token -> (how, layer, expert)
        self._probes: OrderedDict[str, tuple[int, int]] = OrderedDict()  # token -> (layer, expert)
        self._ids = itertools.count()
        self._inbox: str | None = None
        self._sub = None

    async def start(self) -> None:
        """Listen for replies (one wildcard inbox) and for heartbeats (the coverage view)."""
        if self._sub is not None:
            return
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        await self.coverage.start(self.nc, self.model)
        await self.nc.flush()

    async def close(self) -> None:
        await self.coverage.stop()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    # -- the synchronous side (the engine's thread) --------------------------------------------

    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        done: queue.Queue = queue.Queue()
        job = self.bus.submit(self._dispatch_layer(layer, calls, done))
        outs: list[np.ndarray | None] = [None] * len(calls)
        for _ in range(len(calls)):
            while True:
                try:
                    i, won = done.get(timeout=1.0)
                    break
                except queue.Empty:
                    if job.done() and job.exception() is not None:
                        raise job.exception()
            expert, rows = calls[i]
            if self.recorder is not None:
                self.recorder.record_call(layer, expert, len(rows), remote=won is not None)
            if won is None:  # the fallback replica: this node
                outs[i] = self.local.compute(layer, expert, rows)
                self.stats.layer(layer).rows_local += len(rows)
            else:
                outs[i] = self._accept(layer, expert, rows, won)
        job.result()
        return outs

    def _accept(self, layer: int, expert: int, rows: np.ndarray, won: _Won) -> np.ndarray:
        """A won call: audit it if the auditor says so (then the local result is used), credit
        the nodes whose parts were not caught lying."""
        with self._audit_lock:
            audited = [self.auditor.should_audit(part.node, layer) for part in won.parts]
        out = won.out
        honest = list(won.parts)
        if any(audited):
            out = self.local.compute(layer, expert, rows)
            honest = [part for part in won.parts if self._audit(layer, expert, rows, out, part)]
        for part in honest:
            if self.recorder is not None:
                self.recorder.record_win(part.node, layer, expert, len(part.out), latency_s=won.latency_s)
        return out

    def _audit(self, layer: int, expert: int, rows: np.ndarray, reference: np.ndarray, part: _Part) -> bool:
        stats = self.stats.layer(layer)
        stats.audits += 1
        backend, exact = rerun_backend(part.kernel, self.local.backend)
        whole = part.rows == slice(0, len(rows))
        ref = reference[part.rows] if whole and backend == self.local.backend else \
            self.local.compute(layer, expert, rows[part.rows], backend=backend)
        if self.auditor.judge(part.node, part.out, ref, exact=exact, weight_type=self.local.weight_type(layer)):
            return True
        stats.audit_failures += 1
        error = relative_error(part.out, ref) if part.out.shape == ref.shape else float("inf")
        if part.node not in self.stats.quarantined:
            self.stats.quarantined.append(part.node)
            log.warning("node_quarantined", node=part.node, layer=layer, expert=expert, kernel=part.kernel,
                        exact=exact, relative_error=error)
            event = market_codec.Quarantine(model=self.model, node=part.node, layer=layer, expert=expert,
                                            kernel=part.kernel, exact=exact, error=error, at=time.time())
            self.bus.submit(self._publish_quarantine(event))
            if self.recorder is not None:
                self.recorder.void(part.node)
        return False

    async def _publish_quarantine(self, event: market_codec.Quarantine) -> None:
        try:
            await self.nc.publish(self.subjects.quarantine(), event.encode(), headers=codec.headers_for(event))
        except Exception as exc:  # the bus is down: the node stays quarantined here all the same
            log.warning("quarantine_publish_failed", node=event.node, error=str(exc))

    # -- the bus side (the loop thread) --------------------------------------------------------

    async def _dispatch_layer(self, layer: int, calls, done: queue.Queue) -> None:
        async def one(i: int, expert: int, rows: np.ndarray) -> None:
            try:
                out = await self._call(layer, expert, rows)
            except Exception as exc:  # never leave the engine waiting
                log.error("dispatch_failed", layer=layer, expert=expert, error=f"{type(exc).__name__}: {exc}")
                self.stats.layer(layer).bus_errors += 1
                out = None
            done.put((i, out))

        await asyncio.gather(*(one(i, e, rows) for i, (e, rows) in enumerate(calls)))

    def _max_rows(self) -> int:
        """Rows per message under the server's max_payload. Chunks are split evenly, so each
        is far above the 8 rows where ggml's K-quant kernels change regime (bit-identity)."""
        limit = getattr(self.nc, "max_payload", None) or codec.DEFAULT_MAX_BYTES
        return max(1, (limit - _ENVELOPE_BYTES) // (self.n_embd * 4))

    async def _call(self, layer: int, expert: int, rows: np.ndarray) -> _Won | None:
        stats = self.stats.layer(layer)
        if self.coverage.is_uncovered(layer, expert):
            stats.local_choice += 1
            return None
        silent = self.coverage.is_silent(layer, expert)
        chunks = np.array_split(rows, -(-len(rows) // self._max_rows()))  # max_payload: split big batches
        loop = asyncio.get_running_loop()
        tokens, futures, sent = [], [], []
        subject = self.subjects.dispatch(layer, expert)
        t0 = time.perf_counter()
        try:
            for chunk in chunks:
                token = f"{next(self._ids):x}"
                req = codec.DispatchRequest(model=self.model, layer=layer, expert=expert, rows=chunk,
                                            request_id=token)
                payload = req.encode()
                if silent:  # a probe: nobody waits for it, a valid reply ends the silence
                    self._probes[token] = (layer, expert)
                    while len(self._probes) > 4096:
                        self._probes.popitem(last=False)
                else:
                    fut = loop.create_future()
                    self._pending[token] = (fut, layer, expert)
                    tokens.append(token)
                    futures.append(fut)
                    sent.append((token, req, payload))
                await self.nc.publish(subject, payload, reply=f"{self._inbox}.{token}",
                                      headers=codec.headers_for(req))
                stats.bytes_out += len(payload)
        except Exception as exc:
            self._forget(tokens, "error")
            stats.bus_errors += 1
            log.warning("dispatch_send_failed", layer=layer, expert=expert, error=str(exc))
            return None
        if silent:
            stats.silent += 1
            return None
        try:
            if self.replicas is None:
                replies = await asyncio.wait_for(asyncio.gather(*futures), self.timeout.current())
            else:  # hedged re-sends in balance mode, per-expert latency (backbone.replicas)
                replies = await self.replicas.wait(layer, expert, futures, self.timeout.current(),
                                                   lambda: self._resend(subject, sent))
        except _NoResponders:
            self._forget(tokens, "no_responders")
            self.coverage.mark_uncovered(layer, expert)
            stats.no_responders += 1
            return None
        except _OnlyLiars:
            self._forget(tokens, "ignored")
            self.coverage.mark_silent(layer, expert)  # probe from now on: a liar's word is no life
            return None
        except asyncio.TimeoutError:
            self._forget(tokens, "timeout")
            stats.timeouts += 1
            self.timeout.timed_out()
            self.coverage.mark_silent(layer, expert)
            self.refusals.info(("timeout", layer), "dispatch_timeout", layer=layer, expert=expert,
                               timeout_ms=round(1000 * self.timeout.current(), 1))
            return None
        latency = time.perf_counter() - t0
        parts, start = [], 0
        for token, chunk, reply in zip(tokens, chunks, replies):
            part = self._check_reply(layer, expert, token, chunk, reply)
            if part is None:
                stats.invalid += 1
                return None
            parts.append(_Part(slice(start, start + len(chunk)), part.rows, part.node, part.kernel))
            start += len(chunk)
        self.coverage.mark_answered(layer, expert)
        self.timeout.observe(latency)
        self.observe_reply is None or self.observe_reply(layer, latency)
        stats.remote += 1
        stats.rows_remote += len(rows)
        stats.latency_sum_s += latency
        stats.latency_max_s = max(stats.latency_max_s, latency)
        node = parts[0].node
        self.stats.nodes[node] += 1
        self.stats.node_rows[node] += len(rows)
        self.stats.node_latency_s[node] += latency
        return _Won(tuple(parts), latency)

    async def _resend(self, subject: str, sent: list) -> None:
        """A hedge: the chunks still unanswered, once more, to the same reply tokens."""
        for token, req, payload in sent:
            if token in self._pending:
                await self.nc.publish(subject, payload, reply=f"{self._inbox}.{token}",
                                      headers=codec.headers_for(req))

    def _check_reply(self, layer, expert, token, chunk, reply) -> codec.DispatchReply | None:
        # Replies come from strangers: one line per node and kind a minute, not one per reply.
        if isinstance(reply, codec.CodecError):
            self.refusals.warning(("invalid", None), "reply_invalid", layer=layer, expert=expert, error=str(reply))
            return None
        if isinstance(reply, codec.ErrorReply):
            self.refusals.warning(("error", reply.node, reply.code), "reply_error", layer=layer, expert=expert,
                                  node=reply.node, code=reply.code, message=reply.message)
            return None
        problem = None
        if reply.request_id != token:
            problem = f"request id {reply.request_id!r} does not match {token!r}"
        elif reply.rows.shape != chunk.shape:
            problem = f"shape {reply.rows.shape}, expected {chunk.shape}"
        elif not codec.all_finite(reply.rows):
            problem = "NaN or Inf in the rows"
        if problem:
            self.refusals.warning(("invalid", reply.node), "reply_invalid", layer=layer, expert=expert,
                                  node=reply.node, error=problem)
            return None
        return reply

    def _forget(self, tokens: list[str], how: str) -> None:
        for token in tokens:
            entry = self._pending.pop(token, None)
            self._finished[token] = (how, entry[1], entry[2]) if entry else (how, -1, -1)
        while len(self._finished) > 65536:
            self._finished.popitem(last=False)

    def _decode(self, data: bytes):
        """A reply's bytes -> DispatchReply, ErrorReply, or the CodecError saying what is wrong."""
        try:
            return codec.decode_reply(data, n_embd=self.n_embd)
        except codec.CodecError as exc:
            return exc

    async def _on_reply(self, msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        entry = self._pending.get(token)
        if entry is None:  # a probe's reply, one after its timeout, or a replica that lost the race
            probe = self._probes.pop(token, None)
            if probe is not None:
                self._on_probe_reply(probe, msg)
                return
            how, layer, expert = self._finished.get(token, ("unknown", -1, -1))
            if layer >= 0:
                stats = self.stats.layer(layer)
                if how == "timeout":
                    stats.late += 1
                    self._shows_life((layer, expert), msg)  # slow is not silent
                elif how == "won":
                    stats.duplicates += 1
            return
        fut, layer, expert = entry
        if fut.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            fut.set_exception(_NoResponders())
            return
        self.stats.layer(layer).bytes_in += len(msg.data)
        reply = self._decode(msg.data)
        if isinstance(reply, (codec.DispatchReply, codec.ErrorReply)) and self.auditor.is_quarantined(reply.node):
            self.stats.layer(layer).ignored += 1  # a liar: wait a little longer for an honest replica
            grace = max(self.cfg.timeout_floor_s, 2 * (self.timeout.srtt or 0.0))
            asyncio.get_running_loop().call_later(
                grace, lambda: fut.done() or fut.set_exception(_OnlyLiars()))
            return
        self._pending.pop(token, None)
        self._finished[token] = ("won", layer, expert)
        fut.set_result(reply)

    def _on_probe_reply(self, probe: tuple[int, int], msg) -> None:
        if msg.headers and msg.headers.get("Status") == "503":
            self.coverage.mark_uncovered(*probe)
        elif self._shows_life(probe, msg):
            self.stats.layer(probe[0]).probes_answered += 1

    def _shows_life(self, key: tuple[int, int], msg) -> bool:
        """A valid reply of an honest node, even one too late to use: the expert is not silent."""
        reply = self._decode(msg.data)
        if isinstance(reply, codec.DispatchReply) and not self.auditor.is_quarantined(reply.node) \
                and codec.all_finite(reply.rows):
            self.coverage.mark_answered(*key)
            return True
        return False


def log_summary(remote: RemoteExperts) -> None:
    """One canonical line per generation session: how the expert calls went."""
    t = remote.stats.to_dict()["totals"]
    log.info("generation_dispatch_summary", model=remote.model, calls=t["calls"], remote=t["remote"],
             local_choice=t["local_choice"], no_responders=t["no_responders"], timeouts=t["timeouts"],
             invalid=t["invalid"], late=t["late"], duplicates=t["duplicates"], fallback_rate=t["fallback_rate"],
             latency_mean_ms=t["latency_mean_ms"], bytes_out=t["bytes_out"], bytes_in=t["bytes_in"])
