"""The shipped server configs work as shipped, with only ports (and certificate paths) freed:
deploy/nats.conf's WebSocket listener, deploy/nats-443.conf's TLS one, deploy/cluster/*, and
``kvasir nats --websocket``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats, find_binary

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


async def _echo(url: str, options: ConnectOptions = ConnectOptions()) -> bytes:
    nc = await connect(url, "deploy-test", options=options)
    try:
        async def echo(msg):
            await nc.publish(msg.reply, msg.data)

        await nc.subscribe("kvasir.test.echo", cb=echo)
        payload = os.urandom(3 * 1024 * 1024)  # over NATS' 1 MB default: max_payload applies
        reply = await nc.request("kvasir.test.echo", payload, timeout=10)
        return reply.data == payload
    finally:
        await nc.close()


@pytest.mark.parametrize("conf", ["nats.conf", "nats-443.conf", "cluster/bus-a.conf",
                                  "cluster/bus-b.conf", "cluster/bus-c.conf", "cluster/edge.conf"])
def test_every_shipped_config_is_parsed_by_nats_server(conf, tmp_path):
    path = DEPLOY / conf
    if conf == "nats-443.conf":  # its certificate paths are the production ones: point at files
        path = _tls_copy(tmp_path, *_certs(tmp_path), port=443)
    result = subprocess.run([find_binary(), "-t", "-c", str(path)], capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 0 and "is valid" in result.stdout + result.stderr, result.stderr


def test_nats_conf_listens_for_websocket_clients_without_tls_for_a_proxy(arun):
    text = (DEPLOY / "nats.conf").read_text()
    block = re.search(r"^websocket \{(.*?)^\}", text, re.S | re.M)
    assert block, "deploy/nats.conf has no live websocket block"
    assert "no_tls: true" in block.group(1) and "host: 127.0.0.1" in block.group(1)
    with EmbeddedNats(config=DEPLOY / "nats.conf", port=0, http_port=0, websocket_port=0) as server:
        assert arun(_echo(server.websocket_url))


def _certs(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(files[0])
    cert.private_key_and_cert_chain_pem.write_to_path(files[1])
    cert.private_key_pem.write_to_path(files[2])
    return tuple(str(f) for f in files)


def _tls_copy(tmp_path, ca, cert, key, port):
    """deploy/nats-443.conf (and the nats.conf it includes) in tmp_path, with the test's
    certificate and ``port`` in place of 443."""
    text = (DEPLOY / "nats-443.conf").read_text()
    text = text.replace("/etc/kvasir/tls/fullchain.pem", cert).replace("/etc/kvasir/tls/privkey.pem", key)
    text, n = re.subn(r"^  port: 443$", f"  port: {port}", text, flags=re.M)
    assert n == 1
    (tmp_path / "nats-443.conf").write_text(text)
    (tmp_path / "nats.conf").write_text((DEPLOY / "nats.conf").read_text())
    return tmp_path / "nats-443.conf"


def test_nats_443_conf_serves_wss_with_its_certificate(tmp_path, arun):
    ca, cert, key = _certs(tmp_path)
    conf = _tls_copy(tmp_path, ca, cert, key, port=-1)
    with EmbeddedNats(config=conf, port=0, http_port=0) as server:
        assert arun(_echo(f"wss://localhost:{server.websocket_port}", ConnectOptions(tls_ca=ca)))


_CLI = "import sys; from kvasir_bus.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("spec", ["0", "127.0.0.1:0"])
def test_kvasir_nats_websocket_flag_opens_a_plain_listener(spec, arun):
    proc = subprocess.Popen([sys.executable, "-c", _CLI, "nats", "--port", "0", "--http-port", "0",
                             "--websocket", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url, ws = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        assert url.startswith("nats://") and ws.startswith("ws://127.0.0.1:"), proc.stderr.read()
        assert arun(_echo(ws))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("bad", ["x", "127.0.0.1:70000", "host:"])
def test_kvasir_nats_websocket_flag_refuses_bad_input_in_one_line(bad):
    proc = subprocess.run([sys.executable, "-c", _CLI, "nats", "--websocket", bad],
                          capture_output=True, text=True, cwd=REPO, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--websocket" in proc.stderr, proc.stderr
