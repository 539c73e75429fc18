"""`kvasir enrol`: a volunteer with an enrolment token (or the open link, where allowed) gets a
worker identity for its own fresh key over the bus, no reload, no file; every shortcut is
refused (no token, a forged token, a reused nonce, a signature by another key, a flood); a
renewal over the worker's own connection keeps its name; quarantine revokes the key, the server
drops the connection within 5 s, and neither the key nor its token enrols again."""

from __future__ import annotations

import asyncio
import time

import msgpack
import nats
import pytest

from kvasir_bus import creds, enrol, jwt, subjects
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats


@pytest.fixture
def dep(tmp_path):
    out = tmp_path / "dep"
    creds.init(out, "127.0.0.1:0", [], auth="jwt")
    return out


async def _service(dep, url, **kw) -> enrol.EnrolService:
    return await enrol.EnrolService(enrol.EnrolConfig(str(dep), **kw)).start(url)


def test_a_token_holder_enrols_connects_as_itself_and_renews_under_the_same_name(dep, arun, tmp_path):
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            svc = await _service(dep, server.url, ttl_s=60)
            token = enrol.make_token(dep)
            me = await enrol.enrol(server.url, token)
            assert me.name == enrol.node_name(jwt.public_of(me.seed))
            assert me.reply_key == enrol.reply_key(enrol.reply_secret(dep), me.name)
            claims = jwt.decode(me.jwt)
            assert claims["iss"] == creds.account_public(dep) and claims["exp"] == me.exp
            assert f"kvasir.*.coverage.{me.name}" in claims["nats"]["pub"]["allow"]
            path = me.write(tmp_path / "me.creds")
            nc = await connect(server.url, "me", options=ConnectOptions(creds=str(path)))
            again = await enrol.request_identity(nc, me.seed, None)  # renewal: no token
            assert again.name == me.name and again.exp >= me.exp
            await nc.close()
            # the token itself may do nothing but ask
            errors = []

            async def on_error(e):
                errors.append(str(e))
            guest = await enrol.guest_connect(server.url, token, error_cb=on_error)
            await guest.publish("kvasir.m.coverage.x", b"x")
            await guest.flush()
            for _ in range(100):
                if errors:
                    break
                await asyncio.sleep(0.01)
            assert any("permissions violation" in e.lower() for e in errors), errors
            await guest.close()
            assert svc.counts == {"enrolled": 2}
            await svc.stop()
        arun(go(), timeout=30)


def test_every_shortcut_is_refused_and_a_flood_is_rate_limited(dep, arun):
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            svc = await _service(dep, server.url, per_token_rate=0.001, per_token_burst=3)
            token = enrol.make_token(dep)
            guest = await enrol.guest_connect(server.url, token)

            async def join(**over):
                seed, key = jwt.new_keypair("user")
                import nkeys
                kp = nkeys.from_seed(bytearray(seed))
                hello = msgpack.unpackb((await guest.request(subjects.ENROL_HELLO, b"\x80")).data)
                box = b"b" * 32
                req = {"v": 1, "nonce": hello["nonce"], "key": key, "box": box, "token": token,
                       "sig": kp.sign(enrol.JOIN_CONTEXT + hello["nonce"] + box)}
                req.update(over)
                if req.get("token") is None:
                    req.pop("token")
                return msgpack.unpackb((await guest.request(subjects.ENROL_JOIN, msgpack.packb(req))).data)

            other_seed, _ = jwt.new_keypair("user")
            import nkeys
            assert (await join(token=None))["error"] == "bad_token"  # a first join needs a token
            assert (await join(sig=nkeys.from_seed(bytearray(other_seed)).sign(b"x")))["error"] == "bad_signature"
            assert (await join(nonce=b"\0" * 32))["error"] == "bad_nonce"
            # the token's burst of 3 (one spent on the bad signature above): the rest of a flood
            # is refused before any signature is checked
            flood = [await join() for _ in range(5)]
            assert [r.get("error") for r in flood] == [None, None] + ["rate_limited"] * 3, flood
            foreign, _ = jwt.new_keypair("account")
            _, pub = jwt.new_keypair("user")
            forged = jwt.user_jwt(foreign, pub, enrol.TOKEN_TAG, None, bearer=True, tags=[enrol.TOKEN_TAG])
            assert (await join(token=forged))["error"] in ("bad_token", "rate_limited")
            with pytest.raises(Exception):  # nor does the server admit a forged token
                await enrol.guest_connect(server.url, forged, connect_timeout=2)
            open_token = enrol.make_token(dep, open_=True)
            assert (await join(token=open_token))["error"] == "bad_token"  # --open is off
            await guest.close()
            await svc.stop()
        arun(go(), timeout=30)


def test_quarantine_revokes_the_key_drops_the_connection_and_the_token_is_banned(dep, arun, tmp_path):
    from kvasir_bus import market_codec as mc
    from kvasir_bus.connect import read_seed
    from kvasir_bus.signing import Signer

    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            svc = await _service(dep, server.url)
            token = enrol.make_token(dep)
            liar = await enrol.enrol(server.url, token)
            path = liar.write(tmp_path / "liar.creds")
            closed = asyncio.Event()

            async def on_closed():
                closed.set()

            async def quiet(e):
                pass
            nc = await nats.connect(server.url, user_credentials=str(path), closed_cb=on_closed,
                                    error_cb=quiet, max_reconnect_attempts=2, reconnect_time_wait=0.1)
            # the backbone's signed verdict, as backbone/dispatch.py publishes it
            bb = await connect(server.url, "bb", options=ConnectOptions(creds=str(dep / "backbone.creds")))
            signer = Signer(read_seed(dep / "backbone.creds"))
            event = mc.Quarantine(model="m1", node=liar.name, layer=0, expert=1, kernel="", exact=True,
                                  error=1.0, at=time.time())
            forged = mc.Quarantine(model="m1", node="v" + "a" * 12, layer=0, expert=1, kernel="",
                                   exact=True, error=1.0, at=time.time())
            await bb.publish("kvasir.m1.quarantine", forged.encode())  # unsigned: ignored
            payload = event.encode()
            t0 = time.monotonic()
            await bb.publish("kvasir.m1.quarantine", payload, headers=signer.headers(payload))
            await asyncio.wait_for(closed.wait(), 5)  # dropped and refused, within 5 s
            assert time.monotonic() - t0 < 5
            assert svc.revoked_nodes == [liar.name] and svc.counts.get("quarantine_refused") == 1
            with pytest.raises(enrol.EnrolError, match="banned"):  # the same key, the same token
                await enrol.enrol(server.url, token, seed=liar.seed)
            with pytest.raises(enrol.EnrolError, match="banned"):  # a fresh key, the same token
                await enrol.enrol(server.url, token)
            with pytest.raises(enrol.EnrolError, match="revoked"):  # the same key, another token
                await enrol.enrol(server.url, enrol.make_token(dep), seed=liar.seed)
            with pytest.raises(Exception):  # and the server refuses its old .creds outright
                await nats.connect(server.url, user_credentials=str(path), allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2, error_cb=quiet)
            fresh = await enrol.enrol(server.url, enrol.make_token(dep))  # others still join
            assert fresh.name != liar.name
            await bb.close()
            await svc.stop()
        arun(go(), timeout=30)


def test_on_the_bus_a_source_is_its_inbox_and_a_flood_from_one_holds_up_no_other(dep, arun):
    """Hellos and joins are limited per sender inbox (``_INBOX_<its key>``, the only one it can
    read): one token holder flooding hellos is refused while another still gets a nonce and
    enrols; a flood of joins under one inbox stops at that source's burst."""
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            svc = await _service(dep, server.url, per_source_rate=0.001, per_source_burst=2,
                                 per_token_burst=100)
            flooder = await enrol.guest_connect(server.url, enrol.make_token(dep))
            hellos = [msgpack.unpackb((await flooder.request(subjects.ENROL_HELLO, b"\x80")).data)
                      for _ in range(25)]  # 10x the joins' burst, then refused
            assert all("nonce" in h for h in hellos[:20]), hellos[:20]
            assert [h.get("error") for h in hellos[20:]] == ["rate_limited"] * 5
            assert (await enrol.enrol(server.url, enrol.make_token(dep))).name  # another source
            # joins: the flooder's inbox may make 2, then it is refused before any signature check
            import nkeys
            results = []
            for h in hellos[:4]:
                seed, key = jwt.new_keypair("user")
                req = {"v": 1, "nonce": h["nonce"], "key": key, "box": b"b" * 32, "token": "x" * 10,
                       "sig": nkeys.from_seed(bytearray(seed)).sign(enrol.JOIN_CONTEXT + h["nonce"] + b"b" * 32)}
                results.append(msgpack.unpackb((await flooder.request(subjects.ENROL_JOIN, msgpack.packb(req))).data))
            assert [r["error"] for r in results] == ["bad_token", "bad_token", "rate_limited", "rate_limited"]
            await flooder.close()
            await svc.stop()
        arun(go(), timeout=30)
