"""Strangers that subscribe and never answer, or heartbeat nonsense, while the backbone generates."""

from __future__ import annotations

import time

import numpy as np
import pytest

from backbone.model import Engine
from kvasir_bus import codec
from kvasir_bus.codec import Holding
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects
from tests.trust.test_liars import N_DECODE, model, monolithic, prompt, sharded  # noqa: F401 (fixtures)
from backbone.audit import AuditConfig

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")


class Stranger:
    """Subscribes to every dispatch subject of the model and never answers; can heartbeat."""

    def __init__(self, model_path, url: str):
        self.model = model_fingerprint(Engine(model_path).reader)
        self.bus = LoopThread("stranger")
        self.nc = self.bus.run(connect(url, name="kvasir-test-stranger"))
        self.seen = 0

    async def _swallow(self, msg) -> None:
        self.seen += 1

    def subscribe(self) -> "Stranger":
        async def go():
            await self.nc.subscribe(Subjects(self.model).dispatch_all(), cb=self._swallow)
            await self.nc.flush()
        self.bus.run(go())
        return self

    def heartbeat(self, node: str, holdings) -> None:
        hb = codec.Heartbeat(model=self.model, node=node, holdings=holdings, budget_bytes=0, load=0.0, served=0,
                             version="0", kernel="x", sent_at=time.time())

        async def go():
            await self.nc.publish(Subjects(self.model).coverage(node), hb.encode())
            await self.nc.flush()
        self.bus.run(go())

    def close(self) -> None:
        self.bus.run(self.nc.close())
        self.bus.stop()


def test_a_subscriber_that_never_answers_costs_no_timeout(model, prompt, monolithic, nats_server):
    """Before anything on the bus ever answered, the backbone computes each step's calls while they
    are out and does not wait for them once that is done: not one timeout, whatever the step."""
    stranger = Stranger(model, nats_server.url).subscribe()
    try:
        tokens, logits, stats = sharded(model, nats_server.url, prompt, AuditConfig())
    finally:
        stranger.close()
    assert tokens == monolithic()[0] and np.array_equal(logits, monolithic()[1])
    t = stats["totals"]
    assert t["timeouts"] == 0 and t["remote"] == 0
    assert t["unanswered"] == t["calls"] > 0  # every call computed here, none waited for
    assert stranger.seen >= t["calls"]  # and every one still asked


def test_before_any_answer_an_honest_workers_first_reply_makes_the_next_steps_wait(model, prompt, monolithic,
                                                                                   nats_server, tmp_path):
    """A fresh backbone beside a real worker: the first steps may be computed here (the local
    result came first), then the worker's first reply, late or in time, makes it wait again."""
    import asyncio

    from backbone.dispatch import DispatchConfig
    from backbone.generate import generate
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.fingerprint import model_fingerprint
    from launch.swarm import spawn_worker, wait_for_nodes
    from tests.polling import until

    worker = spawn_worker(nats_server.url, "w", ["--model", str(model), "--layer", "all", "--experts", "0-7"],
                          log_file=open(tmp_path / "w.log", "w"))
    try:
        asyncio.run(wait_for_nodes(nats_server.url, model_fingerprint(Engine(model).reader), {"w"}, procs=[worker]))
        engine = Engine(model)
        cfg = BackboneConfig(model_path=str(model), nats_url=nats_server.url, market=False, serve_manifest=False,
                             dispatch=DispatchConfig(audit=AuditConfig(), bundles=False))
        with BackboneService(engine, cfg) as backbone:
            runs = []
            for _ in range(2):
                gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
                runs.append((gen.tokens, gen.logits_array(), backbone.stats.to_dict()["totals"]))
                asyncio.run(until(lambda: backbone.dispatch.coverage.answered, "the worker's first reply", 30))
    finally:
        worker.stop()
    for tokens, logits, _ in runs:
        assert tokens == monolithic()[0] and np.array_equal(logits, monolithic()[1])
    first, second = runs[0][2], runs[1][2]
    assert second["unanswered"] == first["unanswered"]  # once anything answered, every step waits
    assert second["remote"] > first["remote"]  # the worker served the second one


def test_heartbeat_bombs_change_nothing(model, prompt, monolithic, nats_server):
    stranger = Stranger(model, nats_server.url)
    try:
        stranger.heartbeat("bomb", (Holding(0, 0, 999_999_999), Holding(1, 0, 999_999_999)))  # 132-byte style
        stranger.heartbeat("wide", tuple(Holding(layer, 0, 999_999_999) for layer in range(500)))  # ~8 KB
        tokens, logits, stats = sharded(model, nats_server.url, prompt, AuditConfig())
        stranger.heartbeat("bomb", (Holding(0, 0, 999_999_999),))
    finally:
        stranger.close()
    assert tokens == monolithic()[0] and np.array_equal(logits, monolithic()[1])
