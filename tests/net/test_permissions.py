"""Under `kvasir creds` identities the server itself refuses every act outside a role's job, in
both modes: JWT (the default: rights carried in each user JWT) and nkey (users in the config)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.errors import KvasirError
from kvasir_bus.subjects import Subjects

M = Subjects("abc123")


@pytest.fixture(params=["jwt", "nkey"])
def deployment(request, tmp_path):
    """``kvasir creds init`` in both modes (overrides tests/net/conftest.py's nkey one)."""
    from kvasir_bus import creds
    from tests.net.conftest import WORKERS

    out = tmp_path / "dep"
    creds.init(out, "127.0.0.1:0", list(WORKERS), websocket="127.0.0.1:0", auth=request.param)
    return out


class Client:
    """A connection as one identity that records the server's permission errors."""

    def __init__(self, nc, errors):
        self.nc, self.errors = nc, errors

    @classmethod
    async def open(cls, url, creds_file):
        errors: list[str] = []

        async def on_error(exc):
            errors.append(str(exc))

        nc = await connect(url, f"test-{creds_file.stem}", options=ConnectOptions(creds=str(creds_file)),
                           error_cb=on_error)
        return cls(nc, errors)

    async def refused(self, what: str) -> str:
        """Wait for the server's permission violation about ``what``; return its text."""
        for _ in range(200):
            await self.nc.flush()
            # nats-py lowercases the server's message
            hits = [e for e in self.errors if "permissions violation" in e.lower() and what.lower() in e.lower()]
            if hits:
                return hits[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no permission error for {what}: {self.errors}")


def test_a_worker_can_only_act_as_itself(deployment, secure_server, arun):
    async def go():
        watcher = await Client.open(secure_server.url, deployment / "observer.creds")
        seen = []
        async def record(msg):
            seen.append(msg.subject)

        await watcher.nc.subscribe("kvasir.>", cb=record)
        await watcher.nc.flush()
        w1 = await Client.open(secure_server.url, deployment / "w1.creds")

        forbidden = [M.dispatch(0, 1), M.ledger(), M.demand(), M.coverage("w2"), M.routing(), M.node_report("w2")]
        for subject in forbidden:
            await w1.nc.publish(subject, b"x")
            assert subject in await w1.refused(subject)
        await w1.nc.publish(M.coverage("w1"), b"x")  # its own heartbeat goes through
        await w1.nc.publish(M.node_report("w1"), b"")  # and a question about itself
        for _ in range(200):
            if M.node_report("w1") in seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [M.coverage("w1"), M.node_report("w1")]  # and nothing forbidden reached the bus

        # Other nodes' replies: no subscription outside its own inbox.
        await w1.nc.subscribe("_INBOX.>")
        assert "subscription" in await w1.refused("_INBOX.>")
        await w1.nc.subscribe(M.coverage_all())
        await w1.refused(M.coverage_all())
        # $SYS is the operator's: a worker asking for every connection is refused.
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await w1.nc.request("$SYS.REQ.SERVER.PING.CONNZ", b"", timeout=0.5)
        await w1.refused("$SYS.REQ.SERVER.PING.CONNZ")
        op = await Client.open(secure_server.url, deployment / "operator.creds")
        reply = await op.nc.request("$SYS.REQ.SERVER.PING.CONNZ", b"", timeout=2)
        assert b"connections" in reply.data
        for c in (watcher, w1, op):
            await c.nc.close()

    arun(go())


def test_an_observer_reads_but_never_writes(deployment, secure_server, arun):
    async def go():
        obs = await Client.open(secure_server.url, deployment / "observer.creds")
        for subject in (M.demand(), M.coverage("obs"), M.dispatch(0, 0), M.manifest()):
            await obs.nc.publish(subject, b"x")
            await obs.refused(subject)
        await obs.nc.subscribe("kvasir.>")
        await obs.nc.flush()
        assert not [e for e in obs.errors if "kvasir.>" in e]
        await obs.nc.close()

    arun(go())


def test_only_the_market_publishes_demand_and_only_the_backbone_dispatches(deployment, secure_server, arun):
    async def go():
        market = await Client.open(secure_server.url, deployment / "market.creds")
        backbone = await Client.open(secure_server.url, deployment / "backbone.creds")
        await market.nc.publish(M.dispatch(0, 0), b"x")
        await market.refused(M.dispatch(0, 0))
        await backbone.nc.publish(M.demand(), b"x")
        await backbone.refused(M.demand())
        await market.nc.publish(M.demand(), b"x")
        await backbone.nc.publish(M.dispatch(0, 0), b"x")
        await market.nc.flush()
        await backbone.nc.flush()
        assert market.errors == [e for e in market.errors if M.dispatch(0, 0) in e]
        assert backbone.errors == [e for e in backbone.errors if M.demand() in e]
        for c in (market, backbone):
            await c.nc.close()

    arun(go())


def test_a_worker_answers_a_request_and_reads_only_its_own_replies(deployment, secure_server, arun):
    async def go():
        backbone = await Client.open(secure_server.url, deployment / "backbone.creds")
        w1 = await Client.open(secure_server.url, deployment / "w1.creds")

        async def answer(msg):
            await w1.nc.publish(msg.reply, msg.data[::-1])

        await w1.nc.subscribe(M.dispatch(0, 3), cb=answer)
        await w1.nc.flush()
        reply = await backbone.nc.request(M.dispatch(0, 3), b"abc", timeout=2)
        assert reply.data == b"cba"
        assert backbone.nc.new_inbox().startswith("_INBOX_U")
        assert not w1.errors and not backbone.errors
        for c in (backbone, w1):
            await c.nc.close()

    arun(go())


def test_anonymous_and_unknown_keys_are_refused(deployment, secure_server, arun, tmp_path):
    from kvasir_bus.creds import new_seed

    from kvasir_bus import jwt

    stranger = tmp_path / "stranger.creds"
    stranger.write_bytes(new_seed()[0] + b"\n")
    # A well-formed .creds file whose JWT a foreign account signed (not this operator's).
    foreign_account, _ = jwt.new_keypair("account")
    seed, public = jwt.new_keypair("user")
    forged = tmp_path / "forged.creds"
    forged.write_text(jwt.creds_text(jwt.user_jwt(foreign_account, public, "w1", None), seed))

    async def go():
        with pytest.raises(KvasirError, match="[Aa]uthorization"):
            await connect(secure_server.url, "anon", options=ConnectOptions(), connect_deadline=3)
        with pytest.raises(KvasirError, match="[Aa]uthorization"):
            await connect(secure_server.url, "stranger", options=ConnectOptions(creds=str(stranger)),
                          connect_deadline=3)
        async def quiet(exc):
            pass
        with pytest.raises(Exception, match="[Aa]uthorization"):  # nats-py's own reader, one attempt
            await nats.connect(secure_server.url, user_credentials=str(forged), allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2, error_cb=quiet)

    arun(go())


def test_every_role_answers_srv_for_itself_and_the_observer_may_ask(deployment, secure_server, arun):
    import json

    from kvasir_bus import micro

    async def go():
        clients = {name: await Client.open(secure_server.url, deployment / f"{name}.creds")
                   for name in ("w1", "market", "backbone", "observer")}
        services = [await micro.start_service(clients[name].nc, micro.Card(role, name, "abc123"))
                    for name, role in (("w1", "worker"), ("market", "market"), ("backbone", "backbone"))]
        obs = clients["observer"].nc
        inbox, replies, all_three = obs.new_inbox(), [], asyncio.Event()

        async def on_reply(msg):
            replies.append(json.loads(msg.data)["name"])
            if len(replies) == 3:
                all_three.set()

        await obs.subscribe(inbox, cb=on_reply)
        await obs.flush()
        await obs.publish("$SRV.PING", b"", reply=inbox)
        await asyncio.wait_for(all_three.wait(), 10)
        assert sorted(replies) == ["kvasir-backbone", "kvasir-market", "kvasir-worker"]
        info = await obs.request("$SRV.INFO.kvasir-worker", b"", timeout=5)
        assert json.loads(info.data)["metadata"]["node"] == "w1"
        assert {n: c.errors for n, c in clients.items() if c.errors} == {}
        # A worker may not listen as another role's service, nor ask anyone.
        w1 = clients["w1"]
        await w1.nc.subscribe("$SRV.PING.kvasir-market.x")
        await w1.refused("$SRV.PING.kvasir-market.x")
        await w1.nc.publish("$SRV.PING", b"")
        await w1.refused("$SRV.PING")
        for svc in services:
            await micro.stop_service(svc)
        for c in clients.values():
            await c.nc.close()

    arun(go(), timeout=30)


def test_a_worker_hears_bundles_on_its_own_node_subject_only_and_only_the_backbone_sends_them(
        deployment, secure_server, arun):
    async def go():
        backbone = await Client.open(secure_server.url, deployment / "backbone.creds")
        w1 = await Client.open(secure_server.url, deployment / "w1.creds")
        w2 = await Client.open(secure_server.url, deployment / "w2.creds")

        async def answer(msg):
            await w1.nc.publish(msg.reply, msg.data[::-1])

        await w1.nc.subscribe(M.node("w1"), cb=answer)
        await w1.nc.flush()
        reply = await backbone.nc.request(M.node("w1"), b"abc", timeout=2)
        assert reply.data == b"cba"  # the backbone sends, the worker answers through allow_responses
        await w1.nc.subscribe(M.node("w2"))  # another node's bundles
        await w1.refused(M.node("w2"))
        await w1.nc.subscribe("kvasir.*.n.*")
        await w1.refused("kvasir.*.n.*")
        await w2.nc.publish(M.node("w1"), b"x")  # a worker sends no bundles
        await w2.refused(M.node("w1"))
        assert not backbone.errors
        for c in (backbone, w1, w2):
            await c.nc.close()

    arun(go())
