"""`kvasir creds init` / `add-worker`: files nats-server runs as they are, clear refusals."""

from __future__ import annotations

import stat
import subprocess

from kvasir_bus.cli import main as kvasir
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats, find_binary


def test_init_writes_a_config_the_server_accepts_and_add_worker_admits_a_new_node(tmp_path, capsys, arun):
    out = tmp_path / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--websocket", "127.0.0.1:0",
                   "--workers", "a1,b2"]) == 0
    check = subprocess.run([find_binary(), "-t", "-c", str(out / "nats.conf")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for name in ("backbone", "market", "observer", "operator", "a1", "b2"):
        assert stat.S_IMODE((out / f"{name}.creds").stat().st_mode) == 0o600
    assert kvasir(["creds", "add-worker", str(out), "c3"]) == 0
    with EmbeddedNats(config=out / "nats.conf", port=None, host=None) as server:
        async def go():
            for url in (server.url, server.websocket_url):
                nc = await connect(url, "c3", options=ConnectOptions(creds=str(out / "c3.creds")))
                await nc.close()
        arun(go())
    capsys.readouterr()
    assert kvasir(["creds", "add-worker", str(out), "a1"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert kvasir(["creds", "add-worker", str(out), "market"]) == 2
    assert kvasir(["creds", "add-worker", str(out), "bad.name"]) == 2
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0"]) == 2  # never overwrites keys
    assert kvasir(["creds", "init", str(tmp_path / "x"), "--listen", "nohost"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "HOST:PORT" in err and "Traceback" not in err
