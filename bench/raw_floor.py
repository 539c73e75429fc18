"""The floor under any NATS client written in Python: the same request/reply loop as
``bench/dispatch.py``'s nats.py floor, spoken directly on blocking sockets (CONNECT, SUB, PUB,
MSG and nothing else: no asyncio, no tasks, no flusher, no reconnects, no TLS, no auth).

It answers one question for issue 10's remote-call goal: how much of the per-call CPU that
nats.py costs is the client, and how much is the socket and the loopback TCP stack, which any
client pays (on loopback the sender's ``send`` also runs the receiver's TCP processing). Beside
them, what nats-server spends per message it routes and the wall time of a step: with
``--per-step 1``, one round trip through the server with clients that do nothing else, the
floor under every serial wait of a sharded decode (one per MoE layer) on this machine.

    python bench/raw_floor.py [--steps 4000] [--per-step 2] [--size 300]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import record  # noqa: E402  (--save)
from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats  # noqa: E402

SUBJECTS = 8  # the responder listens on floor.0 .. floor.7, as bench_floor's echo does


class RawNats:
    """A blocking NATS connection that speaks just enough of the protocol for the floor."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self._line()  # INFO
        self.sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":false}\r\n')
        self.ping()

    def ping(self) -> None:
        """A round trip to the server: everything sent before it has been processed."""
        self.sock.sendall(b"PING\r\n")
        while self._line() != b"PONG":
            pass

    def sub(self, subject: bytes, sid: int) -> None:
        self.sock.sendall(b"SUB %s %d\r\n" % (subject, sid))

    def pubs(self, messages: list[tuple[bytes, bytes, bytes]]) -> None:
        """(subject, reply or b"", payload) each, in one write: a layer step's publishes."""
        self.sock.sendall(b"".join(b"PUB %s %s%d\r\n%s\r\n" % (subject, reply + b" " if reply else b"", len(data), data)
                                   for subject, reply, data in messages))

    def msg(self) -> tuple[bytes | None, bytes]:
        """The next message: (its reply subject, its payload). Answers the server's PINGs."""
        while True:
            line = self._line()
            if line.startswith(b"MSG "):
                parts = line.split()
                n, reply = int(parts[-1]), (parts[3] if len(parts) == 5 else None)
                while len(self.buf) < n + 2:
                    self._fill()
                data = bytes(self.buf[:n])
                del self.buf[:n + 2]
                return reply, data
            if line == b"PING":
                self.sock.sendall(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise RuntimeError(line.decode(errors="replace"))

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[:i])
        del self.buf[:i + 2]
        return line

    def _fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise EOFError("the server closed the connection")
        self.buf += data


def _echo(port: int) -> None:
    """The responder process: every request answered with its own bytes."""
    nc = RawNats("127.0.0.1", port)
    for i in range(SUBJECTS):
        nc.sub(b"floor.%d" % i, i + 1)
    nc.ping()
    print("ready", flush=True)
    while True:
        reply, data = nc.msg()
        nc.pubs([(reply, b"", data)])


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_raw_floor(steps: int = 4000, per_step: int = 2, size: int = 300, warm: int = 200) -> dict:
    """Requester here, echo responder in another process, on an embedded nats-server: per step
    ``per_step`` requests in one write, then their replies. CPU per call on each side, the
    server's CPU per message routed (its Go thread, /proc), and the wall time of a step (a
    round trip when ``per_step`` is 1)."""
    with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server:
        port = int(server.url.rsplit(":", 1)[1])
        echo = subprocess.Popen([sys.executable, __file__, "--echo", str(port)], stdout=subprocess.PIPE)
        try:
            if echo.stdout.readline().strip() != b"ready":
                raise RuntimeError("the raw echo responder did not start")
            nc = RawNats("127.0.0.1", port)
            nc.sub(b"_INBOX.floor.*", 1)
            nc.ping()
            payload = bytes(size)
            for n in (warm, steps):  # warm, then measure
                c0, t0, w0, s0 = time.process_time(), time.perf_counter(), _proc_cpu_s(echo.pid), _proc_cpu_s(server.pid)
                for step in range(n):
                    nc.pubs([(b"floor.%d" % ((step + k) % SUBJECTS), b"_INBOX.floor.%d_%d" % (step, k), payload)
                             for k in range(per_step)])
                    for _ in range(per_step):
                        reply, data = nc.msg()
                        if len(data) != size:
                            raise RuntimeError(f"echo returned {len(data)} bytes, sent {size}")
                cpu, wall, w_cpu = time.process_time() - c0, time.perf_counter() - t0, _proc_cpu_s(echo.pid) - w0
                s_cpu = _proc_cpu_s(server.pid) - s0
        finally:
            echo.kill()
            echo.wait()
    calls = steps * per_step
    return {"client": "blocking sockets, raw NATS protocol", "calls": calls, "per_step": per_step,
            "payload_bytes": size, "requester_cpu_us_per_call": round(1e6 * cpu / calls, 1),
            "responder_cpu_us_per_call": round(1e6 * w_cpu / calls, 1),
            # the server routes two messages a call (the request and its reply)
            "server_cpu_us_per_message": round(1e6 * s_cpu / (2 * calls), 1),
            "calls_per_s": round(calls / wall), "wall_us_per_step": round(1e6 * wall / steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--per-step", type=int, default=2)
    ap.add_argument("--size", type=int, default=300)
    ap.add_argument("--echo", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the responder process
    record.add_save_flag(ap)
    args = ap.parse_args()
    if args.echo:
        _echo(args.echo)
        return
    out = {"bench": "raw-nats-floor", **bench_raw_floor(args.steps, args.per_step, args.size)}
    print(json.dumps(out, indent=2))
    record.save(args, "raw_floor", out)


if __name__ == "__main__":
    main()
