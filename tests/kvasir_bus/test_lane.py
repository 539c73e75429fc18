"""Inline delivery (kvasir_bus.lane): registered subscriptions are handled where nats.py parses
them, everything else goes the ordinary way, a handler's exception is reported and the reader
goes on, and a client without the hook is refused up front."""

from __future__ import annotations

import asyncio

import pytest

from kvasir_bus.connect import connect
from kvasir_bus import lane
from kvasir_bus.lane import Delivered, InlineDelivery


def test_registered_messages_come_inline_and_the_rest_the_ordinary_way(nats_server, arun):
    async def go():
        nc = await connect(nats_server.url, "lane")
        seen, errors, done, after = [], [], asyncio.Event(), asyncio.Event()

        async def handler(msg):
            seen.append((type(msg).__name__, msg.subject, msg.reply, msg.data, msg.headers))
            if msg.data == b"boom":
                raise ValueError("a bug in a handler")
            if msg.data == b"last":
                done.set()
            if msg.data == b"after":
                after.set()

        lane_ = InlineDelivery(nc, errors.append)
        sub = await nc.subscribe("lane.a", cb=handler)
        assert lane_.add(sub, handler)
        other = []

        async def plain(msg):
            other.append(msg.data)

        await nc.subscribe("lane.b", cb=plain)
        client = await connect(nats_server.url, "client")
        await client.publish("lane.a", b"one", reply="r.1")
        await client.publish("lane.a", b"boom")
        await client.publish("lane.a", b"headed", headers={"K": "v"})
        await client.publish("lane.b", b"elsewhere")
        await client.publish("lane.a", b"last")
        await asyncio.wait_for(done.wait(), 5)
        lane_.close()  # from now on: the subscription's own callback, through nats.py's queue
        await client.publish("lane.a", b"after")
        await asyncio.wait_for(after.wait(), 5)
        stats = dict(nc.stats)
        await client.close()
        await nc.close()
        return seen, errors, other, stats

    seen, errors, other, stats = arun(go(), timeout=30)
    assert seen[0] == ("Delivered", "lane.a", "r.1", b"one", None)
    assert seen[1][3] == b"boom" and [str(e) for e in errors] == ["a bug in a handler"]
    kinds = {data: kind for kind, _, _, data, _ in seen}
    assert kinds == {b"one": "Delivered", b"boom": "Delivered", b"headed": "Msg", b"last": "Delivered",
                     b"after": "Msg"}  # headers, and after close(): nats.py's Msg, its queue and task
    assert next(s[4] for s in seen if s[3] == b"headed") == {"K": "v"}
    assert other == [b"elsewhere"]
    assert stats["in_msgs"] >= 6  # inline messages are counted as nats.py counts its own


def test_a_client_without_the_hook_is_refused():
    class NotNats:
        async def _process_msg(self, sid, subject):  # another signature
            pass

    assert not lane.supported(NotNats()) and not lane.supported(object())
    with pytest.raises(TypeError, match="_process_msg"):
        InlineDelivery(NotNats(), print)


def test_a_delivered_message_reads_like_a_msg_without_headers():
    msg = Delivered("s", "r", b"x")
    assert (msg.subject, msg.reply, msg.data, msg.headers) == ("s", "r", b"x", None)
