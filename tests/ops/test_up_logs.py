"""``kvasir up --logs DIR`` end to end: every role's log is kept in DIR and named in the output,
and the start-up, not on a terminal, logs how many workers are ready."""

from __future__ import annotations

import json
import subprocess
import sys


def test_up_keeps_each_workers_and_the_markets_log_in_dir_and_names_them(models, tmp_path):
    model = models("qwen3moe", "f32")
    logs = tmp_path / "logs" / "run-1"  # created by up, parents too
    proc = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model), "--workers", "2",
                           "--logs", str(logs), "--prompt", "The swarm", "-n", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    named = next(line for line in proc.stdout.splitlines() if line.startswith("logs (kept): "))
    for node, name in (("market", "market.log"), ("worker-0", "worker-0.log"), ("worker-1", "worker-1.log")):
        path = logs / name
        assert path.is_file() and path.stat().st_size > 0, name
        assert str(path) in named, (name, named)
        if node != "market":
            assert f"{node} {path}" in named  # each worker's log beside its name
            assert node in path.read_text()  # its own lines, not another's
    assert "market_started" in (logs / "market.log").read_text()
    assert f"(ledger {logs / 'market.db'})" in proc.stdout  # kept there too, not "temporary"
    assert sorted(p.name for p in logs.iterdir()) == ["market.db", "market.log", "worker-0.log", "worker-1.log"]

    # stderr is a pipe here, not a terminal: the start-up says how far it got.
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    ready = [x for x in lines if x["event"] == "up_workers_ready"]
    assert ready and ready[-1]["done"] == ready[-1]["total"] == 2 and ready[-1]["unit"] == "workers"
    assert any(x["event"] == "up_starting" and x["logs"] == str(logs) for x in lines)
