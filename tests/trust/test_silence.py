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


def test_a_subscriber_that_never_answers_costs_one_layer_step_of_timeouts(model, prompt, monolithic, nats_server):
    stranger = Stranger(model, nats_server.url).subscribe()
    try:
        tokens, logits, stats = sharded(model, nats_server.url, prompt, AuditConfig())
    finally:
        stranger.close()
    assert tokens == monolithic()[0] and np.array_equal(logits, monolithic()[1])
    t = stats["totals"]
    assert 0 < t["timeouts"] <= Engine(model).cfg.n_expert  # the first layer step only
    assert t["silent"] == t["calls"] - t["timeouts"]  # every other call computed here at once
    assert stranger.seen >= t["calls"]  # and still probed


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
