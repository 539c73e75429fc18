"""Replica modes: race (every replica computes) and balance (a queue group: one computes,
hedged when a member does not answer)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.replicas import BALANCE_QUEUE, LatencyBook, ReplicaConfig, Replicas
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kvasir_bus.connect import connect
from kvasir_bus.errors import UsageError
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from launch.swarm import spawn_worker, wait_for_nodes

PROMPT, N = [7, 1, 8, 2, 8, 1, 8], 8


def test_worker_and_backbone_name_the_same_queue_group():
    from workers.cli import BALANCE_QUEUE as worker_side

    assert worker_side == BALANCE_QUEUE


def test_replica_mode_is_checked():
    with pytest.raises(UsageError, match="--replicas must be one of race, balance"):
        ReplicaConfig(mode="broadcast")


def test_the_hedge_delay_is_the_experts_p95_within_bounds():
    book = LatencyBook()
    balance = Replicas(ReplicaConfig(mode="balance", hedge_floor_s=0.01, hedge_ceiling_s=0.2), book)
    assert Replicas(ReplicaConfig(mode="race"), book).hedge_delay(0, 1) is None  # race never hedges
    assert balance.hedge_delay(0, 1) == 0.1  # nothing on record: the initial guess
    for _ in range(60):
        book.observe(0, 1, 0.020)
    for ms in (100, 120, 140, 160):  # a tail: the p95 is past twice the median
        book.observe(0, 1, ms / 1000)
    assert balance.hedge_delay(0, 1) == pytest.approx(np.percentile([20] * 60 + [100, 120, 140, 160], 95) / 1000)
    for ms in range(1, 101):
        book.observe(0, 4, ms / 1000)
    assert balance.hedge_delay(0, 4) == pytest.approx(2 * np.median(np.arange(37, 101)) / 1000)  # last 64, wide
    book.observe(0, 2, 0.001)
    assert balance.hedge_delay(0, 2) == 0.01  # the floor
    for _ in range(64):
        book.observe(0, 3, 5.0)
    assert balance.hedge_delay(0, 3) == 0.2  # the ceiling


@pytest.fixture
def in_process_workers(nats_server, models, tmp_path):
    """Two in-process replicas of every expert, in ``mode``."""
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen2moe", "q4_k")
    out = write_slice(plan_slice(path, [(parse_span("all", "--layer"), parse_span("all", "--experts"))]),
                      tmp_path / "all.gguf").path
    bus = LoopThread("replicas")
    nc = bus.run(connect(nats_server.url, "replicas"))
    workers = []

    def start(mode: str):
        for i in range(2):
            w = Worker(load_slice(out), WorkerConfig(node=f"r{i}", heartbeat_s=60,
                                                     queue_group=BALANCE_QUEUE if mode == "balance" else None))
            bus.run(w.start(nc))
            workers.append(w)
        return path, workers

    yield start
    for w in workers:
        bus.run(w.stop())
    bus.run(nc.close())
    bus.stop()


def served_settles(workers, expected: int) -> int:
    """The workers' served count once the losers of a race have answered too (bounded wait)."""
    deadline = time.monotonic() + 30
    while sum(w.served for w in workers) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return sum(w.served for w in workers)


@pytest.mark.parametrize("mode", ["balance", "race"])
def test_balance_computes_each_request_once_and_race_on_every_replica(nats_server, in_process_workers, mode):
    path, workers = in_process_workers(mode)
    alone = generate(Engine(path), PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    engine = Engine(path)
    # hedges only after a second: a loaded test machine's jitter must not send a request twice
    replicas = ReplicaConfig(mode=mode, hedge_floor_s=1.0, hedge_ceiling_s=1.0)
    cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(timeout_s=10.0), replicas=replicas)
    with BackboneService(engine, cfg) as service:
        gen = generate(engine, PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        stats, hedges = service.stats.to_dict(), service.replicas.hedges
    assert gen.tokens == alone.tokens and np.array_equal(gen.logits_array(), alone.logits_array())
    remote = stats["totals"]["remote"]
    assert remote > 0 and stats["totals"]["local"] == 0 and hedges == 0
    copies = 1 if mode == "balance" else 2
    assert served_settles(workers, copies * remote) == copies * remote
    if mode == "balance":  # the queue group spreads the requests over both members
        assert all(w.served > 0 for w in workers)


def test_a_frozen_member_in_balance_mode_is_hedged_and_the_stream_continues(nats_server, models, tmp_path):
    path = models("qwen2moe", "q4_k")
    procs = [spawn_worker(nats_server.url, f"b{i}", ["--model", str(path), "--layer", "all", "--experts", "0-7"],
                          heartbeat_s=0.5, extra=["--replicas", "balance"],
                          log_file=open(tmp_path / f"b{i}.log", "w")) for i in range(2)]
    try:
        asyncio.run(wait_for_nodes(nats_server.url, model_fingerprint(Engine(path).reader), {"b0", "b1"},
                                   procs=procs))
        alone = generate(Engine(path), PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False)
        engine = Engine(path)
        cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False, serve_manifest=False,
                             dispatch=DispatchConfig(timeout_s=2.0, bundles=False),  # the queue group's hedging
                             replicas=ReplicaConfig(mode="balance"))
        frozen_at = {}

        def freeze(_token):
            if len(frozen_at) == 0 and service.stats.totals().remote > 0:
                os.kill(procs[0].proc.pid, signal.SIGSTOP)
                frozen_at["remote"] = service.stats.totals().remote

        with BackboneService(engine, cfg) as service:
            gen = generate(engine, PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False, on_token=freeze)
            stats, hedges = service.stats.to_dict(), service.replicas.to_dict()
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.proc.pid, signal.SIGCONT)
                p.stop()
    assert gen.tokens == alone.tokens and len(gen.tokens) == N
    assert frozen_at, "the member was never frozen"
    assert hedges["hedges"] > 0  # requests that went to the frozen member were sent again
    # and most were answered by the other member rather than left to time out
    assert stats["per_node"]["b1"]["calls"] > stats["totals"]["timeouts"]


def test_the_flags_reach_the_backbone_config():
    import argparse

    from backbone.cli import add_bus_flags

    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_bus_flags(p)
    cfg = BackboneConfig.from_args(p.parse_args(["--model", "m.gguf", "--replicas", "balance", "--hot", "auto"]))
    assert (cfg.replicas.mode, cfg.hot.mode) == ("balance", "auto")
    cfg = BackboneConfig.from_args(p.parse_args(["--model", "m.gguf"]))
    assert (cfg.replicas.mode, cfg.hot.mode) == ("race", "off")
