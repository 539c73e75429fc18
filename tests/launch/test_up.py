"""`kvasir up` (what `make demo` runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def test_up_runs_the_swarm_and_checks_it_against_the_monolithic_run(tmp_path):
    from synth.model import synth_model

    model = synth_model(tmp_path / "m.gguf", arch="qwen2moe", preset="tiny", qtype="q8_0", seed=9)
    db = tmp_path / "ledger.db"
    proc = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "up", "--model", str(model), "--workers", "3",
                           "--prompt", "The swarm splits a model into experts", "-n", "8", "--check", "--json",
                           "--db", str(db), "--timeout-ms", "20000"],  # every call waits for the workers
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["check"]["bit_identical"] and result["check"]["tokens_equal"]
    assert result["check"]["max_abs_diff"] == 0.0
    assert result["random_weights"] is True  # a kvasir synth model: the report says its text is noise
    assert set(result["workers"]) == {"worker-0", "worker-1", "worker-2"}
    assert sum(w["calls"] for w in result["workers"].values()) == result["dispatch"]["calls"] > 0
    paid = {n["node"]: n["rows"] for n in result["rewards"]["nodes"]}
    # Empty totals happened in 2 of many CI runs: the log's tail says whether the market refused
    # the events, held them, or was not asked in time.
    assert paid == {name: w["rows"] for name, w in result["workers"].items()}, (result["rewards"], proc.stderr[-3000:])
    assert db.exists()


def test_up_starts_its_nats_server_on_one_go_thread(models, monkeypatch, capsys):
    """The embedded server shares the machine with the backbone and the workers: one Go thread
    (EmbeddedNats(procs=...): tests/kvasir_bus/test_server.py checks it reaches the server)."""
    import kvasir_bus.server as server
    from kvasir_bus.cli import main
    from kvasir_bus.errors import UsageError

    asked = []

    class Recording(server.EmbeddedNats):
        def __init__(self, **kw):
            asked.append(kw.get("procs"))
            raise UsageError("stopped here by the test")

    monkeypatch.setattr(server, "EmbeddedNats", Recording)
    monkeypatch.delenv("NATS_URL", raising=False)
    model = models("qwen2moe", "q8_0")
    for extra in ([], ["--secure"]):
        assert main(["up", "--model", str(model), "--workers", "0", "--no-market", *extra]) == 2
        assert "stopped here by the test" in capsys.readouterr().err
    assert asked == [server.SHARED_MACHINE_PROCS] * 2 == [1, 1]


def test_up_says_before_the_text_that_random_weights_make_it_noise(capsys):
    """`make demo` prints random-weight text: the line before it says so and what the run shows."""
    from launch.up import _print_report

    result = {"text": "koeightedrn bani", "tokens": [1, 2, 3], "decode_tokens_per_s": 10.0,
              "workers": {"worker-0": {"experts": "0-7", "calls": 4, "rows": 6}},
              "dispatch": {"local": 0, "rows_local": 0, "no_responders": 0, "timeouts": 0, "invalid": 0},
              "rewards": {"nodes": [{"node": "worker-0", "rows": 6, "reward": 6.0}]},
              "check": {"tokens_equal": True, "positions": 5, "max_abs_diff": 0.0, "bit_identical": True},
              "random_weights": True}
    _print_report(result, 2)
    lines = capsys.readouterr().out.splitlines()
    note = lines.index(next(line for line in lines if line.startswith("random weights")))
    assert lines[note + 1] == "koeightedrn bani"
    assert "noise" in lines[note] and "bit-identical" in lines[note] and "ledger paid" in lines[note]
    _print_report({**result, "random_weights": False}, 2)
    assert "random weights" not in capsys.readouterr().out
