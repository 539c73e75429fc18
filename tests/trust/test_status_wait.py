"""`kvasir status` waits for its answer: a market whose status takes longer than one attempt (a
big ledger) is still heard, where a client that re-asked on a fresh inbox every 0.25 s never was."""

from __future__ import annotations

import asyncio

from kvasir_bus.connect import connect
from market.cli import ask_market


def test_a_slow_answer_to_the_first_ask_still_counts(nats_server, arun):
    async def go():
        market = await connect(nats_server.url, name="slow-market")
        asked = []

        async def slow(msg):
            asked.append(msg.reply)
            await asyncio.sleep(0.7)  # each answer takes longer than an attempt (0.25 s)
            await market.publish(msg.reply, b"status")
        await market.subscribe("kvasir.fp.market.status", cb=slow)
        await market.flush()
        client = await connect(nats_server.url, name="status")
        try:
            msg = await ask_market(client, "kvasir.fp.market.status", timeout=3.0)
        finally:
            await client.close()
            await market.close()
        return msg.data, asked

    data, asked = arun(go(), timeout=20)
    assert data == b"status"
    assert len(set(asked)) == 1 and len(asked) <= 3  # one inbox; asked again with back-off, not every 0.25 s
