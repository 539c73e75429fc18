"""The worker runtime: serve the experts of one slice on the bus.

A :class:`Worker` subscribes to exactly the dispatch subjects of the experts it holds
(``kvasir.<model>.x.<layer>.<expert>``), answers each request with the expert function
(:func:`kernels.expert.expert_ffn`, the code the backbone runs for its own fallback), and
announces its holdings on ``kvasir.<model>.coverage.<node>`` every few seconds. It also takes
*bundles* on its own node subject ``kvasir.<model>.n.<node>`` (and says so in its heartbeat):
every call of a layer step that the backbone sends to this node in one request, the rows once,
answered with one reply that carries per call its output or why not (``not_held``). A decode
bundle (one row for every call) runs the experts of each held range in one ``mul_mat_id`` graph
(:func:`kernels.expert.moe_ffn`, bit for bit each call alone), not one graph per expert.

Every request is validated (model, layer, expert held, dtype, shape, size limits); a bad one
gets an :class:`~kvasir_bus.codec.ErrorReply` and the worker keeps serving. A small product (a
decode row of a small expert) is computed and answered on the event loop: a hop to a thread and
back would cost more than the product. A big one runs on a thread pool while the loop decodes
the next request; many can be in flight at once. A decode bundle (one row per call) that finds
the pool idle is computed on the loop up to a few ms of work (nothing to overlap; the hop is two
thread wake-ups), big experts too in one graph (122b shapes, q4_k, 4 experts on one thread: 2.5-2.9
ms against 2.9-3.1 for four graphs, bit for bit the same). ``stop()`` drains: no new requests, in-flight
ones finish and are answered, then the connection closes.

What a request costs besides its kernel is measured by ``bench/dispatch.py --overhead``; the
hot path keeps to: the handler called where nats.py parses the message (:mod:`kvasir_bus.lane`: no
queue, no task wake-up), one decode by a decoder built for this slice's model, width and limits
(a view on the received bytes, no copy; every check the record makes), one subject lookup for
the expected (layer, expert, weights) or, for a decode step's bundle, one table lookup per call
and one graph bound once per holding and call count (:func:`kernels.expert.moe_step`: the row
copied in, no plan lookup, allocation or pointer binding per call), one encode with node and
kernel checked once, no task, no log line, no NATS header. A worker named by its own key
(a self-certifying name, :mod:`workers.identity`) ends each reply with its proof to the asking
backbone, bound to the request it answers (:meth:`kvasir_bus.attribution.NodeKey.seal`: one
HMAC, in the payload, so the direct reply path stays open).
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import structlog

from kvasir_bus import __version__, codec, micro
from kvasir_bus.subjects import Subjects, parse_dispatch
from kvasir_bus.throttle import ThrottledLog
from kvasir_bus import lane
from kvasir_bus.lane import InlineDelivery
from kernels.expert import expert_ffn, moe_ffn, moe_step, one_thread, prepare
from kernels.backend import backend_name, kernel_label
from modelfile.slice_file import SliceInfo

log = structlog.get_logger("kvasir.worker")


#: Round trips after the first flush in which a refusal of the node subject is looked for.
_REFUSAL_ROUND_TRIPS = 3


def _refused(error: BaseException | None, before: BaseException | None, subject: str) -> bool:
    """Whether the connection's last error is a new permission violation naming ``subject``
    (nats-py keeps the server's -ERR as ``last_error``, lowercased)."""
    text = str(error).lower()
    return error is not before and "permissions violation" in text and subject.lower() in text


def default_node_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{host or 'worker'}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    node: str
    heartbeat_s: float = 2.0
    max_rows: int = 16384  # rows in one request
    max_bytes: int = codec.DEFAULT_MAX_BYTES  # bytes of one request
    compute_threads: int = 1  # ggml already uses every core inside one call
    queue_group: str | None = None  # None: replicas race (first reply wins); a name: load-balance
    budget_bytes: int = 0
    drain_timeout_s: float = 30.0
    metrics: str | None = None  # [HOST:]PORT to serve Prometheus /metrics on (workers.metrics)
    max_in_flight: int = 256  # requests decoded or computing at once; more are refused (overloaded)
    log_interval_s: float = 60.0  # one refusal line per sender and kind this often
    bundles: bool = True  # take bundles on kvasir.<model>.n.<node> (and announce it)
    inline_delivery: bool = True  # handle requests where nats.py parses them (kvasir_bus.lane), if it can
    direct_reply: bool = True  # write replies straight to the socket (kvasir_bus.lane.DirectReply), if it can
    reply_key: bytes = b""  # enrolled: every reply carries Kvasir-Proof under it (kvasir_bus.attribution)
    # A self-certifying identity (kvasir_bus.attribution.NodeKey): when ``node`` is its name, every
    # reply ends with the node's key and a proof to the backbone whose box the request carried.
    node_key: object = None


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Worker:
    def __init__(self, slice_info: SliceInfo, cfg: WorkerConfig):
        self.slice, self.cfg = slice_info, cfg
        self.subjects = Subjects(slice_info.fingerprint)
        self.state = State.NEW
        self.served = 0
        self.errors = 0
        self.rows = 0
        self.compute_s = 0.0  # kernel time of every request served, for $SRV.STATS
        self.on_compute = None  # metrics hook: (layer, seconds) per request (workers.metrics)
        self._service = None  # the $SRV micro service (kvasir_bus.micro)
        self.metrics_server = None  # kvasir_bus.metrics.MetricsServer, with cfg.metrics
        self._nc = None
        self._subs = []
        self.takes_bundles = cfg.bundles  # False once the server refuses this node's bundle subject
        self._node_sub = None  # that subscription, while it stands
        self._error_before = None  # the connection's last error before it was made
        self._tasks: set[asyncio.Task] = set()  # requests on the compute pool
        self._inline = 0  # requests computed on the loop right now (0 or 1)
        self._routes: dict[str, tuple[int, int, tuple]] = {}  # subject -> (layer, expert, weights)
        self._weights: dict[tuple[int, int], tuple] = {}  # (layer, expert) -> weights, for bundles
        self._slot: dict[tuple[int, int], tuple[codec.Holding, int]] = {}  # -> (its holding, slab index)
        # layer -> expert -> (its holding, slab index); holding -> (slabs, work per row and call):
        # what a decode bundle needs, found with two lookups per call (_decode_step)
        self._held: dict[int, dict[int, tuple[codec.Holding, int]]] = {}
        self._holding_plan: dict[codec.Holding, tuple[tuple, int]] = {}
        # (holding, calls) -> its decode step's graph, bound once (kernels.expert.moe_step); at most
        # MAX_STEPS, then moe_ffn's own per-thread cache serves the rest
        self._steps: dict[tuple[codec.Holding, int], object] = {}
        self._one_graph = backend_name() == "ggml"  # a decode bundle's experts in one mul_mat_id graph
        self._heartbeat: asyncio.Task | None = None
        self._lane: InlineDelivery | None = None  # requests and bundles straight from the reader
        self._direct: lane.DirectReply | None = None  # replies straight to the socket
        self._pool = ThreadPoolExecutor(max_workers=cfg.compute_threads, thread_name_prefix="expert")
        self._kernel = kernel_label()  # announced in heartbeats and replies: how audits compare
        self._replies = codec.ReplyEncoder(cfg.node, self._kernel)  # node and kernel checked once
        key = cfg.node_key  # kvasir_bus.attribution.NodeKey: seals replies only under its own name
        self._sealer = key if key is not None and getattr(key, "name", None) == cfg.node else None
        self._bundle_replies = codec.BundleReplyEncoder(cfg.node, self._kernel)
        # model, width and limits fixed once; anything else takes the full decoder and its error
        self._requests = codec.RequestDecoder(slice_info.fingerprint, slice_info.n_embd, cfg.max_rows, cfg.max_bytes)
        self._bundles = codec.BundleDecoder(slice_info.fingerprint, slice_info.n_embd, cfg.max_rows, cfg.max_bytes)
        self.log = log.bind(node=cfg.node, model=slice_info.fingerprint)
        # Bad requests come from strangers: one line per sender and kind a minute, not one each.
        self.refusals = ThrottledLog(self.log, cfg.log_interval_s)

    @property
    def in_flight(self) -> int:
        """Requests being computed: on the pool, or the one on the loop right now."""
        return len(self._tasks) + self._inline

    async def start(self, nc) -> None:
        """Subscribe to every held expert's subject, then announce coverage."""
        if self.state is not State.NEW:
            raise RuntimeError(f"worker already {self.state.value}")
        self._nc = nc
        if self.cfg.metrics is not None:  # first: a port in use fails before we subscribe
            await self._start_metrics()
        self._index_holdings()
        await self._prepare_kernels()
        if self.cfg.inline_delivery and lane.supported(nc):
            self._lane = InlineDelivery(nc, self._handler_failed)
        if self.cfg.direct_reply:
            self._direct, why_not = lane.DirectReply.attach(nc)
            if why_not is not None:
                self.log.info("direct_reply_off", reason=why_not)
        kw = {"queue": self.cfg.queue_group} if self.cfg.queue_group else {}
        for subject in self._routes:
            await self._subscribe(subject, self._on_request, **kw)
        self._error_before = nc.last_error
        if self.cfg.bundles:  # this node's own subject: never a queue group, only we hold it
            self._node_sub = await self._subscribe(self.subjects.node(self.cfg.node), self._on_bundle)
        await nc.flush()  # subscriptions are live on the server before we say so
        # A refusal of the node subject may come a round trip after the flush's PONG: look
        # a few round trips more (and again before every heartbeat).
        for _ in range(_REFUSAL_ROUND_TRIPS):
            if not self._node_sub or await self.check_bundle_subject():
                break
            await nc.flush()
        self.state = State.RUNNING
        self._service = await micro.start_service(nc, self.card(), [self._served()])
        await self._publish_heartbeat()
        self._heartbeat = asyncio.create_task(self._heartbeat_loop())
        self.log.info("worker_started", experts=self.slice.n_held, holdings=len(self.slice.holdings),
                      kernel=self._kernel, subjects=len(self._subs), inline=self._lane is not None,
                      direct=self._direct is not None)

    async def _subscribe(self, subject: str, handler, **kw):
        sub = await self._nc.subscribe(subject, cb=handler, **kw)  # the ordinary path, for what the lane passes on
        self._subs.append(sub)
        if self._lane is not None:
            self._lane.add(sub, handler)
        return sub

    async def check_bundle_subject(self) -> bool:
        """Whether the server refused this node's bundle subject (its permissions were written
        before bundles); if so, serve one request per expert and say so in the heartbeat,
        instead of announcing bundles that nobody would receive."""
        sub = self._node_sub
        if sub is None or not _refused(self._nc.last_error, self._error_before, sub.subject):
            return False
        self._node_sub, self.takes_bundles = None, False
        self._subs.remove(sub)
        await sub.unsubscribe()
        self.log.warning("bundles_refused", subject=sub.subject,
                         hint="the server's permissions predate bundles: run `kvasir creds refresh DIR` "
                              "and `nats-server --signal reload`; serving one request per expert meanwhile")
        return True

    def _handler_failed(self, exc: BaseException) -> None:
        """A handler let an exception through (a bug: each refuses bad input itself); the lane
        dropped that message and goes on."""
        self.errors += 1
        self.log.error("handler_failed", error=f"{type(exc).__name__}: {exc}"[:codec.MAX_ERROR_MESSAGE])

    def _index_holdings(self) -> None:
        """What each request and bundle looks up, built once: per subject the expected (layer,
        expert, weights), per (layer, expert) its weights and slab, per holding its slabs and work."""
        for layer, expert in self.slice.experts():
            weights = self._weights[(layer, expert)] = self.slice.expert_weights(layer, expert)
            h = next(h for h in self.slice.holdings if h.covers(layer, expert))
            self._slot[(layer, expert)] = self._held.setdefault(layer, {})[expert] = (h, expert - h.lo)
            if h not in self._holding_plan:
                gate = weights[0]
                work = 3 * gate.ne[0] * gate.ne[1]
                self._holding_plan[h] = (self.slice.holding_slabs(h), work)
            self._routes[self.subjects.dispatch(layer, expert)] = (layer, expert, weights)

    async def _prepare_kernels(self) -> None:
        """Lay every held slab out for this process's kernels (:func:`kernels.expert.prepare`)
        before any subject is subscribed: a layout made on a first call would hold its request
        for about a second, past the backbone's timeout. Routed experts get a repacked copy
        where ggml has a repacked kernel for their type (``kernels.ggml.expert_layout``: every
        call in the deterministic mode, calls under 8 rows in the fast mode); a repacked slab
        lets go of its mapped pages, so the worker's resident memory stays its slice's size
        until a fast-mode call of 8 rows or more reads them back (up to twice it). On a thread: the
        connection's loop keeps answering the server's PINGs meanwhile."""
        slabs = [w for (triple, _, _), _ in self._holding_plan.values() for w in triple]
        t0 = time.perf_counter()
        done = await asyncio.to_thread(prepare, slabs)
        if done:
            self.log.info("kernels_prepared", repacked_mb=round(done / 2**20, 1),
                          seconds=round(time.perf_counter() - t0, 2))

    async def stop(self) -> None:
        """Drain: stop taking requests, finish and answer the ones in flight, stop heartbeats."""
        if self.state in (State.STOPPED, State.DRAINING):
            return
        was_running = self.state is State.RUNNING
        self.state = State.DRAINING
        if self._lane is not None:
            self._lane.close()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be gone
                pass
        self._subs.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.cfg.drain_timeout_s)
        await micro.stop_service(self._service)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self._heartbeat:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.state = State.STOPPED
        if was_running:
            self.log.info("worker_stopped", served=self.served, errors=self.errors, rows=self.rows)

    async def __aenter__(self) -> "Worker":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _start_metrics(self) -> None:
        from kvasir_bus.metrics import MetricsServer, parse_listen, registry
        from workers.metrics import WorkerCollector

        host, port = parse_listen(self.cfg.metrics)
        collector = WorkerCollector(self)
        self.on_compute = collector.observe_compute
        self.metrics_server = await MetricsServer(registry(collector), host, port).start()
        self.log.info("worker_metrics", url=f"{self.metrics_server.url}/metrics")

    # -- discovery ($SRV) ----------------------------------------------------------------------

    def card(self) -> micro.Card:
        return micro.Card(role="worker", node=self.cfg.node, model=self.slice.fingerprint,
                          kernel=self._kernel)

    def _served(self) -> micro.Served:
        holdings = ",".join(str(h) for h in self.slice.holdings)  # L0:0-31, inclusive
        return micro.Served(
            name="experts", subject=self.subjects.dispatch_all(), queue_group=self.cfg.queue_group or "",
            metadata={"holdings": holdings, "experts": str(self.slice.n_held),
                      "replicas": "load-balanced" if self.cfg.queue_group else "race (first reply wins)"},
            stats=lambda: micro.Tally(requests=self.served + self.errors, errors=self.errors,
                                      processing_ns=int(self.compute_s * 1e9),
                                      data={"rows": self.rows, "in_flight": self.in_flight,
                                            "holdings": holdings}))

    # -- heartbeats ---------------------------------------------------------------------------

    def heartbeat(self) -> codec.Heartbeat:
        return codec.Heartbeat(model=self.slice.fingerprint, node=self.cfg.node, holdings=self.slice.holdings,
                               budget_bytes=self.cfg.budget_bytes or self.slice.nbytes,
                               load=float(self.in_flight), served=self.served, version=__version__,
                               kernel=self._kernel, sent_at=time.time(), bundles=self.takes_bundles,
                               oversubscribed=_cores_oversubscribed())

    async def _publish_heartbeat(self) -> None:
        await self.check_bundle_subject()
        hb = self.heartbeat()
        await self._nc.publish(self.subjects.coverage(self.cfg.node), hb.encode(), headers=codec.headers_for(hb))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self._publish_heartbeat()
            except Exception as exc:  # keep serving; the next beat may get through
                self.log.warning("heartbeat_failed", error=str(exc))

    # -- requests -----------------------------------------------------------------------------

    async def _on_request(self, msg) -> None:
        """One request, as nats.py hands it over (one callback at a time per subscription).

        Validated and, when the product is small, computed and answered right here: no task, no
        thread hop, no header, so the replies of requests that arrived together leave in one socket
        write. A big product goes to the compute pool in a tracked task, and the loop decodes the
        next request meanwhile. Past ``max_in_flight`` pooled requests, refuse at once without
        decoding (a flood costs its sender)."""
        if not msg.reply:
            self.errors += 1
            self.refusals.warning(("no_reply", msg.subject), "request_without_reply_subject", subject=msg.subject)
            return
        if len(self._tasks) >= self.cfg.max_in_flight:
            self.errors += 1
            self.refusals.warning(("overloaded", _sender(msg.reply)), "request_refused", code=codec.ERR_OVERLOADED,
                                  in_flight=len(self._tasks))
            busy = codec.ErrorReply(request_id="", node=self.cfg.node, code=codec.ERR_OVERLOADED,
                                    message=f"{len(self._tasks)} requests in flight")
            await self._send(msg.reply, busy.encode(), busy, box=_peek_box(msg.data), request=msg.data)
            return
        try:
            req, weights = self._validate(msg)
        except Exception as exc:  # refused: the sender is told why, the worker keeps serving
            await self._refuse(msg, _refusal(exc))
            return
        rows = _float32(req.rows)
        if _small(weights, rows):  # a hop to the pool and back costs more than the product
            self._inline += 1
            try:
                await self._answer(msg, req, weights, rows, None)
            finally:
                self._inline -= 1
        else:
            task = asyncio.create_task(self._answer(msg, req, weights, rows, self._pool))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg, req: codec.DispatchRequest, weights, rows: np.ndarray, pool) -> None:
        """Compute a valid request (inline, or on ``pool``) and publish the reply."""
        try:
            if pool is None:
                with one_thread():  # the pool's thread alone leads an OpenMP team (kernels.ggml.one_thread)
                    out, seconds = _timed(weights, rows)
            else:
                out, seconds = await asyncio.get_running_loop().run_in_executor(pool, _timed, weights, rows)
            payload = self._replies.encode(req.request_id, out)
        except Exception as exc:  # the kernel failed: say so, keep serving
            self.errors += 1
            reply = codec.ErrorReply(request_id=req.request_id, node=self.cfg.node, code=codec.ERR_INTERNAL,
                                     message=f"{type(exc).__name__}: {exc}"[:codec.MAX_ERROR_MESSAGE])
            self.log.error("request_failed", subject=msg.subject, error=reply.message)
            await self._send(msg.reply, reply.encode(), reply, box=req.box, request=msg.data)
            return
        self.served += 1
        self.rows += len(rows)
        self.compute_s += seconds
        if self.on_compute is not None:
            self.on_compute(req.layer, seconds)
        await self._send(msg.reply, payload, None, req.request_id, req.box, msg.data)

    # -- bundles ------------------------------------------------------------------------------

    async def _on_bundle(self, msg) -> None:
        """Every call of a layer step that the backbone sends to this node, in one message.

        Validated like a request (model, sizes, the layer's expert count); each call this node
        holds is computed, each it does not is answered ``not_held``, all in one reply. Small
        work is done on the loop, as for a request; more goes to the pool in one submission."""
        if not msg.reply:
            self.errors += 1
            self.refusals.warning(("no_reply", msg.subject), "request_without_reply_subject", subject=msg.subject)
            return
        if len(self._tasks) >= self.cfg.max_in_flight:
            await self._refuse(msg, _Refused(codec.ERR_OVERLOADED, f"{len(self._tasks)} requests in flight",
                                             box=_peek_box(msg.data)))
            return
        try:
            bundle = self._validate_bundle(msg)
        except Exception as exc:
            await self._refuse(msg, _refusal(exc))
            return
        if not self._tasks and self._one_graph:
            step = self._decode_step(bundle)
            if step is not None:  # the hot path: one graph on the loop, one reply
                self._inline += 1
                try:
                    await self._answer_step(msg, bundle, *step)
                finally:
                    self._inline -= 1
                return
        rows = _float32(bundle.rows)
        held, refused, work = [], [], 0
        for i, expert in enumerate(bundle.experts):
            weights = self._weights.get((bundle.layer, expert))
            if weights is None:
                refused.append((bundle.ids[i], codec.ERR_NOT_HELD,
                                f"layer {bundle.layer} expert {expert} is not held here"))
            else:
                held.append((i, weights))
                gate = weights[0]
                work += 3 * bundle.counts[i] * gate.ne[0] * gate.ne[1]
        limit = INLINE_WORK
        if self._one_graph and len(held) > 1:
            held = self._grouped(bundle, held)
            if len(held) == 1:  # one graph: the hop to the pool and back would cost what several calls do
                limit = INLINE_GRAPH_WORK
        if not self._tasks and len(set(bundle.counts)) == 1 and bundle.counts[0] == 1:
            limit = INLINE_DECODE_WORK  # a decode step and an idle pool: nothing to overlap, the hop is pure wait
        if work < limit:
            self._inline += 1
            try:
                await self._answer_bundle(msg, bundle, rows, held, refused, None)
            finally:
                self._inline -= 1
        else:
            task = asyncio.create_task(self._answer_bundle(msg, bundle, rows, held, refused, self._pool))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _decode_step(self, bundle: codec.BundleRequest):
        """``(row, slab ids [K], the holding's bound step)`` when ``bundle`` is what a decode step
        sends: calls on the same one row, every expert held, in one holding, and little enough
        work to compute on the loop (the pool is idle: nothing to overlap); ``(row, None,
        weights)`` for one such call. Else None, and :meth:`_on_bundle`'s general path decides (the
        same jobs, :meth:`_grouped`, one reply)."""
        counts, index = bundle.counts, bundle.index
        k = len(counts)
        if max(counts) != 1:
            return None
        if k == 1:  # one call: its own expert function, as the general path runs it
            weights = self._weights.get((bundle.layer, bundle.experts[0]))
            if weights is None or 3 * weights[0].ne[0] * weights[0].ne[1] >= INLINE_DECODE_WORK:
                return None
            return int(index[0]), None, weights
        first = index.tolist()
        row = first[0]
        if first.count(row) != k:
            return None
        table = self._held.get(bundle.layer)
        if table is None:
            return None
        holding, slots = None, []
        for expert in bundle.experts:
            entry = table.get(expert)
            if entry is None or (holding is not None and entry[0] is not holding):
                return None
            holding = entry[0]
            slots.append(entry[1])
        slabs, work = self._holding_plan[holding]
        if k * work >= INLINE_DECODE_WORK:
            return None
        step = self._steps.get((holding, k))
        if step is None:
            step = self._bind_step(holding, k, slabs)
        return row, slots, step

    def _bind_step(self, holding: codec.Holding, k: int, slabs):
        """The bound graph of ``holding``'s decode steps of ``k`` calls, made on first use; past
        MAX_STEPS of them, a function computing the same through :func:`moe_ffn` (its cache)."""
        (gate, up, down), biases, glu = slabs

        def unbound(row: np.ndarray, slots: list) -> np.ndarray:
            return moe_ffn(gate, up, down, _float32(row[None]), np.array([slots], np.int32),
                           biases=biases, glu=glu)[0]

        if len(self._steps) >= MAX_STEPS:
            return unbound
        try:
            step = moe_step(gate, up, down, k, biases=biases, glu=glu)
        except Exception:  # moe_ffn says the same per call, and every call of the step is answered so
            return unbound
        self._steps[(holding, k)] = step
        return step

    async def _answer_step(self, msg, bundle: codec.BundleRequest, row: int, slots: list | None,
                           compute) -> None:
        """A decode step's bundle (:meth:`_decode_step`): its calls' experts in one ``mul_mat_id``
        graph on the one row (``compute``: the holding's bound step), each call's output the bits
        of its call alone, in the bundle's order; or its one call's expert (``slots`` None,
        ``compute`` its weights)."""
        k = len(bundle.ids)
        t0 = time.perf_counter()
        try:
            if slots is None:
                out = expert_ffn(*compute, _float32(bundle.rows[row:row + 1]), routed=True)  # (1, D)
            else:
                out = compute(bundle.rows[row], slots)  # (K, D), the step's buffer: encoded below
            seconds = time.perf_counter() - t0
            if out.shape != (k, bundle.rows.shape[1]):
                raise ValueError(f"the kernel returned shape {out.shape}")
            payload = self._bundle_replies.encode_answers(bundle, out)
        except Exception as exc:  # the kernel failed: every call says why, as on the general path
            error = f"{type(exc).__name__}: {exc}"
            self.log.error("request_failed", subject=msg.subject, request_id=bundle.bundle_id, error=error)
            await self._answer_bundle(msg, bundle, bundle.rows, [], [(rid, codec.ERR_INTERNAL, error[:codec.MAX_ERROR_MESSAGE])
                                                                   for rid in bundle.ids], None)
            return
        self.served += k
        self.rows += k
        self.compute_s += seconds
        if self.on_compute is not None:
            for _ in range(k):
                self.on_compute(bundle.layer, seconds / k)
        await self._send(msg.reply, payload, None, bundle.bundle_id, bundle.box, msg.data)

    def _grouped(self, bundle: codec.BundleRequest, held: list) -> list:
        """A decode bundle (every call one row, the same row) -> one job per holding: its calls'
        experts in one ``mul_mat_id`` graph, as llama.cpp and the backbone's own layer step run
        them; each expert still sees exactly its one row, so every output has the bits of its
        call alone. Anything else stays one job per call."""
        if any(bundle.counts[i] != 1 for i, _ in held) or len({int(bundle.index[i]) for i, _ in held}) != 1:
            return held
        groups: dict[codec.Holding, list[tuple[int, int]]] = {}
        for i, _ in held:
            h, slot = self._slot[(bundle.layer, bundle.experts[i])]
            groups.setdefault(h, []).append((i, slot))
        jobs = []
        for h, calls in groups.items():
            if len(calls) == 1:
                i = calls[0][0]
                jobs.append((i, self._weights[(bundle.layer, bundle.experts[i])]))
            else:
                jobs.append((tuple(calls), self.slice.holding_slabs(h)))
        return jobs

    def _validate_bundle(self, msg) -> codec.BundleRequest:
        try:
            bundle = self._bundles.decode(msg.data)
        except codec.CodecError as exc:
            raise _Refused(codec.ERR_BAD_REQUEST, str(exc)) from None
        if bundle.model != self.slice.fingerprint:
            raise _Refused(codec.ERR_WRONG_MODEL, f"model {bundle.model} is not {self.slice.fingerprint}",
                           bundle.bundle_id, bundle.box)
        if len(bundle.ids) > self.slice.n_expert:
            raise _Refused(codec.ERR_BAD_REQUEST, f"{len(bundle.ids)} calls, but a layer has "
                           f"{self.slice.n_expert} experts", bundle.bundle_id, bundle.box)
        return bundle

    async def _answer_bundle(self, msg, bundle: codec.BundleRequest, rows: np.ndarray, held, refused, pool) -> None:
        """Compute the held calls of a valid bundle (inline, or on ``pool`` in one submission) and
        publish the one reply."""
        try:
            if pool is None:
                with one_thread():  # as above: a bundle inline is small, and never leads a team
                    done = _bundle_timed(bundle, rows, held)
            else:
                done = await asyncio.get_running_loop().run_in_executor(pool, _bundle_timed, bundle, rows, held)
        except Exception as exc:  # the pool is gone (stopping): say so, keep serving
            await self._refuse(msg, _Refused(codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}", bundle.bundle_id, bundle.box))
            return
        ids, counts, outs = [], [], []
        for i, out, seconds, error in done:
            rid = bundle.ids[i]
            if error is not None:
                refused.append((rid, codec.ERR_INTERNAL, error[:codec.MAX_ERROR_MESSAGE]))
                self.log.error("request_failed", subject=msg.subject, request_id=rid, error=error)
                continue
            ids.append(rid)
            counts.append(len(out))
            outs.append(out)
            self.compute_s += seconds
            if self.on_compute is not None:
                self.on_compute(bundle.layer, seconds)
        self.served += len(ids)
        self.errors += len(refused)
        if refused:
            self.refusals.warning(("bundle_refused", _sender(msg.reply)), "bundle_calls_refused",
                                  layer=bundle.layer, refused=len(refused), code=refused[0][1], error=refused[0][2])
        out = np.concatenate(outs) if len(outs) > 1 else outs[0] if outs else \
            np.zeros((0, self.slice.n_embd), np.float32)
        self.rows += len(out)
        try:
            payload = self._bundle_replies.encode(bundle.bundle_id, tuple(ids), tuple(counts), out, tuple(refused))
        except codec.CodecError as exc:  # a kernel returned a wrong shape: say so, keep serving
            await self._refuse(msg, _Refused(codec.ERR_INTERNAL, str(exc), bundle.bundle_id, bundle.box))
            return
        await self._send(msg.reply, payload, None, bundle.bundle_id, bundle.box, msg.data)

    async def _refuse(self, msg, exc: _Refused) -> None:
        self.errors += 1
        request_id = exc.request_id or (msg.headers or {}).get("Kvasir-Request", "")
        reply = codec.ErrorReply(request_id=_safe_id(request_id), node=self.cfg.node, code=exc.code,
                                 message=str(exc)[:codec.MAX_ERROR_MESSAGE])
        self.refusals.warning((exc.code, _sender(msg.reply)), "request_refused", subject=msg.subject,
                              request_id=reply.request_id, code=exc.code, error=str(exc))
        await self._send(msg.reply, reply.encode(), reply, box=exc.box, request=msg.data)

    async def _send(self, to: str, payload: bytes, record: codec.Record | None, request_id: str = "",
                    box: bytes = b"", request: bytes = b"") -> None:
        """Publish a reply. Error replies carry headers for people watching the bus; dispatch
        replies, the hot path, carry none (the payload says everything, docs/protocol.md), and
        go straight to the socket when that is safe (:class:`kvasir_bus.lane.DirectReply`). A
        self-certifying node seals each reply to the asking backbone's ``box``, bound to the
        ``request`` payload it answers (in the payload: the direct path stays open)."""
        try:
            if box and self._sealer is not None:
                payload = self._sealer.seal(payload, box, request)
            if self.cfg.reply_key:  # attributable: the proof travels in a header (no direct path)
                from kvasir_bus.attribution import PROOF_HEADER, proof

                headers = codec.headers_for(record) if record is not None else {}
                await self._nc.publish(to, payload, headers={**headers, PROOF_HEADER: proof(self.cfg.reply_key, payload)})
                return
            if record is None and self._direct is not None and self._direct.write(to, payload):
                return
            await self._nc.publish(to, payload, headers=codec.headers_for(record) if record is not None else None)
        except Exception as exc:
            self.log.warning("reply_failed", request_id=request_id or getattr(record, "request_id", ""),
                             error=str(exc))

    def _validate(self, msg) -> tuple[codec.DispatchRequest, tuple]:
        """A request's bytes -> the checked request and the held expert's weights, checked against
        the slice: its model, a held (layer, expert), the subject's (layer, expert), the rows'
        width and count. The expectations per subject are built once (:meth:`start`)."""
        try:
            req = self._requests.decode(msg.data)
        except codec.CodecError as exc:
            raise _Refused(codec.ERR_BAD_REQUEST, str(exc)) from None
        if req.model != self.slice.fingerprint:
            raise _Refused(codec.ERR_WRONG_MODEL, f"model {req.model} is not {self.slice.fingerprint}",
                           req.request_id, req.box)
        route = self._routes.get(msg.subject)
        if route is not None and route[0] == req.layer and route[1] == req.expert:
            return req, route[2]
        if not self.slice.holds(req.layer, req.expert):
            raise _Refused(codec.ERR_NOT_HELD, f"layer {req.layer} expert {req.expert} is not held here",
                           req.request_id, req.box)
        try:
            where = parse_dispatch(msg.subject)
        except ValueError as exc:
            raise _Refused(codec.ERR_BAD_REQUEST, str(exc), req.request_id, req.box) from None
        raise _Refused(codec.ERR_BAD_REQUEST, f"payload names layer {req.layer} expert {req.expert}, "
                       f"subject names layer {where.layer} expert {where.expert}", req.request_id, req.box)


INLINE_WORK = 1 << 20  # multiply-adds (~50-100 µs on one core) below which the loop computes inline
INLINE_GRAPH_WORK = 4 * INLINE_WORK  # the same for a decode bundle in one graph (one graph's overhead, not K)
# A decode bundle (one row per call) while the pool is idle: the loop would only wait for the pool,
# and the hop there and back is two thread wake-ups (~1 ms on a loaded 2-core machine, measured
# with bench/dispatch.py's 122b-layer model), so up to a few ms of work run right here.
INLINE_DECODE_WORK = 64 * INLINE_WORK
MAX_STEPS = 64  # bound decode-step graphs per worker (a holding's call counts seen: a handful each)


def _float32(rows: np.ndarray) -> np.ndarray:
    return rows if rows.dtype == np.float32 else rows.astype(np.float32)


def _small(weights, rows) -> bool:
    gate = weights[0]
    return 3 * len(rows) * gate.ne[0] * gate.ne[1] < INLINE_WORK


def _timed(weights, rows):
    t0 = time.perf_counter()
    out = expert_ffn(*weights, rows, routed=True)
    return out, time.perf_counter() - t0


def _bundle_timed(bundle: codec.BundleRequest, rows: np.ndarray, held) -> list:
    """Every held call of a bundle: ``(call, output, seconds, error or None)``. A job is one call
    ``(i, weights)``, or several calls of one holding on one row ``(((i, slab), ...), slabs)``
    (:meth:`Worker._grouped`). Each call sees exactly its rows (gathered from the union), as in
    its own request: the same bits."""
    done = []
    for job, weights in held:
        if isinstance(job, tuple):
            done.extend(_group_timed(bundle, rows, job, weights))
            continue
        try:
            out, seconds = _timed(weights, rows[bundle.call_index(job)])
            if out.shape != (bundle.counts[job], rows.shape[1]):
                raise ValueError(f"the kernel returned shape {out.shape}")
            done.append((job, out, seconds, None))
        except Exception as exc:  # this call failed: the others are still answered
            done.append((job, None, 0.0, f"{type(exc).__name__}: {exc}"))
    return done


def _group_timed(bundle: codec.BundleRequest, rows: np.ndarray, calls, slabs) -> list:
    """Calls ``((i, slab index), ...)`` of one holding, each on the bundle's one row, in one graph."""
    (gate, up, down), biases, glu = slabs
    x = rows[int(bundle.index[calls[0][0]])][None]  # (1, D)
    ids = np.array([[slot for _, slot in calls]], dtype=np.int32)  # (1, K)
    t0 = time.perf_counter()
    try:
        out = moe_ffn(gate, up, down, x, ids, biases=biases, glu=glu)  # (1, K, D)
    except Exception as exc:
        return [(i, None, 0.0, f"{type(exc).__name__}: {exc}") for i, _ in calls]
    seconds = (time.perf_counter() - t0) / len(calls)
    return [(i, out[:, k], seconds, None) for k, (i, _) in enumerate(calls)]


class _Refused(Exception):
    def __init__(self, code: str, message: str, request_id: str = "", box: bytes = b""):
        super().__init__(message)
        self.code, self.request_id, self.box = code, request_id, box  # box: the request's, to seal to


def _refusal(exc: Exception) -> _Refused:
    """Why a request is refused: what a check said (an invalid request), or ``internal`` for a
    bug in a check."""
    return exc if isinstance(exc, _Refused) else _Refused(codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")


_BOX_TAIL = b"\xa3box\xc4\x20"  # "box": bin 32, the last entry of a request the reference encodes


def _peek_box(data: bytes) -> bytes:
    """The backbone's ``box`` of a request not decoded (a refusal while overloaded), where the
    reference encoder puts it: the map's last entry. b"" otherwise (the refusal then goes out
    without a proof, and a backbone that needs one drops it and waits for its timeout)."""
    return bytes(data[-32:]) if len(data) > 38 and data[-38:-32] == _BOX_TAIL else b""


def _sender(reply: str | None) -> str:
    """Who asked, as far as the bus tells: the reply inbox without its last token."""
    return (reply or "").rpartition(".")[0][:128]


def _safe_id(request_id: str) -> str:
    return request_id if codec.is_id(request_id) else ""


def _cores_oversubscribed() -> bool:
    """This process's ggml threads exceed its share of the cores beside the other kvasir
    compute processes on the machine (say, ``--threads 2`` on three workers of two cores)."""
    from kvasir_bus import threads

    try:
        return threads.threads_over_share()
    except Exception:  # never let the census cost a heartbeat
        return False
