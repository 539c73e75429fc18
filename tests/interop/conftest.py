"""Fixtures for running the official ``nats`` CLI against a real swarm.

``nats_cli``: the CLI binary (``make nats-cli`` builds it; without it every test here skips with
one line saying why). ``swarm``: one real ``kvasir up --model M --workers 2 --nats URL --http``
per module, on an embedded nats-server (port 0, JetStream on for the ledger stream); ready when
``kvasir up`` prints its serving line (no sleeps). ``cli``: a :class:`~tests.interop.cli.Cli`
pointed at that swarm's bus.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvasir_bus.server import EmbeddedNats
from tests.interop.cli import Cli, find_cli

REPO = Path(__file__).resolve().parents[2]
KVASIR = [sys.executable, "-m", "kvasir_bus.cli"]


@pytest.fixture(scope="session")
def nats_cli() -> str:
    path, why = find_cli()
    if path is None:
        pytest.skip(why)
    return path


@dataclass
class Swarm:
    url: str
    fingerprint: str
    model: Path
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # what kvasir up printed


def _read_lines(proc: subprocess.Popen, into: queue.Queue) -> None:
    for raw in proc.stdout:
        into.put(raw.decode("utf-8", "replace").rstrip("\n"))
    into.put(None)


def start_up(url: str, model: Path, state: Path, extra: list[str] = (), deadline_s: float = 120) -> Swarm:
    """``kvasir up --model M --workers 2 --nats URL --http 127.0.0.1:0``; returns once it serves
    (its ``serving ... /v1`` line), with the model fingerprint from its ``swarm up`` line."""
    env = dict(os.environ, XDG_STATE_HOME=str(state), KVASIR_KERNEL_MODE="deterministic")
    proc = subprocess.Popen([*KVASIR, "up", "--model", str(model), "--workers", "2", "--nats", url,
                             "--http", "127.0.0.1:0", *extra],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    seen: list[str] = []
    fp = None
    end = time.monotonic() + deadline_s
    while True:
        try:
            line = lines.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            line = ""
        if line is None or time.monotonic() > end:
            proc.kill()
            raise AssertionError("kvasir up did not come up:\n" + "\n".join(seen[-30:]))
        seen.append(line)
        m = re.match(r"swarm up: \S+, model ([0-9a-f]+) ", line)
        if m:
            fp = m[1]
        if line.startswith("serving ") and "/v1" in line:
            break
    assert fp, seen
    swarm = Swarm(url, fp, model, proc, seen)
    # keep draining its output so that it never blocks on a full pipe
    threading.Thread(target=lambda: [swarm.lines.append(x) for x in iter(lines.get, None)], daemon=True).start()
    return swarm


def stop_up(swarm: Swarm) -> None:
    if swarm.proc.poll() is None:
        swarm.proc.terminate()
        try:
            swarm.proc.wait(20)
        except subprocess.TimeoutExpired:
            swarm.proc.kill()
            swarm.proc.wait()


@pytest.fixture(scope="module")
def swarm(nats_cli, models, tmp_path_factory):
    model = models("qwen3moe", "q8_0")
    with EmbeddedNats(port=0) as server:
        s = start_up(server.url, model, tmp_path_factory.mktemp("up-state"))
        try:
            yield s
        finally:
            stop_up(s)


@pytest.fixture(scope="module")
def cli(nats_cli, swarm, tmp_path_factory) -> Cli:
    return Cli(nats_cli, swarm.url, tmp_path_factory.mktemp("nats-cli-home"))
