"""The embedded nats-server, the connection helper, logging and ``kvasir nats``.

Every server here is on a port the server chose itself (port 0), and readiness is the ports
file the server writes, never a sleep.
"""

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats.errors
import numpy as np
import pytest
import structlog

from kvasir_bus import codec, logs
from kvasir_bus.codec import DispatchReply, DispatchRequest
from kvasir_bus.connect import DEFAULT_URL, connect, resolve_url
from kvasir_bus.errors import DependencyError, KvasirError, UsageError
from kvasir_bus.server import EmbeddedNats, find_binary
from kvasir_bus.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
DEPLOY_CONF = REPO / "deploy" / "nats.conf"
FP = "0123456789abcdef"
MIB = 1024 * 1024


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- server lifecycle -----------------------------------------------------------------------

def test_server_on_port_zero_reports_its_url(nats_server):
    assert nats_server.running
    assert nats_server.port and nats_server.port > 0
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    with socket.create_connection(("127.0.0.1", nats_server.port), timeout=2) as s:
        info = s.recv(4096)
    assert info.startswith(b"INFO ")
    assert json.loads(info[5:])["max_payload"] == 8 * MIB


def test_two_servers_at_once_get_different_ports():
    with EmbeddedNats() as a, EmbeddedNats() as b:
        assert a.port != b.port
        assert a.running and b.running


def test_stop_is_idempotent_and_the_process_is_gone():
    server = EmbeddedNats().start()
    pid, tmp = server.pid, server._tmpdir
    assert Path(tmp).is_dir()
    server.stop()
    server.stop()
    assert not server.running
    assert gone(pid)
    assert not Path(tmp).exists()
    with pytest.raises(UsageError, match="stopped"):
        server.start()


def test_context_manager_stops_on_error():
    with pytest.raises(RuntimeError):
        with EmbeddedNats() as server:
            pid = server.pid
            raise RuntimeError("boom")
    assert gone(pid)


def test_stop_before_start_is_harmless():
    server = EmbeddedNats()
    server.stop()
    with pytest.raises(UsageError, match="no client listener"):
        server.url


def test_websocket_and_monitoring_listeners(nats_server):
    assert nats_server.websocket_port not in (None, nats_server.port)
    assert nats_server.websocket_url == f"ws://127.0.0.1:{nats_server.websocket_port}"
    key = base64.b64encode(os.urandom(16)).decode()
    with socket.create_connection(("127.0.0.1", nats_server.websocket_port), timeout=2) as s:
        s.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 101")
    with EmbeddedNats(http_port=0) as server:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=2) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert b"200 OK" in s.recv(4096)


def _varz(server: EmbeddedNats) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{server.http_url}/varz", timeout=5) as r:
        return json.load(r)


def test_procs_sets_the_servers_go_threads_unless_the_environment_does(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with EmbeddedNats(http_port=0, procs=1) as server:
        assert _varz(server)["gomaxprocs"] == 1
    with EmbeddedNats(http_port=0) as server:
        assert _varz(server)["gomaxprocs"] == os.cpu_count()
    monkeypatch.setenv("GOMAXPROCS", "2")
    with EmbeddedNats(http_port=0, procs=1) as server:
        assert _varz(server)["gomaxprocs"] == 2  # the operator's setting wins
    with pytest.raises(UsageError, match="procs"):
        EmbeddedNats(procs=0)


def test_missing_binary_is_a_clear_error(monkeypatch):
    with pytest.raises(DependencyError, match="cannot run"):
        EmbeddedNats(binary="/nonexistent/nats-server").start()
    monkeypatch.setenv("KVASIR_NATS_SERVER", "/nonexistent/nats-server")
    with pytest.raises(DependencyError, match="KVASIR_NATS_SERVER"):
        find_binary()


def test_binary_comes_from_the_wheel():
    path = Path(find_binary())
    assert path.name == "nats-server" and os.access(path, os.X_OK)


def test_a_bad_config_fails_fast_with_the_server_message(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("port: {{{\n")
    t0 = time.monotonic()
    with pytest.raises(KvasirError, match="exited with status.*(?i:parse|error)"):
        EmbeddedNats(config=conf).start()
    assert time.monotonic() - t0 < 5


def test_a_busy_port_fails_with_the_server_message():
    with EmbeddedNats() as first:
        with pytest.raises(KvasirError, match="exited with status"):
            EmbeddedNats(port=first.port).start()


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(UsageError):
        EmbeddedNats(port=70000)
    with pytest.raises(UsageError, match="does not exist"):
        EmbeddedNats(config=tmp_path / "missing.conf")


# -- deploy/nats.conf -----------------------------------------------------------------------

def test_deploy_config_passes_the_servers_own_check():
    result = subprocess.run([find_binary(), "-t", "-c", str(DEPLOY_CONF)], capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_deploy_config_runs_with_ports_overridden(arun):
    with EmbeddedNats(config=DEPLOY_CONF, port=0, http_port=0, websocket_port=0) as server:
        assert server.port != 4222 and server.http_port != 8222 and server.websocket_port != 8080

        async def go():
            nc = await connect(server.url, "conf-test")
            try:
                return nc.max_payload
            finally:
                await nc.close()

        assert arun(go()) == 8 * MIB


# -- request/reply through the server -------------------------------------------------------

async def _echo_worker(nc, subject, node="w1"):
    """A stand-in worker: answers each dispatch with its rows doubled, as a DispatchReply."""

    async def handle(msg):
        req = codec.decode_request(msg.data)
        reply = DispatchReply(request_id=req.request_id, node=node,
                              rows=req.rows.astype(np.float32) * 2)
        await nc.publish(msg.reply, reply.encode(), headers=codec.headers_for(reply))

    sub = await nc.subscribe(subject, cb=handle)
    await nc.flush()
    return sub


@pytest.mark.parametrize("n_rows,width", [(1, 8), (17, 4096), (512, 2048)],
                         ids=["tiny", "over-64KiB", "4MiB"])
def test_dispatch_round_trip_with_headers(nats_server, arun, n_rows, width):
    subject = Subjects(FP).dispatch(3, 9)
    rows = np.random.default_rng(0).standard_normal((n_rows, width)).astype(np.float32)

    async def go():
        worker = await connect(nats_server.url, "worker")
        backbone = await connect(nats_server.url, "backbone")
        seen = []
        try:
            await _echo_worker(worker, subject)

            async def watch(m):  # what `nats sub 'kvasir.>'` would print
                seen.append(m.headers)

            tap = await backbone.subscribe(Subjects(FP).dispatch_layer(3), cb=watch)
            await backbone.flush()
            req = DispatchRequest(model=FP, layer=3, expert=9, rows=rows, request_id="q1")
            msg = await backbone.request(subject, req.encode(), timeout=5,
                                         headers=codec.headers_for(req))
            await tap.unsubscribe()
            return msg, seen
        finally:
            await worker.close()
            await backbone.close()

    msg, seen = arun(go())
    reply = codec.decode_reply(msg.data)
    assert isinstance(reply, DispatchReply)
    assert reply.request_id == "q1" and reply.node == "w1"
    assert np.array_equal(reply.rows, rows * 2)
    assert msg.headers["Kvasir-Node"] == "w1"
    assert msg.headers["Kvasir-Rows"] == str(n_rows)
    assert seen and seen[0]["Kvasir-Layer"] == "3" and seen[0]["Kvasir-Expert"] == "9"
    assert seen[0]["Kvasir-Rows"] == str(n_rows) and seen[0]["Kvasir-Dtype"] == "float32"


def test_first_replica_wins_and_later_replies_are_dropped(nats_server, arun):
    subject = Subjects(FP).dispatch(0, 1)

    async def go():
        a = await connect(nats_server.url, "a")
        b = await connect(nats_server.url, "b")
        bb = await connect(nats_server.url, "backbone")
        try:
            await _echo_worker(a, subject, node="a")
            await _echo_worker(b, subject, node="b")
            req = DispatchRequest(model=FP, layer=0, expert=1, rows=np.ones((2, 4), np.float32),
                                  request_id="q")
            msg = await bb.request(subject, req.encode(), timeout=5)
            return codec.decode_reply(msg.data).node
        finally:
            for nc in (a, b, bb):
                await nc.close()

    assert arun(go()) in ("a", "b")


def test_no_responders_fails_fast(nats_server, arun):
    async def go():
        nc = await connect(nats_server.url, "backbone")
        try:
            t0 = time.perf_counter()
            with pytest.raises(nats.errors.NoRespondersError):
                await nc.request(Subjects(FP).dispatch(1, 2), b"x", timeout=5)
            return time.perf_counter() - t0
        finally:
            await nc.close()

    assert arun(go()) < 1.0


# -- connect --------------------------------------------------------------------------------

def test_resolve_url(monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    assert resolve_url(None) == DEFAULT_URL
    assert resolve_url("nats://h:1") == "nats://h:1"
    assert resolve_url("h:4222") == "nats://h:4222"
    assert resolve_url("a:1, b:2") == "nats://a:1,nats://b:2"
    monkeypatch.setenv("NATS_URL", "tls://bus.example.org:4222")
    assert resolve_url(None) == "tls://bus.example.org:4222"
    assert resolve_url("ws://127.0.0.1:8080") == "ws://127.0.0.1:8080"
    for bad in ("http://h:1", "nats://h:notaport", "nats://:4222"):
        with pytest.raises(UsageError):
            resolve_url(bad)


def test_unreachable_bus_is_one_line_error(arun):
    port = free_port()

    async def go():
        with pytest.raises(KvasirError) as info:
            await connect(f"nats://user:secret@127.0.0.1:{port}", "t", connect_deadline=0.5)
        return str(info.value)

    t0 = time.monotonic()
    message = arun(go())
    assert time.monotonic() - t0 < 3
    assert message.startswith(f"cannot reach NATS at nats://***@127.0.0.1:{port}: ")
    assert "secret" not in message and "\n" not in message


def test_websocket_url_without_aiohttp_names_the_extra(arun):
    try:
        import aiohttp  # noqa: F401
        pytest.skip("aiohttp is installed: ws:// URLs work")
    except ImportError:
        pass
    with pytest.raises(DependencyError, match="aiohttp"):
        arun(connect("ws://127.0.0.1:1", "ws"))


def test_connect_uses_nats_url_from_the_environment(nats_server, arun, monkeypatch):
    monkeypatch.setenv("NATS_URL", nats_server.url)

    async def go():
        nc = await connect(None, "env")
        try:
            return nc.connected_url.port
        finally:
            await nc.close()

    assert arun(go()) == nats_server.port


def test_a_lost_server_is_logged_not_printed(arun):
    server = EmbeddedNats().start()

    async def go():
        with logs.capture() as lines:
            nc = await connect(server.url, "lost", reconnect_time_wait=0.05)
            server.stop()
            while not any(line["event"] == "nats disconnected, reconnecting" for line in lines):
                await asyncio.sleep(0.01)  # polled; arun's deadline bounds it
            await nc.close()
        return lines

    lines = arun(go(), timeout=5)
    lost = [line for line in lines if line["event"] == "nats disconnected, reconnecting"]
    assert lost[0]["log_level"] == "warning" and lost[0]["conn"] == "lost"


# -- logs -----------------------------------------------------------------------------------

def test_logs_json_on_stderr_and_bound_context(capsys):
    try:
        logs.configure(level="info", json=True)
        log = structlog.get_logger().bind(node="n1", layer=3, expert=9)
        log.info("served", request_id="q1", rows=4)
        log.debug("hidden")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        line = json.loads(err[0])
        assert line["event"] == "served" and line["level"] == "info"
        assert (line["node"], line["layer"], line["expert"], line["request_id"]) == \
            ("n1", 3, 9, "q1")
        assert "timestamp" in line
        logs.configure(level="debug", json=False)
        structlog.get_logger().debug("shown", node="n2")
        err = capsys.readouterr().err
        assert "shown" in err and "node=n2" in err and not err.lstrip().startswith("{")
    finally:
        structlog.reset_defaults()


def test_capture_sees_loggers_bound_before_it():
    try:
        logs.configure(level="info", json=True)
        log = structlog.get_logger().bind(node="early")
        with logs.capture() as lines:
            log.warning("late", expert=1)
        assert lines == [{"event": "late", "log_level": "warning", "node": "early", "expert": 1}]
    finally:
        structlog.reset_defaults()


def test_bad_log_level_is_refused():
    with pytest.raises(ValueError, match="log level"):
        logs.configure(level="loud")


# -- kvasir nats ----------------------------------------------------------------------------

_CLI = ("import argparse, sys\n"
        "from kvasir_bus import nats_cli\n"
        "p = argparse.ArgumentParser(); sub = p.add_subparsers()\n"
        "nats_cli.register(sub)\n"
        "a = p.parse_args(sys.argv[1:])\n"
        "sys.exit(a.func(a))\n")


@pytest.mark.timeout(30)
def test_kvasir_nats_serves_the_deploy_config_and_stops_on_sigterm(arun):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _CLI, "nats", "--port", "0", "--http-port", "0",
                             "--websocket", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("nats://127.0.0.1:"), proc.stderr.read() if not url else url

        async def go():
            nc = await connect(url, "cli-test")
            try:
                return nc.max_payload
            finally:
                await nc.close()

        assert arun(go()) == 8 * MIB
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "deploy/nats.conf" in proc.stderr.read()
