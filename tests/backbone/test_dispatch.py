"""The dispatch's decisions, against a fake NATS connection (no server, no model).

Every request the dispatch publishes goes to an ``answer`` function the test sets; it returns
the replies to deliver at once (a real server's 503 included) and the test can deliver more
later (a late reply). The fallback replica is a fake too: it doubles the rows, so whether an
output came from a "worker" or from the fallback shows in the numbers.
"""

from __future__ import annotations

import asyncio
import threading

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backbone.audit import AuditConfig
from kernels.backend import kernel_label
from backbone.coverage_view import CoverageView
from backbone.dispatch import AdaptiveTimeout, DispatchConfig, RemoteExperts
from kvasir_bus import codec, market_codec
from kvasir_bus.codec import Holding
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects

MODEL = "feedc0ffee000001"
NO_AUDIT = AuditConfig(rate=0.0)  # the paths below are about the bus; audits have their own tests
D = 4  # n_embd
NO_RESPONDERS = (b"", {"Status": "503"})


class FakeMsg:
    def __init__(self, subject: str, data: bytes, headers: dict | None = None):
        self.subject, self.data, self.headers = subject, data, headers


class FakeSub:
    def __init__(self, nc: "FakeNats", subject: str, cb):
        self.nc, self.subject, self.cb = nc, subject, cb

    async def unsubscribe(self) -> None:
        self.nc.subs.remove(self)


def matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))


class FakeNats:
    """What :class:`RemoteExperts` uses of a nats.py client, delivering in-process."""

    max_payload = 1 << 20

    def __init__(self):
        self.subs: list[FakeSub] = []
        self.requests: list[tuple[str, codec.DispatchRequest, str]] = []  # (subject, request, reply to)
        self.answer = lambda subject, req: []  # -> [(data, headers)] delivered at once
        self.bundles: list[tuple[str, codec.BundleRequest, str]] = []  # (node, bundle, reply to)
        self.answer_bundle = lambda node, bundle: [NO_RESPONDERS]  # nobody on a node's subject

    def new_inbox(self) -> str:
        return "_INBOX.fake"

    async def subscribe(self, subject: str, cb) -> FakeSub:
        sub = FakeSub(self, subject, cb)
        self.subs.append(sub)
        return sub

    async def flush(self) -> None:
        pass

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        if ".n." in subject:  # a bundle for one node
            bundle = codec.decode_bundle(payload)
            node = subject.rsplit(".", 1)[1]
            self.bundles.append((node, bundle, reply))
            for data, hdrs in self.answer_bundle(node, bundle):
                await self.deliver(reply, data, hdrs)
            return
        if ".x." not in subject:  # an event (a quarantine): straight to the subscribers
            await self.deliver(subject, payload, headers)
            return
        req = codec.decode_request(payload)
        self.requests.append((subject, req, reply))
        for data, hdrs in self.answer(subject, req):
            await self.deliver(reply, data, hdrs)

    async def deliver(self, subject: str, data: bytes, headers: dict | None = None) -> None:
        for sub in [s for s in self.subs if matches(s.subject, subject)]:
            await sub.cb(FakeMsg(subject, data, headers))


class DoublingLocal:
    """The fallback replica: output = 2 x rows, every call counted (with the kernel asked for)."""

    backend = "ggml"

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.backends: list[str | None] = []

    def compute(self, layer: int, expert: int, rows: np.ndarray, *, backend: str | None = None) -> np.ndarray:
        self.calls.append((layer, expert))
        self.backends.append(backend)
        return 2 * rows

    def weight_type(self, layer: int) -> int:
        return int(T.F32)


class Recorder:
    def __init__(self):
        self.calls, self.wins, self.voided, self.audits = [], [], [], []

    def record_call(self, layer, expert, rows, remote):
        self.calls.append((layer, expert, rows, remote))

    def record_win(self, node, layer, expert, rows, latency_s=None, at=None):
        self.wins.append((node, layer, expert, rows))

    def void(self, node, since=0.0):
        self.voided.append(node)

    def record_audit(self, node, passed):
        self.audits.append((node, passed))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reply(req: codec.DispatchRequest, rows: np.ndarray, node: str = "w0", kernel: str = "") -> tuple[bytes, None]:
    return codec.DispatchReply(request_id=req.request_id, node=node, rows=rows.astype(np.float32),
                               kernel=kernel).encode(), None


def times(k: float, node: str = "w0", kernel: str = ""):
    """An answer: one worker replying k x rows."""
    return lambda subject, req: [reply(req, k * req.rows, node, kernel)]


@pytest.fixture
def bus():
    b = LoopThread("test-dispatch")
    yield b
    b.stop()


@pytest.fixture
def rig(bus):
    """(dispatch, fake connection, fallback, recorder, clock), started."""

    def make(cfg: DispatchConfig = DispatchConfig(timeout_s=5.0, audit=NO_AUDIT)):
        nc, local, recorder, clock = FakeNats(), DoublingLocal(), Recorder(), Clock()
        remote = RemoteExperts(bus, nc, MODEL, local, D, cfg, coverage=CoverageView(cfg.uncovered_ttl_s, clock),
                               recorder=recorder)
        bus.run(remote.start())
        return remote, nc, local, recorder, clock

    return make


ROWS = np.arange(2 * D, dtype=np.float32).reshape(2, D) + 1  # (2, D)


def test_a_valid_reply_is_used_and_credited_to_its_node(rig):
    remote, nc, local, recorder, _ = rig()
    nc.answer = times(3, node="w7")
    (out,) = remote.run_layer(0, [(5, ROWS)])
    assert np.array_equal(out, 3 * ROWS)
    assert nc.requests[0][0] == Subjects(MODEL).dispatch(0, 5)
    assert local.calls == []
    s = remote.stats.layer(0)
    assert (s.remote, s.local, s.rows_remote) == (1, 0, 2)
    assert dict(remote.stats.nodes) == {"w7": 1}
    assert recorder.calls == [(0, 5, 2, True)] and recorder.wins == [("w7", 0, 5, 2)]


@pytest.mark.parametrize("bad", [
    pytest.param(lambda req: (b"\x00not msgpack", None), id="bad-bytes"),
    pytest.param(lambda req: reply(req, req.rows[:1]), id="too-few-rows"),
    pytest.param(lambda req: reply(req, np.zeros((2, D - 1))), id="wrong-width"),
    pytest.param(lambda req: reply(req, np.full((2, D), np.nan)), id="nan"),
    pytest.param(lambda req: reply(req, np.full((2, D), np.inf)), id="inf"),
    pytest.param(lambda req: (codec.DispatchReply(request_id="someone-else", node="w0",
                                                  rows=req.rows).encode(), None), id="wrong-request-id"),
    pytest.param(lambda req: (codec.ErrorReply(request_id=req.request_id, node="w0", code=codec.ERR_NOT_HELD,
                                               message="not here").encode(), None), id="error-reply"),
])
def test_an_invalid_reply_is_counted_and_the_expert_computed_locally(rig, bad):
    remote, nc, local, recorder, _ = rig()
    nc.answer = lambda subject, req: [bad(req)]
    (out,) = remote.run_layer(1, [(2, ROWS)])
    assert np.array_equal(out, 2 * ROWS)  # the fallback's answer, not the worker's
    assert local.calls == [(1, 2)]
    s = remote.stats.layer(1)
    assert (s.invalid, s.remote, s.rows_local) == (1, 0, 2)
    assert recorder.calls == [(1, 2, 2, False)] and recorder.wins == []


def test_a_reply_after_the_timeout_is_counted_late_and_changes_nothing(rig, bus):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=0.02, audit=NO_AUDIT))
    (out,) = remote.run_layer(0, [(1, ROWS)])  # nobody answers in time
    assert np.array_equal(out, 2 * ROWS)
    assert remote.stats.layer(0).timeouts == 1
    _, req, reply_to = nc.requests[0]
    bus.run(nc.deliver(reply_to, *reply(req, 9 * req.rows)))  # the straggler arrives
    s = remote.stats.layer(0)
    assert (s.late, s.remote, s.duplicates) == (1, 0, 0)
    assert dict(remote.stats.nodes) == {}
    nc.answer = times(3)  # and the next call is not confused by it
    assert np.array_equal(remote.run_layer(0, [(1, ROWS)])[0], 3 * ROWS)


def test_racing_replicas_the_first_reply_wins_and_ours_drops_the_second(rig):
    remote, nc, local, recorder, _ = rig()
    nc.answer = lambda subject, req: [reply(req, 3 * req.rows, "fast"), reply(req, 3 * req.rows, "slow")]
    (out,) = remote.run_layer(0, [(4, ROWS)])
    assert np.array_equal(out, 3 * ROWS)
    s = remote.stats.layer(0)
    assert (s.remote, s.duplicates, s.invalid, s.disputes) == (1, 1, 0, 0)  # the replicas agree
    assert dict(remote.stats.nodes) == {"fast": 1}
    assert recorder.wins == [("fast", 0, 4, 2)]  # the loser is never paid


def test_racing_replicas_that_disagree_are_both_audited_and_the_call_recomputed(rig):
    remote, nc, local, recorder, _ = rig()  # no audits: only the disagreement makes one
    nc.answer = lambda subject, req: [reply(req, 2 * req.rows, "honest"), reply(req, 5 * req.rows, "liar")]
    (out,) = remote.run_layer(0, [(4, ROWS)])
    assert np.array_equal(out, 2 * ROWS)
    deadline = time.monotonic() + 10
    while remote.stats.layer(0).disputes < 1 and time.monotonic() < deadline:  # the loser comes on the bus thread
        time.sleep(0.005)
    assert remote.stats.layer(0).disputes == 1
    remote.run_layer(0, [(4, ROWS)])  # the next step audits both sides first
    assert remote.auditor.quarantined == {"liar"}


def test_no_responders_falls_back_at_once_and_then_stops_asking_until_the_ttl(rig):
    remote, nc, local, _, clock = rig(DispatchConfig(timeout_s=5.0, uncovered_ttl_s=1.0, audit=NO_AUDIT))
    nc.answer = lambda subject, req: [NO_RESPONDERS]
    assert np.array_equal(remote.run_layer(0, [(3, ROWS)])[0], 2 * ROWS)
    assert remote.stats.layer(0).no_responders == 1 and len(nc.requests) == 1
    assert np.array_equal(remote.run_layer(0, [(3, ROWS)])[0], 2 * ROWS)
    assert remote.stats.layer(0).local_choice == 1 and len(nc.requests) == 1  # not even asked
    remote.run_layer(0, [(4, ROWS)])  # another expert is asked as usual
    assert len(nc.requests) == 2
    clock.now += 1.5  # the ttl has passed: ask again
    nc.answer = times(3)
    assert np.array_equal(remote.run_layer(0, [(3, ROWS)])[0], 3 * ROWS)
    assert len(nc.requests) == 3


def test_a_heartbeat_announcing_the_expert_ends_uncovered_at_once(rig, bus):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=5.0, uncovered_ttl_s=600, audit=NO_AUDIT))
    nc.answer = lambda subject, req: [NO_RESPONDERS]
    remote.run_layer(2, [(6, ROWS)])
    remote.run_layer(2, [(6, ROWS)])
    assert len(nc.requests) == 1  # given up on for 600 s

    def beat(*holdings):
        hb = codec.Heartbeat(model=MODEL, node="late", holdings=holdings, budget_bytes=0, load=0.0, served=0,
                             version="0.1.0", kernel="fake", sent_at=0.0)
        bus.run(nc.deliver(Subjects(MODEL).coverage("late"), hb.encode()))

    beat(Holding(1, 0, 8), Holding(2, 0, 6))  # other experts: still uncovered
    bus.run(nc.deliver(Subjects(MODEL).coverage("junk"), b"\x01garbage"))  # ignored, no crash
    remote.run_layer(2, [(6, ROWS)])
    assert len(nc.requests) == 1
    beat(Holding(2, 4, 8))
    nc.answer = times(3, node="late")
    assert np.array_equal(remote.run_layer(2, [(6, ROWS)])[0], 3 * ROWS)
    assert len(nc.requests) == 2 and dict(remote.stats.nodes) == {"late": 1}


def test_one_layer_step_asks_every_expert_at_once_and_keeps_the_order(rig):
    remote, nc, local, _, _ = rig()
    nc.answer = lambda subject, req: ([NO_RESPONDERS] if req.expert == 1 else [reply(req, (req.expert + 3) * req.rows)])
    outs = remote.run_layer(0, [(0, ROWS), (1, ROWS[:1]), (2, ROWS)])
    assert [o.shape for o in outs] == [(2, D), (1, D), (2, D)]
    assert np.array_equal(outs[0], 3 * ROWS) and np.array_equal(outs[2], 5 * ROWS)
    assert np.array_equal(outs[1], 2 * ROWS[:1])  # the hole, computed here
    assert remote.stats.to_dict()["totals"]["fallback_rate"] == round(1 / 3, 4)


def test_adaptive_timeout_follows_latency_between_floor_and_ceiling():
    cfg = DispatchConfig(timeout_floor_s=0.05, timeout_ceiling_s=2.0, initial_timeout_s=0.5)
    t = AdaptiveTimeout(cfg)
    assert t.current() == 0.5  # nothing observed yet
    for _ in range(50):
        t.observe(0.001)
    assert t.current() == 0.05  # fast replies: the floor
    for _ in range(50):
        t.observe(0.2)
    assert 0.2 < t.current() < 0.5  # smoothed latency plus its deviation
    for _ in range(50):
        t.observe(5.0)
    assert t.current() == 2.0  # the ceiling
    assert AdaptiveTimeout(DispatchConfig(timeout_s=0.123)).current() == 0.123  # fixed when configured


# -- audits, quarantine, silence ---------------------------------------------------------------

OWN = kernel_label("ggml")  # the fake fallback's kernel on this machine


def test_an_audited_honest_reply_is_replaced_by_the_local_result_and_credited(rig):
    remote, nc, local, recorder, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0)))
    nc.answer = times(2, node="honest", kernel=OWN)  # the same function, so the same bits
    (out,) = remote.run_layer(0, [(5, ROWS)])
    assert np.array_equal(out, 2 * ROWS) and local.calls == [(0, 5)]
    assert recorder.wins == [("honest", 0, 5, 2)]
    assert recorder.audits == [("honest", True)]  # passes are reported too (the market counts them)
    d = remote.stats.to_dict()
    assert (d["audits"], d["audit_failures"], d["quarantined"]) == (1, 0, [])


def test_a_liar_is_caught_replaced_quarantined_announced_and_never_paid_again(rig, bus):
    remote, nc, local, recorder, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0)))
    events = []

    async def listen():
        async def got(msg):
            events.append(market_codec.decode_quarantine(msg.data))
        await nc.subscribe(Subjects(MODEL).quarantine(), cb=got)

    bus.run(listen())
    nc.answer = times(2 * (1 + 1e-3), node="liar", kernel=OWN)  # honest x (1 + 1e-3)
    (out,) = remote.run_layer(3, [(1, ROWS)])
    assert np.array_equal(out, 2 * ROWS)  # the backbone's own result, not the lie
    assert recorder.wins == [] and recorder.voided == ["liar"] and recorder.audits == [("liar", False)]
    assert remote.stats.to_dict()["quarantined"] == ["liar"]
    bus.run(nc.flush())
    assert [(e.node, e.layer, e.expert, e.exact) for e in events] == [("liar", 3, 1, True)]
    # From now on its replies are ignored: a slower honest replica wins the race instead.
    nc.answer = lambda subject, req: [reply(req, 7 * req.rows, "liar", OWN), reply(req, 2 * req.rows, "honest", OWN)]
    (out,) = remote.run_layer(3, [(1, ROWS)])
    assert np.array_equal(out, 2 * ROWS)
    assert remote.stats.layer(3).ignored == 1 and recorder.wins == [("honest", 3, 1, 2)]


def test_a_reply_of_a_kernel_the_backbone_can_rerun_is_judged_by_that_kernel(rig):
    remote, nc, local, recorder, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0)))
    nc.answer = times(2, node="phone", kernel=kernel_label("numpy"))
    remote.run_layer(0, [(5, ROWS)])
    assert local.backends == [None, "numpy"]  # the used result (own kernel), then the judge's
    assert recorder.wins == [("phone", 0, 5, 2)]


def test_a_silent_expert_costs_one_timeout_then_is_computed_here_and_only_probed(rig, bus):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=0.02, audit=NO_AUDIT))
    # A stranger subscribes to everything and never answers: no 503, no reply.
    for _ in range(5):
        outs = remote.run_layer(0, [(1, ROWS), (2, ROWS)])
        assert all(np.array_equal(o, 2 * ROWS) for o in outs)
    outs = remote.run_layer(1, [(3, ROWS)])  # other experts: silence was seen, nothing ever answered
    bus.run(nc.flush())  # a step of probes only returns before the loop has sent them: let it
    s = remote.stats.to_dict()["totals"]
    assert s["timeouts"] == 2  # the first step only
    assert s["silent"] == 2 * 4 + 1 and len(nc.requests) == 2 * 5 + 1  # still probed, never waited for
    # An honest worker appears: its first probe reply ends the silence of that expert.
    nc.answer = times(3, node="new")
    remote.run_layer(0, [(1, ROWS)])
    bus.run(nc.flush())
    assert remote.stats.layer(0).probes_answered == 1
    (out,) = remote.run_layer(0, [(1, ROWS)])
    assert np.array_equal(out, 3 * ROWS)


def test_a_heartbeat_claiming_a_billion_experts_costs_what_the_model_has(rig, bus):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=5.0, uncovered_ttl_s=600, audit=NO_AUDIT))
    remote.coverage.n_layer, remote.coverage.n_expert = 4, 8
    nc.answer = lambda subject, req: [NO_RESPONDERS]
    remote.run_layer(2, [(6, ROWS)])
    bomb = codec.Heartbeat(model=MODEL, node="bomb", holdings=(Holding(2, 0, 999_999_999),), budget_bytes=0,
                           load=0.0, served=0, version="0.1.0", kernel="x", sent_at=0.0)
    bus.run(nc.deliver(Subjects(MODEL).coverage("bomb"), bomb.encode()))  # returns at once
    assert remote.coverage.uncovered == 0  # layer 2 expert 6 is claimed: asked again


class DeferringNats(FakeNats):
    """Replies are delivered on the loop's next turn, as a real connection does (they come back
    through the socket), and every publish is logged beside every reply handled."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers=None) -> None:
        if ".x." not in subject:
            await super().publish(subject, payload, reply, headers)
            return
        req = codec.decode_request(payload)
        self.requests.append((subject, req, reply))
        self.events.append(f"pub {req.expert}")
        for data, hdrs in self.answer(subject, req):
            asyncio.get_running_loop().call_soon(lambda r=reply, d=data, h=hdrs: asyncio.ensure_future(
                self.deliver(r, d, h)))

    async def deliver(self, subject: str, data: bytes, headers: dict | None = None) -> None:
        self.events.append("reply")
        await super().deliver(subject, data, headers)


def test_a_layer_step_is_published_as_one_batch_before_any_reply_is_handled(bus):
    nc, local = DeferringNats(), DoublingLocal()
    cfg = DispatchConfig(timeout_s=5.0, audit=NO_AUDIT)
    remote = RemoteExperts(bus, nc, MODEL, local, D, cfg, coverage=CoverageView(cfg.uncovered_ttl_s, Clock()))
    bus.run(remote.start())
    batches = []
    publish_step = remote._publish_step

    async def counted(step):
        batches.append([call.expert for call in step.calls])
        await publish_step(step)

    remote._publish_step = counted
    nc.answer = times(3)
    outs = remote.run_layer(0, [(0, ROWS), (1, ROWS[:1]), (2, ROWS)])
    assert batches == [[0, 1, 2]]  # one publish batch (so nats.py flushes once) per layer step
    assert nc.events == ["pub 0", "pub 1", "pub 2", "reply", "reply", "reply"]
    assert [o.tolist() for o in outs] == [(3 * ROWS).tolist(), (3 * ROWS[:1]).tolist(), (3 * ROWS).tolist()]
    assert local.calls == []


def test_a_closed_bus_loop_costs_no_wait_every_expert_is_computed_here(rig, bus):
    remote, nc, local, recorder, _ = rig()
    nc.answer = times(3)
    bus.stop()  # the connection's loop is gone (a service stopping under the engine)
    outs = remote.run_layer(0, [(0, ROWS), (1, ROWS)])
    assert all(np.array_equal(o, 2 * ROWS) for o in outs)
    assert remote.stats.layer(0).bus_errors == 2 and nc.requests == []
    assert [c[3] for c in recorder.calls] == [False, False]


def test_balance_mode_re_sends_an_unanswered_call_and_stops_once_it_is_answered(rig, bus):
    """A queue group's member froze: after the hedge delay the same request (same reply token)
    goes out again; the second member's reply wins; no hedge follows an answered call."""
    from backbone.replicas import ReplicaConfig, Replicas

    remote, nc, local, recorder, _ = rig()
    remote.replicas = Replicas(ReplicaConfig(mode="balance", hedge_initial_s=0.01, max_hedges=2))
    first = {}

    def frozen_then_second(subject, req):
        if req.request_id not in first:  # the frozen member swallows the first copy
            first[req.request_id] = True
            return []
        return [reply(req, 3 * req.rows, "second")]

    nc.answer = frozen_then_second
    (out,) = remote.run_layer(0, [(5, ROWS)])
    assert np.array_equal(out, 3 * ROWS) and local.calls == []
    tokens = [reply_to for _, _, reply_to in nc.requests]
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # the same call, asked twice
    assert remote.replicas.to_dict() == {"mode": "balance", "hedges": 1, "hedged_calls": 1}
    assert recorder.wins == [("second", 0, 5, 2)]
    assert remote.replicas.book.mean(0, 5) is not None  # its round trip is on record

    nc.answer = times(3)  # answered at once: nothing is re-sent
    remote.run_layer(0, [(6, ROWS)])
    bus.run(asyncio.sleep(0.05))
    assert remote.replicas.to_dict()["hedges"] == 1


# -- bundles: one message per bundle-capable node and layer step --------------------------------

def heartbeat(bus, nc, node: str, *holdings, bundles: bool = True) -> None:
    hb = codec.Heartbeat(model=MODEL, node=node, holdings=holdings or (Holding(0, 0, 8),), budget_bytes=0,
                         load=0.0, served=0, version="0.1.0", kernel="fake", sent_at=0.0, bundles=bundles)
    bus.run(nc.deliver(Subjects(MODEL).coverage(node), hb.encode()))


def bundle_reply(node: str, bundle: codec.BundleRequest, k: float = 3.0, *, skip=(), extra=()) -> tuple[bytes, None]:
    """``node`` answers every call of ``bundle`` with k x its rows (but those in ``skip``: not
    held), and ``extra`` (request id, rows) answers besides."""
    ids, counts, outs, errors = [], [], [], []
    for i, rid in enumerate(bundle.ids):
        if bundle.experts[i] in skip:
            errors.append((rid, codec.ERR_NOT_HELD, "not here"))
            continue
        rows = k * bundle.rows[bundle.call_index(i)].astype(np.float32)
        ids.append(rid), counts.append(len(rows)), outs.append(rows)
    for rid, rows in extra:
        ids.append(rid), counts.append(len(rows)), outs.append(rows)
    out = np.concatenate(outs) if outs else np.zeros((0, D), np.float32)
    return codec.BundleReply(bundle.bundle_id, node, tuple(ids), tuple(counts), out, tuple(errors)).encode(), None


ROW = ROWS[:1]


def test_a_layer_step_for_a_bundle_node_is_one_message_with_each_row_once(rig, bus):
    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]
    outs = remote.run_layer(0, [(1, ROW), (2, ROW.copy()), (5, ROWS)])  # a decode row twice, and two rows
    assert [np.array_equal(o, 3 * x) for o, x in zip(outs, (ROW, ROW, ROWS))] == [True] * 3
    assert nc.requests == [] and local.calls == []
    ((node, sent, _),) = nc.bundles
    assert node == "wb" and sent.experts == (1, 2, 5) and sent.counts == (1, 1, 2)
    assert sent.rows.shape == (2, D)  # ROW is also ROWS[0]: every distinct row once
    assert [sent.call_index(i).tolist() for i in range(3)] == [[0], [0], [0, 1]]
    s = remote.stats.layer(0)
    assert (s.bundles, s.bundled_calls, s.remote, s.foreign) == (1, 3, 3, 0)
    assert dict(remote.stats.nodes) == {"wb": 3}
    assert recorder.wins == [("wb", 0, 1, 1), ("wb", 0, 2, 1), ("wb", 0, 5, 2)]


def test_an_old_worker_without_bundles_is_asked_per_expert(rig, bus):
    remote, nc, local, _, _ = rig()
    heartbeat(bus, nc, "old", bundles=False)
    nc.answer = times(3, node="old")
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 3 * ROW) for o in outs)
    assert nc.bundles == [] and len(nc.requests) == 2
    heartbeat(bus, nc, "new")  # a bundle node: its experts go in its bundle, the rest stays per expert
    heartbeat(bus, nc, "old", bundles=False)
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]
    remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert len(nc.bundles) == 1 and len(nc.requests) == 2


def test_calls_a_bundle_node_does_not_hold_fall_back_here_and_the_rest_is_used(rig, bus):
    remote, nc, local, _, _ = rig()
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3, skip=(2,))]
    outs = remote.run_layer(0, [(1, ROW), (2, ROW), (3, ROW)])
    assert [float(o[0, 0] / ROW[0, 0]) for o in outs] == [3.0, 2.0, 3.0]
    assert local.calls == [(0, 2)]
    s = remote.stats.layer(0)
    assert (s.remote, s.invalid) == (2, 1)


def test_a_bundle_reply_answers_only_the_calls_sent_to_that_node(rig, bus):
    """Node a holds expert 1, node b expert 2: a's reply also 'answers' b's call with other
    numbers; that answer is dropped and counted, b's own answer wins."""
    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "a", Holding(0, 1, 2))
    heartbeat(bus, nc, "b", Holding(0, 2, 3))
    tokens = {}

    def answer(node, b):
        tokens[node] = b.ids
        if node == "a":
            return [bundle_reply("a", b, 3, extra=[(rid, 9 * ROW) for rid in tokens.get("b", ())])]
        return [bundle_reply("b", b, 5)]

    nc.answer_bundle = answer
    outs = remote.run_layer(0, [(2, ROW), (1, ROW)])  # b's bundle goes out first
    assert np.array_equal(outs[0], 5 * ROW) and np.array_equal(outs[1], 3 * ROW)
    s = remote.stats.layer(0)
    assert (s.foreign, s.remote, s.duplicates) == (1, 2, 0)
    assert sorted(recorder.wins) == [("a", 0, 1, 1), ("b", 0, 2, 1)]


def test_a_bundle_reply_from_another_node_is_refused(rig, bus):
    remote, nc, local, _, _ = rig()
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: [bundle_reply("someone-else", b, 3)]
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 2 * ROW) for o in outs)
    assert remote.stats.layer(0).invalid == 2 and dict(remote.stats.nodes) == {}


def test_racing_bundle_nodes_the_first_answer_wins_per_call(rig, bus):
    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "a")
    heartbeat(bus, nc, "b")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]  # replicas that agree (else: a dispute)
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 3 * ROW) for o in outs)
    bus.run(nc.flush())  # b's bundle may go out once a's answer has settled the step
    assert sorted(node for node, _, _ in nc.bundles) == ["a", "b"]
    s = remote.stats.layer(0)
    assert (s.bundles, s.bundled_calls, s.remote, s.duplicates) == (2, 2, 2, 2)
    assert dict(remote.stats.nodes) == {"a": 2}


def test_balance_mode_gives_each_call_to_one_bundle_node(rig, bus):
    from backbone.replicas import ReplicaConfig, Replicas

    remote, nc, local, _, _ = rig()
    remote.replicas = Replicas(ReplicaConfig(mode="balance", max_hedges=0))
    heartbeat(bus, nc, "a")
    heartbeat(bus, nc, "b")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]
    outs = remote.run_layer(0, [(e, ROW) for e in range(4)])
    assert all(np.array_equal(o, 3 * ROW) for o in outs)
    assert sorted((node, len(b.ids)) for node, b, _ in nc.bundles) == [("a", 2), ("b", 2)]
    assert remote.stats.layer(0).duplicates == 0
    assert remote.replicas.book.node_mean("a") is not None


def test_a_gone_bundle_node_costs_no_timeout_its_calls_go_per_expert(rig, bus):
    remote, nc, local, _, _ = rig()
    heartbeat(bus, nc, "gone")
    nc.answer = times(3, node="other")  # nobody on gone's subject; another worker on the experts'
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 3 * ROW) for o in outs)
    assert len(nc.bundles) == 1 and len(nc.requests) == 2
    s = remote.stats.layer(0)
    assert (s.bundles_unheard, s.remote, s.timeouts) == (1, 2, 0)
    remote.run_layer(0, [(1, ROW)])  # forgotten until it heartbeats again
    assert len(nc.bundles) == 1 and len(nc.requests) == 3


def test_a_silent_bundle_node_costs_one_timeout_then_its_experts_are_only_probed(rig, bus):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=0.05, audit=NO_AUDIT))
    heartbeat(bus, nc, "frozen")
    nc.answer_bundle = lambda node, b: []  # subscribed, never answers
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 2 * ROW) for o in outs)
    assert remote.stats.layer(0).timeouts == 2
    remote.run_layer(0, [(1, ROW), (2, ROW)])  # computed here at once, probed on the experts' subjects
    bus.run(nc.flush())  # the probes were published before this ran: nobody waited for them
    s = remote.stats.layer(0)
    assert (s.timeouts, s.silent) == (2, 2) and len(nc.bundles) == 1 and len(nc.requests) == 2


def test_a_lying_bundle_node_is_caught_quarantined_and_sent_no_more_bundles(rig, bus):
    remote, nc, local, recorder, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0)))
    heartbeat(bus, nc, "liar")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 7)]
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 2 * ROW) for o in outs)  # audited: the local result is used
    assert remote.stats.quarantined == ["liar"] and recorder.wins == []
    remote.run_layer(0, [(1, ROW)])
    assert len(nc.bundles) == 1  # no bundle for a liar; its expert goes per expert


def test_a_crowd_of_unproven_bundle_nodes_gets_two_bundles_a_step_in_turn(rig, bus):
    from backbone.dispatch import MAX_UNPROVEN_BUNDLE_NODES

    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=0.1)))
    crowd = [f"s{i:02d}" for i in range(10)]
    for node in crowd:
        heartbeat(bus, nc, node)
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 2)]  # honest: the fallback doubles too
    served: list[set[str]] = []
    for _ in range(5):
        before = len(nc.bundles)
        outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
        assert all(np.array_equal(o, 2 * ROW) for o in outs)
        bus.run(nc.flush())
        served.append({node for node, _, _ in nc.bundles[before:]})
    assert all(len(s) == MAX_UNPROVEN_BUNDLE_NODES for s in served)  # not one bundle per stranger
    assert len(set().union(*served)) > MAX_UNPROVEN_BUNDLE_NODES  # in turn, so each gets to prove itself


def test_balance_mode_hedges_a_call_whose_bundle_node_froze_on_the_experts_subject(rig, bus):
    from backbone.replicas import ReplicaConfig, Replicas

    remote, nc, local, recorder, _ = rig()
    remote.replicas = Replicas(ReplicaConfig(mode="balance", hedge_initial_s=0.01, max_hedges=1))
    heartbeat(bus, nc, "frozen")
    nc.answer_bundle = lambda node, b: []  # subscribed, never answers
    nc.answer = times(3, node="member")  # the queue group's other member
    (out,) = remote.run_layer(0, [(5, ROW)])
    assert np.array_equal(out, 3 * ROW) and local.calls == []
    assert len(nc.bundles) == 1 and len(nc.requests) == 1
    assert nc.requests[0][2].endswith("." + nc.bundles[0][1].ids[0])  # the call's own token
    assert remote.replicas.hedges == 1 and recorder.wins == [("member", 0, 5, 1)]


def test_a_node_whose_bundles_go_unanswered_gets_none_for_a_doubling_hold(rig, bus):
    """Its experts answer on their own subjects (say the bus refuses this backbone the node
    subjects, under a deployment's credentials from before bundles): one timeout, then per expert."""
    remote, nc, local, _, clock = rig(DispatchConfig(timeout_s=0.05, audit=NO_AUDIT))
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: []
    nc.answer = times(3, node="wb")
    remote.run_layer(0, [(1, ROW)])  # the bundle times out: computed here
    remote.run_layer(0, [(1, ROW)])  # silent: computed here, probed per expert (answered)
    bus.run(nc.flush())
    (out,) = remote.run_layer(0, [(1, ROW)])
    assert np.array_equal(out, 3 * ROW)  # asked per expert, not in a bundle
    assert len(nc.bundles) == 1 and remote.stats.layer(0).timeouts == 1
    clock.now += 2.5  # the first hold (2 s) is over: bundles again; an answered one ends the hold
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 5)]
    (out,) = remote.run_layer(0, [(1, ROW)])
    assert np.array_equal(out, 5 * ROW) and len(nc.bundles) == 2


def test_bundles_are_split_to_fit_the_servers_max_payload_and_a_big_call_goes_per_expert(rig, bus):
    remote, nc, local, _, _ = rig()
    nc.max_payload = 1024 + 8 * D * 4  # 8 rows a message (besides the envelope)
    heartbeat(bus, nc, "wb")
    sizes = []

    def answer(node, b):
        sizes.append(len(b.encode()))
        return [bundle_reply(node, b, 3)]

    nc.answer_bundle = answer
    nc.answer = times(3)
    big = np.arange(9 * D, dtype=np.float32).reshape(9, D)  # more rows than one message holds
    calls = [(e, ROWS + e) for e in range(6)] + [(7, big)]
    outs = remote.run_layer(0, calls)
    assert all(np.array_equal(o, 3 * x) for o, (_, x) in zip(outs, calls))
    assert len(nc.bundles) > 1 and sum(len(b.ids) for _, b, _ in nc.bundles) == 6
    assert max(sizes) <= nc.max_payload
    assert {req.expert for _, req, _ in nc.requests} == {7} and len(nc.requests) == 2  # in two chunks


def test_audited_bundle_calls_are_recomputed_while_the_reply_is_on_the_way_and_a_lie_is_still_caught(rig, bus):
    remote, nc, local, recorder, _ = rig(DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0)))
    heartbeat(bus, nc, "liar")
    computed = threading.Event()
    compute = local.compute

    def counted(*args, **kw):
        out = compute(*args, **kw)
        if len(local.calls) == 2:
            computed.set()
        return out

    def answer(node, b):
        assert computed.wait(5)  # the reply leaves only once the engine has both references
        return [bundle_reply(node, b, 7)]

    local.compute, nc.answer_bundle = counted, answer
    outs = remote.run_layer(0, [(1, ROW), (2, ROW)])
    assert all(np.array_equal(o, 2 * ROW) for o in outs)  # the lie is never used
    assert local.calls == [(0, 1), (0, 2)]  # each computed once, ahead, and that result used
    assert remote.stats.quarantined == ["liar"] and recorder.wins == []  # nor paid
    assert remote.stats.layer(0).timeouts == 0


def test_a_nan_in_one_call_of_a_bundle_reply_refuses_that_call_only(rig, bus):
    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "wb")

    def answer(node, b):
        out = 3 * b.rows[b.index].astype(np.float32)  # every call one row, in order
        out[1, 0] = np.nan
        return [(codec.BundleReply(b.bundle_id, node, b.ids, b.counts, out).encode(), None)]

    nc.answer_bundle = answer
    outs = remote.run_layer(0, [(1, ROW), (2, ROW), (3, ROW)])
    assert [o.tolist() for o in outs] == [(3 * ROW).tolist(), (2 * ROW).tolist(), (3 * ROW).tolist()]
    assert local.calls == [(0, 2)] and remote.stats.layer(0).invalid == 1
    assert recorder.wins == [("wb", 0, 1, 1), ("wb", 0, 3, 1)]


def test_a_wrong_row_count_for_one_call_of_a_bundle_reply_refuses_that_call_only(rig, bus):
    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "wb")

    def answer(node, b):  # call 2 gets two rows: a valid bundle reply, a wrong answer for that call
        out = 3 * b.rows[np.array([0, 0, 0, 0])].astype(np.float32)
        return [(codec.BundleReply(b.bundle_id, node, b.ids, (1, 2, 1), out).encode(), None)]

    nc.answer_bundle = answer
    outs = remote.run_layer(0, [(1, ROW), (2, ROW), (3, ROW)])
    assert [o.tolist() for o in outs] == [(3 * ROW).tolist(), (2 * ROW).tolist(), (3 * ROW).tolist()]
    assert local.calls == [(0, 2)] and remote.stats.layer(0).invalid == 1
    assert recorder.wins == [("wb", 0, 1, 1), ("wb", 0, 3, 1)]


def test_the_books_of_a_steps_wins_are_kept_before_the_step_returns(rig, bus):
    """The loop thread only settles; the engine's thread books every win of the step before
    run_layer returns: counters, per-node sums, the adaptive timeout, latency and the metrics hook."""
    from backbone.replicas import Replicas

    remote, nc, local, _, _ = rig()
    remote.replicas = Replicas()
    seen = []
    remote.observe_reply = lambda layer, s: seen.append((layer, s))
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]
    remote.run_layer(0, [(1, ROW), (5, ROWS)])
    s = remote.stats.layer(0)
    assert (s.remote, s.rows_remote, s.rows_local) == (2, 3, 0)
    assert s.latency_sum_s > 0 and s.latency_max_s <= s.latency_sum_s
    assert (dict(remote.stats.nodes), dict(remote.stats.node_rows)) == ({"wb": 2}, {"wb": 3})
    assert remote.stats.node_latency_s["wb"] == pytest.approx(s.latency_sum_s)
    assert [layer for layer, _ in seen] == [0, 0] and sum(x for _, x in seen) == pytest.approx(s.latency_sum_s)
    assert remote.timeout.srtt is not None
    assert remote.replicas.book.mean(0, 1) is not None and remote.replicas.book.mean(0, 5) is not None
    assert remote.replicas.book.node_mean("wb") is not None


def test_a_latency_book_takes_a_steps_wins_as_it_takes_them_one_by_one():
    from backbone.replicas import LatencyBook

    wins = [(1, "a", 0.010), (2, "b", 0.020), (1, "b", 0.040), (3, "a", 0.005)]
    one, batch = LatencyBook(4), LatencyBook(4)
    for expert, node, seconds in wins:
        one.observe(7, expert, seconds)
        one.observe_node(node, seconds)
    batch.observe_wins(7, wins)
    for expert in (1, 2, 3, 9):
        assert batch.mean(7, expert) == one.mean(7, expert)
        assert batch.quantiles(7, expert, (50.0,)) == one.quantiles(7, expert, (50.0,))
    assert (batch.node_mean("a"), batch.node_mean("b")) == (one.node_mean("a"), one.node_mean("b"))


def test_a_step_left_unanswered_after_an_answered_one_still_expires_on_the_shared_timer(rig):
    remote, nc, local, _, _ = rig(DispatchConfig(timeout_s=0.05, audit=NO_AUDIT))
    nc.answer = times(3)
    assert np.array_equal(remote.run_layer(0, [(1, ROWS)])[0], 3 * ROWS)  # the timer is set for this step
    nc.answer = lambda subject, req: []  # nobody answers the next one: its deadline comes later
    assert np.array_equal(remote.run_layer(0, [(2, ROWS)])[0], 2 * ROWS)
    assert remote.stats.layer(0).timeouts == 1 and local.calls == [(0, 2)]
    assert remote._waiting == {}  # nothing left waiting


def test_start_now_runs_a_coroutine_to_its_first_wait_at_once_and_a_task_carries_it_on():
    from backbone.dispatch import _start_now

    async def main() -> list[str]:
        log: list[str] = []

        async def no_wait() -> None:
            log.append("no-wait")

        async def waits() -> None:
            log.append("a")
            await asyncio.sleep(0)
            fut = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_result, "b")
            log.append(await fut)

        async def cancelled() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                log.append("cancelled")
                raise

        _start_now(no_wait())
        _start_now(waits())
        assert log == ["no-wait", "a"]  # before the loop turned
        _start_now(cancelled())
        for _ in range(5):
            await asyncio.sleep(0)
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return log

    assert asyncio.run(main()) == ["no-wait", "a", "b", "cancelled"]


def test_settled_layer_steps_leave_nothing_for_the_cycle_collector(rig, bus):
    """A step and its calls refer to each other; once the step is settled they let go, so
    refcounting frees them at once. Kept for the cycle collector instead, they made its passes a
    quarter of the backbone's CPU in a sharded decode (perf, small model)."""
    import gc

    from backbone.dispatch import _Call, _Step

    remote, nc, local, recorder, _ = rig()
    heartbeat(bus, nc, "wb")
    nc.answer_bundle = lambda node, b: [bundle_reply(node, b, 3)]
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            outs = remote.run_layer(0, [(1, ROW), (2, ROW), (5, ROW)])
            assert all(np.array_equal(o, 3 * ROW) for o in outs)
        left = [o for o in gc.get_objects() if type(o) in (_Step, _Call)]
    finally:
        gc.enable()
    assert left == []
    assert remote.stats.layer(0).remote == 60 and local.calls == []


class ExplainingLocal(DoublingLocal):
    """A fallback that can also judge a kernel it cannot rerun (``explained_gap``), counting the
    rows each such judgement is given."""

    def __init__(self):
        super().__init__()
        self.explained_rows: list[int] = []

    def explained_gap(self, layer, expert, rows, reply):
        self.explained_rows.append(len(rows))
        ref = 2 * rows
        return float(np.linalg.norm(reply - ref) / np.linalg.norm(ref))


def test_an_audit_of_a_kernel_the_backbone_cannot_rerun_judges_a_bounded_sample_of_rows(bus):
    """The numpy rerun with its flip analysis costs several ggml computes: an audit of a 100-row
    reply judges 16 rows drawn after the reply came, so a stranger's big reply costs the backbone
    a bounded audit, and a liar on every row is caught all the same."""
    from backbone.dispatch import EXPLAINED_ROWS

    cfg = DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=1.0))
    nc, local, recorder = FakeNats(), ExplainingLocal(), Recorder()
    remote = RemoteExperts(bus, nc, MODEL, local, D, cfg, coverage=CoverageView(cfg.uncovered_ttl_s, Clock()),
                           recorder=recorder)
    bus.run(remote.start())
    rows = np.random.default_rng(1).standard_normal((100, D)).astype(np.float32) + 3
    foreign = "ggml-riscv64"  # a CPU this backbone is not: not rerun bit for bit
    nc.answer = times(2, node="honest", kernel=foreign)
    (out,) = remote.run_layer(0, [(5, rows)])
    assert np.array_equal(out, 2 * rows) and recorder.audits == [("honest", True)]
    nc.answer = times(2 * (1 + 1e-3), node="liar", kernel=foreign)
    remote.run_layer(0, [(5, rows)])
    assert recorder.audits[-1] == ("liar", False) and remote.stats.to_dict()["quarantined"] == ["liar"]
    assert local.explained_rows == [EXPLAINED_ROWS, EXPLAINED_ROWS]
