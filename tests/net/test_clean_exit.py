"""SIGTERM ends a worker and a market with status 0 whether or not the bus is reachable."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from kvasir_bus.server import EmbeddedNats

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=2)


def _wait_for_text(path, text, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text()[-2000:]
        time.sleep(0.05)  # polling a log file, not guessing readiness
    raise AssertionError(f"{text!r} never appeared in {path}")


def _term(proc, log):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert "Traceback" not in text and "internal error" not in text, text[-2000:]


def test_a_worker_exits_0_on_sigterm_after_the_bus_went_away(model, tmp_path):
    from kernels.tensors import open_gguf
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import spawn_worker, wait_for_nodes

    server = EmbeddedNats().start()
    log_path = tmp_path / "w.log"
    w = spawn_worker(server.url, "w-gone", ["--model", str(model), "--layer", "0", "--experts", "0-1"],
                     heartbeat_s=0.3, log_file=open(log_path, "w"))
    try:
        asyncio.run(wait_for_nodes(server.url, model_fingerprint(open_gguf(model)), {"w-gone"}, procs=[w]))
        server.stop()
        _wait_for_text(log_path, "reconnecting", w.proc)
        _term(w.proc, log_path)
    finally:
        w.stop()
        server.stop()


def test_a_worker_that_never_reached_the_bus_exits_0_on_sigterm(model, tmp_path):
    from launch.swarm import spawn_worker

    log_path = tmp_path / "w.log"
    w = spawn_worker("nats://127.0.0.1:1", "w-none", ["--model", str(model), "--layer", "0", "--experts", "0"],
                     log_file=open(log_path, "w"), extra=["--log-level", "debug"])
    try:
        _wait_for_text(log_path, "nats connect attempt failed", w.proc)
        _term(w.proc, log_path)
    finally:
        w.stop()


def test_a_market_exits_0_on_sigterm_after_the_bus_went_away(tmp_path):
    server = EmbeddedNats().start()
    log_path = tmp_path / "m.log"
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "market", "--nats", server.url,
                             "--db", str(tmp_path / "l.db"), "--log-level", "debug"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for_text(log_path, "market_started", proc)
        server.stop()
        _wait_for_text(log_path, "reconnecting", proc)
        _term(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()


def _serve(model, url, log_path):
    return subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "serve", "--model", str(model),
                             "--nats", url], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def test_kvasir_serve_exits_0_on_sigterm_after_the_bus_went_away(model, tmp_path):
    server = EmbeddedNats().start()
    log_path = tmp_path / "serve.log"
    proc = _serve(model, server.url, log_path)
    try:
        _wait_for_text(log_path, "backbone serving model", proc)
        server.stop()
        _wait_for_text(log_path, "reconnecting", proc)
        _term(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()


def test_kvasir_serve_exits_0_on_sigterm_while_the_bus_is_unreachable(model, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = _serve(model, "nats://127.0.0.1:1", log_path)
    try:
        _wait_for_text(log_path, "backbone_connecting", proc)
        _term(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
