"""A server whose permissions predate bundles (no ``kvasir.*.n.<node>`` for a worker) refuses
the worker's bundle subject: the worker notices, serves one request per expert, says so in its
heartbeat and in one warning that names the fix; `kvasir creds refresh` writes that fix."""

from __future__ import annotations

import structlog
import pytest

from kvasir_bus import creds
from kvasir_bus.cli import main
from kvasir_bus.connect import ConnectOptions, connect
from kvasir_bus.server import EmbeddedNats
from workers.runtime import Worker, WorkerConfig
from tests.workers.test_worker import model, slice_info  # noqa: F401 (fixtures)

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

NODE_RIGHT = '"kvasir.*.n.w1", '


def _stale(deployment) -> None:
    """accounts.conf as a version before bundles wrote it: w1 may not hear kvasir.*.n.w1."""
    path = deployment / "accounts.conf"
    text = path.read_text()
    assert NODE_RIGHT in text
    path.write_text(text.replace(NODE_RIGHT, ""))


def _serve_once(deployment, info, arun) -> tuple[Worker, dict]:
    server = EmbeddedNats(config=deployment / "nats.conf", port=None, host=None)
    server.start()
    try:
        async def go():
            nc = await connect(server.url, "w1", options=ConnectOptions(creds=str(deployment / "w1.creds")))
            worker = Worker(info, WorkerConfig(node="w1", heartbeat_s=60))
            await worker.start(nc)
            # start() looks for a refusal a few round trips; the server may send it later still,
            # so keep asking (as every heartbeat does), a bounded number of round trips.
            for _ in range(100):
                if not worker.takes_bundles or await worker.check_bundle_subject():
                    break
                await nc.flush()
            beat = worker.heartbeat()
            await worker.stop()
            await nc.drain()
            return worker, beat

        return arun(go())
    finally:
        server.stop()


def test_a_refused_bundle_subject_turns_bundles_off_and_refresh_turns_them_back_on(
        deployment, arun, slice_info, capsys):  # noqa: F811
    _stale(deployment)
    with structlog.testing.capture_logs() as logs:
        worker, beat = _serve_once(deployment, slice_info, arun)
    assert not worker.takes_bundles and not beat.bundles
    refused = [e for e in logs if e["event"] == "bundles_refused"]
    assert len(refused) == 1 and "kvasir creds refresh" in refused[0]["hint"]
    assert refused[0]["subject"].endswith(".n.w1")

    assert main(["creds", "refresh", str(deployment)]) == 0
    assert NODE_RIGHT in (deployment / "accounts.conf").read_text()
    assert "rewrote" in capsys.readouterr().out
    worker, beat = _serve_once(deployment, slice_info, arun)
    assert worker.takes_bundles and beat.bundles


def test_refresh_keeps_every_identity_and_key(deployment):
    before = creds.load(deployment)
    creds.refresh(deployment)
    assert creds.load(deployment) == before
