"""The OpenAI API server bounds what a slow or hostile client holds: header and body read
timeouts, connection caps, and a bad request logged as one line without a traceback."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request

import pytest

from backbone.http_guard import GuardConfig
from backbone.model import Engine
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(models):
    path = models("qwen3moe", "q8_0")
    guard = GuardConfig(max_connections=24, max_per_address=16, header_timeout_s=0.5, body_timeout_s=0.8)
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig(max_active=4, deterministic=True),
                       guard=guard)
    with ServerThread(Engine(path), Tokenizer(path), cfg) as s:
        yield s


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float = 10.0) -> bytes:
    """Read until the server closes the connection; what it sent."""
    sock.settimeout(within_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def _healthy(server) -> bool:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        return r.status == 200


def test_a_client_that_never_finishes_its_headers_is_closed(server):
    socks = []
    for _ in range(3):
        s = _connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # and never \r\n\r\n
        socks.append(s)
    idle = _connect(server)  # one that connects and says nothing
    for s in (*socks, idle):
        assert _closed_by_server(s) == b""
        s.close()
    assert server.server.http_limits.slow_closed >= 4
    assert _healthy(server)


def test_a_body_shorter_than_its_content_length_is_closed_and_a_whole_one_is_answered(server):
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": \"he")
    assert b"200 OK" not in _closed_by_server(s)
    s.close()
    # a slow but whole request, body in pieces inside the timeout, is served as ever
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    s.sendall(body[:5])
    time.sleep(0.2)  # a pause shorter than the body timeout: the client is slow, not stalled
    s.sendall(body[5:])
    reply = _closed_by_server(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 200") and b'"choices"' in reply


def test_connections_over_the_per_address_cap_get_503_and_the_server_keeps_serving(server):
    held = [_connect(server) for _ in range(16)]
    try:
        for s in held:  # each has sent the start of a request: aiohttp holds them all
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        extra = _connect(server)
        got = _closed_by_server(extra)
        extra.close()
        assert got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
        assert server.server.http_limits.refused >= 1
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while server.server.http_limits.open and time.monotonic() < deadline:
        time.sleep(0.05)  # the closes reach the server's loop
    assert _healthy(server)


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(10_000)) + b"\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
], ids=["10000-headers", "1MB-header", "bad-content-length"])
def test_a_malformed_request_is_a_400_and_one_log_line_without_a_traceback(server, request_bytes, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    s = _connect(server)
    try:
        s.sendall(request_bytes)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before it read it all
    got = _closed_by_server(s)
    s.close()
    assert got == b"" or got.startswith(b"HTTP/1.") and b" 400 " in got.split(b"\r\n")[0]
    for record in caplog.records:
        assert record.exc_info is None and "Traceback" not in record.getMessage(), record.getMessage()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    assert _healthy(server)
