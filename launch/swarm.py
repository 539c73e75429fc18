"""Starting and watching a local swarm: worker processes, and waiting for their coverage.

Used by ``kvasir up`` and by the tests. Workers are separate processes (``kvasir worker``),
exactly as they run on other machines; a worker is "up" when its first heartbeat arrives,
which it sends only after its subscriptions are live on the server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from kvasir_bus import codec
from kvasir_bus.connect import connect
from kvasir_bus.micro import connection_name
from kvasir_bus.errors import KvasirError, UsageError
from kvasir_bus.subjects import Subjects


def split_experts(n_expert: int, n_workers: int) -> list[tuple[int, int]]:
    """Inclusive expert ranges that split 0..n_expert-1 as evenly as possible."""
    if not 0 < n_workers <= n_expert:
        raise UsageError(f"--workers must be between 0 and {n_expert} (the experts per layer), got {n_workers}")
    bounds = [round(i * n_expert / n_workers) for i in range(n_workers + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n_workers)]


@dataclass
class WorkerProcess:
    node: str
    proc: subprocess.Popen
    log_path: str | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (the worker drains), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_worker(url: str, node: str, source_args: list[str], *, heartbeat_s: float = 1.0,
                 log_file=None, extra: list[str] = (), threads: int | None = 1) -> WorkerProcess:
    """Start ``kvasir worker`` in its own process. ``source_args`` is ``["--slice", path]`` or
    ``["--model", path, "--layer", "all", "--experts", "0-7"]``.

    ``threads``: ggml threads per expert call (``KVASIR_THREADS``). Workers that share a machine
    with the backbone and each other get 1 by default: OpenMP barriers on oversubscribed cores
    spin against each other."""
    cmd = [sys.executable, "-m", "kvasir_bus.cli", "worker", "--nats", url, "--node", node,
           "--heartbeat", str(heartbeat_s), *source_args, *extra]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if threads:
        env["KVASIR_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL, env=env)
    return WorkerProcess(node, proc, getattr(log_file, "name", None))


async def wait_for_nodes(url: str, model: str, nodes: set[str], timeout: float = 60.0,
                         procs: list[WorkerProcess] = (), progress=None) -> dict[str, codec.Heartbeat]:
    """Wait until every node in ``nodes`` has sent a heartbeat for ``model``; ``progress(seen,
    wanted)`` is called every poll (0.2 s) and once at the end."""
    nc = await connect(url, name=connection_name("up"))
    seen: dict[str, codec.Heartbeat] = {}
    arrived = asyncio.Event()

    async def on_beat(msg):
        try:
            hb = codec.decode_heartbeat(msg.data)
        except codec.CodecError:
            return
        if hb.node in nodes:
            seen[hb.node] = hb
            if set(seen) >= nodes:
                arrived.set()

    sub = await nc.subscribe(Subjects(model).coverage_all(), cb=on_beat)
    deadline = time.monotonic() + timeout
    try:
        while not arrived.is_set():
            if progress is not None:
                progress(len(seen), len(nodes))
            dead = [p.node for p in procs if not p.alive()]
            if dead:
                raise KvasirError(f"worker {', '.join(dead)} exited before announcing its experts")
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(nodes - set(seen)))
                raise KvasirError(f"workers did not announce themselves within {timeout:.0f} s: {missing}")
            try:
                await asyncio.wait_for(arrived.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
    finally:
        await sub.unsubscribe()
        await nc.drain()
    if progress is not None:
        progress(len(seen), len(nodes))
    return seen
