"""The dispatch's view of who covers what: which experts are worth waiting for.

Each ``(layer, expert)`` is in one of three states (absent from the tables: *unknown*):

* **unknown**: ask and wait for a reply, up to the (adaptive) timeout;
* **uncovered**: "no responders" (the server's instant 503) came back, so nobody is subscribed:
  compute locally without asking, for ``ttl_s``;
* **silent**: a request timed out and no reply has come for that expert since: somebody is
  subscribed but does not answer (a frozen worker, or a stranger that subscribes to everything and
  never replies). Compute locally at once, and still send the request as a *probe* without waiting
  for it: the first valid reply ends the silence. While nothing on the bus has ever answered and
  one expert went silent, every unknown expert is treated as silent too, so a subscriber that never
  answers costs one timeout per generation, not one per expert.

A worker's heartbeat announcing an expert ends its uncovered state at once, and ends a silence
too, but at most once per ``hold`` period for that expert, and the hold doubles every time the
expert goes silent again (up to ``max_hold_s``): a node that heartbeats and never answers cannot
buy a timeout per heartbeat. Heartbeat claims are clipped to the model's geometry first, so a
heartbeat claiming a billion experts costs as much as one claiming the real ones.

With ``track_nodes`` it also keeps who takes *bundles* (heartbeats with ``bundles``): per node its
holdings and when it was last heard, so the dispatch can send all of a layer step's calls for one
node in one message (:meth:`bundle_holders`). A node unheard for ``node_ttl_s``, or whose bundle
subject got "no responders" (:meth:`forget_node`), is dropped until its next heartbeat. A node
whose bundle went unanswered (:meth:`bundle_unanswered`: frozen, or a bus that refuses the
backbone the node subjects) gets none for a hold that doubles each time, as silence does, until
one of its bundles is answered: its experts are asked per expert meanwhile.

Strangers are cheap to be: anyone may heartbeat thousands of bundle nodes. With
``limit_unproven(k)`` (the dispatch sets it when audits are sampled) :meth:`bundle_holders`
names only the nodes the dispatch said passed their probation (:meth:`mark_proven`) and at most
``k`` unproven ones, *in turn*: :meth:`next_turn` (once per layer step) gives the next ``k`` of
them the turn, so each newcomer still gets bundles, and a proof, in its time. While the turns go
unanswered (nobody on those nodes' subjects, or silence), they come every 2, 4, ... up to
:data:`MAX_TURN_GAP` steps; the first answer of a node in turn brings them back every step. An
honest newcomer is asked per expert meanwhile, and once its audits pass it is proven. The holders of an
expert are then found among the proven nodes and the ``k`` in turn, never among every stranger:
2,000 fake nodes cost a layer step what two do (``tests/trust/test_sybils.py``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Callable

import structlog

from kvasir_bus import codec
from kvasir_bus.subjects import Subjects

log = structlog.get_logger("kvasir.coverage_view")


MAX_TURN_GAP = 64  # layer steps between unproven nodes' turns while every turn goes unanswered


class CoverageView:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, *,
                 n_layer: int | None = None, n_expert: int | None = None,
                 silence_hold_s: float = 2.0, max_hold_s: float = 60.0, node_ttl_s: float = 10.0,
                 max_nodes: int = 4096):
        self.ttl_s, self.clock = ttl_s, clock
        self.n_layer, self.n_expert = n_layer, n_expert
        self.silence_hold_s, self.max_hold_s = silence_hold_s, max_hold_s
        self._uncovered: dict[tuple[int, int], float] = {}  # (layer, expert) -> until (clock)
        self._silent: dict[tuple[int, int], tuple[float, float]] = {}  # -> (heartbeats ignored until, hold)
        self._revived: dict[tuple[int, int], float] = {}  # silent, then revived by a heartbeat -> its hold
        self._answered = False  # any valid reply ever: then unknown experts are worth a wait
        self._sub = None
        self.track_nodes = False  # keep the bundle-capable nodes' holdings (the dispatch sets it)
        self.node_ttl_s, self.max_nodes = node_ttl_s, max_nodes
        self._nodes: dict[str, tuple[dict[int, list[tuple[int, int]]], float]] = {}  # node -> (spans, heard at)
        self._holders: dict[tuple[int, int], tuple[str, ...]] = {}  # (layer, expert) -> nodes, a cache
        self._next_sweep = 0.0
        self._bundle_hold: dict[str, tuple[float, float]] = {}  # node -> (no bundles until, hold)
        self._unproven_k: int | None = None  # None: every bundle node may hold; k: the proven and k in turn
        self._proven: OrderedDict[str, None] = OrderedDict()  # passed probation (the dispatch says), oldest first
        self._queue: deque[str] = deque()  # unproven bundle nodes waiting for their turn, next first
        self._queued: set[str] = set()
        self._turn: tuple[str, ...] = ()  # the unproven nodes whose turn it is
        self._turns = 0  # layer steps since start (next_turn calls)
        self._gap = 1  # a turn every this many steps: doubles while turns go unanswered (up to MAX_TURN_GAP)
        self._turn_heard = False  # a node in turn answered its bundle since the turn began
        self._turn_failed = False  # ... or one got "no responders" or let its bundle time out
        self._read_at: dict[str, float] = {}  # bundle node -> when its heartbeat was last decoded
        self.reread_s = node_ttl_s / 2  # a stranger out of turn: its heartbeats decoded this seldom
        # The engine's thread reads the node table, the loop thread writes it: one lock, so a
        # cached answer is never computed from a table that changed under it.
        self._lock = threading.Lock()

    # -- the cache (the loop thread) ------------------------------------------------------------

    def is_uncovered(self, layer: int, expert: int) -> bool:
        if not self._uncovered:  # nearly always: no clock read then
            return False
        return self._uncovered.get((layer, expert), float("-inf")) > self.clock()

    def mark_uncovered(self, layer: int, expert: int) -> None:
        self._uncovered[(layer, expert)] = self.clock() + self.ttl_s

    def is_silent(self, layer: int, expert: int) -> bool:
        """Compute locally and only probe: the expert timed out and nothing answered since (or,
        before any reply was ever seen, any expert did)."""
        if not self._silent:  # nearly always: neither test can hold then
            return False
        if (layer, expert) in self._silent:
            return True
        return not self._answered and bool(self._silent)

    def mark_silent(self, layer: int, expert: int) -> None:
        key = (layer, expert)
        if key in self._silent:
            return
        hold = min(self.max_hold_s, 2 * self._revived.pop(key, self.silence_hold_s / 2))
        self._silent[(layer, expert)] = (self.clock() + hold, hold)

    @property
    def answered(self) -> bool:
        """Whether any valid reply was ever seen (until then, a subscriber may be a stranger that
        never answers)."""
        return self._answered

    def mark_answered(self, layer: int, expert: int) -> None:
        """A valid reply came for the expert: it is alive."""
        self._answered = True
        if self._silent:  # empty nearly always: a won call costs no lookups then
            self._silent.pop((layer, expert), None)
        if self._revived:
            self._revived.pop((layer, expert), None)

    @property
    def uncovered(self) -> int:
        """Experts currently given up on (expired entries included until overwritten)."""
        now = self.clock()
        return sum(until > now for until in self._uncovered.values())

    @property
    def silent(self) -> int:
        return len(self._silent)

    # -- who takes bundles (the engine's thread reads, the loop thread writes) ----------------------

    def bundle_holders(self, layer: int, expert: int) -> tuple[str, ...]:
        """The bundle-capable nodes that announced ``(layer, expert)``, in name order."""
        now = self.clock()
        if now >= self._next_sweep:
            self._sweep(now)
        key = (layer, expert)
        nodes = self._holders.get(key)
        if nodes is None:
            with self._lock:
                table = self._nodes
                if self._unproven_k is None:
                    eligible = table.items()
                else:  # the proven and those in turn: never a scan of every stranger
                    eligible = [(node, table[node]) for node in (*self._proven, *self._turn) if node in table]
                nodes = tuple(sorted(node for node, (spans, _) in eligible
                                     if any(lo <= expert < hi for lo, hi in spans.get(layer, ()))
                                     and self._bundle_hold.get(node, (0.0,))[0] <= now))
                self._holders[key] = nodes
        return nodes

    def limit_unproven(self, k: int | None) -> None:
        """Name at most ``k`` nodes not yet proven among any expert's bundle holders, in turn
        (None: every bundle node, proven or not)."""
        with self._lock:
            self._unproven_k = k
            self._holders = {}

    def mark_proven(self, node: str) -> None:
        """``node`` passed its probation: it holds bundles from now on without waiting its turn."""
        if node in self._proven:
            return
        with self._lock:
            self._proven[node] = None
            while len(self._proven) > self.max_nodes:
                self._proven.popitem(last=False)
            self._holders = {}

    def next_turn(self) -> tuple[str, ...]:
        """Give the next ``k`` unproven bundle nodes the turn (once per layer step); returns them.
        Names that left the table, or were proven meanwhile, leave the queue as they come up."""
        k = self._unproven_k
        if k is None or not self._queue:
            return self._turn
        now = self.clock()
        with self._lock:
            self._turns += 1
            if self._turn_failed and not self._turn_heard:  # the last turn answered nothing: a crowd of mutes
                self._gap = min(MAX_TURN_GAP, 2 * self._gap)
            self._turn_heard = self._turn_failed = False
            turn: list[str] = []
            for _ in range(len(self._queue) if self._turns % self._gap == 0 else 0):
                if len(turn) == k:
                    break
                node = self._queue.popleft()
                if node not in self._nodes or node in self._proven:
                    self._queued.discard(node)
                    continue
                self._queue.append(node)  # to the back: its next turn comes after everyone else's
                if self._bundle_hold.get(node, (0.0,))[0] <= now:
                    turn.append(node)
            if tuple(turn) != self._turn:
                self._turn = tuple(turn)
                self._holders = {}
        return self._turn

    def forget_node(self, node: str) -> None:
        """The node's bundle subject has no subscriber: send it nothing until it heartbeats again."""
        with self._lock:
            self._nodes.pop(node, None)
            self._read_at.pop(node, None)
            self._turn_failed = self._turn_failed or node in self._turn
            if self._unproven_k is None or node in self._proven or node in self._turn:
                self._holders = {}  # a stranger out of turn is named nowhere

    def bundle_unanswered(self, node: str) -> None:
        """A bundle sent to ``node`` timed out: no bundles to it for a while (doubling)."""
        now = self.clock()
        with self._lock:
            self._turn_failed = self._turn_failed or node in self._turn
            until, hold = self._bundle_hold.get(node, (0.0, self.silence_hold_s / 2))
            if until > now:
                return  # one step's timeout counts once
            hold = min(self.max_hold_s, 2 * hold)
            self._bundle_hold[node] = (now + hold, hold)
            self._holders = {}
            if len(self._bundle_hold) > self.max_nodes:
                self._bundle_hold.pop(next(iter(self._bundle_hold)))

    def bundle_answered(self, node: str) -> None:
        """A bundle of ``node`` was answered: its next timeout holds it back for the shortest hold again."""
        if node in self._turn:  # an unproven node that answers: turns every step again
            self._turn_heard, self._gap = True, 1
        if node in self._bundle_hold:
            with self._lock:
                self._bundle_hold.pop(node, None)
                self._holders = {}

    @property
    def bundle_nodes(self) -> int:
        return len(self._nodes)

    def _sweep(self, now: float) -> None:
        with self._lock:
            self._next_sweep = now + min(1.0, self.node_ttl_s / 4)
            stale = [node for node, (_, heard_at) in self._nodes.items() if now - heard_at > self.node_ttl_s]
            for node in stale:
                del self._nodes[node]
                self._read_at.pop(node, None)
            if self._unproven_k is not None:  # strangers out of turn were named nowhere
                stale = [node for node in stale if node in self._proven or node in self._turn]
            released = [node for node, (until, _) in self._bundle_hold.items() if 0.0 < until <= now]
            for node in released:  # the hold is kept, doubled by the next timeout; only the ban ends
                self._bundle_hold[node] = (0.0, self._bundle_hold[node][1])
            if stale or released:
                self._holders = {}

    def _track(self, heartbeat: codec.Heartbeat, spans: dict[int, list[tuple[int, int]]]) -> None:
        node = heartbeat.node
        if not heartbeat.bundles:  # an old worker, or one that stopped taking bundles
            if node in self._nodes:
                self.forget_node(node)
            return
        with self._lock:
            known = self._nodes.get(node)
            if known is None and len(self._nodes) >= self.max_nodes:
                return
            self._nodes[node] = (spans, self.clock())
            self._read_at[node] = self._nodes[node][1]
            if known is None and node not in self._queued and node not in self._proven:
                self._queue.append(node)  # a newcomer waits for its turn (at once if there is room)
                self._queued.add(node)
                if len(self._queue) > 2 * self.max_nodes:  # names that left, not yet come up: drop them
                    self._queue = deque(n for n in self._queue if n in self._nodes and n not in self._proven)
                    self._queued = set(self._queue)
                if self._unproven_k is not None and self._gap == 1 and len(self._turn) < self._unproven_k \
                        and node not in self._turn:
                    self._turn += (node,)
                    self._holders = {}
            if known is None or known[0] != spans:
                if self._unproven_k is None or node in self._proven or node in self._turn:
                    self._holders = {}  # a stranger out of turn is named nowhere: no cache to redo

    def heard(self, heartbeat: codec.Heartbeat) -> None:
        """A worker announced its holdings: ask again for those we had given up on, and (with
        ``track_nodes``) note whether it takes bundles. The work is bounded by the model's
        geometry and what we had given up on, never by what the heartbeat claims."""
        if not self._uncovered and not self._silent and not self.track_nodes:
            return
        spans: dict[int, list[tuple[int, int]]] = {}
        for h in heartbeat.holdings:
            if self.n_layer is not None and h.layer >= self.n_layer:
                continue
            hi = h.hi if self.n_expert is None else min(h.hi, self.n_expert)
            if h.lo < hi:
                spans.setdefault(h.layer, []).append((h.lo, hi))
        if self.track_nodes:
            self._track(heartbeat, spans)
        if not spans or (not self._uncovered and not self._silent):
            return

        def claimed(key: tuple[int, int]) -> bool:
            return any(lo <= key[1] < hi for lo, hi in spans.get(key[0], ()))

        for key in [k for k in self._uncovered if claimed(k)]:
            del self._uncovered[key]
        now = self.clock()
        for key in [k for k, (until, _) in self._silent.items() if until <= now and claimed(k)]:
            self._revived[key] = self._silent.pop(key)[1]  # the next silence holds twice as long

    def _still_out_of_turn(self, node: str) -> bool:
        """A stranger already on the table, out of turn, read less than ``reread_s`` ago: it is
        named nowhere, so what it claims cannot matter before its turn. Note that it is alive and
        skip decoding (2,000 of them heartbeating cost the backbone a tenth of a core to decode)."""
        read_at = self._read_at.get(node)
        if read_at is None or node in self._proven or node in self._turn:
            return False
        now = self.clock()
        if now - read_at >= self.reread_s:
            return False
        with self._lock:
            entry = self._nodes.get(node)
            if entry is None:
                return False
            self._nodes[node] = (entry[0], now)
        return True

    # -- the heartbeat listener -------------------------------------------------------------------

    async def start(self, nc, model: str) -> None:
        if self._sub is None:
            self._sub = await nc.subscribe(Subjects(model).coverage_all(), cb=self._on_heartbeat)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _on_heartbeat(self, msg) -> None:
        if not self._uncovered and not self._silent and not self.track_nodes:
            return
        if self._unproven_k is not None and self._still_out_of_turn(msg.subject.rpartition(".")[2]):
            return
        try:
            hb = codec.decode_heartbeat(msg.data, max_bytes=64 * 1024)
        except codec.CodecError:
            return  # the market logs malformed heartbeats; dispatch only needs good ones
        self.heard(hb)
