"""Liars on the bus, written from the wire contract alone, against the backbone's audits.

A liar subscribes to every dispatch subject of the model (a plain subscription: it races the
honest replicas), computes the honest answer from its own copy of the weights, then lies as told
and answers first. It announces the backbone's own kernel, so an audit demands identical bits.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from backbone.audit import AuditConfig
from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kernels.backend import kernel_label
from kernels.expert import expert_ffn
from kvasir_bus import codec, market_codec
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects, parse_dispatch
from launch.swarm import spawn_worker, wait_for_nodes
from tests.polling import until

pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")

N_PROMPT, N_DECODE = 36, 16


def noise(out, layer, n):
    return np.random.default_rng(n).standard_normal(out.shape).astype(np.float32)


def zeros(out, layer, n):
    return np.zeros_like(out)


def scaled(out, layer, n):
    return (out * np.float32(1 + 1e-3)).astype(np.float32)


def one_layer(out, layer, n):
    return noise(out, layer, n) if layer == 1 else out


def after_100(out, layer, n):
    return noise(out, layer, n) if n >= 100 else out


LIES = {"noise": noise, "zeros": zeros, "scaled": scaled, "one-layer": one_layer, "after-100": after_100}


class Liar:
    """Answers every expert of the model with ``lie(honest, layer, n)`` (n: replies sent so far);
    counts the lies it told before it heard its own quarantine announced."""

    def __init__(self, model_path, url: str, lie, node: str = "liar"):
        self.engine, self.url, self.lie, self.node = Engine(model_path), url, lie, node
        self.model = model_fingerprint(self.engine.reader)
        self.sent = 0
        self.replies: list[tuple[float, bool, int]] = []  # (when sent, whether it lied, layer)
        self.caught_at: float | None = None  # the backbone's decision time (Quarantine.at)
        self.caught_layer: int | None = None
        self.quarantined = threading.Event()
        self.bus = LoopThread("liar")

    def __enter__(self) -> "Liar":
        self.nc = self.bus.run(connect(self.url, name=f"kvasir-test-{self.node}"))
        self.bus.run(self._listen())
        return self

    def __exit__(self, *exc) -> None:
        self.bus.run(self.nc.close())
        self.bus.stop()

    async def _listen(self) -> None:
        subjects = Subjects(self.model)
        await self.nc.subscribe(subjects.dispatch_all(), cb=self._answer)
        await self.nc.subscribe(subjects.quarantine(), cb=self._heard)
        await self.nc.flush()

    async def _heard(self, msg) -> None:
        event = market_codec.decode_quarantine(msg.data)
        if event.node == self.node:
            self.caught_at, self.caught_layer = event.at, event.layer
            self.quarantined.set()

    async def _answer(self, msg) -> None:
        req = codec.decode_request(msg.data)
        layer = parse_dispatch(msg.subject).layer
        honest = expert_ffn(*self.engine.weights.expert(layer, req.expert), req.rows, routed=True)
        out = self.lie(honest, layer, self.sent)
        self.replies.append((time.time(), not np.array_equal(out, honest), layer))
        self.sent += 1
        reply = codec.DispatchReply(request_id=req.request_id, node=self.node, rows=out, kernel=kernel_label())
        await self.nc.publish(msg.reply, reply.encode())


@pytest.fixture(scope="module")
def model(models):
    return models("qwen3moe", "q4_k")


@pytest.fixture(scope="module")
def prompt(model):
    return np.random.default_rng(3).integers(0, Engine(model).cfg.n_vocab, N_PROMPT).tolist()


def n_decode(lie: str) -> int:
    """Long enough for the liar that waits for 100 honest replies to start lying (~4 per step)."""
    return 64 if lie == "after-100" else N_DECODE


@pytest.fixture(scope="module")
def monolithic(model, prompt):
    cache = {}

    def run(n: int = N_DECODE):
        if n not in cache:
            gen = generate(Engine(model), prompt, n, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
            cache[n] = gen.tokens, gen.logits_array()
        return cache[n]

    return run


class UsedReplies:
    """The dispatch's recorder: every reply it used (accepted unaudited, or audited and passed),
    by node, with the layer and when it was taken. A caught node's replies in its catching step
    are recomputed, never recorded: what is recorded for a liar after its first lie is what its
    lies changed."""

    def __init__(self):
        self.wins: list[tuple[str, int, float]] = []  # (node, layer, taken at)

    def record_win(self, node, layer, expert, rows, latency_s=None, at=None):
        self.wins.append((node, layer, at if at is not None else time.time()))

    def record_call(self, layer, expert, rows, remote):
        pass

    def void(self, node, since=0.0):
        pass

    def record_audit(self, node, passed):
        pass

    def used_since(self, node: str, first: dict[int, float], layer: int | None = None) -> int:
        """Replies of ``node`` used at or after its first lie on their layer (``first``)."""
        return sum(1 for who, where, at in self.wins
                   if who == node and where in first and at >= first[where] and layer in (None, where))


def sharded(model, url, prompt, audit: AuditConfig, n: int = N_DECODE, used: UsedReplies | None = None,
            wait_nodes: frozenset = frozenset()):
    """``wait_nodes``: generate once this backbone has heard their heartbeats (a worker's holdings
    reach a fresh backbone with its next heartbeat: before that every call is computed here)."""
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(audit=audit))
    with BackboneService(engine, cfg) as backbone:
        if wait_nodes:
            asyncio.run(until(lambda: wait_nodes <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                              f"the backbone hears {sorted(wait_nodes)}'s heartbeats", 20))
        if used is not None:
            backbone.dispatch.recorder = used
        gen = generate(engine, prompt, n, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        return gen.tokens, gen.logits_array(), backbone.stats.to_dict()


@pytest.mark.parametrize("lie", sorted(LIES))
def test_with_every_reply_audited_a_liar_changes_nothing_and_is_quarantined(lie, model, prompt, monolithic,
                                                                             nats_server):
    with Liar(model, nats_server.url, LIES[lie]) as liar:
        tokens, logits, stats = sharded(model, nats_server.url, prompt, AuditConfig(rate=1.0), n_decode(lie))
    assert tokens == monolithic(n_decode(lie))[0]
    assert np.array_equal(logits, monolithic(n_decode(lie))[1])
    assert stats["quarantined"] == ["liar"]
    assert stats["audit_failures"] >= 1 and liar.sent > 0


@pytest.mark.parametrize("lie", sorted(LIES))
def test_with_the_default_audit_each_liar_is_quarantined_within_the_stated_bound(lie, model, prompt, nats_server):
    cfg = AuditConfig()  # rate 0.1: one audit in every 10 replies of a node on a layer
    used = UsedReplies()
    with Liar(model, nats_server.url, LIES[lie]) as liar:
        _, _, stats = sharded(model, nats_server.url, prompt, cfg, n_decode(lie), used)
        assert liar.quarantined.wait(10), f"{lie}: never quarantined ({liar.sent} replies)"
    assert stats["quarantined"] == ["liar"]
    # docs/trust.md: at most 2 x ceil(1/R) - 2 of its lying replies on a layer are used before it
    # is caught (the catching step's are all recomputed), on each layer it lies on. Counted on the
    # backbone's side (what it used), not the liar's (what it sent: on a loaded machine lies that
    # came after their timeout, or in the catching step, were sent but never used).
    first: dict[int, float] = {}
    for at, lied, layer in liar.replies:
        if lied and layer not in first:
            first[layer] = at
    layers = Engine(model).cfg.n_layer
    assert used.used_since("liar", first, liar.caught_layer) <= cfg.max_replies_used, used.wins
    assert used.used_since("liar", first) <= layers * cfg.max_replies_used


def test_an_honest_worker_on_the_numpy_kernel_is_never_quarantined(model, prompt, monolithic, nats_server,
                                                                    tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_KERNEL", "numpy")
    log = open(tmp_path / "numpy-worker.log", "w")
    worker = spawn_worker(nats_server.url, "numpy-w", ["--model", str(model), "--layer", "all", "--experts", "0-7"],
                          log_file=log)
    monkeypatch.delenv("KVASIR_KERNEL")
    try:
        fp = model_fingerprint(Engine(model).reader)
        asyncio.run(wait_for_nodes(nats_server.url, fp, {"numpy-w"}, procs=[worker]))
        tokens, logits, stats = sharded(model, nats_server.url, prompt, AuditConfig(rate=1.0),
                                        wait_nodes=frozenset({"numpy-w"}))
    finally:
        worker.stop()
    assert stats["quarantined"] == [] and stats["audit_failures"] == 0
    assert stats["audits"] == stats["totals"]["remote"] > 0
    assert tokens == monolithic()[0] and np.array_equal(logits, monolithic()[1])
