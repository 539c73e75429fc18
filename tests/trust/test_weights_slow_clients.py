"""The weights server bounds what a slow client holds: connections from one address past its cap
are closed at accept (no thread each), and the server still answers once they are gone."""

from __future__ import annotations

import socket
import threading
import time

from backbone import weights_http
from backbone.weights_http import WeightsServer

EXTRA = 40


def test_connections_past_the_cap_get_no_thread_and_the_server_still_answers(tmp_path, monkeypatch):
    blob = tmp_path / "w.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    monkeypatch.setattr(weights_http, "MAX_CONNECTIONS_PER_ADDRESS", 16)  # the default is 256: a quick test
    cap = weights_http.MAX_CONNECTIONS_PER_ADDRESS
    with WeightsServer(blob, port=0, host="127.0.0.1") as srv:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(cap + EXTRA)]
        try:
            closed = 0
            for sock in idle:
                sock.sendall(b"GET")  # a slowloris start, never finished
                sock.settimeout(0.1)
                try:
                    closed += sock.recv(1) == b""
                except socket.timeout:
                    pass  # held open: one of the admitted ones
                except OSError:
                    closed += 1
            assert closed >= EXTRA - 4  # (a few may be admitted before the first ones registered)
            assert threading.active_count() - before <= cap + 6
            assert srv.refused_connections >= EXTRA - 4
        finally:
            for sock in idle:
                sock.close()
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.settimeout(5)
                sock.sendall(b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(16).startswith(b"HTTP/1."):
                    break
            time.sleep(0.05)  # poll: the closed ones leave the books as their threads see EOF
        else:
            raise AssertionError("the server never answered again")
