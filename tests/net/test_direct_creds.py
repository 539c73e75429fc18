"""The engine thread's direct connection (kvasir_bus.direct) in a `kvasir creds` deployment: it
signs the server's nonce as the backbone, may send a bundle to a worker's node subject with its
own inbox as the reply subject, and the worker's reply comes back on it, with no permission
error; an identity the server does not know is refused at connect."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvasir_bus.connect import ConnectOptions
from kvasir_bus.direct import DirectConnection, DirectError
from tests.net.test_permissions import M, Client


def test_the_direct_connection_speaks_as_the_backbone_of_a_deployment(deployment, secure_server, arun):
    direct = DirectConnection(secure_server.url, "test-direct", ConnectOptions(creds=str(deployment / "backbone.creds")))
    try:
        async def worker_answers():
            w1 = await Client.open(secure_server.url, deployment / "w1.creds")
            got = asyncio.get_running_loop().create_future()

            async def on_bundle(msg):
                await w1.nc.publish(msg.reply, b"answer:" + msg.data)
                got.set_result(msg.reply)

            await w1.nc.subscribe(M.node("w1"), cb=on_bundle)
            await w1.nc.flush()
            return w1, got

        async def serve():
            w1, got = await worker_answers()
            ready.set()
            reply = await asyncio.wait_for(got, 10)
            await w1.nc.flush()
            await w1.nc.close()
            return reply, w1.errors

        ready = threading.Event()
        result = {}
        thread = threading.Thread(target=lambda: result.update(done=arun(serve(), timeout=20)))
        thread.start()
        assert ready.wait(20)
        direct.send(b"PUB %s %s.t1 5\r\nhello\r\n" % (M.node("w1").encode(), direct.inbox.encode()))
        deadline, msgs = time.monotonic() + 10, []
        while not msgs and time.monotonic() < deadline:
            msgs = direct.receive(deadline)
        thread.join(20)
        reply, errors = result["done"]
        assert reply == f"{direct.inbox}.t1" and errors == []
        assert [(m.subject, m.data, m.status) for m in msgs] == [(f"{direct.inbox}.t1", b"answer:hello", None)]
    finally:
        direct.close()


def test_an_unknown_identity_is_refused_at_connect(tmp_path, deployment, secure_server):
    from kvasir_bus import creds

    other = tmp_path / "other"
    creds.init(other, "127.0.0.1:0", ["w9"])
    with pytest.raises(DirectError, match="refused|closed|PONG"):
        DirectConnection(secure_server.url, "test-direct", ConnectOptions(creds=str(other / "backbone.creds")))
