"""The 443 path: ws:// and wss:// (a throwaway CA from trustme) carry every payload size intact,
and a whole swarm over each serves a generation bit-identical to the monolithic run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.errors import KvasirError
from kvasir_bus.server import EmbeddedNats

trustme = pytest.importorskip("trustme")

#: 1 KiB .. 8 MiB: every power of two, and both sides of the 64 KiB frame size that once broke.
SIZES = sorted({2 ** k for k in range(10, 24)} | {64 * 1024 - 1, 64 * 1024 + 1})


@pytest.fixture
def tls_files(tmp_path):
    """A throwaway CA and a server certificate for localhost/127.0.0.1, plus a client one."""
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("worker-1@kvasir")
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "server.pem", "key": tmp_path / "server.key",
             "client_cert": tmp_path / "client.pem", "client_key": tmp_path / "client.key"}
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    return {k: str(v) for k, v in files.items()}


@pytest.fixture
def wss_server(tls_files, tmp_path):
    """nats-server with a TLS WebSocket listener that also verifies client certificates."""
    conf = tmp_path / "wss.conf"
    conf.write_text("\n".join([
        "max_payload: 8MB",
        "websocket {", "  listen: \"127.0.0.1:-1\"", "  compression: false",
        "  tls {", f"    cert_file: {json.dumps(tls_files['cert'])}", f"    key_file: {json.dumps(tls_files['key'])}",
        f"    ca_file: {json.dumps(tls_files['ca'])}", "    verify: true", "  }", "}", ""]))
    with EmbeddedNats(config=conf, port=0) as server:
        yield server


async def _echo_all(url: str, options: ConnectOptions) -> list[int]:
    """Round-trip every size through a responder on a second connection; return failures.

    A request that finds no responder while the responder's connection is coming back from a
    drop (seen twice in CI runs on a loaded 2-core machine; not reproduced alone) is asked again once
    that connection is up: this test is about the bytes that arrive, which are still compared
    for every size. A "no responders" without a reconnect fails the test."""
    import nats.errors

    server_side = await connect(url, "echo", options=options)
    client = await connect(url, "asker", options=options)

    async def echo(msg):
        await server_side.publish(msg.reply, msg.data)

    await server_side.subscribe("kvasir.test.echo", cb=echo)
    await server_side.flush()
    bad = []
    for n in SIZES:
        payload = os.urandom(n)
        try:
            reply = await client.request("kvasir.test.echo", payload, timeout=20)
        except nats.errors.NoRespondersError:
            dropped = server_side.stats["reconnects"] or not server_side.is_connected
            assert dropped, f"no responder for {n} bytes, and the responder's connection never dropped"
            await server_side.flush(timeout=20)  # it is back, with its subscription
            reply = await client.request("kvasir.test.echo", payload, timeout=20)
        if reply.data != payload:
            bad.append(n)
    await client.close()
    await server_side.close()
    return bad


def test_every_payload_size_crosses_plain_websocket_intact(nats_server, arun):
    assert arun(_echo_all(nats_server.websocket_url, ConnectOptions()), timeout=120) == []


def test_every_payload_size_crosses_websocket_tls_intact(wss_server, tls_files, arun):
    url = f"wss://localhost:{wss_server.websocket_port}"
    options = ConnectOptions(tls_ca=tls_files["ca"], tls_cert=tls_files["client_cert"],
                             tls_key=tls_files["client_key"])
    assert arun(_echo_all(url, options), timeout=120) == []


def test_wss_without_the_ca_or_client_certificate_is_refused(wss_server, tls_files, arun):
    url = f"wss://localhost:{wss_server.websocket_port}"
    with pytest.raises(KvasirError, match="cannot reach NATS"):
        arun(connect(url, "no-ca", options=ConnectOptions(), connect_deadline=2))
    with pytest.raises(KvasirError, match="cannot reach NATS"):
        arun(connect(url, "no-client-cert", options=ConnectOptions(tls_ca=tls_files["ca"]), connect_deadline=2))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=4)


def _up(model, url, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    proc = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model), "--nats", url,
                           *extra, "--workers", "2", "--prompt", "Over the 443 path", "-n", "6", "--check",
                           "--json", "--timeout-ms", "20000"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["check"]["bit_identical"] and result["check"]["tokens_equal"]
    # (a fixed timeout: every call waits for the workers; with the adaptive one a fresh backbone
    # computes its first step here while the calls are out, and a loaded machine's workers may lose)
    assert result["dispatch"]["local"] == 0 and result["dispatch"]["calls"] > 0
    return result


def test_a_swarm_over_ws_is_bit_identical(model, nats_server):
    _up(model, nats_server.websocket_url)


def test_a_swarm_over_wss_with_a_private_ca_and_client_certificates_is_bit_identical(model, wss_server, tls_files):
    _up(model, f"wss://localhost:{wss_server.websocket_port}", "--tls-ca", tls_files["ca"],
        "--tls-cert", tls_files["client_cert"], "--tls-key", tls_files["client_key"])
