"""The worker's hot path end to end: a decode step's bundle (every call held, one row) runs in one
``mul_mat_id`` graph and is answered in the bundle's order with each call's own bits; requests and
bundles delivered inline (kvasir_bus.lane) get the same replies as through nats.py's queue."""

from __future__ import annotations

import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from workers import runtime
from workers.runtime import Worker, WorkerConfig
from tests.workers.test_bundles import ask_one_bundle, bundle
from tests.workers.test_worker import model, reference, request, slice_info  # noqa: F401 (fixtures)

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def test_a_decode_step_of_held_experts_is_one_graph_answered_in_order_with_each_calls_bits(
        nats_server, arun, slice_info, model, monkeypatch):  # noqa: F811
    info = slice_info  # layer 0, experts 2-5
    rows = np.random.default_rng(4).standard_normal((1, info.n_embd)).astype(np.float32)
    calls = [("a", 5, [0]), ("b", 2, [0]), ("c", 4, [0]), ("d", 3, [0])]
    graphs, bound = [], []
    moe_step = runtime.moe_step

    def spied(*a, **kw):
        step = moe_step(*a, **kw)
        bound.append(a[3])
        return lambda row, slots: graphs.append([list(slots)]) or step(row, slots)

    monkeypatch.setattr(runtime, "moe_step", spied)
    general = []
    grouped = Worker._grouped
    monkeypatch.setattr(Worker, "_grouped", lambda *a: general.append(a) or grouped(*a))

    worker = Worker(info, WorkerConfig(node="ws", heartbeat_s=60))
    reply = arun(ask_one_bundle(nats_server.url, worker, info, rows, calls), timeout=30)
    assert general == []  # the decode step's own path, not the general one
    assert graphs == [[[3, 0, 2, 1]]]  # the slab of each call's expert, in the bundle's order, in one graph
    assert bound == [4]  # the holding's graph for four calls, bound on first use
    assert reply.ids == ("a", "b", "c", "d") and reply.counts == (1, 1, 1, 1) and reply.errors == ()
    for rid, out in reply.results():
        expert = dict((c[0], c[1]) for c in calls)[rid]
        assert np.array_equal(out, reference(model, 0, expert, rows)), rid
    assert (worker.served, worker.rows, worker.errors) == (4, 4, 0) and worker.compute_s > 0


def test_a_decode_step_whose_graph_fails_answers_every_call_with_internal(
        nats_server, arun, slice_info, monkeypatch):  # noqa: F811
    info = slice_info
    rows = np.ones((1, info.n_embd), np.float32)

    def broken(*a, **kw):
        raise RuntimeError("ggml said no")

    monkeypatch.setattr(runtime, "moe_step", lambda *a, **kw: broken)
    worker = Worker(info, WorkerConfig(node="ws", heartbeat_s=60))
    reply = arun(ask_one_bundle(nats_server.url, worker, info, rows, [("a", 5, [0]), ("b", 2, [0])]), timeout=30)
    assert isinstance(reply, codec.BundleReply) and reply.ids == ()
    assert [(e[0], e[1]) for e in reply.errors] == [("a", codec.ERR_INTERNAL), ("b", codec.ERR_INTERNAL)]
    assert "ggml said no" in reply.errors[0][2]
    assert worker.served == 0 and worker.errors == 2


@pytest.mark.parametrize("inline", [True, False])
def test_inline_and_queued_delivery_give_the_same_replies(nats_server, arun, slice_info, model, inline):  # noqa: F811
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.random.default_rng(5).standard_normal((2, info.n_embd)).astype(np.float32)

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="wl", heartbeat_s=60, inline_delivery=inline))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        step = await client.request(subj.node("wl"), bundle(info, rows, [("a", 2, [1]), ("b", 5, [1])]).encode(),
                                    timeout=5)
        single = await client.request(subj.dispatch(0, 3), request(info, 0, 3, rows, "s").encode(), timeout=5)
        bad = await client.request(subj.node("wl"), b"\x93not a bundle", timeout=5)
        headed = await client.request(subj.dispatch(0, 4), request(info, 0, 4, rows, "h").encode(), timeout=5,
                                      headers={"Kvasir-Request": "h"})  # headers: always nats.py's own path
        lane = worker._lane
        await worker.stop()
        await client.drain()
        await nc.drain()
        return step, single, bad, headed, lane

    step, single, bad, headed, lane = arun(go(), timeout=30)
    assert (lane is not None) is inline
    got = dict(codec.decode_bundle_reply(step.data, n_embd=info.n_embd).results())
    assert np.array_equal(got["a"], reference(model, 0, 2, rows[1:]))
    assert np.array_equal(got["b"], reference(model, 0, 5, rows[1:]))
    assert np.array_equal(codec.decode_reply(single.data).rows, reference(model, 0, 3, rows))
    assert np.array_equal(codec.decode_reply(headed.data).rows, reference(model, 0, 4, rows))
    error = codec.decode_reply(bad.data)
    assert isinstance(error, codec.ErrorReply) and error.code == codec.ERR_BAD_REQUEST


def test_a_decode_step_of_one_call_is_its_expert_alone_with_its_bits(
        nats_server, arun, slice_info, model, monkeypatch):  # noqa: F811
    info = slice_info
    rows = np.random.default_rng(6).standard_normal((2, info.n_embd)).astype(np.float32)
    general = []
    grouped = Worker._grouped
    monkeypatch.setattr(Worker, "_grouped", lambda *a: general.append(a) or grouped(*a))
    monkeypatch.setattr(runtime, "moe_ffn", None)  # one call: no graph of several experts

    worker = Worker(info, WorkerConfig(node="ws", heartbeat_s=60))
    reply = arun(ask_one_bundle(nats_server.url, worker, info, rows, [("a", 4, [1])]), timeout=30)
    assert reply.ids == ("a",) and reply.errors == () and general == []
    assert np.array_equal(dict(reply.results())["a"], reference(model, 0, 4, rows[1:]))
    assert (worker.served, worker.rows) == (1, 1)


@pytest.mark.parametrize("max_steps", [64, 1])  # bound steps for both call counts; one, then moe_ffn
def test_decode_steps_one_after_another_reuse_their_bound_graph_and_keep_each_calls_bits(
        nats_server, arun, slice_info, model, monkeypatch, max_steps):  # noqa: F811
    info = slice_info
    subj = Subjects(info.fingerprint)
    monkeypatch.setattr(runtime, "MAX_STEPS", max_steps)
    rng = np.random.default_rng(9)
    steps = [[("a", 2, [0]), ("b", 5, [0])], [("c", 4, [0]), ("d", 3, [0])],
             [("e", 5, [0]), ("f", 2, [0]), ("g", 3, [0])], [("h", 3, [0]), ("i", 3, [0])]]
    inputs = [rng.standard_normal((1, info.n_embd)).astype(np.float32) for _ in steps]

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="wb", heartbeat_s=60))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        replies = [await client.request(subj.node("wb"), bundle(info, rows, calls, bid=f"s{i}").encode(), timeout=5)
                   for i, (rows, calls) in enumerate(zip(inputs, steps))]
        bound = dict(worker._steps)
        await worker.stop()
        await client.drain()
        await nc.drain()
        return replies, bound

    replies, bound = arun(go(), timeout=30)
    assert sorted(k for _, k in bound) == ([2, 3] if max_steps > 1 else [2])
    for msg, rows, calls in zip(replies, inputs, steps):
        reply = codec.decode_bundle_reply(msg.data, n_embd=info.n_embd)
        assert reply.ids == tuple(c[0] for c in calls) and reply.errors == ()
        got = dict(reply.results())
        for rid, expert, _ in calls:  # each output its call's own bits, not the buffer's next contents
            assert np.array_equal(got[rid], reference(model, 0, expert, rows)), rid
