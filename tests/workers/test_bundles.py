"""A worker answers a bundle (every call of a layer step for it, in one request) with one reply:
per call its output, bit for bit what the call's own request gets, or why not; a bad bundle gets
an error reply and the worker keeps serving."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from workers import runtime
from workers.runtime import Worker, WorkerConfig
from tests.workers.test_worker import model, reference, request, slice_info  # noqa: F401 (fixtures)

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def bundle(info, rows, calls, bid="b1", layer=0):
    """``calls``: (request id, expert, row indices into ``rows``)."""
    return codec.BundleRequest(info.fingerprint, layer, bid, rows, tuple(c[0] for c in calls),
                               tuple(c[1] for c in calls), tuple(len(c[2]) for c in calls),
                               np.array([i for c in calls for i in c[2]], np.uint32))


async def ask_one_bundle(url: str, worker: Worker, info, rows, calls):
    """Start ``worker``, send it one bundle on its node subject, stop it: the decoded reply."""
    nc = await connect(url, "w")
    await worker.start(nc)
    client = await connect(url, "c")
    msg = await client.request(Subjects(info.fingerprint).node(worker.cfg.node), bundle(info, rows, calls).encode(),
                               timeout=5)
    await worker.stop()
    await client.drain()
    await nc.drain()
    return codec.decode_bundle_reply(msg.data, n_embd=info.n_embd)


def test_a_bundle_gets_one_reply_with_every_held_call_and_not_held_for_the_others(
        nats_server, arun, slice_info, model):  # noqa: F811
    info = slice_info  # layer 0, experts 2-5
    subj = Subjects(info.fingerprint)
    rows = np.random.default_rng(1).standard_normal((3, info.n_embd)).astype(np.float32)
    calls = [("a", 3, [0]), ("b", 7, [1]), ("c", 2, [2, 0]), ("d", 5, [1, 1, 2])]

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="wb", heartbeat_s=60))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        msg = await client.request(subj.node("wb"), bundle(info, rows, calls).encode(), timeout=5)
        single = await client.request(subj.dispatch(0, 2), request(info, 0, 2, rows[[2, 0]], "s").encode(), timeout=5)
        beat = worker.heartbeat()
        await worker.stop()
        await client.drain()
        await nc.drain()
        return codec.decode_bundle_reply(msg.data, n_embd=info.n_embd), codec.decode_reply(single.data), beat, worker

    reply, single, beat, worker = arun(go(), timeout=30)
    assert beat.bundles is True
    assert isinstance(reply, codec.BundleReply) and reply.node == "wb" and reply.bundle_id == "b1"
    got = dict(reply.results())
    assert sorted(got) == ["a", "c", "d"]
    for rid, expert, index in calls:
        if rid in got:
            assert np.array_equal(got[rid], reference(model, 0, expert, rows[index])), rid
    assert np.array_equal(got["c"], single.rows)  # bit for bit what its own request gets
    assert reply.errors == (("b", codec.ERR_NOT_HELD, "layer 0 expert 7 is not held here"),)
    assert worker.served == 3 + 1 and worker.errors == 1


def test_a_decode_bundle_runs_its_experts_in_one_graph_with_the_bits_of_each_call_alone(
        nats_server, arun, slice_info, model):  # noqa: F811
    info = slice_info  # layer 0, experts 2-5
    rows = np.random.default_rng(2).standard_normal((1, info.n_embd)).astype(np.float32)
    calls = [("a", 5, [0]), ("b", 2, [0]), ("x", 7, [0]), ("c", 3, [0])]  # a decode step: one row

    worker = Worker(info, WorkerConfig(node="wd", heartbeat_s=60))
    reply = arun(ask_one_bundle(nats_server.url, worker, info, rows, calls), timeout=30)
    got = dict(reply.results())
    assert sorted(got) == ["a", "b", "c"] and [e[0] for e in reply.errors] == ["x"]
    for rid, expert, _ in calls:
        if rid in got:
            assert np.array_equal(got[rid], reference(model, 0, expert, rows)), rid
    assert worker.served == 3


def test_a_decode_bundle_of_big_experts_runs_in_one_graph_on_the_loop_with_the_bits_of_each_call_alone(
        nats_server, arun, slice_info, model, monkeypatch):  # noqa: F811
    info = slice_info  # layer 0, experts 2-5
    rows = np.random.default_rng(2).standard_normal((1, info.n_embd)).astype(np.float32)
    calls = [("a", 5, [0]), ("b", 2, [0]), ("c", 3, [0])]
    monkeypatch.setattr(runtime, "INLINE_WORK", 1)  # every expert is big, past the usual inline bound

    def no_single(*args, **kw):
        raise AssertionError("a big expert's decode call ran in its own graph")

    monkeypatch.setattr(runtime, "expert_ffn", no_single)

    worker = Worker(info, WorkerConfig(node="wd", heartbeat_s=60))
    pooled = []
    submit = worker._pool.submit
    worker._pool.submit = lambda *a, **kw: pooled.append(a) or submit(*a, **kw)
    reply = arun(ask_one_bundle(nats_server.url, worker, info, rows, calls), timeout=30)
    got = dict(reply.results())
    assert sorted(got) == ["a", "b", "c"] and reply.errors == ()
    for rid, expert, _ in calls:
        assert np.array_equal(got[rid], reference(model, 0, expert, rows)), rid
    assert pooled == []  # a decode step with the pool idle: computed on the loop, no hop
    assert len(worker._steps) == 1  # the holding's bound step graph


def test_bad_bundles_get_an_error_reply_and_the_worker_keeps_serving(nats_server, arun, slice_info, model):  # noqa: F811
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.ones((2, info.n_embd), np.float32)
    good = bundle(info, rows, [("a", 2, [0, 1])])
    body = msgpack.unpackb(good.encode())
    too_many = info.n_expert + 1
    bad = {
        "malformed": b"\x93not msgpack\xff",
        "a_request": request(info, 0, 2, rows).encode(),  # per-expert requests go on expert subjects
        "index_past_rows": msgpack.packb({**body, "index": np.array([0, 2], "<u4").tobytes()}),
        "wrong_width": bundle(info, np.ones((2, info.n_embd + 1), np.float32), [("a", 2, [0])]).encode(),
        "wrong_model": codec.BundleRequest("f" * 16, 0, "b2", rows, ("a",), (2,), (1,),
                                           np.zeros(1, np.uint32)).encode(),
        "too_many_calls": bundle(info, rows, [(f"q{i}", 2, [0]) for i in range(too_many)]).encode(),
        "oversized": bundle(info, np.ones((300, info.n_embd), np.float32), [("a", 2, [0])]).encode(),
    }

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="wb", heartbeat_s=60, max_bytes=64 * 1024))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        replies = {}
        for name, payload in bad.items():
            msg = await client.request(subj.node("wb"), payload, timeout=5)
            replies[name] = codec.decode_bundle_reply(msg.data)
        msg = await client.request(subj.node("wb"), good.encode(), timeout=5)
        after = codec.decode_bundle_reply(msg.data, n_embd=info.n_embd)
        await worker.stop()
        await client.drain()
        await nc.drain()
        return replies, after

    replies, after = arun(go(), timeout=30)
    for name, reply in replies.items():
        assert isinstance(reply, codec.ErrorReply) and reply.node == "wb", name
    assert replies["wrong_model"].code == codec.ERR_WRONG_MODEL and replies["wrong_model"].request_id == "b2"
    assert {r.code for n, r in replies.items() if n != "wrong_model"} == {codec.ERR_BAD_REQUEST}
    assert "index" in replies["index_past_rows"].message and "n_embd" in replies["wrong_width"].message
    assert isinstance(after, codec.BundleReply) and [rid for rid, _ in after.results()] == ["a"]


def test_a_worker_without_bundles_neither_announces_nor_takes_them(nats_server, arun, slice_info):  # noqa: F811
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.ones((1, info.n_embd), np.float32)

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="old", heartbeat_s=60, bundles=False))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        try:
            await client.request(subj.node("old"), bundle(info, rows, [("a", 2, [0])]).encode(), timeout=2)
            outcome = "answered"
        except Exception as exc:  # NoRespondersError: nobody is on the node subject
            outcome = type(exc).__name__
        beat = worker.heartbeat()
        await worker.stop()
        await client.drain()
        await nc.drain()
        return outcome, beat

    outcome, beat = arun(go(), timeout=30)
    assert outcome == "NoRespondersError"
    assert beat.bundles is False and "bundles" not in msgpack.unpackb(beat.encode())
