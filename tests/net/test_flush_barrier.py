"""``flush()`` on a connection from :func:`kvasir_bus.connect.connect` is a barrier: what was
queued before it (a SUB, a PUB) reaches the socket before its PING.

nats-py 2.16 writes the PING straight to the socket while the SUB still waits for the flusher
task, so "subscribe, flush, then let the other side publish" could lose the first message (CI
once saw a request answered "no responders" this way). The order of the bytes handed to the
transport is checked here, so the test does not depend on winning a race.
"""

from __future__ import annotations

from kvasir_bus.connect import connect


def test_flush_writes_the_queued_sub_before_its_ping(nats_server, arun):
    async def go():
        nc = await connect(nats_server.url, "flush-barrier")
        written: list[bytes] = []
        transport = nc._transport
        write, writelines = transport.write, transport.writelines

        def record_write(data):
            written.append(bytes(data))
            return write(data)

        def record_writelines(lines):
            lines = list(lines)
            written.extend(bytes(x) for x in lines)
            return writelines(lines)

        transport.write, transport.writelines = record_write, record_writelines
        try:
            for n in range(20):
                written.clear()
                await nc.subscribe(f"barrier.{n}")
                await nc.flush()
                sent = b"".join(written)
                assert sent.find(b"SUB barrier.") != -1, sent
                assert sent.find(b"SUB barrier.") < sent.find(b"PING"), sent
        finally:
            transport.write, transport.writelines = write, writelines
            await nc.close()

    arun(go())


def test_a_subscription_flushed_is_there_for_the_next_request(nats_server, arun):
    async def go():
        server = await connect(nats_server.url, "flush-answer")
        client = await connect(nats_server.url, "flush-ask")
        try:
            for n in range(200):
                async def answer(msg):
                    await server.publish(msg.reply, msg.data[::-1])
                sub = await server.subscribe(f"ask.{n}", cb=answer)
                await server.flush()
                reply = await client.request(f"ask.{n}", b"abc", timeout=5)
                assert reply.data == b"cba"
                await sub.unsubscribe()
        finally:
            await server.close()
            await client.close()

    arun(go())
