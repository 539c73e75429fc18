"""The worker answers every request on its subjects: a result, or an error reply, and keeps serving."""

from __future__ import annotations

import asyncio
import signal

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from kernels.expert import expert_ffn
from workers.runtime import Worker, WorkerConfig
from modelfile.slice_file import load_slice
from modelfile.slicer import parse_span, plan_slice, write_slice
from kernels.tensors import open_gguf, tensors_from_reader

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    return synth_model(path, arch="qwen3moe", preset="tiny", qtype="q8_0", seed=3)


@pytest.fixture(scope="module")
def slice_info(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("s") / "slice.gguf"
    write_slice(plan_slice(model, [(parse_span("0", "--layer"), parse_span("2-5", "--experts"))]), out)
    return load_slice(out)


def reference(model, layer, expert, rows):
    t = tensors_from_reader(open_gguf(model))
    w = [t[f"blk.{layer}.ffn_{k}_exps.weight"].expert(expert) for k in ("gate", "up", "down")]
    return expert_ffn(*w, rows, routed=True)


def request(info, layer, expert, rows, rid="r1"):
    return codec.DispatchRequest(model=info.fingerprint, layer=layer, expert=expert, rows=rows, request_id=rid)


def test_bad_requests_get_error_replies_and_the_worker_keeps_serving(nats_server, arun, slice_info, model):
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.random.default_rng(0).standard_normal((3, info.n_embd)).astype(np.float32)

    async def go():
        nc = await connect(nats_server.url, "test-client")
        worker = Worker(info, WorkerConfig(node="w-test", max_bytes=64 * 1024, heartbeat_s=60))
        await worker.start(nc)
        client = await connect(nats_server.url, "test-sender")

        async def ask(subject, payload):
            msg = await client.request(subject, payload, timeout=5)
            return codec.decode_reply(msg.data)

        replies = {
            "malformed": await ask(subj.dispatch(0, 2), b"\x93not msgpack at all\xff"),
            "not_a_request": await ask(subj.dispatch(0, 2), msgpack.packb({"v": 1, "t": "hb"})),
            "unknown_expert": await ask(subj.dispatch(0, 2), request(info, 0, 7, rows).encode()),
            "unknown_layer": await ask(subj.dispatch(0, 2), request(info, 1, 2, rows).encode()),
            "subject_mismatch": await ask(subj.dispatch(0, 2), request(info, 0, 3, rows).encode()),
            "wrong_shape": await ask(subj.dispatch(0, 2),
                                     request(info, 0, 2, np.zeros((3, info.n_embd + 1), np.float32)).encode()),
            "oversized": await ask(subj.dispatch(0, 2),
                                   request(info, 0, 2, np.zeros((300, info.n_embd), np.float32)).encode()),
        }
        good = await ask(subj.dispatch(0, 3), request(info, 0, 3, rows, "ok1").encode())
        await worker.stop()
        await client.drain()
        await nc.drain()
        return replies, good, worker

    replies, good, worker = arun(go(), timeout=30)
    for name, reply in replies.items():
        assert isinstance(reply, codec.ErrorReply), name
        assert reply.node == "w-test"
    assert replies["malformed"].code == codec.ERR_BAD_REQUEST
    assert replies["unknown_expert"].code == codec.ERR_NOT_HELD
    assert replies["unknown_layer"].code == codec.ERR_NOT_HELD
    assert replies["subject_mismatch"].code == codec.ERR_BAD_REQUEST
    assert replies["wrong_shape"].code == codec.ERR_BAD_REQUEST and "n_embd" in replies["wrong_shape"].message
    assert replies["oversized"].code == codec.ERR_BAD_REQUEST
    assert isinstance(good, codec.DispatchReply) and good.request_id == "ok1"
    assert np.array_equal(good.rows, reference(model, 0, 3, rows))
    assert worker.served == 1 and worker.errors == len(replies)


def test_worker_subscribes_to_exactly_the_experts_it_holds(nats_server, arun, slice_info):
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.ones((1, info.n_embd), np.float32)

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="w1", heartbeat_s=60))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        answered, silent = [], []
        for e in range(8):
            try:
                await client.request(subj.dispatch(0, e), request(info, 0, e, rows).encode(), timeout=2)
                answered.append(e)
            except Exception as exc:  # NoRespondersError
                silent.append(type(exc).__name__)
        await worker.stop()
        await client.drain()
        await nc.drain()
        return answered, silent

    answered, silent = arun(go(), timeout=30)
    assert answered == [2, 3, 4, 5]
    assert set(silent) == {"NoRespondersError"}


def test_many_requests_in_flight_are_all_answered(nats_server, arun, slice_info, model):
    info = slice_info
    subj = Subjects(info.fingerprint)
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((1 + i % 5, info.n_embd)).astype(np.float32) for i in range(40)]

    async def go():
        nc = await connect(nats_server.url, "w")
        worker = Worker(info, WorkerConfig(node="w1", heartbeat_s=60))
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        msgs = await asyncio.gather(*(
            client.request(subj.dispatch(0, 2 + i % 4), request(info, 0, 2 + i % 4, b, f"q{i}").encode(), timeout=10)
            for i, b in enumerate(batches)))
        await worker.stop()
        await client.drain()
        await nc.drain()
        return [codec.decode_reply(m.data) for m in msgs]

    replies = arun(go(), timeout=60)
    for i, (reply, b) in enumerate(zip(replies, batches)):
        assert reply.request_id == f"q{i}"
        assert np.array_equal(reply.rows, reference(model, 0, 2 + i % 4, b))


def test_sigterm_drains_and_exits_cleanly(nats_server, model, tmp_path):
    from launch.swarm import spawn_worker, wait_for_nodes
    from kvasir_bus.fingerprint import model_fingerprint

    log = open(tmp_path / "w.log", "w")
    proc = spawn_worker(nats_server.url, "w-term", ["--model", str(model), "--layer", "0", "--experts", "0-1"],
                        heartbeat_s=0.5, log_file=log)
    asyncio.run(wait_for_nodes(nats_server.url, model_fingerprint(open_gguf(model)), {"w-term"}, procs=[proc]))
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(20) == 0
    text = (tmp_path / "w.log").read_text()
    assert "worker_stopped" in text and "Traceback" not in text


def test_a_flood_of_bad_requests_logs_a_few_lines_and_refuses_past_the_in_flight_bound(nats_server, arun,
                                                                                        slice_info):
    from kvasir_bus.logs import capture

    info = slice_info
    subj = Subjects(info.fingerprint)

    async def go():
        nc = await connect(nats_server.url, "test-worker")
        worker = Worker(info, WorkerConfig(node="w-flood", heartbeat_s=60, max_in_flight=4))
        await worker.start(nc)
        flooder = await connect(nats_server.url, "test-flooder")
        replies, all_in = [], asyncio.Event()

        async def got(msg):
            replies.append(codec.decode_reply(msg.data))
            if len(replies) == 2000:
                all_in.set()

        inbox = flooder.new_inbox()
        await flooder.subscribe(f"{inbox}.*", cb=got)
        with capture() as logs:
            for i in range(2000):
                await flooder.publish(subj.dispatch(0, 2), b"\x93garbage", reply=f"{inbox}.{i}")
            await flooder.flush()
            await asyncio.wait_for(all_in.wait(), 30)  # every request gets an answer
        await worker.stop()
        await flooder.drain()
        await nc.drain()
        return replies, logs, worker

    replies, logs, worker = arun(go(), timeout=60)
    assert len(replies) == 2000 and all(isinstance(r, codec.ErrorReply) for r in replies)
    assert {r.code for r in replies} <= {codec.ERR_BAD_REQUEST, codec.ERR_OVERLOADED}
    refused = [e for e in logs if e["event"] in ("request_refused", "request_without_reply_subject")]
    assert len(refused) <= 4  # one line per sender and kind a minute, not 2000
    assert worker.errors == 2000
