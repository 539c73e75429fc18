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
* before anything on the bus has ever answered (a fresh backbone), a step's calls are computed
  here while they are out and not waited for once that is done (with the adaptive timeout): a
  subscriber on every subject that never answers then costs no timeout at all, and the first
  reply, in time or late, makes the next steps wait as usual;
* a reply is *audited* as :mod:`backbone.audit` decides: recomputed here, compared, and replaced
  by the local result; a failed audit quarantines its node: the market is told
  (``kvasir.<model>.quarantine``), its replies are ignored from then on (another replica may still
  win the race) and it is never credited again.

Local fallbacks run on the calling thread as soon as they are known, while the remote calls
are still in flight. Whoever computes an expert, the function and its input are the same (the
wire rounding is applied by the engine before dispatch), so the output is bit-identical.

Replies come back on one wildcard inbox per backbone, matched by request id: that is how a
late reply can be told from a racing replica's, which ``nc.request`` cannot do.

**Bundles** (``DispatchConfig.bundles``, on by default): a call whose expert a bundle-capable
node holds (its heartbeat says so; :meth:`CoverageView.bundle_holders`) is not sent on the
expert's subject but in that node's *bundle*: one :class:`~kvasir_bus.codec.BundleRequest` per
node and layer step on ``kvasir.<model>.n.<node>``, the step's rows once, answered by one
:class:`~kvasir_bus.codec.BundleReply`. In race mode a call goes into the bundle of every holder
(the first valid answer wins); in balance mode into one holder's (the fewest calls of this step,
then the lowest smoothed round trip), and hedging re-sends it on its expert subject. Each call
keeps its own token, and each answer in a bundle reply goes through exactly the path of a single
reply (validated, audited, won, credited, counted); an answer for a token that was not in that
node's bundle is dropped and counted (``foreign``). A bundle whose node has gone ("no responders")
sends its unanswered calls on their expert subjects, as calls without a bundle holder always are.
Calls bigger than one message, and probes of silent experts, go per expert too.

What a remote call costs (``bench/dispatch.py --overhead``) is kept to the bus client's own
work: the engine's thread decides and encodes a whole layer step (:meth:`RemoteExperts._plan`)
and hands it to the loop in one hop; :meth:`RemoteExperts._publish_step` publishes every request
of the step before the client's flusher runs (one socket write), in the callback that received
the step (no task), and hands the step to the one timer shared by every waiting step (none armed
per step); each reply is one dict lookup, one decode and a few counters on the loop thread, and the
engine's thread wakes once per step (or once per fallback, to compute it at once). No task,
future or queue per call. A replica policy (a queue group, hedged requests) belongs in
``_publish_step``.

Around it: the counters are :mod:`backbone.dispatch_stats`, the uncovered cache and the
heartbeat listener :mod:`backbone.coverage_view`, the market's share (routing statistics,
ledger events) a recorder, :mod:`backbone.market_link`. The connection, its loop thread and
their lifecycle belong to :class:`backbone.service.BackboneService`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from collections.abc import Coroutine
from typing import NamedTuple, Protocol

import numpy as np
import structlog

from backbone.audit import (AuditConfig, Auditor, numpy_family, relative_error, replies_agree, rerun_backend,
                            rerun_plain, rerun_rows)
from backbone.coverage_view import CoverageView
from backbone.dispatch_stats import DispatchStats, LayerStats
from kvasir_bus import codec, lane, market_codec
from kvasir_bus.direct import DirectConnection, DirectError
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects
from kvasir_bus.throttle import ThrottledLog

log = structlog.get_logger("kvasir.dispatch")

_ENVELOPE_BYTES = 1024  # msgpack map, ids and headers around the rows, generously
#: Rows of a reply an audit reruns in numpy when the node's kernel is one the backbone cannot rerun
#: bit for bit (a random sample of them, drawn after the reply came): the numpy rerun and its flip
#: analysis cost 3-6x a ggml compute, so without a cap one stranger's 512-row prefill reply cost
#: the backbone about a second per audit. A liar that lies on every row is caught as before; one
#: that lies on k of n > 16 rows is caught by an audit with probability about 1 - (1 - k/n)^16.
EXPLAINED_ROWS = 16
#: Bundle-capable nodes still on probation that get bundles in one step (in turn across steps).
MAX_UNPROVEN_BUNDLE_NODES = 2
_CALL_BYTES = 96  # a call's id, expert and count in a bundle, or its id and count (or error) in the reply


@dataclass(frozen=True)
class DispatchConfig:
    timeout_s: float | None = None  # fixed per-request timeout; None: adaptive
    timeout_floor_s: float = 0.05
    timeout_ceiling_s: float = 2.0
    initial_timeout_s: float = 0.5  # before any latency has been observed
    uncovered_ttl_s: float = 1.0  # after "no responders", compute locally without asking this long
    audit: AuditConfig = AuditConfig()  # which remote replies are recomputed here
    bundles: bool = True  # one message per bundle-capable worker per layer step (--bundles on|off)
    inline_delivery: bool = True  # replies handled where nats.py parses them (kvasir_bus.lane), if it can
    direct_publish: bool = True  # a step's requests written straight to the socket (kvasir_bus.lane), if safe
    engine_connection: bool = True  # all-bundle steps sent and awaited on the engine thread's own connection
    reply_secret: bytes = b""  # the deployment's reply secret: replies naming an enrolled node need its proof
    # Race mode: once a step's calls are won, wait up to this many times the step's round trip for
    # the racing replicas' bundle replies (nodes past probation), so that a lie is compared with
    # an honest replica's answer before it is used. 0: use the first replies at once.
    confirm: float = 1.0


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


class Local(Protocol):
    """The fallback replica (:class:`backbone.experts.LocalExperts`)."""

    backend: str  # the kernel it computes with ("ggml" or "numpy")

    def compute(self, layer: int, expert: int, rows: np.ndarray, *, backend: str | None = None,
                plain: bool = False) -> np.ndarray: ...

    def weight_type(self, layer: int) -> int: ...


class _Part(NamedTuple):
    """One chunk of a won call: which rows, what came back, who computed it with what.
    (A named tuple, not a frozen dataclass: one is built per reply chunk on the loop thread.)"""

    rows: slice
    out: np.ndarray
    node: str
    kernel: str


class _Won(NamedTuple):
    parts: tuple[_Part, ...]
    latency_s: float = 0.0  # request to last reply chunk

    @property
    def out(self) -> np.ndarray:
        return self.parts[0].out if len(self.parts) == 1 else np.concatenate([p.out for p in self.parts])


class _Call:
    """One expert's remote call in a layer step: its request chunks and what came back for them.

    The engine thread builds it (and encodes its requests) before the step goes to the loop;
    from then on only the loop thread writes it, until it is ``done``."""

    __slots__ = ("step", "index", "expert", "rows", "chunks", "tokens", "payloads", "parts", "left",
                 "won", "done", "liar_timer", "nodes", "routes", "disputed")

    def __init__(self, step: _Step, index: int, expert: int, rows: np.ndarray, chunks: list[np.ndarray]):
        self.step, self.index, self.expert, self.rows, self.chunks = step, index, expert, rows, chunks
        self.tokens: list[str] = []
        self.payloads: list[bytes] = []
        self.parts: list[_Part | None] = [None] * len(chunks)
        self.left = len(chunks)  # chunks not answered yet
        self.won: _Won | None = None
        self.done = False
        self.liar_timer: asyncio.TimerHandle | None = None
        self.nodes: tuple[str, ...] = ()  # bundled: the nodes whose bundles carry it
        self.routes = 0  # bundles that may still answer it (0: ask on the expert's subject)
        self.disputed = False  # a racing replica's reply differed from the winner's: recompute it here


class _Answer(NamedTuple):
    """One call's output in a bundle reply: what a :class:`codec.DispatchReply` carries, already
    checked by the bundle reply's own record (ids, node, kernel, float32 rows)."""

    request_id: str
    node: str
    rows: np.ndarray
    kernel: str
    finite: bool = False  # the whole reply's rows were checked at once and hold no NaN or Inf


def _row_bytes(rows: np.ndarray) -> list[bytes]:
    """Each row's bytes (a decode call's one row without iterating the array)."""
    return [rows.tobytes()] if len(rows) == 1 else [row.tobytes() for row in rows]


class _Bundle:
    """The calls of one layer step sent to one node in one message (:class:`codec.BundleRequest`)."""

    __slots__ = ("node", "layer", "token", "calls", "tokens", "payload", "answered", "step")

    def __init__(self, node: str, layer: int, token: str, calls: list[_Call], payload: bytes,
                 tokens: frozenset[str]):
        self.node, self.layer, self.token, self.calls, self.payload = node, layer, token, calls, payload
        self.tokens = tokens  # the calls' tokens: what a reply to it may answer
        self.answered = False  # its node's reply (or the server's 503) has been taken
        self.step: _Step | None = calls[0].step if calls else None


class _Union:
    """The distinct rows of a bundle, each once, found by content (every expert of a decode step
    gets the same row; equal rows give equal outputs, so sending one copy changes no bit)."""

    __slots__ = ("rows", "_seen")

    def __init__(self):
        self.rows: list[bytes] = []
        self._seen: dict[bytes, list[int]] = {}

    def add(self, row: bytes) -> int:
        key = row[::61]  # a sample to find candidates; equality is checked on every byte
        found = self._seen.get(key)
        if found is not None:
            for j in found:
                if self.rows[j] == row:
                    return j
        else:
            found = self._seen[key] = []
        found.append(len(self.rows))
        self.rows.append(row)
        return len(self.rows) - 1

    def array(self, like: np.ndarray) -> np.ndarray:
        """The distinct rows as one (R, n_embd) array of ``like``'s dtype."""
        return np.frombuffer(b"".join(self.rows), like.dtype).reshape(len(self.rows), like.shape[1])


class _Step:
    """Every remote call of one layer step: sent as one batch (one flush), waited for as one.

    The loop thread settles each call (won, or to be computed here) and tells the engine thread
    through ``fallbacks``: a call's index as soon as it must be computed here, :data:`_SETTLED`
    once every call is settled. One loop hop and one queue per step, not per call; one timer for
    all steps (:meth:`RemoteExperts._wait_for`)."""

    __slots__ = ("layer", "calls", "probes", "bundles", "singles", "timeout_s", "t0", "left", "fallbacks",
                 "confirming")

    def __init__(self, layer: int, timeout_s: float):
        self.layer, self.timeout_s = layer, timeout_s
        self.calls: list[_Call] = []  # waited for
        self.probes: list[_Call] = []  # silent experts: sent, never waited for
        self.bundles: list[_Bundle] = []  # calls for bundle-capable nodes, one message per node
        self.singles = 0  # calls and probes asked on their experts' subjects (in no bundle)
        self.t0 = 0.0
        self.left = 0  # calls not settled yet
        self.fallbacks: queue.SimpleQueue = queue.SimpleQueue()
        self.confirming: tuple[list[_Bundle], threading.Event] | None = None  # racing replies awaited


_SETTLED = -1  # on a step's queue: every call is settled
_FINISHED_KEPT = 65536  # settled calls' tokens remembered, to tell a late reply from a duplicate
_WON_KEPT = 4096  # won chunks kept for comparison with a losing replica's reply (their rows and outputs) ...
_WON_KEPT_BYTES = 32 << 20  # ... and at most this many bytes of outputs among them (prefill chunks are big)
_DISPUTES_KEPT = 256  # disagreements waiting for the engine thread's audit
_CONFIRM_FLOOR_S = 0.010  # the least a won step may wait for its racing replicas (confirm > 0): a busy CPU's scheduling delays
_CONFIRM_MISSES = 3  # a node that missed that wait this many steps in a row is not waited for ...
_CONFIRM_RETRY = 64  # ... except every this many steps (it may have become faster)
_CONFIRM_KEPT = 4096  # nodes remembered as having answered a bundle (with their misses in a row)


def _release(step: _Step) -> None:
    """A settled step leaves the books: its recent bundles keep their tokens (a late reply is
    still counted) but no longer their calls, and each call forgets its step. Calls and step
    refer to each other; without this, nothing of a step was freed before Python's cycle
    collector ran, whose passes were a quarter of the backbone's CPU in a sharded decode (perf,
    small model). Nothing reads a settled call's step (every path there checks ``call.done`` or
    the pending tokens first)."""
    for bundle in step.bundles:
        bundle.calls, bundle.step = (), None
    step.confirming = None
    for call in (*step.calls, *step.probes):
        call.step = None


_HANDED_POLL_S = 0.002  # a step handed to the bus thread: how often the engine thread reads its connection


def _sent(call: _Call | None, k: int) -> bytes | None:
    """The request payload of chunk ``k`` of ``call`` as sent on its expert's subject (None if it
    went only in a bundle, or the call is not known any more)."""
    return call.payloads[k] if call is not None and k < len(call.payloads) else None


class _Forwarded(NamedTuple):
    """A reply read on the engine thread's connection, as the bus thread's handler reads one."""
    subject: str
    headers: dict | None
    data: bytes
_STEP_GRACE_S = 5.0  # the engine gives up on a step this long after its timeout (a dead loop thread)


def _start_now(coro: Coroutine) -> None:
    """Run ``coro`` in the calling callback up to its first real wait, and let a task carry it on
    from there (Python 3.12's eager tasks): a step's publishes, which wait only when the client's
    outbound buffer is full, then cost no task and no extra turn of the loop."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return
    asyncio.get_running_loop().create_task(_carry_on(coro, waiting_on))


async def _carry_on(coro: Coroutine, waiting_on) -> None:
    await _Resume(coro, waiting_on)


class _Resume:
    """Awaiting it goes on with a coroutine that was started by hand and now waits on
    ``waiting_on`` (what it yielded): the awaiting task waits for that, then resumes the coroutine
    (throws into it what the task was thrown, a cancellation), until it returns."""

    def __init__(self, coro: Coroutine, waiting_on):
        self.coro, self.waiting_on = coro, waiting_on

    def __await__(self):
        waiting_on = self.waiting_on
        while True:
            try:
                yield waiting_on
            except BaseException as exc:  # noqa: B036 (handed on to the coroutine, which decides)
                resume, arg = self.coro.throw, exc
            else:
                resume, arg = self.coro.send, None
            try:
                waiting_on = resume(arg)
            except StopIteration as done:
                return done.value


class Recorder(Protocol):
    """Who wants to hear about every call and every win (:class:`backbone.market_link.MarketLink`)."""

    def record_call(self, layer: int, expert: int, rows: int, remote: bool) -> None: ...

    def record_win(self, node: str, layer: int, expert: int, rows: int, latency_s: float | None = None,
                   at: float | None = None) -> None: ...

    def void(self, node: str, since: float = 0.0) -> None: ...

    def record_audit(self, node: str, passed: bool) -> None: ...


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
        from kvasir_bus.attribution import ProofChecker

        # Replies naming a self-certifying node (always) or an enrolled one (with the reply secret)
        # need its proof; every request carries this backbone's box key for the former.
        self.proofs = ProofChecker(cfg.reply_secret)  # kvasir_bus.attribution
        self.coverage = coverage or CoverageView(cfg.uncovered_ttl_s)
        self.recorder = recorder
        self.subjects = Subjects(model)
        self.model = model
        self.requests = codec.RequestEncoder(model, self.proofs.box)  # the model is checked once, not per request
        self.bundle_requests = codec.BundleEncoder(model, self.proofs.box)
        self.bundles = cfg.bundles
        self._steps_planned = 0  # layer steps planned: the turn of the unproven bundle nodes
        self.coverage.track_nodes = self.coverage.track_nodes or cfg.bundles
        if cfg.bundles and 0 < cfg.audit.rate < 1:  # strangers' bundles in turn (see _bundle_nodes)
            self.coverage.limit_unproven(MAX_UNPROVEN_BUNDLE_NODES)
        self.stats = DispatchStats()
        self.timeout = AdaptiveTimeout(cfg)
        self.observe_reply = None  # metrics hook (backbone.metrics): (layer, seconds) of each winning reply
        self.replicas = None  # backbone.replicas.Replicas: hedged re-sends (balance mode), per-expert latency
        self.signer = None  # kvasir_bus.signing.Signer: quarantine events carry its signature
        # Race mode's free audits: each won chunk by token, so the losing replica's reply can be
        # compared with it (bounded: the recent ones), and the disagreements for the engine thread.
        self._won_recent: OrderedDict[str, tuple[_Call, int]] = OrderedDict()
        self._disputes: deque = deque(maxlen=_DISPUTES_KEPT)
        self._won_bytes = 0
        self._confirm_misses: dict[str, int] = {}  # node that answered bundles -> racing waits it missed in a row
        self._confirm_tried: OrderedDict[str, None] = OrderedDict()  # never-heard nodes waited for once (audits off)
        self._audit_rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))  # rows a node cannot foresee
        self._audit_lock = threading.Lock()  # two micro-batches accept replies at once; the audit windows count
        self._pending: dict[str, tuple[_Call, int]] = {}  # token -> (call, chunk)
        self._finished: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # token -> (how, layer, expert)
        self._probes: OrderedDict[str, tuple[int, int]] = OrderedDict()  # token -> (layer, expert)
        self._bundles: OrderedDict[str, _Bundle] = OrderedDict()  # bundle token -> bundle, recent ones
        self._node_subjects: dict[str, str] = {}
        # (announced kernel, ours) -> rerun_backend's answer, and whether the rerun is told the plain layout
        self._reruns: dict[tuple[str, str], tuple[str, bool, bool]] = {}
        # Steps waited for, with their deadlines (loop time), and one timer for the earliest: a
        # step that settles in time (nearly all) costs a dict entry, not a timer armed and cancelled.
        self._waiting: dict[_Step, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._ids = itertools.count()
        self._inbox: str | None = None
        self._sub = None
        self._lane: lane.InlineDelivery | None = None  # replies straight from nats.py's reader
        self._direct: lane.DirectPublish | None = None  # a step's requests straight to the socket
        self._conn = None  # kvasir_bus.direct.DirectConnection: the engine thread's own (engine_connection)
        self._conn_lock = threading.Lock()  # one step on it at a time (micro-batches: the other takes the bus)
        self._conn_failures = 0  # connection attempts failed in a row
        self._conn_off = False
        self.direct_steps = 0  # steps sent on the engine thread's connection
        self.handed_steps = 0  # of them, steps the bus thread finished (a 503, an error, a liar, the deadline)

    async def start(self) -> None:
        """Listen for replies (one wildcard inbox) and for heartbeats (the coverage view)."""
        if self._sub is not None:
            return
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)  # headed replies (503s)
        if self.cfg.inline_delivery and lane.supported(self.nc):
            if self._lane is None:  # one wrapper per client and backbone, reused after a restart
                self._lane = lane.InlineDelivery(self.nc, self._reply_failed)
            self._lane.add(self._sub, self._on_reply)
        if self.cfg.direct_publish and self._direct is None:
            self._direct, why_not = lane.DirectPublish.attach(self.nc)
            if why_not is not None:
                log.info("direct_publish_off", reason=why_not)
        await self.coverage.start(self.nc, self.model)
        await self.nc.flush()

    async def close(self) -> None:
        await self.coverage.stop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lane is not None:
            self._lane.close()
        if self._conn is not None:  # a step still reading it ends as one whose connection was lost
            self._conn.close()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    def _reply_failed(self, exc: BaseException) -> None:
        """A reply's handling raised (a bug: every refusal is handled): the lane dropped that
        reply, whose call ends as a timeout would, and reads on."""
        log.error("reply_handler_failed", error=f"{type(exc).__name__}: {exc}")

    # -- the synchronous side (the engine's thread) --------------------------------------------

    def run_layer(self, layer: int, calls: list[tuple[int, np.ndarray]],
                  while_waiting: Callable[[], None] | None = None) -> list[np.ndarray]:
        """Every selected expert of a layer step with its rows -> their outputs, in order.
        ``while_waiting``: the caller's work that needs no expert output (the shared expert),
        run here once the requests are out."""
        stats = self.stats.layer(layer)
        step = self._plan(layer, calls, stats)
        if self._direct_eligible(step) and self._conn_lock.acquire(blocking=False):
            try:
                outs = self._run_direct(layer, calls, step, stats, while_waiting)
            finally:
                self._conn_lock.release()
            if outs is not None:
                return outs
        if step.calls or step.probes or step.bundles:
            try:
                self.bus.loop.call_soon_threadsafe(self._send, step)
            except RuntimeError as exc:  # the loop is closed: nobody will answer
                log.warning("dispatch_send_failed", layer=layer, error=str(exc))
                stats.bus_errors += len(step.calls)
                step.calls = []
        if while_waiting is not None:
            while_waiting()
        outs = self._compute_unasked(layer, calls, step, stats)
        references = self._audit_ahead(layer, step.calls) if step.calls else {}
        ahead = self._before_any_answer(layer, step, references) if step.calls else {}
        if step.calls:
            deadline = step.timeout_s + _STEP_GRACE_S
            while True:
                try:
                    i = step.fallbacks.get(timeout=deadline)
                except queue.Empty:  # the loop thread is gone: compute what is missing here
                    log.error("dispatch_step_lost", layer=layer)
                    break
                if i == _SETTLED:
                    self._await_racing(step, stats)
                    break
                if i in ahead:
                    stats.rows_local += len(calls[i][1])
                    outs[i] = ahead.pop(i)
                else:
                    outs[i] = self._compute_here(layer, calls[i][0], calls[i][1], stats)
        return self._finish_step(layer, calls, step, stats, references, outs)

    def _before_any_answer(self, layer: int, step: _Step, references: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Nothing on the bus has ever answered: whoever is subscribed may never do (a stranger on
        every subject). Compute the step's waited calls here while they are out, then stop waiting
        for them (:meth:`_give_up`): a reply that came first is used as ever, a later one shows
        life and the next steps wait as usual. With a fixed ``timeout_s`` the wait is the user's
        to choose: none of this."""
        if self.cfg.timeout_s is not None or self.coverage.answered:
            return {}
        ahead = {call.index: references[call.index] if call.index in references
                 else self.local.compute(layer, call.expert, call.rows) for call in step.calls}
        try:
            self.bus.loop.call_soon_threadsafe(self._give_up, step)
        except RuntimeError:  # the loop is closed: the step's wait ends on its own
            pass
        return ahead

    def _give_up(self, step: _Step) -> None:
        """The engine computed the step's calls itself before any answer came: settle those still
        open (their late replies count as late, and show life)."""
        if not step.t0:  # never published: the send's own error path settles it
            return
        stats = self.stats.layer(step.layer)
        for call in step.calls:
            if not call.done:
                stats.unanswered += 1
                self._settle(call, "unanswered")

    def _compute_unasked(self, layer: int, calls, step: _Step, stats: LayerStats) -> list[np.ndarray | None]:
        """The step's outputs so far: those of the calls nobody was asked for (the fallback
        replica works while the bus does), None for the rest."""
        outs: list[np.ndarray | None] = [None] * len(calls)
        if len(step.calls) < len(calls):
            asked = {call.index for call in step.calls}
            for i, (expert, rows) in enumerate(calls):
                if i not in asked:
                    outs[i] = self._compute_here(layer, expert, rows, stats)
        return outs

    def _finish_step(self, layer: int, calls, step: _Step, stats: LayerStats, references,
                     outs: list[np.ndarray | None]) -> list[np.ndarray]:
        """Once every call is settled: book and accept the won ones (audits), compute the rest."""
        if self._disputes:
            self._settle_disputes()
        if step.calls:
            # Audited calls first: a node caught by any of them loses every reply of this step
            # (recomputed here below, uncredited), the ones taken before its failure included.
            verdicts = self._book_wins(layer, step.calls)
            for call, audited in verdicts:
                if call.disputed:  # a racing replica disagreed: audit every part
                    audited[:] = [True] * len(audited)
            verdicts.sort(key=lambda verdict: True not in verdict[1])
            for call, audited in verdicts:
                if True not in audited and any(self.auditor.is_quarantined(part.node) for part in call.won.parts):
                    self.stats.layer(layer).recomputed += 1
                    continue
                outs[call.index] = self._accept(layer, call.expert, call.rows, call.won, audited,
                                                references.get(call.index))
            for call in step.calls:
                if outs[call.index] is None:
                    outs[call.index] = self._compute_here(layer, call.expert, call.rows, stats)
        if self.recorder is not None:
            asked = {call.index for call in step.calls}
            for call in step.calls:
                self.recorder.record_call(layer, call.expert, len(call.rows), remote=call.won is not None)
            for i, (expert, rows) in enumerate(calls):
                if i not in asked:
                    self.recorder.record_call(layer, expert, len(rows), remote=False)
        if not step.left:
            _release(step)
        return outs

    # -- the engine thread's own connection -----------------------------------------------------

    def _direct_eligible(self, step: _Step) -> bool:
        """A step the engine thread can send and wait for itself: every waited call in a bundle,
        no probe, no call on an expert's subject, no hedge (balance mode re-sends on a timer)."""
        return (self.cfg.engine_connection and not self._conn_off and bool(step.calls) and not step.probes
                and not step.singles and (self.replicas is None or self.replicas.cfg.mode != "balance")
                and all(call.nodes for call in step.calls))

    def _connection(self):
        """The engine thread's connection, alive: what waited on it since the last step (PINGs,
        late replies, a server that closed it) is read first; a lost one is made again once per
        step. None: take the bus thread's path this step."""
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                self._forward(conn.poll())
                return conn
            except DirectError as exc:
                log.info("engine_connection_lost", error=str(exc))
        url = getattr(self.nc, "connected_url", None)  # None while the bus thread's client reconnects
        if url is None:
            return None
        try:
            self._conn = DirectConnection(url.geturl(), "kvasir-backbone-engine")
        except (DirectError, OSError) as exc:
            self._conn = None
            self._conn_failures += 1
            if self._conn_failures >= 3 or isinstance(exc, DirectError) and exc.permanent:
                self._conn_off = True  # the bus thread's path from now on, said once
                log.warning("engine_connection_off", error=str(exc),
                            note="every step goes through the bus thread (correct, a little slower)")
            return None
        self._conn_failures = 0
        return self._conn

    def _run_direct(self, layer: int, calls, step: _Step, stats: LayerStats,
                    while_waiting: Callable[[], None] | None) -> list[np.ndarray] | None:
        """Send an all-bundle step on the engine thread's connection and take its replies here:
        no bus-thread hop either way. A reply that is anything but a valid, finite answer of an
        honest node (a 503, an error, bytes that do not decode, a quarantined node), the step's
        deadline, or a lost connection hands the step to the bus thread, whose code decides it
        exactly as it decides every other step; replies that arrive here afterwards go there
        too. None: nothing was sent, take the ordinary path."""
        conn = self._connection()
        if conn is None:
            return None
        self._register(step)
        inbox = conn.inbox + "."
        data, sent = [], 0
        for bundle in step.bundles:
            data.append(b"PUB %s %s %d\r\n" % (self._node_subject(bundle.node).encode(),
                                                 (inbox + bundle.token).encode(), len(bundle.payload)))
            data += (bundle.payload, b"\r\n")
            sent += len(bundle.payload)
        step.t0 = time.perf_counter()
        try:
            conn.send(b"".join(data))
        except DirectError as exc:
            log.info("engine_connection_lost", error=str(exc))
            return None  # nothing went out: the bus thread sends the same step
        self.direct_steps += 1
        stats.bytes_out += sent
        if while_waiting is not None:
            while_waiting()
        outs = self._compute_unasked(layer, calls, step, stats)
        references = self._audit_ahead(layer, step.calls)
        deadline = time.monotonic() + step.timeout_s
        ours = {bundle.token: bundle for bundle in step.bundles}
        skip = len(inbox)
        rest: list = []  # what the bus thread gets with the step
        while step.left and not rest:
            try:
                msgs = conn.receive(deadline)
            except DirectError as exc:
                log.info("engine_connection_lost", error=str(exc))
                break
            if not msgs:
                break  # the deadline: the bus thread's timer expires the step at once
            for n, msg in enumerate(msgs):
                bundle = ours.get(msg.subject[skip:])
                if bundle is None:
                    self._forward((msg,), skip)  # an earlier step's: late or a duplicate
                elif not self._take_direct(bundle, msg, stats):
                    rest = msgs[n:]
                    break
        if not step.left and not rest:
            self._confirm_direct(conn, step, stats, ours, skip, deadline)
        if step.left:
            self._hand_over(step, deadline, rest, skip)
            return self._wait_handed(layer, calls, step, stats, references, deadline, outs)
        while (i := step.fallbacks.get_nowait()) != _SETTLED:  # a call refused as invalid
            outs[i] = self._compute_here(layer, calls[i][0], calls[i][1], stats)
        return self._finish_step(layer, calls, step, stats, references, outs)

    def _racing(self, step: _Step) -> list[_Bundle]:
        """A won step's bundles whose nodes have not answered yet but raced a call another node
        won: their answers check the winners' (:meth:`_compare_loser`). Only in race mode with
        sampled or no audits (at ``--audit 1`` every reply is recomputed anyway), and only nodes that
        have answered a bundle before, on time or late (a crowd of strangers that never answer
        costs no waiting; an honest replica that always loses the race, and so is never audited,
        still checks the winner), and have not missed the wait ``_CONFIRM_MISSES`` steps in a row.

        With audits off, a node never heard yet is waited for once too: a fresh backbone's first
        steps end before the slower honest replica's first reply has come, and nothing else
        checks a winner then (a sleeper turning in the second layer step of the first prompt got
        its lies used). Each stranger costs one wait at most, all of a step's together; with
        audits on, probation and the sampled audits bound those first steps instead."""
        if self.cfg.confirm <= 0 or not step.bundles or self.auditor.cfg.rate >= 1.0 or \
                (self.replicas is not None and self.replicas.cfg.mode == "balance"):
            return []
        auditor, misses, retry = self.auditor, self._confirm_misses, self._steps_planned % _CONFIRM_RETRY == 0
        trial = auditor.cfg.rate <= 0.0
        racing = []
        for bundle in step.bundles:
            node = bundle.node
            missed = misses.get(node)
            if missed is None and trial and node not in self._confirm_tried:
                missed = 0
            if bundle.answered or missed is None or (missed >= _CONFIRM_MISSES and not retry) \
                    or auditor.is_quarantined(node):
                continue
            if any(call.won is not None and call.won.parts[0].node != node for call in bundle.calls):
                racing.append(bundle)
        return racing

    def _confirm_grace(self, step: _Step, deadline: float) -> float:
        """How long a won step waits for its racing replicas: ``confirm`` times its round trip so
        far (at least ``_CONFIRM_FLOOR_S``), within the step's own deadline (``time.monotonic``)."""
        grace = max(_CONFIRM_FLOOR_S, self.cfg.confirm * (time.perf_counter() - step.t0))
        return max(0.0, min(grace, deadline - time.monotonic()))

    def _count_racing(self, racing: list[_Bundle], stats: LayerStats) -> None:
        stats.confirm_waits += 1
        misses = self._confirm_misses
        for bundle in racing:
            if bundle.answered:
                misses[bundle.node] = 0
            else:
                stats.confirm_missed += 1
                if bundle.node in misses:
                    misses[bundle.node] += 1
                else:  # a stranger's one trial (audits off): not waited for again until heard
                    tried = self._confirm_tried
                    tried[bundle.node] = None
                    if len(tried) > _CONFIRM_KEPT:
                        tried.popitem(last=False)

    def _bundle_heard(self, node: str) -> None:
        """A node answered a bundle (in time or late): a racing replica worth waiting for. The
        names are strangers': at most ``_CONFIRM_KEPT``, the oldest first out."""
        misses = self._confirm_misses
        if node not in misses:
            misses[node] = 0
            if len(misses) > _CONFIRM_KEPT:
                try:
                    del misses[next(iter(misses))]
                except (KeyError, RuntimeError, StopIteration):  # the other thread got there first
                    pass

    def _await_racing(self, step: _Step, stats: LayerStats, conn=None) -> None:
        """The bus thread's path: a won step waits for its racing replicas' bundle replies (the
        loop thread sets the event when the last one has been taken, compared with the winners).
        ``conn``: a step the engine thread handed over, whose replies still arrive on the engine's
        own connection; they are passed on to the bus thread while the step waits (without it the
        wait would end empty, and a lie that won the race would be used unchecked)."""
        racing = self._racing(step)
        if not racing:
            return
        event = threading.Event()
        step.confirming = (racing, event)
        if not all(bundle.answered for bundle in racing):  # the loop may have taken them meanwhile
            until = time.monotonic() + self._confirm_grace(step, time.monotonic() + step.timeout_s)
            while conn is not None and not conn.closed and not event.is_set() \
                    and (left := until - time.monotonic()) > 0:
                try:
                    self._forward(conn.receive(time.monotonic() + min(left, _HANDED_POLL_S)))
                except DirectError as exc:
                    log.info("engine_connection_lost", error=str(exc))
                    break
            event.wait(max(0.0, until - time.monotonic()))
        self._count_racing(racing, stats)

    def _confirm_direct(self, conn, step: _Step, stats: LayerStats, ours: dict[str, _Bundle], skip: int,
                        deadline: float) -> None:
        """The engine connection's path of :meth:`_await_racing`: read the racing replicas'
        bundle replies here until each has come or the grace is over. Every call of the step is
        settled, so a reply that is not a clean answer (an error, a liar's NaN) is taken here too,
        the bus thread's way: it can only be compared with a winner."""
        racing = self._racing(step)
        if not racing:
            return
        until = time.monotonic() + self._confirm_grace(step, deadline)
        while not all(bundle.answered for bundle in racing):
            try:
                msgs = conn.receive(until)
            except DirectError as exc:
                log.info("engine_connection_lost", error=str(exc))
                break
            if not msgs:
                break
            for msg in msgs:
                bundle = ours.get(msg.subject[skip:])
                if bundle is None:
                    self._forward((msg,), skip)
                elif not self._take_direct(bundle, msg, stats):
                    self._on_bundle_reply(bundle, _Forwarded(msg.subject, {"Status": msg.status} if msg.status else None,
                                                             msg.data))
        self._count_racing(racing, stats)

    def _take_direct(self, bundle: _Bundle, msg, stats: LayerStats) -> bool:
        """A bundle reply read on the engine thread, taken as :meth:`_on_bundle_reply` takes it
        when it is a valid, finite answer of an honest node (True); anything else is left for
        the bus thread (False)."""
        if msg.status is not None:
            if msg.status == "503" and all(call.done or call.routes > 1 for call in bundle.calls):
                # Nobody on that node's subject (a stranger's heartbeat, or a node gone), and every
                # call of it is in another holder's bundle too: nothing to re-send, nothing for the
                # bus thread to decide. (Handing the step over cost every such step a poll period:
                # 2,000 fake bundle nodes, two of them in turn a step, doubled a generation's time.)
                self.coverage.forget_node(bundle.node)
                stats.bundles_unheard += 1
                for call in bundle.calls:
                    call.routes -= 1
                bundle.answered = True
                return True
            return False
        try:
            reply = codec.decode_bundle_reply(msg.data, n_embd=self.n_embd)
        except codec.CodecError:
            return False
        if self._forged(bundle.layer, reply, msg, bundle.payload, bundle=True):
            return True  # dropped and counted here: the node's own reply may still come
        if isinstance(reply, codec.ErrorReply) or reply.errors or reply.node != bundle.node \
                or self.auditor.is_quarantined(reply.node) or not codec.all_finite(reply.rows):
            return False
        stats.bytes_in += len(msg.data)
        self.coverage.bundle_answered(bundle.node)  # under the view's lock
        self._bundle_heard(bundle.node)
        self._take_bundle(bundle, reply, stats)
        bundle.answered = True
        return True

    def _forward(self, msgs, skip: int | None = None) -> None:
        """Replies read on the engine thread, to the bus thread's reply handler, in order."""
        if not msgs:
            return
        if skip is None:
            skip = len(self._conn.inbox) + 1
        loop, bundles = self.bus.loop, self._bundles
        for msg in msgs:
            token = msg.subject[skip:]
            bundle = bundles.get(token) if msg.status is None else None
            if bundle is not None:  # a racing replica's late bundle reply: the next steps wait for it
                self._bundle_heard(bundle.node)
            loop.call_soon_threadsafe(self._on_forwarded, token, msg.status, msg.data)

    def _on_forwarded(self, token: str, status: str | None, data: bytes) -> None:
        _start_now(self._on_reply(_Forwarded(f"{self._inbox}.{token}", {"Status": status} if status else None, data)))

    def _hand_over(self, step: _Step, deadline: float, rest, skip: int) -> None:
        """The bus thread takes the step: first the replies that made the engine thread stop,
        then its timer for what is left of the step's time."""
        self.handed_steps += 1
        self._forward(rest, skip)
        self.bus.loop.call_soon_threadsafe(self._adopt, step, max(0.0, deadline - time.monotonic()))

    def _adopt(self, step: _Step, left_s: float) -> None:
        if step.left:
            self._wait_for(step, asyncio.get_running_loop(), left_s)

    def _wait_handed(self, layer: int, calls, step: _Step, stats: LayerStats, references,
                     deadline: float, outs: list[np.ndarray | None]) -> list[np.ndarray]:
        """Wait for a handed-over step as :meth:`run_layer` waits, reading the connection in
        between: its replies now go to the bus thread."""
        give_up = deadline + _STEP_GRACE_S
        conn = self._conn
        while True:
            try:
                i = step.fallbacks.get(timeout=_HANDED_POLL_S)
            except queue.Empty:
                if time.monotonic() > give_up:
                    log.error("dispatch_step_lost", layer=layer)
                    break
                if conn is not None and not conn.closed:
                    try:
                        self._forward(conn.receive(time.monotonic() + _HANDED_POLL_S))
                    except DirectError as exc:
                        log.info("engine_connection_lost", error=str(exc))
                continue
            if i == _SETTLED:
                self._await_racing(step, stats, conn)  # checked before use, as run_layer's steps are
                break
            outs[i] = self._compute_here(layer, calls[i][0], calls[i][1], stats)
        return self._finish_step(layer, calls, step, stats, references, outs)

    def _audit_ahead(self, layer: int, calls: list[_Call]) -> dict[int, np.ndarray]:
        """The local result of every call whose reply will be audited, computed while the replies
        are on the way (this thread would only wait): an audit then costs the step a comparison,
        not a recompute. Known only for a call in exactly one node's bundle (the node that will
        answer it); the verdict stays :meth:`Auditor.should_audit`'s when the reply is used, so a
        guess made stale by a concurrent step only costs a recompute or an unused one."""
        if self.auditor.cfg.rate <= 0.0:  # audits off: would_audit says no to every call
            return {}
        before: dict[str, int] = {}  # per node, its calls whose verdicts come first (_book_wins' order)
        ahead = []
        with self._audit_lock:
            for call in calls:
                if len(call.nodes) == 1:
                    node = call.nodes[0]
                    n = before.get(node, 0)
                    before[node] = n + 1
                    if self.auditor.would_audit(node, layer, n):
                        ahead.append(call)
        return {call.index: self.local.compute(layer, call.expert, call.rows) for call in ahead}

    def _compute_here(self, layer: int, expert: int, rows: np.ndarray, stats: LayerStats) -> np.ndarray:
        stats.rows_local += len(rows)
        return self.local.compute(layer, expert, rows)

    def _plan(self, layer: int, calls, stats: LayerStats) -> _Step:
        """Decide per expert (ask and wait, only probe, or not ask at all), choose who gets it (a
        node's bundle, or the expert's subject) and encode the messages here, so the loop thread
        only publishes."""
        self._steps_planned += 1
        if self.bundles:
            self.coverage.next_turn()  # the next unproven bundle nodes get their turn
        step = _Step(layer, self.timeout.current())
        max_rows = self._max_rows()
        by_node: dict[str, list[_Call]] = {}
        coverage, ids, bundles = self.coverage, self._ids, self.bundles
        waited, probes = step.calls, step.probes
        bundled = 0
        for i, (expert, rows) in enumerate(calls):
            if coverage.is_uncovered(layer, expert):
                stats.local_choice += 1
                continue
            silent = coverage.is_silent(layer, expert)
            n = len(rows)
            chunks = [rows] if n <= max_rows else np.array_split(rows, -(-n // max_rows))  # max_payload
            call = _Call(step, i, expert, rows, chunks)
            nodes = self._bundle_nodes(layer, expert, by_node) if bundles and not silent and n <= max_rows else ()
            if nodes:
                call.tokens.append(f"{next(ids):x}")
                call.nodes, call.routes = nodes, len(nodes)
                for node in nodes:
                    node_calls = by_node.get(node)
                    if node_calls is None:
                        by_node[node] = [call]
                    else:
                        node_calls.append(call)
            else:
                step.singles += 1
                for chunk in chunks:
                    token = f"{next(ids):x}"
                    call.tokens.append(token)
                    call.payloads.append(self.requests.encode(layer, expert, token, chunk))
            if silent:  # a probe: nobody waits for it, a valid reply ends the silence
                stats.silent += 1
                probes.append(call)
            else:
                bundled += bool(nodes)
                waited.append(call)
        for node, node_calls in by_node.items():
            step.bundles.extend(self._pack(layer, node, node_calls, max_rows))
        stats.bundles += len(step.bundles)
        stats.bundled_calls += bundled
        step.left = len(waited)
        return step

    def _bundle_nodes(self, layer: int, expert: int, by_node: dict[str, list[_Call]]) -> tuple[str, ...]:
        """Who gets a call in its bundle: every honest bundle-capable holder (race), or one of them
        (balance: the fewest calls of this step so far, then the lowest smoothed round trip). A
        bundle-capable node still on probation (with sampled audits on; at ``--audit 1`` every
        reply is audited anyway) shares the bundles with at most MAX_UNPROVEN_BUNDLE_NODES - 1
        other such nodes a step, in turn, so a crowd of fake bundle nodes costs the backbone a
        bounded number of bundles a step, however many there are; every reply of theirs is
        audited until they pass."""
        nodes = self.coverage.bundle_holders(layer, expert)
        if not nodes:
            return ()
        nodes = self.auditor.honest(nodes)
        if 0 < self.auditor.cfg.rate < 1:
            unproven = [node for node in nodes if self.auditor.on_probation(node)]
            if unproven:  # a few of them a step, in turn: a crowd of strangers costs 2 bundles a step
                k = self._steps_planned % len(unproven)
                chosen = set((unproven[k:] + unproven[:k])[:MAX_UNPROVEN_BUNDLE_NODES])
                nodes = tuple(node for node in nodes if node in chosen or not self.auditor.on_probation(node))
        if len(nodes) < 2 or self.replicas is None or self.replicas.cfg.mode != "balance":
            return nodes
        book = self.replicas.book
        return (min(nodes, key=lambda node: (len(by_node.get(node, ())), book.node_mean(node) or 0.0)),)

    def _pack(self, layer: int, node: str, calls: list[_Call], max_rows: int) -> list[_Bundle]:
        """A node's calls of one step -> its bundles: usually one; more only when the request (each
        distinct row once, a row index per call row, an id per call) or the reply (every call's
        output) would pass the message size. A single call always fits (it has <= max_rows)."""
        budget = max_rows * self.n_embd * 4  # what one message may carry besides its envelope
        first = calls[0].rows
        if len(first) == 1 and all(call.rows is first for call in calls):
            # Decode: the engine hands every expert of the step the token's one row (the same
            # array), so the union is that row; it fits, as the engine's rows fit one message.
            if len(calls) * (self.n_embd * 4 + 4 + _CALL_BYTES) <= budget:
                token = f"{next(self._ids):x}"
                tokens = [call.tokens[0] for call in calls]
                payload = self.bundle_requests.encode_one_row(layer, token, first, tokens,
                                                              [call.expert for call in calls])
                return [_Bundle(node, layer, token, calls, payload, frozenset(tokens))]
        row_bytes = self.n_embd * first.itemsize
        n_rows = sum(len(call.rows) for call in calls)
        if n_rows * (self.n_embd * 4 + 4) + _CALL_BYTES * len(calls) <= budget:  # fits even if no row repeats
            union, index = _Union(), []
            for call in calls:
                index.extend(map(union.add, _row_bytes(call.rows)))
            return [self._bundle(layer, node, calls, union.array(first), index)]
        bundles, start, union, index, total = [], 0, _Union(), [], 0
        for k, call in enumerate(calls + [None]):
            n = 0 if call is None else len(call.rows)
            calls_bytes = _CALL_BYTES * (k - start + 1)
            request = (len(union.rows) + n) * row_bytes + 4 * (total + n) + calls_bytes  # the new rows, at worst
            reply = (total + n) * self.n_embd * 4 + calls_bytes
            if call is None or (k > start and max(request, reply) > budget):
                bundles.append(self._bundle(layer, node, calls[start:k], union.array(first), index))
                start, union, index, total = k, _Union(), [], 0
            if call is not None:
                index.extend(map(union.add, _row_bytes(call.rows)))
                total += n
        return bundles

    def _bundle(self, layer: int, node: str, calls: list[_Call], rows: np.ndarray, index: list[int]) -> _Bundle:
        """One bundle: ``rows`` each distinct row once, ``index`` each call's rows in them."""
        token = f"{next(self._ids):x}"
        tokens = [call.tokens[0] for call in calls]
        payload = self.bundle_requests.encode(layer, token, rows, tokens, [call.expert for call in calls],
                                              [len(call.rows) for call in calls], index)
        return _Bundle(node, layer, token, calls, payload, frozenset(tokens))

    def _accept(self, layer: int, expert: int, rows: np.ndarray, won: _Won, audited: list[bool],
                reference: np.ndarray | None = None) -> np.ndarray:
        """A won call: audited (``audited``: the auditor's verdict per part, taken by
        :meth:`_book_wins`) when the auditor said so, then the local result is used (``reference``
        when it was computed ahead); credit the nodes whose parts were not caught lying."""
        out = won.out
        honest = won.parts
        taken = time.time()  # before any audit of it passes: a win older than the pass it earns
        if True in audited:
            out = reference if reference is not None else self.local.compute(layer, expert, rows)
            honest = [part for part in won.parts if self._audit(layer, expert, rows, out, part)]
        if self.recorder is not None:
            for part in honest:
                self.recorder.record_win(part.node, layer, expert, len(part.out), latency_s=won.latency_s, at=taken)
        return out

    def _audit(self, layer: int, expert: int, rows: np.ndarray, reference: np.ndarray, part: _Part) -> bool:
        stats = self.stats.layer(layer)
        stats.audits += 1
        key = (part.kernel, self.local.backend)
        how = self._reruns.get(key)
        if how is None:  # a label per node and kernel, from strangers: a bounded cache
            if len(self._reruns) >= 64:
                self._reruns.clear()
            how = self._reruns[key] = (*rerun_backend(*key), rerun_plain(*key))
        backend, exact, plain = how
        whole = part.rows == slice(0, len(rows))
        chunk = rerun_rows(part.kernel, self.local.backend)  # > 0: a -det worker, rerun in its kernel's chunks
        plain = {"plain": True} if plain else {}  # a node with plain experts, rerun by a backbone that repacks
        explain = getattr(self.local, "explained_gap", None)
        gap = None
        if not exact and not numpy_family(part.kernel) and explain is not None:
            # a kernel we cannot rerun: its quant-step flips are taken out before the bound applies
            mine, theirs = rows[part.rows], part.out
            if len(mine) > EXPLAINED_ROWS:  # the numpy rerun's cost bounded: rows the node could not foresee
                pick = np.sort(self._audit_rng.choice(len(mine), EXPLAINED_ROWS, replace=False))
                mine, theirs = mine[pick], theirs[pick]
            gap = explain(layer, expert, mine, theirs)
            ref = None
        elif chunk:
            mine = rows[part.rows]
            ref = np.concatenate([self.local.compute(layer, expert, mine[i:i + chunk], backend=backend, **plain)
                                  for i in range(0, len(mine), chunk)])
        elif whole and backend == self.local.backend and not plain:
            ref = reference[part.rows]
        else:
            ref = self.local.compute(layer, expert, rows[part.rows], backend=backend, **plain)
        passed = self.auditor.judge(part.node, part.out, ref, exact=exact, weight_type=self.local.weight_type(layer),
                                    kernel=part.kernel, gap=gap)
        if self.recorder is not None:  # the market counts every node's audits, passes too
            self.recorder.record_audit(part.node, passed)
        if passed:
            if self.bundles and not self.auditor.on_probation(part.node):
                self.coverage.mark_proven(part.node)  # bundles from now on, without waiting its turn
            return True
        stats.audit_failures += 1
        error = gap if ref is None else relative_error(part.out, ref) if part.out.shape == ref.shape else float("inf")
        if part.node not in self.stats.quarantined:
            self.stats.quarantined.append(part.node)
            log.warning("node_quarantined", node=part.node, layer=layer, expert=expert, kernel=part.kernel,
                        exact=exact, relative_error=error)
            since = self.auditor.last_pass_at(part.node)
            event = market_codec.Quarantine(model=self.model, node=part.node, layer=layer, expert=expert,
                                            kernel=part.kernel, exact=exact, error=error, at=time.time(),
                                            since=since)
            self.bus.submit(self._publish_quarantine(event))
            if self.recorder is not None:  # what its last passed audit vouched for stays
                self.recorder.void(part.node, since)
        return False

    async def _publish_quarantine(self, event: market_codec.Quarantine) -> None:
        try:
            signed = self.signer.headers(event.encode()) if self.signer is not None else {}  # the same bytes as sent
            await self.nc.publish(self.subjects.quarantine(), event.encode(), headers={**codec.headers_for(event), **signed})
        except Exception as exc:  # the bus is down: the node stays quarantined here all the same
            log.warning("quarantine_publish_failed", node=event.node, error=str(exc))

    def _max_rows(self) -> int:
        """Rows per message under the server's max_payload. Chunks are split evenly, so each
        is far above the 8 rows where ggml's K-quant kernels change regime (bit-identity)."""
        limit = getattr(self.nc, "max_payload", None) or codec.DEFAULT_MAX_BYTES
        return max(1, (limit - _ENVELOPE_BYTES) // (self.n_embd * 4))

    # -- the bus side (the loop thread) --------------------------------------------------------

    def _send(self, step: _Step) -> None:
        _start_now(self._publish_step(step))

    async def _publish_step(self, step: _Step) -> None:
        """Publish every request of a layer step, then put the step under the shared timer.

        A step costs one socket write (one flush), not one per expert: straight to the socket
        when that is safe (:meth:`kvasir_bus.lane.DirectPublish.write_all`, no flusher task), else
        every request through ``nc.publish`` before nats.py's flusher can run, which writes
        everything pending in one ``writelines``. Replica policies (a queue group, hedged requests)
        hook in here."""
        layer = step.layer
        self._register(step)  # before the first publish: a reply may come at once
        stats = self.stats.layer(layer)
        step.t0 = time.perf_counter()
        subject_of = self.subjects.dispatch
        reply_to = self._inbox + "."
        sent = 0
        try:
            messages = [(self._node_subject(bundle.node), reply_to + bundle.token, bundle.payload)
                        for bundle in step.bundles]
            for call in (*step.calls, *step.probes) if step.singles else ():
                if call.nodes:
                    continue  # in its nodes' bundles
                subject = subject_of(layer, call.expert)
                messages.extend((subject, reply_to + token, payload)
                                for token, payload in zip(call.tokens, call.payloads))
            if self._direct is not None and self._direct.write_all(messages):
                sent = sum(len(payload) for _, _, payload in messages)
            else:
                for subject, reply, payload in messages:
                    await self.nc.publish(subject, payload, reply=reply)
                    sent += len(payload)
        except Exception as exc:
            log.warning("dispatch_send_failed", layer=layer, error=str(exc))
            for call in step.calls:
                if not call.done:
                    stats.bus_errors += 1
                    self._settle(call, "error")
            return
        finally:
            stats.bytes_out += sent
        if step.left:
            loop = asyncio.get_running_loop()
            self._wait_for(step, loop)
            if self.replicas is not None and self.replicas.cfg.mode == "balance":  # ask again after the usual wait
                for call in step.calls:
                    delay = self.replicas.hedge_delay(layer, call.expert)
                    if delay is not None and delay < step.timeout_s:
                        loop.call_later(delay, self._hedge, call, 1, delay)

    def _register(self, step: _Step) -> None:
        """Make a step's tokens known, so that its replies find their calls."""
        for call in step.calls:
            for k, token in enumerate(call.tokens):
                self._pending[token] = (call, k)
        for call in step.probes:
            for token in call.tokens:
                self._probes[token] = (step.layer, call.expert)
        while len(self._probes) > 4096:
            self._probes.popitem(last=False)
        for bundle in step.bundles:
            self._bundles[bundle.token] = bundle
        while len(self._bundles) > 4096:
            self._bundles.popitem(last=False)

    def _wait_for(self, step: _Step, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None) -> None:
        """Expire ``step`` at its deadline (``timeout_s`` from now, its own timeout by default)
        unless it settles first: the shared timer is re-armed only when this deadline comes
        before the one it is set for."""
        deadline = loop.time() + (step.timeout_s if timeout_s is None else timeout_s)
        self._waiting[step] = deadline
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = loop.call_at(deadline, self._on_timer), deadline

    def _on_timer(self) -> None:
        """Expire every waiting step whose deadline has come; set the timer for the next one."""
        due, self._timer = self._timer_at, None
        for step, deadline in list(self._waiting.items()):
            if deadline <= due:
                del self._waiting[step]
                self._expire(step)
        if self._waiting:
            deadline = min(self._waiting.values())
            self._timer, self._timer_at = asyncio.get_running_loop().call_at(deadline, self._on_timer), deadline

    def _node_subject(self, node: str) -> str:
        subject = self._node_subjects.get(node)
        if subject is None:
            subject = self._node_subjects[node] = self.subjects.node(node)
            if len(self._node_subjects) > 4096:  # nodes come and go; their names are only a cache
                self._node_subjects.clear()
        return subject

    def _payloads(self, call: _Call) -> list[bytes]:
        """A call's requests on its expert's subject (a bundled call gets them when first needed)."""
        if not call.payloads:
            layer = call.step.layer
            call.payloads = [self.requests.encode(layer, call.expert, token, chunk)
                             for token, chunk in zip(call.tokens, call.chunks)]
        return call.payloads

    def _send_per_expert(self, call: _Call) -> None:
        """Ask for a call's unanswered chunks on its expert's subject, under the same tokens."""
        subject = self.subjects.dispatch(call.step.layer, call.expert)
        reply_to = self._inbox + "."
        for k, (token, payload) in enumerate(zip(call.tokens, self._payloads(call))):
            if call.parts[k] is None:
                asyncio.get_running_loop().create_task(self.nc.publish(subject, payload, reply=reply_to + token))

    def _hedge(self, call: _Call, n: int, delay: float) -> None:
        """Re-send a call's unanswered chunks (the ``n``-th time) to the same reply tokens on the
        expert's subject: a queue group picks a member again, the first reply wins, the step's
        timer stays behind."""
        if call.done or self.replicas is None:
            return
        self.replicas.hedges += 1
        self.replicas.hedged_calls += n == 1
        self._send_per_expert(call)
        if n < self.replicas.cfg.max_hedges and (n + 1) * delay < call.step.timeout_s:
            asyncio.get_running_loop().call_later(delay, self._hedge, call, n + 1, delay)

    def _settle(self, call: _Call, how: str) -> None:
        """The call is decided: won (``call.won`` is set) or to be computed here (``how`` says why)."""
        call.done = True
        if call.liar_timer is not None:
            call.liar_timer.cancel()
        step = call.step
        if how != "won":  # a won call's tokens went to _finished as their answers came
            for token in call.tokens:
                if self._pending.pop(token, None) is not None:
                    self._finished[token] = (how, step.layer, call.expert)
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)
        if call.won is None:
            step.fallbacks.put(call.index)
        step.left -= 1
        if step.left == 0:
            self._waiting.pop(step, None)
            step.fallbacks.put(_SETTLED)

    def _expire(self, step: _Step) -> None:
        stats = self.stats.layer(step.layer)
        for call in step.calls:
            if call.done:
                continue
            stats.timeouts += 1
            self.timeout.timed_out()
            self.coverage.mark_silent(step.layer, call.expert)
            for node in call.nodes:  # a bundle that let its call time out: none to that node for a while
                self.coverage.bundle_unanswered(node)
                if self.replicas is not None:
                    self.replicas.book.observe_node(node, step.timeout_s)
            self.refusals.info(("timeout", step.layer), "dispatch_timeout", layer=step.layer, expert=call.expert,
                               timeout_ms=round(1000 * self.timeout.current(), 1))
            self._settle(call, "timeout")

    def _only_liars(self, call: _Call) -> None:
        """Only quarantined nodes answered, and no honest replica within a short grace after."""
        if not call.done:
            self.coverage.mark_silent(call.step.layer, call.expert)  # probe from now on: a liar's word is no life
            self._settle(call, "ignored")

    def _win(self, call: _Call, latency_s: float | None = None) -> None:
        """Every chunk of the call came back valid: it is won (``latency_s``: its round trip, when
        the caller measured it already). Only what the engine needs is done here; the books
        (latency, coverage, counters, metrics) are kept by :meth:`_book_wins` on the engine's
        thread, once per step, after it has woken up."""
        if latency_s is None:
            latency_s = time.perf_counter() - call.step.t0
        call.won = _Won(tuple(call.parts), latency_s)
        self._settle(call, "won")

    def _book_wins(self, layer: int, calls: list[_Call]) -> list[tuple[_Call, list[bool]]]:
        """The bookkeeping of a step's won calls, in one pass under one lock (two micro-batches may
        book at once): the adaptive timeout, the expert's coverage and latency record, the
        counters per layer and per node, the metrics hook; and the auditor's verdict on each of
        their parts (whether it is recomputed here). Returns the won calls with their verdicts."""
        won = [call for call in calls if call.won is not None]
        if not won:
            return []
        stats = self.stats.layer(layer)
        nodes, node_rows, node_latency = self.stats.nodes, self.stats.node_rows, self.stats.node_latency_s
        observe, mark_answered, timeout = self.observe_reply, self.coverage.mark_answered, self.timeout
        should_audit = self.auditor.should_audit
        verdicts = []
        rows_remote, latency_sum = 0, 0.0
        with self._audit_lock:  # two micro-batches may book one layer's stats at once
            latency_max = stats.latency_max_s
            for call in won:
                parts, latency = call.won
                node = parts[0].node
                n = len(call.rows)
                mark_answered(layer, call.expert)
                timeout.observe(latency)
                rows_remote += n
                latency_sum += latency
                if latency > latency_max:
                    latency_max = latency
                nodes[node] += 1
                node_rows[node] += n
                node_latency[node] += latency
                observe is None or observe(layer, latency)
                verdicts.append((call, [should_audit(node, layer)] if len(parts) == 1 else
                                 [should_audit(part.node, layer) for part in parts]))
            stats.remote += len(won)
            stats.rows_remote += rows_remote
            stats.latency_sum_s += latency_sum
            stats.latency_max_s = latency_max
        if self.replicas is not None:
            self.replicas.book.observe_wins(layer, [(call.expert, call.won.parts[0].node, call.won.latency_s)
                                                    for call in won])
        return verdicts

    def _check_reply(self, layer, expert, token, chunk, reply) -> codec.DispatchReply | _Answer | None:
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
        elif not (isinstance(reply, _Answer) and reply.finite) and not codec.all_finite(reply.rows):
            problem = "NaN or Inf in the rows"
        if problem:
            self.refusals.warning(("invalid", reply.node), "reply_invalid", layer=layer, expert=expert,
                                  node=reply.node, error=problem)
            return None
        return reply

    def _decode(self, data: bytes):
        """A reply's bytes -> DispatchReply, ErrorReply, or the CodecError saying what is wrong."""
        try:
            return codec.decode_reply(data, n_embd=self.n_embd)
        except codec.CodecError as exc:
            return exc

    async def _on_reply(self, msg) -> None:
        token = msg.subject[len(self._inbox) + 1:]
        entry = self._pending.get(token)
        if entry is None:
            bundle = self._bundles.get(token)
            if bundle is not None:
                self._on_bundle_reply(bundle, msg)
            else:  # a probe's reply, one after its timeout, or a replica that lost the race
                self._on_stray_reply(token, msg)
            return
        call, k = entry
        layer = call.step.layer
        if msg.headers and msg.headers.get("Status") == "503":
            self.coverage.mark_uncovered(layer, call.expert)
            self.stats.layer(layer).no_responders += 1
            self._settle(call, "no_responders")
            return
        self.stats.layer(layer).bytes_in += len(msg.data)
        reply = self._decode(msg.data)
        if self._forged(layer, reply, msg, _sent(call, k)):
            return  # not the named node's: wait for the real replicas, blame nobody
        self._on_answer(call, k, token, reply)

    def _forged(self, layer: int, reply, msg, request: bytes | None, bundle: bool = False) -> bool:
        """Whether a reply names a self-certifying or enrolled node without that node's proof
        (counted, dropped). ``request``: the payload the reply answers (a self-certifying node's
        proof is bound to it; None where no such request went out). A bundle reply (``bundle``) is
        checked for self-certifying names only: an enrolled node's bundle subject is its own under
        creds, and its header proof does not survive the engine thread's connection."""
        if not isinstance(reply, (codec.DispatchReply, codec.ErrorReply, codec.BundleReply)):
            return False
        if bundle:
            if not self.proofs.self_named(reply.node) or self.proofs.sealed_by(reply.node, msg.data, request):
                return False
        elif self.proofs.holds(reply.node, msg.data, msg.headers, request):
            return False
        self.stats.layer(layer).forged += 1
        self.refusals.warning(("forged", reply.node), "reply_forged", layer=layer, node=reply.node,
                              hint="a reply under this node's name without its proof: another sender's lie")
        return True

    def _on_bundle_reply(self, bundle: _Bundle, msg) -> None:
        """One node's answer to its bundle: each call's part goes the way a single reply goes;
        then a won step waiting for it as a racing replica (:meth:`_await_racing`) hears so."""
        taken = False
        try:
            taken = self._take_bundle_reply(bundle, msg)
        finally:
            if taken:  # not a forgery or bytes nobody can vouch for: the node's own answer came
                bundle.answered = True
            step = bundle.step
            confirming = step.confirming if step is not None else None
            if confirming is not None and all(b.answered for b in confirming[0]):
                confirming[1].set()

    def _take_bundle_reply(self, bundle: _Bundle, msg) -> bool:
        """Whether what came is the node's answer (a 503 included): a forged or undecodable reply
        leaves a racing replica's wait (:meth:`_await_racing`) waiting for the real one."""
        stats = self.stats.layer(bundle.layer)
        if msg.headers and msg.headers.get("Status") == "503":  # nobody on the node's subject: it is gone
            self.coverage.forget_node(bundle.node)
            stats.bundles_unheard += 1
            for call in bundle.calls:
                call.routes -= 1
                if not call.done and call.routes == 0:
                    self._send_per_expert(call)  # as a call without a bundle holder; its 503 settles it
            return True
        stats.bytes_in += len(msg.data)
        taken = False
        try:
            reply = codec.decode_bundle_reply(msg.data, n_embd=self.n_embd)
            if reply.node != bundle.node:
                raise codec.CodecError(f"bundle reply: node {reply.node!r} answers a bundle sent to {bundle.node!r}")
            if self._forged(bundle.layer, reply, msg, bundle.payload, bundle=True):
                return False  # an eavesdropper on the node's subject: wait for the node, blame nobody
            taken = True
            self.coverage.bundle_answered(bundle.node)
            self._bundle_heard(bundle.node)
            if isinstance(reply, codec.ErrorReply):  # the whole bundle refused: each call hears why
                answers = [(token, codec.ErrorReply(token, reply.node, reply.code, reply.message))
                           for token in bundle.tokens]
            else:
                finite = codec.all_finite(reply.rows)  # one check for every call; if not, each call's own
                if finite and not self.auditor.is_quarantined(reply.node):
                    self._take_bundle(bundle, reply, stats)
                    answers = []
                else:
                    answers = [(rid, _Answer(rid, reply.node, rows, reply.kernel, finite))
                               for rid, rows in reply.results()]
                answers += [(rid, codec.ErrorReply(rid, reply.node, code, message))
                            for rid, code, message in reply.errors]
        except codec.CodecError as exc:
            answers = [(token, exc) for token in bundle.tokens]
        for token, answer in answers:
            if token not in bundle.tokens:
                stats.foreign += 1  # only what was sent to this node can be answered by it
                continue
            entry = self._pending.get(token)
            if entry is None:
                self._count_stray(token, lambda answer=answer: answer)
            else:
                self._on_answer(entry[0], entry[1], token, answer)
        return taken

    def _take_bundle(self, bundle: _Bundle, reply: codec.BundleReply, stats: LayerStats) -> None:
        """The outputs of a valid bundle reply from an honest node, every row finite: what
        :meth:`_on_answer` does for each, without an intermediate record per call. A call whose
        rows have the wrong shape takes :meth:`_on_answer`'s path, which refuses it. Every call it
        wins gets the reply's one round trip (its calls came back together)."""
        node, kernel, tokens, pending, finished = reply.node, reply.kernel, bundle.tokens, self._pending, self._finished
        latency = -1.0
        for rid, rows in reply.results():
            if rid not in tokens:
                stats.foreign += 1  # only what was sent to this node can be answered by it
                continue
            entry = pending.get(rid)
            if entry is None:
                self._count_stray(rid, lambda rid=rid, rows=rows: _Answer(rid, node, rows, kernel, True))
                continue
            call, k = entry
            if k or rows.shape != call.chunks[0].shape:  # a bundled call is one chunk
                self._on_answer(call, k, rid, _Answer(rid, node, rows, kernel, True))
                continue
            del pending[rid]
            finished[rid] = ("won", bundle.layer, call.expert)
            self._keep_won(rid, call, 0)
            call.parts[0] = _Part(slice(0, len(rows)), rows, node, kernel)
            call.left -= 1
            if call.left == 0:
                if latency < 0.0:
                    latency = time.perf_counter() - call.step.t0
                self._win(call, latency)

    def _on_answer(self, call: _Call, k: int, token: str, reply) -> None:
        """A reply (or what its decoding raised) for chunk ``k`` of a pending call."""
        layer = call.step.layer
        stats = self.stats.layer(layer)
        if isinstance(reply, (_Answer, codec.DispatchReply, codec.ErrorReply)) and self.auditor.is_quarantined(reply.node):
            stats.ignored += 1  # a liar: wait a little longer for an honest replica
            if call.liar_timer is None:
                grace = max(self.cfg.timeout_floor_s, 2 * (self.timeout.srtt or 0.0))
                call.liar_timer = asyncio.get_running_loop().call_later(grace, self._only_liars, call)
            return
        del self._pending[token]
        self._finished[token] = ("won", layer, call.expert)
        part = self._check_reply(layer, call.expert, token, call.chunks[k], reply)
        if part is None:
            stats.invalid += 1
            self._settle(call, "invalid")
            return
        start = sum(len(c) for c in call.chunks[:k]) if k else 0
        call.parts[k] = _Part(slice(start, start + len(call.chunks[k])), part.rows, part.node, part.kernel)
        self._keep_won(token, call, k)
        call.left -= 1
        if call.left == 0:
            self._win(call)

    def _on_stray_reply(self, token: str, msg) -> None:
        probe = self._probes.pop(token, None)
        if probe is not None:
            if msg.headers and msg.headers.get("Status") == "503":
                self.coverage.mark_uncovered(*probe)
            elif self._shows_life(probe, self._decode(msg.data)):
                self.stats.layer(probe[0]).probes_answered += 1
            return
        # A forged loser must not start a dispute against the named node. Only a won call's loser
        # can, while the call is kept for comparison (its request with it); a late reply only
        # shows its expert's life, which a stranger may show under its own name as well.
        how, layer, _ = self._finished.get(token, ("unknown", -1, -1))
        reply = self._decode(msg.data)
        if layer >= 0 and isinstance(reply, (codec.DispatchReply, codec.ErrorReply)):
            if not self.proofs.self_named(reply.node):
                if self._forged(layer, reply, msg, None):
                    return
            elif how == "won":
                won = self._won_recent.get(token)
                if won is None:
                    return  # nothing left to compare it with: dropped unchecked, blaming nobody
                if self._forged(layer, reply, msg, _sent(*won)):
                    return
        self._count_stray(token, lambda: reply)

    def _count_stray(self, token: str, decode) -> None:
        """A reply for a call already settled: late (its expert still shows life) or a duplicate.
        ``decode()`` gives the reply, only when it is needed."""
        how, layer, expert = self._finished.get(token, ("unknown", -1, -1))
        if layer >= 0:
            stats = self.stats.layer(layer)
            if how in ("timeout", "unanswered"):
                stats.late += 1
                self._shows_life((layer, expert), decode())  # slow is not silent
            elif how == "won":
                stats.duplicates += 1
                self._compare_loser(token, decode())

    def _keep_won(self, token: str, call: _Call, k: int) -> None:
        if len(call.nodes) > 1 or not call.nodes:  # a replica may race it (a call in one bundle: none can)
            won = self._won_recent
            won[token] = (call, k)
            self._won_bytes += call.chunks[k].nbytes
            while len(won) > _WON_KEPT or self._won_bytes > _WON_KEPT_BYTES:
                old_call, old_k = won.popitem(last=False)[1]
                self._won_bytes -= old_call.chunks[old_k].nbytes

    def _compare_loser(self, token: str, reply) -> None:
        """A racing replica's reply to a call another node won: compare it with the winner's (the
        same bits when both announce one kernel, the cross-kernel tolerance otherwise). On a
        mismatch both are audited here (:meth:`_settle_disputes`, on the engine thread), and a
        call whose step is still open is recomputed before it is used."""
        entry = self._won_recent.pop(token, None)
        if entry is None:
            return
        call, k = entry
        self._won_bytes -= call.chunks[k].nbytes
        if not isinstance(reply, (_Answer, codec.DispatchReply)):
            return
        winner = call.parts[k]
        if winner is None or reply.node == winner.node or self.auditor.is_quarantined(reply.node) \
                or self.auditor.is_quarantined(winner.node):
            return
        same = bool(winner.kernel) and reply.kernel == winner.kernel
        layer = self._finished.get(token, ("", -1, -1))[1]
        if layer < 0:
            return
        agree = reply.rows.shape == winner.out.shape and (
            np.array_equal(reply.rows, winner.out) if same else
            replies_agree(reply.rows, winner.out, same_kernel=False, weight_type=self.local.weight_type(layer)))
        if agree:
            return
        self.stats.layer(layer).disputes += 1
        call.disputed = True
        loser = _Part(winner.rows, np.asarray(reply.rows, np.float32), reply.node, reply.kernel)
        self._disputes.append((layer, call.expert, call.rows, winner, loser))

    def _settle_disputes(self) -> None:
        """Audit both sides of every disagreement between racing replicas (engine thread): the
        one that differs from the backbone's own result is quarantined, as by any audit."""
        while self._disputes:
            try:
                layer, expert, rows, winner, loser = self._disputes.popleft()
            except IndexError:
                return
            reference = self.local.compute(layer, expert, rows)
            with self._audit_lock:
                for part in (winner, loser):
                    if not self.auditor.is_quarantined(part.node):
                        self._audit(layer, expert, rows, reference, part)

    def _shows_life(self, key: tuple[int, int], reply) -> bool:
        """A valid reply of an honest node, even one too late to use: the expert is not silent."""
        if isinstance(reply, (_Answer, codec.DispatchReply)) and not self.auditor.is_quarantined(reply.node) \
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
