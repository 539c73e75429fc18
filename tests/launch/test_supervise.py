"""``kvasir up`` supervises what it started: a killed worker or market comes back with back-off,
dead children are reaped, and Ctrl-C stops every one of them."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch.supervise import Supervisor
from launch.swarm import wait_for_nodes

REPO = Path(__file__).resolve().parents[2]


class _Child:
    """A real process (the supervisor polls and reaps it) that exits with ``code`` when told."""

    def __init__(self, code: int = 3) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); sys.exit({code})"],
                                     stdin=subprocess.PIPE)
        self.stopped = False

    def exit(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()

    def stop(self) -> None:
        self.stopped = True
        if self.proc.poll() is None:
            self.exit()


def test_a_dead_child_is_reaped_and_restarted_with_a_doubling_back_off_that_resets_once_stable():
    now = [0.0]
    sup = Supervisor(backoff_s=1.0, max_backoff_s=4.0, stable_s=10.0, clock=lambda: now[0])
    made: list[_Child] = []

    def start() -> _Child:
        made.append(_Child())
        return made[-1]

    seen = []
    sup.add("w", start, on_start=seen.append)
    assert sup.check() == []  # alive: nothing to do
    made[0].exit()
    assert sup.check() == []  # reaped now, due in 1 s
    assert made[0].proc.returncode == 3
    now[0] = 0.5
    assert sup.check() == []
    now[0] = 1.0
    assert sup.check() == ["w"] and sup.child("w") is made[1] and seen == [made[1]]
    made[1].exit()  # dies at once: the next back-off is 2 s, then 4 s (the cap), then 4 s
    waits = []
    for _ in range(3):
        sup.check()
        t0 = now[0]
        while sup.check() == []:
            now[0] += 0.5
        waits.append(now[0] - t0)
        sup.child("w").exit()
    assert waits == [2.0, 4.0, 4.0]
    sup.check()
    now[0] += 4.0
    assert sup.check() == ["w"]
    now[0] += 10.0  # stable: back to 1 s
    sup.check()
    sup.child("w").exit()
    sup.check()
    now[0] += 1.0
    assert sup.check() == ["w"]
    assert sup.restarts() == {"w": 6}
    sup.stop()
    assert made[-1].stopped and all(c.proc.poll() is not None for c in made)


def test_a_start_that_fails_is_retried_and_stop_ends_the_restarts_before_stopping_children():
    now = [0.0]
    sup = Supervisor(backoff_s=1.0, clock=lambda: now[0])
    child = _Child()
    calls = []

    def start():
        calls.append(now[0])
        raise OSError("no such file")

    sup.add("m", start, child=child)
    child.exit()
    sup.check()
    for t in (1.0, 2.0, 3.0, 5.0):
        now[0] = t
        sup.check()
    assert calls == [1.0, 3.0]  # 1 s, then 2 s later; the next is due at 7 s
    sup.stop()
    now[0] = 100.0
    sup.check()
    assert calls == [1.0, 3.0]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    """Exited and reaped (no zombie left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "X"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child pids from Linux's /proc")
def test_up_restarts_a_killed_worker_and_market_and_ctrl_c_stops_everything(models, tmp_path):
    model = models("qwen3moe", "q8_0")
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), KVASIR_KERNEL_MODE="deterministic")
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model),
                             "--workers", "2", "--restart-backoff", "0.2", "--logs", str(tmp_path / "logs")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(raw.decode(errors="replace")) for raw in proc.stdout],
                     daemon=True).start()
    seen: list[str] = []

    def until(pattern: str, timeout_s: float = 120) -> re.Match:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                assert proc.poll() is None, "kvasir up exited:\n" + "".join(seen[-30:])
                continue
            seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no {pattern!r} from kvasir up:\n" + "".join(seen[-30:]))

    try:
        url, fp = until(r"swarm up: (\S+), model ([0-9a-f]+) ").groups()
        until("serving until Ctrl-C")
        kids = {pid: _cmdline(pid) for pid in _children(proc.pid)}
        worker0 = next(p for p, c in kids.items() if "--node worker-0" in c)
        market = next(p for p, c in kids.items() if " market " in c)
        os.kill(worker0, signal.SIGKILL)
        os.kill(market, signal.SIGKILL)
        restarted = set()
        while restarted != {"worker-0", "market"}:
            event = json.loads(until(r'^\{.*"event": "child_restarted".*\}$')[0])
            restarted.add(event["child"])
        assert _gone(worker0) and _gone(market)  # reaped by up, no zombies
        asyncio.run(wait_for_nodes(url, fp, {"worker-0", "worker-1"}, timeout=120))  # the new worker-0 serves
        now = {pid: _cmdline(pid) for pid in _children(proc.pid)}
        assert sum("--node worker-" in c for c in now.values()) == 2
        assert sum(" market " in c for c in now.values()) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(seen[-30:])
        assert all(_gone(pid) for pid in now)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
