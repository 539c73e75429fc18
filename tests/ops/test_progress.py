"""Long work says how far it got when nobody watches a terminal: log lines, not a ``\\r`` line.

:class:`kvasir_bus.progress.LogProgress` is driven by a fake clock (no test waits on time);
``kvasir synth`` and ``kvasir verify`` run in-process with pytest's captured stderr, which is
not a terminal, and must write their progress there as JSON lines.
"""

from __future__ import annotations

import io
import json

import pytest

from kvasir_bus.cli import main
from kvasir_bus.logs import capture
from kvasir_bus.progress import LogProgress
from workers.download import TerminalProgress, progress_for


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_every_tenth_of_the_work_with_done_total_and_rate():
    clock = Clock()
    p = LogProgress("copy_progress", unit="bytes", clock=clock, node="n1")
    with capture() as lines:
        for done in range(0, 1_000_001, 10_000):  # 101 calls, 1 s apart: 10 kB/s
            p(done, 1_000_000)
            clock.t += 1.0
    assert [x["pct"] for x in lines] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    last = lines[-1]
    assert last["event"] == "copy_progress" and last["node"] == "n1"
    assert (last["done"], last["total"], last["unit"], last["rate_unit"]) == (1_000_000, 1_000_000, "bytes", "MB/s")
    assert last["rate"] == pytest.approx(0.01)  # 1 MB in 100 s
    assert last["elapsed_s"] == 100.0


def test_a_stalled_job_still_says_it_is_alive_every_interval_and_ends_once():
    clock = Clock()
    p = LogProgress("wait", unit="workers", every_s=10.0, clock=clock)
    with capture() as lines:
        for _ in range(35):  # 35 s stuck at 0 of 4, polled every second
            p(0, 4)
            clock.t += 1.0
        p(4, 4)
        p(4, 4)  # a repeated end is not news
    assert [x["elapsed_s"] for x in lines] == [0.0, 10.0, 20.0, 30.0, 35.0]
    assert [x["done"] for x in lines] == [0, 0, 0, 0, 4]
    assert lines[-1]["rate"] == pytest.approx(4 / 35, abs=0.01) and lines[-1]["rate_unit"] == "workers/s"


def test_bytes_done_before_the_first_call_do_not_count_towards_the_rate():
    clock = Clock()
    p = LogProgress("download_progress", clock=clock)
    with capture() as lines:
        p(600_000_000, 1_000_000_000)  # resumed: 600 MB already on disk
        clock.t += 4.0
        p(1_000_000_000, 1_000_000_000)
    assert lines[-1]["rate"] == pytest.approx(100.0)  # 400 MB in 4 s, not 1000


def test_downloads_draw_a_line_on_a_terminal_and_log_elsewhere():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_for(Tty()), TerminalProgress)
    logged = progress_for(io.StringIO(), node="phone-1")
    assert isinstance(logged, LogProgress)
    with capture() as lines:
        logged(0, 100)
        logged(100, 100)
        logged.close()
    assert [(x["event"], x["node"], x["pct"]) for x in lines] == [
        ("download_progress", "phone-1", 0.0), ("download_progress", "phone-1", 100.0)]


def _json_lines(text: str, event: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == event:
                out.append(doc)
    return out


def test_a_quick_job_stays_quiet_when_asked_to():
    clock = Clock()
    p = LogProgress("synth_progress", after_s=2.0, clock=clock)
    with capture() as lines:
        for done in range(11):
            p(done, 10)
            clock.t += 0.1  # all done in 1 s
    assert lines == []


def test_synth_not_on_a_terminal_logs_its_progress_as_json_lines(capsys, tmp_path, monkeypatch):
    import types

    import kvasir_bus.progress

    # Every look at the clock is a second later: the file "takes" long enough to be reported.
    ticks = iter(range(10_000))
    monkeypatch.setattr(kvasir_bus.progress, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    out = tmp_path / "m.gguf"
    assert main(["synth", "--preset", "tiny", "--type", "f32", "--layers", "4", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    lines = _json_lines(captured.err, "synth_progress")
    assert len(lines) >= 3, captured.err
    assert lines[-1]["pct"] == 100.0 and lines[-1]["done"] == lines[-1]["total"] > 0
    assert all(x["output"] == str(out) for x in lines)
    assert [x["done"] for x in lines] == sorted(x["done"] for x in lines)
    assert captured.out.startswith(f"wrote {out}")  # the report stays on stdout, alone


def test_verify_not_on_a_terminal_logs_its_steps_then_the_reference_run(capsys, models):
    pytest.importorskip("llama_cpp", reason="verify compares against llama.cpp")
    path = str(models("qwen3moe", "f32"))
    assert main(["verify", "--model", path, "--decode", "10"]) == 0
    captured = capsys.readouterr()
    steps = _json_lines(captured.err, "verify_progress")
    assert [x["done"] for x in steps] == list(range(1, 11))  # 10 steps: each one is 10%
    assert steps[-1]["unit"] == "steps" and steps[-1]["total"] == 10
    (ref,) = _json_lines(captured.err, "verify_reference")
    assert ref["engine"] == "llama.cpp"
    assert "max |diff|" in captured.out
