"""Continuous batching: many requests share one engine, one step at a time.

Each engine step runs every active sequence once: a sequence that is decoding contributes its
one new token, a sequence still reading its prompt contributes the next chunk of it, and the
chunks fill whatever the per-step token budget leaves after the decode tokens (chunked
prefill: a long prompt never stalls the streams already decoding). The engine groups the rows
of the whole step by expert, so every selected expert is asked once per layer for all of them.

Admission is by memory: the active sequences' KV caches (reserved for the prompt plus
``max_tokens``, in the engine's 256-cell chunks, plus a delta-net layer's fixed state) fit
``kv_bytes`` (default: the lesser of ``max_active`` full contexts and half the memory available
when the server starts; see :func:`stream_bytes`), and at most ``max_active`` run (``kvasir
serve`` sets it to :data:`MAX_ACTIVE`, so memory decides); the rest wait in a FIFO
queue of at most ``max_queue`` requests, beyond which :meth:`Scheduler.submit` raises
:class:`Overloaded` (the HTTP layer answers 429 with ``Retry-After``).

Fair share: each request names its ``client`` (a bus identity's inbox prefix, an HTTP API key
or address). One client may hold at most ``max_queue_per_client`` of the waiting places, so a
flood from one leaves room for the others, and a free slot goes to the waiting request whose
client runs the fewest streams (the earliest among equals): another client's request waits for
the next slot that frees, never behind a flooder's queue. When every slot is taken and a waiting
request's client runs at least two streams fewer than the client running the most (one micro-batch lane), that client's
newest stream is *parked* for it at the next step: it keeps its KV cache (and its memory) and
waits with the queue, first in line for the next slot its client's share allows, so one client's
long streams keep another's request out for one step, not until they end. A parked stream's
tokens are the ones it would have had (deterministic mode: bit for bit). Memory is not freed by
parking: a request that does not fit the memory bound still waits. A cancelled request (its
client went away, or a stop string ended it) is dropped, and its KV cache freed, at the start
of the next step.

Determinism: the engine is batch-invariant (every row of a step is computed as it would be
alone, and a prompt read in chunks gives the same bits as read whole), so a sequence's tokens
do not depend on what else runs beside it. ``deterministic`` records that the server promises
this; a faster batched kernel that is not invariant must be bypassed when it is set.

Two micro-batches in flight (``micro_batches=2``): the active sequences are split into lanes
at admission (each to the lane with fewer), and each lane runs its own engine steps on a thread
of its own. While one lane's step waits for its remote experts (a round trip per MoE layer, the
GIL released), the other computes its attention and dense layers, so the backbone's compute
hides inside the waiting instead of adding to it. The engine is re-entrant across disjoint
sequences (each thread has its own ggml graphs; the expert backends are thread-safe), and a
sequence's tokens do not depend on which lane, or what else, ran beside it.

The engine runs on threads of its own; ``on_event`` callbacks are called on those threads
(the HTTP layer hands them to its event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import structlog

from backbone.sampling import Sampler, SamplerConfig
from kvasir_bus.errors import KvasirError, UsageError
from kernels.backend import thread_cap
from kvasir_bus.threads import usable_cores, waking as core_share_waking

log = structlog.get_logger("kvasir.scheduler")


MAX_MICRO_BATCHES = 4
#: The most sequences one server runs at once (``kvasir serve``'s default: memory decides below it).
MAX_ACTIVE = 1024
#: The share of the memory available at start that the KV caches may take by default.
MEMORY_SHARE = 0.5


def stream_bytes(cfg, tokens: int, n_ctx: int | None = None) -> dict:
    """What one stream of ``tokens`` (prompt plus generated) costs in memory, from the model's
    shapes: float16 K and V per attention layer and token (``per_token``), allocated in 256-cell
    chunks (``kv``), plus a delta-net layer's conv and recurrent state, float32, whatever the
    length (``state``); ``total`` = kv + state."""
    from kernels import dense

    attn = [il for il in range(cfg.n_layer) if not cfg.is_recurrent(il)]
    per_token = len(attn) * 2 * cfg.n_head_kv * cfg.head_dim * 2
    state = 0
    for il in range(cfg.n_layer):
        if cfg.is_recurrent(il):
            state += 4 * (cfg.ssm_conv_channels * (cfg.ssm_conv_kernel - 1)
                          + cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim)
    kv = dense.cache_cells_for(tokens, n_ctx) * per_token
    return {"per_token": per_token, "kv": kv, "state": state, "total": kv + state}


def available_memory() -> int | None:
    """Bytes of memory available now (/proc/meminfo MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


MAX_CLIENTS_REMEMBERED = 4096  # clients whose last admission the fair share remembers


class Overloaded(KvasirError):
    """The queue is full: try again later."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 16  # sequences in one step
    max_queue: int = 64  # waiting requests beyond which submit() refuses
    max_queue_per_client: int | None = None  # waiting places one client may hold (None: a quarter of max_queue, >= 1)
    step_tokens: int = 256  # tokens per engine step: decode tokens + prefill chunks
    kv_bytes: int | None = None  # bound on the reserved KV caches (None: max_active full contexts)
    deterministic: bool = False
    retry_after_s: int = 1  # what a refused client is told to wait
    micro_batches: int = 1  # lanes of sequences stepped on threads of their own (2: hide the round trip)

    def __post_init__(self):
        for name in ("max_active", "step_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise UsageError(f"max-queue must be >= 0, got {self.max_queue}")
        if self.max_queue_per_client is not None and self.max_queue_per_client < 1:
            raise UsageError(f"max-queue-per-client must be >= 1, got {self.max_queue_per_client}")
        if not 1 <= self.micro_batches <= MAX_MICRO_BATCHES:
            raise UsageError(f"micro-batches must be 1..{MAX_MICRO_BATCHES}, got {self.micro_batches}")
        if self.kv_bytes is not None and self.kv_bytes <= 0:
            raise UsageError(f"the KV memory bound must be positive, got {self.kv_bytes}")


@dataclass(frozen=True)
class GenRequest:
    """What to generate: validated at the edge (the HTTP layer), checked again here."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampler: SamplerConfig = SamplerConfig()
    stop_on_eos: bool = True
    client: str = ""  # who asked, for the fair share ("" : one anonymous client)


# Events passed to on_event: ("token", id), ("done", "stop" | "length"), ("error", message).
Event = tuple[str, object]


class _LoopInbox:
    """Events bound for one asyncio loop from the engine threads, handed over with one wake-up
    of the loop for all that arrive before it runs. Each job's events stay in their order.

    A step of S streams pushes S tokens. With ``call_soon_threadsafe`` per token the loop woke
    at the first (a write to its self-pipe, the GIL released for it): it took the GIL while the
    engine thread was still sampling the others and made it wait, token after token (py-spy and
    timers: 1.2-2 ms of a 25-45 ms step at 16-32 streams on 2 cores, 0.2 ms without the loop).
    Inside :func:`_one_wakeup` (the scheduler delivers a step's events there) the wake-ups wait
    until the step's last event is queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Event]] = []

    def put(self, queue: asyncio.Queue, event: Event) -> None:
        with self._lock:
            self._items.append((queue, event))
            if len(self._items) > 1:  # a wake-up is on its way (or held): it takes this one too
                return
        held = _held.inboxes
        if held is not None:
            held.append(self)
        else:
            self.wake()

    def wake(self) -> None:
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, event in items:
            queue.put_nowait(event)


class _Held(threading.local):
    inboxes: list[_LoopInbox] | None = None  # inside _one_wakeup: the inboxes to wake at its end


_held = _Held()
_inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _one_wakeup():
    """On this thread, the :class:`LoopEvents` pushed inside reach their loops at the end, with
    one wake-up of each loop."""
    if _held.inboxes is not None:  # nested: the outer one wakes them
        yield
        return
    _held.inboxes = []
    try:
        yield
    finally:
        inboxes, _held.inboxes = _held.inboxes, None
        for inbox in inboxes:
            try:
                inbox.wake()
            except RuntimeError:  # that loop is closed: nobody is reading its events
                pass


class LoopEvents:
    """A job's events handed from the engine thread to an asyncio loop: ``push`` is the job's
    ``on_event``; ``await next()`` takes them in order. The jobs of one loop share its inbox
    (:class:`_LoopInbox`: one wake-up per batch of events). When the engine outruns the reader
    the queue is never empty, and a plain ``get()`` would then never suspend: one fast stream
    would hold the loop (every other client, ``/health``) until its whole answer was sent.
    ``next`` lets the loop run once before taking an event that was already waiting."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._inbox = _inboxes.get(loop)
        if self._inbox is None:
            self._inbox = _inboxes[loop] = _LoopInbox(loop)
        self._queue: asyncio.Queue = asyncio.Queue()

    def push(self, event: Event) -> None:
        self._inbox.put(self._queue, event)

    async def next(self) -> Event:
        if not self._queue.empty():
            await asyncio.sleep(0)
        return await self._queue.get()


@dataclass(eq=False)
class Job:
    """One request inside the scheduler. Only the engine thread touches the fields below
    ``cancelled``; others read ``tokens`` after the "done" event."""

    request: GenRequest
    on_event: Callable[[Event], None]
    reserved_bytes: int
    cancelled: bool = False
    seq: object = None  # backbone.model.Sequence once admitted
    fed: int = 0  # prompt tokens read so far
    tokens: list[int] = field(default_factory=list)
    pending: int | None = None  # the last sampled token, fed at the next step
    sampler: Sampler | None = None
    lane: int = 0  # which micro-batch steps it

    @property
    def parked(self) -> bool:
        """Waiting in the queue with its KV cache kept (see the module docstring)."""
        return self.seq is not None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt)


@dataclass
class Stats:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0  # dropped before the engine finished them
    rejected: int = 0  # refused with Overloaded
    failed: int = 0
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    max_step_sequences: int = 0  # the most sequences one step has run
    max_step_tokens: int = 0
    parked: int = 0  # streams parked for another client's request (fair share)


class Scheduler:
    """Owns the engine's thread. ``start()``/``stop()`` are idempotent; also a context manager."""

    def __init__(self, engine, cfg: SchedulerConfig = SchedulerConfig()):
        self.engine, self.cfg = engine, cfg
        c = engine.cfg
        cost = stream_bytes(c, engine.n_ctx, engine.n_ctx)
        self.cell_bytes, self.state_bytes = cost["per_token"], cost["state"]  # K and V float16; delta-net state
        self.kv_bytes = cfg.kv_bytes
        if self.kv_bytes is None:
            self.kv_bytes = cfg.max_active * cost["total"]
            free = available_memory()
            if free:  # admission by memory: never plan on more than a share of what is there
                self.kv_bytes = max(cost["total"], min(self.kv_bytes, int(free * MEMORY_SHARE)))
        self.stats = Stats()
        self.on_step = None  # metrics hook (backbone.metrics): (tokens generated) after each step
        self._queue: list[Job] = []
        self._admissions = 0  # jobs admitted so far
        self._admitted_at: dict[str, int] = {}  # client -> its last admission's number (bounded)
        self._active: list[Job] = []
        self._reserved = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> "Scheduler":
        if not self._threads:
            self._stopping = False
            self._threads = [threading.Thread(target=self._main, args=(lane,), name=f"kvasir-scheduler-{lane}",
                                              daemon=True) for lane in range(self.cfg.micro_batches)]
            for thread in self._threads:
                thread.start()
        return self

    def stop(self) -> None:
        if not self._threads:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []
        for job in self._queue + self._active:
            job.on_event(("error", "the server is shutting down"))
        self._queue, self._active, self._reserved = [], [], 0

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- requests ---------------------------------------------------------------------------

    def _cells(self, n: int) -> int:
        from kernels import dense

        return dense.cache_cells_for(n, self.engine.n_ctx)

    def _reserve(self, tokens: int) -> int:
        return self._cells(tokens) * self.cell_bytes + self.state_bytes

    def stream_cost(self) -> dict:
        """One stream's memory on this engine (:func:`stream_bytes`) and how many full-context
        streams the bound admits."""
        cost = stream_bytes(self.engine.cfg, self.engine.n_ctx, self.engine.n_ctx)
        return {**cost, "bound": self.kv_bytes, "full_context_streams": self.kv_bytes // cost["total"]}

    def check(self, request: GenRequest) -> None:
        """Raise :class:`UsageError` for a request that could never run here."""
        n = len(request.prompt)
        if n == 0:
            raise UsageError("the prompt is empty")
        if request.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if n + request.max_tokens > self.engine.n_ctx:
            raise UsageError(f"the prompt ({n} tokens) plus max_tokens ({request.max_tokens}) exceeds "
                             f"the context of {self.engine.n_ctx} tokens")
        need = self._reserve(n + request.max_tokens)
        if need > self.kv_bytes:
            raise UsageError(f"the request needs {need} bytes of KV cache; this server's bound is {self.kv_bytes}")

    def submit(self, request: GenRequest, on_event: Callable[[Event], None]) -> Job:
        """Queue a request; raises :class:`UsageError` or :class:`Overloaded`."""
        self.check(request)
        job = Job(request, on_event, self._reserve(len(request.prompt) + request.max_tokens))
        with self._cond:
            if self._stopping or not self._threads:
                raise Overloaded("the server is not running")
            waiting = len(self._queue) - max(0, self.cfg.max_active - len(self._active))
            if waiting >= self.cfg.max_queue:  # ahead of it, this many could not start now
                self.stats.rejected += 1
                raise Overloaded(f"{len(self._queue)} requests are already waiting")
            free = max(0, self.cfg.max_active - len(self._active))
            mine = sum(j.request.client == request.client for j in self._queue) - free  # of its, waiting
            if waiting >= 0 and mine >= self.per_client_queue:  # it would wait: within its share?
                self.stats.rejected += 1
                raise Overloaded(f"this client has {mine} requests waiting already (its share of the queue)")
            self.stats.submitted += 1
            self._queue.append(job)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job at the next step (idempotent; a finished job is left alone)."""
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()

    def snapshot(self) -> dict:
        with self._cond:
            return {"active": len(self._active), "queued": len(self._queue),
                    "kv_reserved_bytes": self._reserved, "kv_bound_bytes": self.kv_bytes,
                    **self.stats.__dict__}

    # -- the engine thread ------------------------------------------------------------------

    @property
    def per_client_queue(self) -> int:
        got = self.cfg.max_queue_per_client
        return got if got is not None else max(1, self.cfg.max_queue // 4)

    def _next_queued(self) -> int:
        """Under the lock, the queue not empty: the index of the waiting job to admit next:
        its client runs the fewest streams; among equals, the client admitted longest ago (round
        robin), then the earliest queued."""
        running: dict[str, int] = {}
        for j in self._active:
            running[j.request.client] = running.get(j.request.client, 0) + 1
        last = self._admitted_at
        return min(range(len(self._queue)), key=lambda i: (
            running.get(self._queue[i].request.client, 0), last.get(self._queue[i].request.client, 0), i))

    def _can_admit(self, job: Job) -> bool:
        fits = job.parked or self._reserved + job.reserved_bytes <= self.kv_bytes
        return len(self._active) < self.cfg.max_active and fits

    def _park_for(self, job: Job) -> Job | None:
        """Under the lock, every slot taken: the active job to park so that ``job`` (waiting, its
        memory fits) can start, or None. Only a stream of the client running the most, and only
        when ``job``'s client runs at least two fewer: a swap that leaves the two at most one apart,
        so the next step never swaps them back."""
        if len(self._active) < self.cfg.max_active or not (
                job.parked or self._reserved + job.reserved_bytes <= self.kv_bytes):
            return None
        running: dict[str, list[Job]] = {}
        for j in self._active:
            running.setdefault(j.request.client, []).append(j)
        heaviest = max(running.values(), key=len)
        if len(heaviest) < len(running.get(job.request.client, ())) + 2:
            return None
        return heaviest[-1]  # its newest

    def _has_work(self, lane: int) -> bool:
        """Under the lock: whether ``lane`` has a step to run (after dropping cancelled queued jobs)."""
        dropped = [j for j in self._queue if j.cancelled]
        if dropped:
            self._queue = [j for j in self._queue if not j.cancelled]
            self.stats.cancelled += len(dropped)
            for job in dropped:
                if job.parked:  # its KV cache goes with it
                    self._reserved -= job.reserved_bytes
                    job.seq = None
        return any(j.lane == lane for j in self._active) or bool(
            self._queue and self._can_admit(self._queue[self._next_queued()]))

    def _admit(self, lane: int) -> None:
        """Under the lock: drop this lane's cancelled jobs (the other lanes' may be inside a
        step), move queued ones in (FIFO) while they fit, each to the lane with fewest."""
        for job in [j for j in self._active if j.cancelled and j.lane == lane]:
            self._release(job)
            self.stats.cancelled += 1
        admitted = False
        if self._queue and self.cfg.micro_batches == 1:  # (lanes step on their own: none parked there)
            victim = self._park_for(self._queue[self._next_queued()])
            if victim is not None:  # between steps (one lane): no step holds it now
                self._active.remove(victim)
                self._queue.insert(0, victim)  # first among its client's waiting requests
                self.stats.parked += 1
        while self._queue and self._can_admit(self._queue[self._next_queued()]):
            job = self._queue.pop(self._next_queued())
            self._admissions += 1
            self._admitted_at.pop(job.request.client, None)
            self._admitted_at[job.request.client] = self._admissions  # newest last
            while len(self._admitted_at) > MAX_CLIENTS_REMEMBERED:
                del self._admitted_at[next(iter(self._admitted_at))]
            if not job.parked:  # a parked one resumes with its cache, sampler and reservation
                job.seq = self.engine.new_sequence()
                job.sampler = Sampler(job.request.sampler)
                self._reserved += job.reserved_bytes
            counts = [0] * self.cfg.micro_batches
            for j in self._active:
                counts[j.lane] += 1
            job.lane = counts.index(min(counts))
            self._active.append(job)
            admitted = True
        if admitted:
            self._cond.notify_all()  # another lane may have jobs now

    def _release(self, job: Job) -> None:
        self._active.remove(job)
        self._reserved -= job.reserved_bytes
        job.seq = None  # the KV cache goes with it

    def _plan(self, lane: int) -> list[tuple[Job, np.ndarray]]:
        """This lane's step: every decoding sequence's token, then prompt chunks in admission
        order while the token budget lasts."""
        mine = [j for j in self._active if j.lane == lane]
        batch = [(j, np.asarray([j.pending])) for j in mine if not j.prefilling]
        budget = self.cfg.step_tokens - len(batch)
        if budget <= 0:  # more streams decode than the budget: prompts still move on
            budget = max(1, self.cfg.step_tokens // 4)
        for job in mine:
            if budget <= 0:
                break
            if job.prefilling:
                chunk = job.request.prompt[job.fed:job.fed + budget]
                batch.append((job, np.asarray(chunk)))
                budget -= len(chunk)
        return batch

    def _main(self, lane: int) -> None:
        if self.cfg.micro_batches > 1:  # each lane's OpenMP team within its share of the cores
            with thread_cap(max(1, usable_cores() // self.cfg.micro_batches)):
                return self._lane(lane)
        return self._lane(lane)

    def _lane(self, lane: int) -> None:
        while True:
            idle = False
            with self._cond:
                while not self._stopping and not self._has_work(lane):
                    self._cond.wait()
                    idle = True
                if self._stopping:
                    return
                self._admit(lane)
                batch = self._plan(lane)
            if idle:  # work after a quiet spell: the core share looks again (kvasir_bus.threads)
                core_share_waking()
            if batch:
                self._step(batch)

    def _step(self, batch: list[tuple[Job, np.ndarray]]) -> None:
        try:
            logits = self.engine.forward([(job.seq, ids) for job, ids in batch], all_logits=False)
        except Exception as exc:  # one bad step fails its requests, never the server
            log.error("engine_step_failed", error=f"{type(exc).__name__}: {exc}", sequences=len(batch))
            with self._cond:
                for job, _ in batch:
                    if job in self._active:
                        self._release(job)
                    self.stats.failed += 1
            for job, _ in batch:
                job.on_event(("error", f"the engine failed: {exc}"))
            return
        with _one_wakeup():  # the step's events reach each loop at once, after the last is sampled
            self._sample(batch, logits)

    def _sample(self, batch: list[tuple[Job, np.ndarray]], logits: list[np.ndarray]) -> None:
        """After a step: each sequence that read the end of its prompt, or decoded, samples its
        next token; finished ones are released; their events go out (inside ``_one_wakeup``)."""
        s = self.stats
        eos = self.engine.cfg.eos_id
        finished: list[tuple[Job, str]] = []
        prompt = generated = 0
        for (job, ids), row in zip(batch, logits):
            if job.prefilling:
                job.fed += len(ids)
                prompt += len(ids)
                if job.prefilling:  # more prompt to read: no token yet
                    continue
            token = job.sampler(row[-1])
            job.tokens.append(token)
            job.pending = token
            generated += 1
            job.on_event(("token", token))
            if job.request.stop_on_eos and token == eos:
                finished.append((job, "stop"))
            elif len(job.tokens) >= job.request.max_tokens:
                finished.append((job, "length"))
        with self._cond:  # the lanes share the counters
            s.steps += 1
            s.max_step_sequences = max(s.max_step_sequences, len(batch))
            s.max_step_tokens = max(s.max_step_tokens, sum(len(ids) for _, ids in batch))
            s.prompt_tokens += prompt
            s.generated_tokens += generated
        self.on_step is None or self.on_step(generated)
        if finished:
            with self._cond:
                for job, _ in finished:
                    self._release(job)
                    s.completed += 1
            for job, reason in finished:
                job.on_event(("done", reason))
