"""The market under creds: it shows the enrolment service's revocations (node, when, why) in
``kvasir status`` (text and JSON), those made before it started and those after; and a worker
under a fixed identity (``kvasir creds init --workers``) may ask for an assignment only for its
own node: the server lets it publish only on ``kvasir.<model>.market.volunteer.<its name>``,
and the market refuses a request whose payload names another node than that subject."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvasir_bus import creds, enrol
from kvasir_bus import market_codec as mc
from kvasir_bus.connect import ConnectOptions, connect, read_seed
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import ENROL_REVOKED, Subjects
from tests.net.enrol_procs import enrol_service, kvasir, market

MODEL = "m1"


def _wait(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling the market's answer
    raise AssertionError(f"timed out waiting for {what}")


async def _quarantine(url, dep, node: str, expert: int) -> mc.Revocation:
    """Publish the backbone's signed verdict on ``node`` and wait for the enrolment service's
    revocation of it (heard as the observer)."""
    from kvasir_bus.signing import Signer

    watch = await connect(url, "watch", options=ConnectOptions(creds=str(dep / "observer.creds")))
    bb = await connect(url, "bb", options=ConnectOptions(creds=str(dep / "backbone.creds")))
    try:
        heard = await watch.subscribe(ENROL_REVOKED)
        await watch.flush()
        verdict = mc.Quarantine(model=MODEL, node=node, layer=0, expert=expert, kernel="", exact=True,
                                error=0.75, at=time.time())
        payload = verdict.encode()
        await bb.publish(f"kvasir.{MODEL}.quarantine", payload,
                         headers=Signer(read_seed(dep / "backbone.creds")).headers(payload))
        return mc.decode_revocation((await heard.next_msg(timeout=10)).data)
    finally:
        await bb.close()
        await watch.close()


def test_the_market_shows_revocations_in_kvasir_status(tmp_path):
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", [], auth="jwt")
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        svc, _ = enrol_service(dep, url, tmp_path / "enrol.log")
        procs = [svc]
        try:
            token = enrol.make_token(dep)
            first, second = (asyncio.run(enrol.enrol(url, token)) for _ in range(2))
            before = asyncio.run(_quarantine(url, dep, first.name, expert=1))  # before the market runs
            assert before.node == first.name and "expert 1" in before.why and before.model == MODEL

            procs.append(market(dep, url, tmp_path / "m.db", tmp_path / "market.log", MODEL))

            def status(*flags):
                out = kvasir("status", "--nats", url, "--creds", dep / "observer.creds", "--model", MODEL, *flags)
                assert out.returncode == 0, out.stderr
                return out.stdout

            def revoked():
                return [r["node"] for r in json.loads(status("--json"))["models"][0]["revoked"]]

            _wait(lambda: revoked() == [first.name], "the market to learn the earlier revocation")
            after = asyncio.run(_quarantine(url, dep, second.name, expert=2))  # while it runs
            _wait(lambda: revoked() == [first.name, second.name], "the market to hear the new one")
            doc = json.loads(status("--json"))["models"][0]["revoked"]
            assert doc[1] == {"node": second.name, "key": after.key, "at": after.at, "why": after.why,
                              "model": MODEL}
            assert after.key == enrol.jwt.public_of(second.seed)
            text = status()
            assert "revoked (2, the enrolment service locked them out):" in text, text
            lines = text.splitlines()
            at = lines.index(next(line for line in lines if line.startswith("revoked (2")))
            assert second.name in lines[at + 2] and first.name in lines[at + 3]  # the most recent first
            assert "failed an audit (error 0.75)" in lines[at + 2] and "expert 2" in lines[at + 2]
        finally:
            for p in procs:
                p.stop()
        for p in procs:
            assert "Traceback" not in p.text(), p.text()[-2000:]


@pytest.mark.parametrize("auth", ["jwt", "nkey"])
def test_a_fixed_identity_asks_for_its_own_node_only(auth, tmp_path):
    dep = tmp_path / "dep"
    creds.init(dep, "127.0.0.1:0", ["w1", "w2"], auth=auth)
    s = Subjects(MODEL)
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        url = server.url
        mk = market(dep, url, tmp_path / "m.db", tmp_path / "market.log", MODEL)
        try:
            async def go():
                errors = []

                async def on_error(exc):
                    errors.append(str(exc).lower())

                nc = await connect(url, "w1", options=ConnectOptions(creds=str(dep / "w1.creds")),
                                   error_cb=on_error)
                try:
                    async def ask(subject, node):
                        req = mc.VolunteerRequest(model=MODEL, node=node, budget_bytes=10**6)
                        msg = await nc.request(subject, req.encode(), timeout=5)
                        return mc.decode_volunteer_reply(msg.data)

                    # another node's subject, and the older one without a node: the server refuses
                    for subject in (s.volunteer("w2"), s.volunteer()):
                        errors.clear()
                        with pytest.raises(Exception):
                            await nc.request(subject, mc.VolunteerRequest(model=MODEL, node="w2",
                                                                          budget_bytes=10**6).encode(), timeout=1)
                        assert any("permissions violation" in e for e in errors), (subject, errors)
                    # its own subject naming another node: the market refuses
                    wrong = await ask(s.volunteer("w1"), "w2")
                    assert isinstance(wrong, mc.ErrorReply) and wrong.code == mc.ERR_BAD_REQUEST, wrong
                    assert "its own node only" in wrong.message and "names w1" in wrong.message
                    # its own subject and node: heard (no manifest yet: no backbone runs here)
                    right = await ask(s.volunteer("w1"), "w1")
                    assert isinstance(right, mc.ErrorReply) and right.code == mc.ERR_NO_MANIFEST, right
                finally:
                    await nc.close()

            asyncio.run(asyncio.wait_for(go(), 60))
        finally:
            mk.stop()
        assert "Traceback" not in mk.text()
