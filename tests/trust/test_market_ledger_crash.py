"""A backbone killed with SIGKILL mid-generation and a market restarted: the ledger afterwards
holds exactly the events the backbone's own spool says won (issue 8's acceptance).

A real ``kvasir generate --nats`` with two worker processes and a market on a nats-server with
JetStream. Once wins show in its spool, the ledger stream is made to refuse new messages for a
while (full, discard new: as a stream on a full disk would), so that when the backbone is
SIGKILLed mid-generation some of its wins are certainly not stored: without the spool those
would be lost. The stream is then given its room back, the market restarted, and
``kvasir ledger replay`` flushes the dead backbone's spool. The ledger must then hold every win
the spool recorded (same ids, nodes, layers, experts and rows), none twice and nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys

import nats.js.errors
import pytest

from backbone import spool
from backbone.manifest import build_manifest, serve_manifest
from backbone.model import Engine
from kvasir_bus import ledger_stream
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from launch.swarm import spawn_worker, wait_for_nodes
from market.service import Market, MarketConfig
from tests.market.fakes import wait_for

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")


def config(db, fp):
    return MarketConfig(db_path=str(db), expiry_s=2.0, range_experts=4, warmup_s=0, models=(fp,),
                        manifest_retry_s=0.05, manifest_retry_max_s=0.2)


def ledger_rows(db) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return sorted(con.execute("SELECT event_id, node, layer, expert, rows FROM events"))


def test_sigkill_mid_generation_and_a_market_restart_lose_no_won_event(nats_server, models, arun, tmp_path):
    model = models("qwen2moe", "q4_k")
    engine = Engine(model)
    fp = model_fingerprint(engine.reader)
    n = engine.n_ctx - 40  # long enough to be killed mid-way
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1"}
    spool_dir, db = tmp_path / "spool", tmp_path / "m.db"
    workers = [spawn_worker(nats_server.url, node, ["--model", str(model), "--layer", "all", "--experts", experts],
                            heartbeat_s=0.5, log_file=open(tmp_path / f"{node}.log", "w"))
               for node, experts in (("w0", "0-3"), ("w1", "4-7"))]
    proc = None

    async def go():
        nonlocal proc
        await wait_for_nodes(nats_server.url, fp, {"w0", "w1"}, procs=workers)
        manifest_nc = await connect(nats_server.url, name="manifest")   # `generate` serves none
        await serve_manifest(manifest_nc, build_manifest(model))
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(db, fp)).start()
        js = nc.jetstream()
        with open(tmp_path / "generate.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvasir_bus.cli", "generate", "--model", str(model), "--prompt", "hello swarm",
                 "-n", str(n), "--no-stop", "--json", "--nats", nats_server.url, "--spool", str(spool_dir)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        wins = lambda: len(spool.read(spool_dir).wins) if (spool_dir / spool.FILE).exists() else 0  # noqa: E731
        try:
            await wait_for(lambda: wins() >= 20, timeout=90, interval=0.05, what="wins in the spool")

            async def stored() -> bool:
                try:
                    return (await js.stream_info(ledger_stream.STREAM)).state.messages > 0
                except nats.js.errors.NotFoundError:
                    return False
            await wait_for(stored, timeout=30, what="the backbone's first messages in the stream")
            # The generation is paused while the market reads them and the stream is made full:
            # how long that takes on a loaded machine (6 s of an 18 s generation, once, beside
            # three busy loops) is then no race against the generation's end.
            os.kill(proc.pid, signal.SIGSTOP)
            await wait_for(lambda: market.stream_applied > 0, timeout=30, what="the market reading")
            info = await js.stream_info(ledger_stream.STREAM)
            full = dataclasses.replace(info.config, max_msgs=info.state.messages,
                                       discard=ledger_stream.stream_config().discard.__class__("new"))
            await js.update_stream(full)                       # the stream refuses for a while
            seen = wins()
            os.kill(proc.pid, signal.SIGCONT)
            await wait_for(lambda: wins() >= seen + 20, timeout=60, interval=0.05, what="more wins")
            assert proc.poll() is None, "generation ended before the kill: not mid-generation"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            won = spool.read(spool_dir)
            assert won.events > 0  # wins the stream never stored: the spool's reason to be
            await js.update_stream(ledger_stream.stream_config())   # room again
            await market.stop()                                      # the market restarts
            await nc.close()
            nc = await connect(nats_server.url, name="market-2")
            market = await Market(nc, config(db, fp)).start()
            done = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "kvasir_bus.cli", "ledger", "replay", "--spool", str(spool_dir),
                "--nats", nats_server.url, "--json"], capture_output=True, text=True, timeout=120, env=env)
            assert done.returncode == 0, done.stderr
            replay = json.loads(done.stdout)
            assert replay["replayed"] == won.events and replay["unsent"] == 0
            js = nc.jetstream()

            async def drained():
                got = await js.consumer_info(ledger_stream.STREAM, ledger_stream.CONSUMER)
                return got.num_pending == 0 and got.num_ack_pending == 0

            await wait_for(drained, timeout=30, what="the market to read the whole stream")
            expected = sorted((e.event_id, e.node, e.layer, e.expert, e.rows) for e in won.wins)
            assert len({e[0] for e in expected}) == len(expected) > 40
            rows = ledger_rows(db)                        # same ids, same rows, none twice, none missing
            missing, extra = sorted(set(expected) - set(rows)), sorted(set(rows) - set(expected))
            assert rows == expected, (f"{len(missing)} of {len(expected)} wins missing (first: {missing[:4]}), "
                                      f"{len(extra)} rows extra (first: {extra[:4]}), replay: {replay}")
            st = await market.status(fp)
            assert sum(t.events for t in st.totals) == len(expected)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            await market.stop()
            await nc.close()
            await manifest_nc.close()

    try:
        arun(go(), timeout=240)
    finally:
        for w in workers:
            w.stop()
