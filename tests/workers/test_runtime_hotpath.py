"""The worker's hot path: small products answered on the loop, big ones on the pool, with the
same bits; dispatch replies carry no NATS headers (the payload says it all), error replies do."""

from __future__ import annotations

import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from kernels.expert import expert_ffn
from modelfile.slice_file import load_slice
from modelfile.slicer import parse_span, plan_slice, write_slice
from workers import runtime
from workers.runtime import Worker, WorkerConfig

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def slice_info(tmp_path_factory):
    from synth.model import synth_model

    model = synth_model(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="qwen3moe", preset="tiny",
                        qtype="q8_0", seed=5)
    out = tmp_path_factory.mktemp("s") / "slice.gguf"
    write_slice(plan_slice(model, [(parse_span("1", "--layer"), parse_span("0-3", "--experts"))]), out)
    return load_slice(out)


def test_inline_and_pooled_products_are_the_same_bits_and_replies_carry_no_headers(
        nats_server, arun, slice_info, monkeypatch):
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.random.default_rng(0).standard_normal((5, info.n_embd)).astype(np.float32)
    expected = expert_ffn(*info.expert_weights(1, 2), rows, routed=True)

    async def ask_all(worker):
        nc = await connect(nats_server.url, "w")
        await worker.start(nc)
        client = await connect(nats_server.url, "c")
        req = codec.DispatchRequest(model=info.fingerprint, layer=1, expert=2, rows=rows, request_id="q1")
        good = await client.request(subj.dispatch(1, 2), req.encode(), timeout=10)
        bad = await client.request(subj.dispatch(1, 2), b"\x93garbage", timeout=10)
        await worker.stop()
        await client.drain()
        await nc.drain()
        return good, bad

    from kernels import ggml

    seen = []  # the threads a ggml call would take, where the worker computes
    timed = runtime._timed
    monkeypatch.setattr(runtime, "_timed", lambda w, r: (seen.append(ggml.n_threads()), timed(w, r))[1])
    inline = Worker(info, WorkerConfig(node="w-inline", heartbeat_s=60))
    good, bad = arun(ask_all(inline), timeout=30)
    inline_threads, seen[:] = list(seen), []
    monkeypatch.setattr(runtime, "INLINE_WORK", 0)  # every product goes to the pool
    pooled = Worker(info, WorkerConfig(node="w-pool", heartbeat_s=60))
    good_pooled, _ = arun(ask_all(pooled), timeout=30)
    # a product computed on the loop never leads an OpenMP team (kernels.ggml.one_thread): the
    # pool's thread alone does, so libgomp never throttles the worker's teams
    assert inline_threads == [1] and seen == [ggml.n_threads()]

    for msg, node in ((good, "w-inline"), (good_pooled, "w-pool")):
        reply = codec.decode_reply(msg.data)
        assert isinstance(reply, codec.DispatchReply) and reply.node == node and reply.request_id == "q1"
        assert np.array_equal(reply.rows, expected)
        assert not msg.headers  # the hot path sends no headers
    error = codec.decode_reply(bad.data)
    assert isinstance(error, codec.ErrorReply) and error.code == codec.ERR_BAD_REQUEST
    assert bad.headers["Kvasir-Error"] == codec.ERR_BAD_REQUEST  # refusals stay visible on the bus
    assert inline.served == 1 and inline.errors == 1 and inline.in_flight == 0
    assert pooled.served == 1 and pooled.in_flight == 0
