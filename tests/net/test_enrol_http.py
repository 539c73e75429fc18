"""`kvasir enrol --http` over TLS (a trustme certificate): the bus side's hello/join flow by URL.
A flood from one source address is refused with 429 while another address still enrols; a
flood of hellos is bounded per source too; every bad request gets a 4xx with a JSON reason and
the service logs no traceback; an identity got over HTTPS connects to the bus it names."""

from __future__ import annotations

import asyncio
import base64
import ssl

import nats
import pytest

from kvasir_bus import creds, enrol, jwt
from kvasir_bus.server import EmbeddedNats
from tests.net.enrol_procs import enrol_service, kvasir, tls_files

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("trustme")


@pytest.fixture
def dep(tmp_path):
    out = tmp_path / "dep"
    creds.init(out, "127.0.0.1:0", [], auth="jwt")
    return out


def _join_body(nonce_b64: str, token: str | None, seed=None, sign_with=None) -> dict:
    import nkeys

    seed = seed or jwt.new_keypair("user")[0]
    kp = nkeys.from_seed(bytearray(seed))
    box = b"\x07" * 32
    signer = nkeys.from_seed(bytearray(sign_with)) if sign_with else kp
    nonce = base64.b64decode(nonce_b64)
    body = {"v": 1, "nonce": nonce_b64, "key": kp.public_key.decode(), "box": base64.b64encode(box).decode(),
            "sig": base64.b64encode(signer.sign(enrol.JOIN_CONTEXT + nonce + box)).decode()}
    if token is not None:
        body["token"] = token
    return body


@pytest.mark.parametrize("link", ["closed", "open"])
def test_a_flood_from_one_source_is_429_while_another_enrols_and_bad_requests_are_4xx(link, dep, tmp_path):
    """A closed token is limited per token too (20 at once here); the open one is everyone's,
    so over HTTPS only per address (its per-token limit, 1 here, would let one address lock
    everyone out)."""
    (cert, key), ca = tls_files(tmp_path)
    ctx = ssl.create_default_context(cafile=ca)
    token = enrol.make_token(dep, open_=link == "open")
    extra = ["--open", "--per-token-rate", "0.1"] if link == "open" else []
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        # a burst of 4 joins per source, refilled at 0.4 per second
        svc, base = enrol_service(dep, server.url, tmp_path / "enrol.log", "--per-source-rate", "0.4",
                                  *extra, http=True, tls=(cert, key))
        try:
            assert base.startswith("https://127.0.0.1:") and base.endswith("/enrol")

            async def go():
                async def session(local: str):
                    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(local, 0), ssl=ctx))

                async def join(s, **over):
                    async with s.post(f"{base}/hello", json={"v": 1}) as r:
                        assert r.status == 200, await r.text()
                        nonce = (await r.json())["nonce"]
                    body = {**_join_body(nonce, token), **over}
                    async with s.post(f"{base}/join", json=body) as r:
                        return r.status, await r.json(), r.headers

                a, b, c = [await session(f"127.0.0.{i}") for i in (1, 2, 3)]
                try:
                    flood = [await join(a) for _ in range(12)]
                    codes = [status for status, _, _ in flood]
                    assert codes[:4] == [200] * 4, flood[:5]
                    assert codes.count(429) >= 6, codes  # refilled at 0.4/s: a few more at most
                    refused = next(f for f in flood if f[0] == 429)
                    assert refused[1]["error"] == "rate_limited" and refused[2]["Retry-After"] == "1"
                    status, got, _ = await join(b)  # another address is not held up by the flood
                    assert status == 200, got
                    assert got["nats"] == server.url and got["name"].startswith("v")
                    assert jwt.decode(got["jwt"])["name"] == got["name"]

                    # the identity from HTTPS is a working bus identity
                    seed_me = jwt.new_keypair("user")[0]
                    async with b.post(f"{base}/hello", json={"v": 1}) as r:
                        nonce = (await r.json())["nonce"]
                    async with b.post(f"{base}/join", json=_join_body(nonce, token, seed=seed_me)) as r:
                        assert r.status == 200
                        got = await r.json()
                    me = enrol.Enrolled(got["name"], got["jwt"], got["exp"], seed_me, b"")
                    path = me.write(tmp_path / "me.creds")
                    nc = await nats.connect(got["nats"], user_credentials=str(path), allow_reconnect=False)
                    assert nc.is_connected
                    await nc.close()

                    # hellos are bounded per source as well (10x the joins' rate and burst)
                    hellos = []
                    for _ in range(60):
                        async with a.post(f"{base}/hello") as r:
                            hellos.append(r.status)
                    assert 429 in hellos and hellos[0] == 200, hellos

                    # bad requests: a 4xx with a reason, from a third source (not rate-limited)
                    async def post(path, data=None, **kw):
                        async with c.request(kw.pop("method", "POST"), f"{base}{path}", data=data, **kw) as r:
                            return r.status, await r.text()

                    async with c.post(f"{base}/hello") as r:
                        nonce = (await r.json())["nonce"]
                    other_seed = jwt.new_keypair("user")[0]
                    foreign, _ = jwt.new_keypair("account")
                    _, pub = jwt.new_keypair("user")
                    forged = jwt.user_jwt(foreign, pub, enrol.TOKEN_TAG, None, bearer=True, tags=[enrol.TOKEN_TAG])
                    cases = {
                        "not json": ("/join", b"{not json", 400, "bad_request"),
                        "a list": ("/join", b"[1, 2]", 400, "bad_request"),
                        "no fields": ("/join", b'{"v": 1}', 400, "bad_request"),
                        "wrong version": ("/join", b'{"v": 7}', 400, "bad_request"),
                        "bad base64": ("/join", b'{"v": 1, "nonce": "***", "box": "", "sig": ""}', 400, "bad_request"),
                        "made-up nonce": ("/join", _json({**_join_body(base64.b64encode(b"n" * 32).decode(), token)}),
                                          400, "bad_nonce"),
                        "another key's signature": ("/join", _json(_join_body(nonce, token, sign_with=other_seed)),
                                                    401, "bad_signature"),
                        "a forged token": ("/join", _json(_join_body(nonce, forged)), 401, "bad_token"),
                        "no token": ("/join", _json(_join_body(nonce, None)), 401, "bad_token"),
                    }
                    for what, (path, data, want, code) in cases.items():
                        if what in ("a forged token", "no token"):  # each needs an unused nonce
                            async with c.post(f"{base}/hello") as r:
                                data = _json(_join_body((await r.json())["nonce"], forged if what == "a forged token" else None))
                        status, text = await post(path, data, headers={"Content-Type": "application/json"})
                        assert status == want and f'"error": "{code}"' in text, (what, status, text)
                    assert (await post("/join", b"x" * 20_000))[0] == 413
                    assert (await post("/join", method="GET"))[0] == 405
                    assert (await post("/elsewhere", b"{}"))[0] == 404
                finally:
                    for s in (a, b, c):
                        await s.close()

            asyncio.run(asyncio.wait_for(go(), 120))
        finally:
            svc.stop()
        assert "Traceback" not in svc.text(), svc.text()[-3000:]


def _json(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()


def test_bad_enrolment_flags_and_links_are_one_line_and_exit_2(dep, tmp_path):
    cases = [
        (["enrol", dep, "--tls-cert", tmp_path / "none.pem"], "go with --http"),
        (["enrol", dep, "--http", "nowhere"], "expected HOST:PORT"),
        (["enrol", dep, "--http", "127.0.0.1:0", "--tls-cert", tmp_path / "none.pem", "--tls-key", tmp_path / "k"],
         "no such file"),
        (["enrol", dep, "--token", "--url", "https://host:8443/enrol?x=1"], "expected https://HOST:PORT/enrol"),
        (["worker", "--enrol", "ftp://host/enrol#T", "--slice", tmp_path / "s.gguf"], "scheme 'ftp'"),
    ]
    for argv, says in cases:
        out = kvasir(*argv, timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (argv, out.stderr)
