"""Direct replies (kvasir_bus.lane.DirectReply): on nats.py's TCP transport a reply goes to the socket
in one write, intact and in order with everything published the ordinary way; it steps aside
(the caller publishes) whenever nats.py has something pending, is not connected, or talks
websocket; a worker keeps serving across a nats-server restart."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import Subjects
from tests.polling import until
from tests.workers.test_worker import model, reference, request, slice_info  # noqa: F401 (fixtures)
from kvasir_bus.lane import DIRECT_BUFFER_LIMIT, DIRECT_JOIN_LIMIT, DirectPublish, DirectReply
from workers.runtime import Worker, WorkerConfig

#: Both sides of the join limit, of asyncio's 64 KiB high-water mark, and a few times past it.
SIZES = [0, 1, 100, DIRECT_JOIN_LIMIT - 1, DIRECT_JOIN_LIMIT, DIRECT_JOIN_LIMIT + 1,
         DIRECT_BUFFER_LIMIT - 1, DIRECT_BUFFER_LIMIT, DIRECT_BUFFER_LIMIT + 1, 3 * DIRECT_BUFFER_LIMIT + 7,
         1024 * 1024]


def _payload(seq: int, size: int) -> bytes:
    """``size`` bytes that say their sequence number and cannot be mistaken for another's."""
    body = np.random.default_rng(seq).integers(0, 256, max(size, 4), dtype=np.uint8).tobytes()
    return (seq.to_bytes(4, "little") + body[4:])[:size] if size >= 4 else body[:size]


async def _replies_in_order(url: str, options: ConnectOptions | None = None):
    """Publish 400 replies of every size in SIZES on one connection, most through DirectReply,
    every seventh the ordinary way; return what a second connection received and the counts."""
    plan = [(i, SIZES[i % len(SIZES)], i % 7 == 3) for i in range(400)]  # (seq, size, ordinary publish?)
    nc = await connect(url, "direct", options=options)
    direct, why_not = DirectReply.attach(nc)
    assert why_not is None, why_not
    got, done = [], asyncio.Event()
    client = await connect(url, "client", options=options)

    async def collect(msg):
        got.append(msg.data)
        if len(got) == len(plan):
            done.set()

    await client.subscribe("reply.one", cb=collect)
    await client.flush()
    before = dict(nc.stats)
    took = 0
    for seq, size, ordinary in plan:
        data = _payload(seq, size)
        if ordinary:  # leaves nats.py's buffer non-empty until its flusher runs
            await nc.publish("reply.one", data)
        elif direct.write("reply.one", data):
            took += 1
        else:
            await nc.publish("reply.one", data)
        if seq % 50:
            await asyncio.sleep(0)  # the loop turns between replies, as in a worker: the flusher runs
    await asyncio.wait_for(done.wait(), 30)
    stats = dict(nc.stats)
    await client.close()
    await nc.close()
    return plan, got, took, direct.written, before, stats


def _check_in_order(plan, got, took, written, before, stats):
    assert [len(d) for d in got] == [size for _, size, _ in plan]
    assert got == [_payload(seq, size) for seq, size, _ in plan]  # every byte, in publish order
    assert took == written and took > len(plan) // 2, took  # most went direct; the rest stepped aside
    assert stats["out_msgs"] - before["out_msgs"] == len(plan)
    assert stats["out_bytes"] - before["out_bytes"] == sum(size for _, size, _ in plan)


def test_replies_go_direct_on_tcp_intact_and_in_order_with_ordinary_publishes(nats_server, arun):
    _check_in_order(*arun(_replies_in_order(nats_server.url), timeout=60))


def test_replies_go_direct_on_tls_intact_and_in_order(arun, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca, files = trustme.CA(), {name: tmp_path / name for name in ("ca.pem", "server.pem", "server.key")}
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(files["ca.pem"])
    server_cert.cert_chain_pems[0].write_to_path(files["server.pem"])
    server_cert.private_key_pem.write_to_path(files["server.key"])
    conf = tmp_path / "tls.conf"
    conf.write_text(f"max_payload: 8MB\ntls {{\n  cert_file: {json.dumps(str(files['server.pem']))}\n"
                    f"  key_file: {json.dumps(str(files['server.key']))}\n}}\n")
    with EmbeddedNats(config=conf, port=0) as server:
        url = f"tls://127.0.0.1:{server.port}"
        _check_in_order(*arun(_replies_in_order(url, ConnectOptions(tls_ca=str(files["ca.pem"]))), timeout=60))


def test_it_steps_aside_while_something_is_pending_or_the_client_is_not_connected(arun):
    async def go():
        with EmbeddedNats(port=0) as server:
            nc = await connect(server.url, "direct", reconnect_time_wait=0.2)
            direct, _ = DirectReply.attach(nc)
            seen = {"idle": direct.write("x.y", b"a")}
            await nc.publish("x.y", b"queued")  # in nats.py's buffer until its flusher's next turn
            seen["pending"] = direct.write("x.y", b"b")
            await nc.flush()
            seen["flushed"] = direct.write("x.y", b"c")
            seen["too_large"] = direct.write("x.y", b"z" * (nc.max_payload + 1))
            seen["bad_subject"] = [direct.write(s, b"d") for s in ("", "a b", "a\r\nPUB x 1")]
            seen["not_bytes"] = direct.write("x.y", bytearray(b"e"))
            port = server.port
        await until(lambda: nc.is_reconnecting, "the client to notice the server is gone", 20)
        seen["reconnecting"] = direct.write("x.y", b"f")
        with EmbeddedNats(port=port):  # the same port: the client comes back by itself
            await until(lambda: nc.is_connected and not nc.pending_data_size, "the client to reconnect", 30)
            seen["back"] = direct.write("x.y", b"g")
            await nc.close()
        seen["closed"] = direct.write("x.y", b"h")
        return seen

    seen = arun(go(), timeout=90)
    assert seen == {"idle": True, "pending": False, "flushed": True, "too_large": False,
                    "bad_subject": [False, False, False], "not_bytes": False, "reconnecting": False,
                    "back": True, "closed": False}


class _CountingSocket:
    """The transport under a stream writer, counting the writes made to it."""

    def __init__(self, inner):
        self.inner, self.writes = inner, 0

    def write(self, data):
        self.writes += 1
        self.inner.write(data)

    def writelines(self, parts):
        self.writes += 1
        self.inner.writelines(parts)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_step_goes_direct_in_one_write_with_its_reply_subjects_or_not_at_all(nats_server, arun):
    """write_all: a backbone's layer step (requests with reply subjects) in one transport write;
    any message it cannot write (too large, a bad subject) or anything pending in nats.py sends
    the whole step back to the ordinary path, so nothing is written out of order."""
    big = _payload(7, DIRECT_JOIN_LIMIT + 5)  # past the join limit: writelines, still one write

    async def go():
        nc = await connect(nats_server.url, "direct")
        direct, why_not = DirectPublish.attach(nc)
        assert why_not is None, why_not
        client = await connect(nats_server.url, "client")
        got, done = [], asyncio.Event()

        async def collect(msg):
            got.append((msg.subject, msg.reply, msg.data))
            if msg.subject == "step.end":
                done.set()

        await client.subscribe("step.>", cb=collect)
        await client.flush()
        writer = nc._transport._io_writer
        counting = writer._transport = _CountingSocket(writer._transport)
        before = dict(nc.stats)
        took = {}
        took["small"] = direct.write_all([("step.a", "inbox.x.1", b"one"), ("step.b", "", b""),
                                          ("step.c", "inbox.x.3", b"three")])
        writes_small = counting.writes
        took["large"] = direct.write_all([("step.d", "inbox.x.4", big), ("step.e", "inbox.x.5", b"five")])
        writes_large = counting.writes - writes_small
        took["single"] = direct.write("step.f", b"six", reply="inbox.x.6")
        took["empty"] = direct.write_all([])
        took["bad_reply"] = direct.write_all([("step.g", "inbox.x.7", b"seven"), ("step.h", "a b", b"eight")])
        took["too_large"] = direct.write_all([("step.g", "inbox.x.7", b"z" * (nc.max_payload + 1))])
        await nc.publish("step.i", b"queued", reply="inbox.x.9")  # pending in nats.py's buffer
        took["pending"] = direct.write_all([("step.j", "inbox.x.10", b"ten")])
        await nc.publish("step.j", b"ten", reply="inbox.x.10")  # the caller's ordinary path
        await nc.flush()
        took["flushed"] = direct.write_all([("step.end", "inbox.x.11", b"end")])
        await asyncio.wait_for(done.wait(), 30)
        writer._transport = counting.inner
        stats = dict(nc.stats)
        await client.close()
        await nc.close()
        return took, writes_small, writes_large, got, before, stats, direct.written

    took, writes_small, writes_large, got, before, stats, written = arun(go(), timeout=60)
    assert took == {"small": True, "large": True, "single": True, "empty": True, "bad_reply": False,
                    "too_large": False, "pending": False, "flushed": True}
    assert (writes_small, writes_large) == (1, 1)
    assert got == [("step.a", "inbox.x.1", b"one"), ("step.b", "", b""), ("step.c", "inbox.x.3", b"three"),
                   ("step.d", "inbox.x.4", big), ("step.e", "inbox.x.5", b"five"), ("step.f", "inbox.x.6", b"six"),
                   ("step.i", "inbox.x.9", b"queued"), ("step.j", "inbox.x.10", b"ten"),
                   ("step.end", "inbox.x.11", b"end")]
    assert written == 7
    assert stats["out_msgs"] - before["out_msgs"] == 9
    assert stats["out_bytes"] - before["out_bytes"] == sum(len(data) for _, _, data in got)


def test_websocket_and_foreign_clients_keep_the_ordinary_path(arun, tmp_path):
    class NotNats:
        stats = {"out_msgs": 0, "out_bytes": 0}

    _, why_not = DirectReply.attach(NotNats())
    assert why_not and "_status" in why_not
    with pytest.raises(TypeError, match="no direct writes"):
        DirectReply(NotNats())

    conf = tmp_path / "ws.conf"
    conf.write_text('websocket {\n  listen: "127.0.0.1:-1"\n  no_tls: true\n}\n')

    async def go(server):
        nc = await connect(f"ws://127.0.0.1:{server.websocket_port}", "ws")
        direct, why_not = DirectReply.attach(nc)
        await nc.close()
        return direct, why_not

    with EmbeddedNats(config=conf, port=0) as server:
        direct, why_not = arun(go(server), timeout=30)
    assert direct is None and "WebSocketTransport" in why_not


def test_a_worker_answers_directly_and_keeps_serving_across_a_server_restart(arun, slice_info, model):  # noqa: F811
    info = slice_info
    subj = Subjects(info.fingerprint)
    rows = np.random.default_rng(5).standard_normal((2, info.n_embd)).astype(np.float32)

    async def ask(client, i):
        """One request, asked again while the worker has not resubscribed after the restart."""
        for _ in range(100):
            try:
                msg = await client.request(subj.dispatch(0, 2 + i % 4), request(info, 0, 2 + i % 4, rows, f"q{i}").encode(),
                                           timeout=2)
                return codec.decode_reply(msg.data)
            except Exception:  # no responders / timeout while the worker's connection comes back
                await asyncio.sleep(0.1)
        raise AssertionError(f"request q{i} never answered")

    async def go():
        replies = []
        first = EmbeddedNats(port=0).start()
        port = first.port
        try:
            nc = await connect(first.url, "w", reconnect_time_wait=0.2)
            worker = Worker(info, WorkerConfig(node="w-restart", heartbeat_s=60))
            await worker.start(nc)
            assert worker._direct is not None
            client = await connect(first.url, "c", reconnect_time_wait=0.2)
            replies += [await ask(client, i) for i in range(8)]
            direct_before = worker._direct.written
        finally:
            first.stop()
        with EmbeddedNats(port=port):
            await until(lambda: nc.is_connected and client.is_connected, "both clients to reconnect", 30)
            replies += [await ask(client, i) for i in range(8, 16)]
            direct_after = worker._direct.written
            await worker.stop()
            await client.close()
            await nc.close()
        return replies, direct_before, direct_after

    replies, direct_before, direct_after = arun(go(), timeout=120)
    assert [r.request_id for r in replies] == [f"q{i}" for i in range(16)]
    for i, reply in enumerate(replies):
        assert np.array_equal(reply.rows, reference(model, 0, 2 + i % 4, rows))
    assert direct_before == 8 and direct_after > direct_before  # direct before and after the restart
