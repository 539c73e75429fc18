"""The blocking direct connection (kvasir_bus.direct): its parser bounds every size and refuses
what is not the protocol; a live connection publishes and receives its replies, a 503 for a
subject nobody serves, and answers the server's PING; its deadlines hold with kernel timeouts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvasir_bus.connect import connect
from kvasir_bus.direct import MAX_LINE, RECV_SLICE_S, DirectConnection, DirectError, Message, Parser


def test_parser_reads_messages_in_pieces_and_control_lines():
    p = Parser(max_payload=100)
    stream = (b"INFO {\"max_payload\": 100}\r\nMSG a.b 1 r.1 3\r\nabc\r\nPING\r\n+OK\r\n"
              b"HMSG in.x 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n-ERR 'bad'\r\nMSG c 1 0\r\n\r\n")
    events = []
    for i in range(0, len(stream), 7):  # in pieces that split lines and payloads
        events += p.feed(stream[i:i + 7])
    assert events == [("info", {"max_payload": 100}), ("msg", Message("a.b", "r.1", b"abc", None)), ("ping",),
                      ("ok",), ("msg", Message("in.x", "", b"", "503")), ("err", "'bad'"),
                      ("msg", Message("c", "", b"", None))]


@pytest.mark.parametrize("stream, why", [
    (b"MSG a 1 999999\r\n", "out of bounds"),
    (b"MSG a 1 x\r\n", "non-numeric"),
    (b"MSG a\r\n", "malformed"),
    (b"HMSG a 1 9 3\r\n", "out of bounds"),
    (b"MSG a 1 2\r\nabcd", "not followed by CRLF"),
    (b"WHAT\r\n", "unknown"),
    (b"x" * (MAX_LINE + 1), "longer than"),
    (b"INFO {\r\n", "not JSON"),
])
def test_parser_refuses_what_is_not_the_protocol(stream, why):
    with pytest.raises(DirectError, match=why):
        Parser(max_payload=100).feed(stream)


def test_a_live_connection_publishes_receives_and_hears_no_responders(nats_server, arun):
    conn = DirectConnection(nats_server.url)
    stop = threading.Event()

    async def echo():
        nc = await connect(nats_server.url, "echo")

        async def cb(msg):
            await nc.publish(msg.reply, b"echo:" + msg.data)

        await nc.subscribe("svc.echo", cb=cb)
        await nc.flush()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.01)
        await nc.close()

    ready = threading.Event()
    t = threading.Thread(target=lambda: asyncio.run(echo()), daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        conn.send(b"PUB svc.echo %s.1 2\r\nhi\r\nPUB svc.none %s.2 1\r\nx\r\n" % (conn.inbox.encode(),
                                                                                conn.inbox.encode()))
        got, deadline = [], time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got += conn.receive(deadline)
        by_subject = {m.subject: m for m in got}
        assert by_subject[conn.inbox + ".1"].data == b"echo:hi" and by_subject[conn.inbox + ".1"].status is None
        assert by_subject[conn.inbox + ".2"].status == "503"
        assert conn.receive(time.monotonic() + 0.05) == []  # nothing more: empty at the deadline
    finally:
        stop.set()
        t.join(30)
        conn.close()


@pytest.mark.parametrize("url", ["ws://127.0.0.1:1", "wss://example.invalid:443"])
def test_a_websocket_bus_is_refused_for_good_without_a_connection_attempt(url):
    """The engine connection speaks plain NATS over TCP or TLS: on a ws:// bus the backbone
    keeps every step on the bus thread, and says so once (engine_connection_off)."""
    with pytest.raises(DirectError, match="nats:// or tls://") as refused:
        DirectConnection(url)
    assert refused.value.permanent


def test_deadlines_nearer_and_further_than_the_kernel_timeout_slice_both_hold(nats_server):
    """A plain TCP connection waits in the kernel (SO_RCVTIMEO, no Python timeout): a deadline
    nearer than the slice, then further, then nearer again, each ends the wait empty and never
    before the deadline; a message sent meanwhile still arrives."""
    conn = DirectConnection(nats_server.url)
    try:
        assert conn.sock.gettimeout() is None  # blocking: one recvfrom per read
        for wait_s in (0.002, 3 * RECV_SLICE_S, 0.001):
            deadline = time.monotonic() + wait_s
            assert conn.receive(deadline) == []
            assert time.monotonic() >= deadline
        conn.send(b"PUB %s.self 2\r\nhi\r\n" % conn.inbox.encode())
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got += conn.receive(deadline)
        assert [(m.subject, m.data) for m in got] == [(conn.inbox + ".self", b"hi")]
    finally:
        conn.close()
