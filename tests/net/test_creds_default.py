"""`kvasir creds init` writes NATS JWT auth by default: standard .creds files that nats-py
(`user_credentials=`) and nats.js (`credsAuthenticator`) read as they are; anonymous connections
are refused; `kvasir creds` names the one command that migrates an nkey deployment, and the
migrated identities keep their keys."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import nats
import pytest

from kvasir_bus import creds, jwt
from kvasir_bus.cli import main as kvasir
from kvasir_bus.connect import inbox_prefix_for
from kvasir_bus.server import EmbeddedNats

NATSJS = Path(__file__).parent / "natsjs"


@pytest.fixture
def dep(tmp_path, capsys):
    out = tmp_path / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1"]) == 0
    capsys.readouterr()
    return out


def test_init_defaults_to_jwt_and_nats_py_reads_every_file(dep, arun):
    assert creds.load(dep).auth == "jwt"
    names = [i.name for i in creds.load(dep).identities]
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        async def go():
            with pytest.raises(Exception):  # anonymous: no user JWT, no connection
                await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                                   connect_timeout=2)
            for name in names:  # nats-py's own reader, nothing of ours
                nc = await nats.connect(server.url, user_credentials=str(dep / f"{name}.creds"),
                                        allow_reconnect=False, max_reconnect_attempts=0)
                assert nc.is_connected
                await nc.close()
        arun(go(), timeout=30)


def test_bare_kvasir_creds_names_the_migration_and_migrate_keeps_the_keys(tmp_path, capsys, arun):
    assert kvasir(["creds"]) == 0
    assert "kvasir creds migrate OLD NEW" in capsys.readouterr().out
    old, new = tmp_path / "old", tmp_path / "new"
    assert kvasir(["creds", "init", str(old), "--nkey", "--listen", "127.0.0.1:0", "--workers", "w1"]) == 0
    assert kvasir(["creds", "add-worker", str(old), "w2"]) == 0
    assert "kvasir creds migrate OLD NEW" in capsys.readouterr().err  # the reload hint says so
    assert kvasir(["creds", "migrate", str(old), str(new)]) == 0
    before, after = creds.load(old), creds.load(new)
    assert after.auth == "jwt" and before.auth == "nkey"
    assert [(i.name, i.public_key) for i in after.identities] == \
        [(i.name, i.public_key) for i in before.identities]
    assert kvasir(["creds", "migrate", str(new), str(tmp_path / "again")]) == 2
    assert "JWT deployment already" in capsys.readouterr().err
    claims = jwt.decode(jwt.read_creds_jwt(new / "w2.creds"))
    assert claims["sub"] == before.identities[-1].public_key
    with EmbeddedNats(config=new / "nats.conf", port=None, host=None) as server:
        async def go():
            nc = await nats.connect(server.url, user_credentials=str(new / "w2.creds"),
                                    allow_reconnect=False, max_reconnect_attempts=0)
            await nc.close()
        arun(go())


def _node_script() -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node: nats.js needs Node.js (apt install nodejs)")
    if not (NATSJS / "node_modules" / "@nats-io" / "transport-node").is_dir():
        pytest.skip(f"nats.js not installed: cd {NATSJS} && npm install")
    return [node, str(NATSJS / "connect.mjs")]


def test_nats_js_connects_with_the_written_creds_and_anonymous_is_refused(dep):
    script = _node_script()
    public = creds.load(dep).identities[-1].public_key
    with EmbeddedNats(config=dep / "nats.conf", port=None, host=None) as server:
        def run(creds_file: str, subject: str, *extra: str) -> dict:
            r = subprocess.run([*script, server.url, creds_file, subject, *extra],
                               capture_output=True, text=True, timeout=30)
            return json.loads(r.stdout.strip().splitlines()[-1])

        ok = run(str(dep / "w1.creds"), "kvasir.m.coverage.w1", inbox_prefix_for(public))
        assert ok["connected"] is True, ok
        for name in ("backbone", "market", "observer", "operator"):
            assert run(str(dep / f"{name}.creds"), "kvasir.m.ping")["connected"] is True
        anon = run("-", "kvasir.m.coverage.w1")
        assert anon["connected"] is False and "authorization" in anon["error"].lower(), anon
