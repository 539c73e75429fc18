"""`kvasir creds init --jwt`: NATS decentralised auth (operator, account, user JWTs in standard
.creds files) that nats-server runs as written; rights carried in each user JWT; anonymous refused;
a key revoked at runtime ($SYS.REQ.CLAIMS.UPDATE, no reload) is dropped and refused."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import nats
import pytest

from kvasir_bus import creds, jwt
from kvasir_bus.cli import main as kvasir
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats, find_binary


@pytest.fixture
def dep(tmp_path, capsys):
    out = tmp_path / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1",
                   "--clients", "c1", "--jwt"]) == 0
    capsys.readouterr()
    return out


def test_creds_files_are_standard_and_the_server_accepts_the_config(dep):
    text = (dep / "w1.creds").read_text()
    lines = text.splitlines()
    assert lines[0] == "-----BEGIN NATS USER JWT-----"
    assert lines[2] == "------END NATS USER JWT------"
    assert "-----BEGIN USER NKEY SEED-----" in lines and "------END USER NKEY SEED------" in lines
    claims = jwt.decode(lines[1])  # the signature verifies against the account key
    assert claims["iss"] == creds.account_public(dep)
    assert claims["name"] == "w1" and claims["nats"]["type"] == "user" and claims["nats"]["version"] == 2
    assert "kvasir.*.coverage.w1" in claims["nats"]["pub"]["allow"]
    check = subprocess.run([find_binary(), "-t", "-c", str(dep / "nats.conf")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_identities_connect_anonymous_is_refused_and_rights_hold(dep, arun):
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            with pytest.raises(Exception):
                await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                                   connect_timeout=2)
            obs = await connect(server.url, "obs", options=ConnectOptions(creds=str(dep / "observer.creds")))
            # nats-py's own user_credentials= reads the file as it is
            w1 = await nats.connect(server.url, user_credentials=str(dep / "w1.creds"),
                                    inbox_prefix=b"_INBOX_" + (await _pub(dep / "w1.creds")).encode())
            heard = []
            async def on_msg(m):
                heard.append(m.subject)
            sub = await obs.subscribe("kvasir.>", cb=on_msg)
            await obs.flush()
            await w1.publish("kvasir.m.coverage.w2", b"x")  # another node's name: denied
            await w1.publish("kvasir.m.x.0.1", b"x")  # dispatch: the backbone's only
            await w1.publish("kvasir.m.coverage.w1", b"ok")
            await w1.flush()
            for _ in range(100):
                if heard:
                    break
                await asyncio.sleep(0.02)
            await obs.flush()
            assert heard == ["kvasir.m.coverage.w1"]
            await sub.unsubscribe()
            await w1.close()
            await obs.close()
        arun(go())


async def _pub(path: Path) -> str:
    import nkeys

    from kvasir_bus.connect import read_seed
    return nkeys.from_seed(bytearray(read_seed(path))).public_key.decode()


def test_enrolled_user_without_reload_and_revocation_at_runtime(dep, arun):
    """A user JWT issued after the server started connects (no reload, no file on the server);
    revoking its key pushes the account JWT and the server drops and refuses it."""
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        seed, public = jwt.new_keypair("user")
        token = creds.issue_user(dep, "v1", "worker", public, expires=int(time.time()) + 600)
        path = dep.parent / "v1.creds"
        path.write_text(jwt.creds_text(token, seed))

        async def go():
            closed = asyncio.Event()

            async def on_closed():
                closed.set()
            v1 = await nats.connect(server.url, user_credentials=str(path), allow_reconnect=True,
                                    max_reconnect_attempts=2, reconnect_time_wait=0.1,
                                    closed_cb=on_closed, error_cb=_quiet)
            assert v1.is_connected
            op = await connect(server.url, "op", options=ConnectOptions(creds=str(dep / "operator.creds")))
            answer = await creds.push_account(op, creds.revoke(dep, public))
            assert "error" not in answer, answer
            await asyncio.wait_for(closed.wait(), 5)  # dropped, and its reconnects refused
            with pytest.raises(Exception):
                await nats.connect(server.url, user_credentials=str(path), allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2, error_cb=_quiet)
            await op.close()
        arun(go())
        assert public in creds.revocations(dep)


async def _quiet(exc):
    pass


def test_nats_cli_connects_with_written_creds(dep):
    from tests.interop.cli import find_cli  # where `make nats-cli` puts it, or PATH

    cli, why = find_cli()
    if cli is None:
        pytest.skip(why)
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        r = subprocess.run([cli, "--server", server.url, "--creds", str(dep / "observer.creds"),
                            "rtt"], capture_output=True, text=True, timeout=30)
        # `nats rtt` exits 0 even when it could not connect: it prints "failed" instead
        assert r.returncode == 0 and "failed" not in r.stdout + r.stderr, r.stdout + r.stderr
