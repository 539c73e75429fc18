"""A crowd of fake nodes costs the backbone bounded memory and bounded messages: 2,000 strangers
that announce every expert of a 48-layer, 256-expert model (and bundles) and never answer."""

from __future__ import annotations

import tracemalloc

import numpy as np

from backbone.audit import AuditConfig
from backbone.coverage_view import CoverageView
from backbone.dispatch import MAX_UNPROVEN_BUNDLE_NODES, DispatchConfig, RemoteExperts
from kvasir_bus import codec
from kvasir_bus.codec import Holding
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.subjects import Subjects
from tests.backbone.test_dispatch import MODEL, ROW, Clock, DoublingLocal, FakeNats, Recorder

SYBILS, LAYERS, EXPERTS = 2000, 48, 256
MEMORY_BOUND = 20 << 20  # what the issue allows 2,000 fake nodes to cost the backbone


def test_two_thousand_silent_sybils_cost_under_20_mb_and_two_bundles_a_step():
    bus = LoopThread("test-sybils")
    try:
        cfg = DispatchConfig(timeout_s=0.05, audit=AuditConfig(rate=0.1))
        nc, local, recorder, clock = FakeNats(), DoublingLocal(), Recorder(), Clock()
        remote = RemoteExperts(bus, nc, MODEL, local, 4, cfg, coverage=CoverageView(cfg.uncovered_ttl_s, clock),
                               recorder=recorder)
        bus.run(remote.start())
        nc.answer_bundle = lambda node, b: []  # subscribed, never answers
        holdings = tuple(Holding(layer, 0, EXPERTS) for layer in range(LAYERS))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(SYBILS):
            hb = codec.Heartbeat(model=MODEL, node=f"sybil-{i:04d}", holdings=holdings, budget_bytes=0, load=0.0,
                                 served=0, version="0.1.0", kernel="fake", sent_at=0.0, bundles=True)
            bus.run(nc.deliver(Subjects(MODEL).coverage(f"sybil-{i:04d}"), hb.encode()))
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        print(f"{SYBILS} sybils hold {held / 2**20:.2f} MiB")
        assert held < MEMORY_BOUND, f"{SYBILS} sybils hold {held / 2**20:.1f} MiB"
        for step in range(3):  # each step: at most two unproven nodes get a bundle; the answers are exact
            sent = len(nc.bundles)
            outs = remote.run_layer(step, [(e, ROW) for e in range(8)])
            assert all(np.array_equal(o, 2 * ROW) for o in outs)
            bus.run(nc.flush())
            assert len(nc.bundles) - sent <= MAX_UNPROVEN_BUNDLE_NODES
    finally:
        bus.stop()


def test_among_two_thousand_strangers_an_expert_names_the_proven_nodes_and_two_in_turn():
    """The holders of an expert are looked up among the proven nodes and the two unproven ones in
    turn, never among every stranger (a step's cost does not grow with the crowd), and a node
    that passed its probation is named from then on."""
    clock = Clock()
    view = CoverageView(1.0, clock, n_layer=LAYERS, n_expert=EXPERTS)
    view.track_nodes = True
    view.limit_unproven(MAX_UNPROVEN_BUNDLE_NODES)
    holdings = tuple(Holding(layer, 0, EXPERTS) for layer in range(LAYERS))
    for i in range(SYBILS):
        view.heard(codec.Heartbeat(model=MODEL, node=f"sybil-{i:04d}", holdings=holdings, budget_bytes=0, load=0.0,
                                   served=0, version="0.1.0", kernel="fake", sent_at=0.0, bundles=True))
    named = set()
    for _ in range(50):
        turn = view.next_turn()
        assert len(turn) == MAX_UNPROVEN_BUNDLE_NODES
        assert set(view.bundle_holders(3, 7)) == set(turn)
        named |= set(turn)
    assert len(named) == 50 * MAX_UNPROVEN_BUNDLE_NODES  # each in turn, none twice before all had one
    view.mark_proven("sybil-1999")  # it passed its probation (the dispatch says so after the audits)
    for _ in range(3):
        turn = view.next_turn()
        assert set(view.bundle_holders(0, 0)) == {"sybil-1999", *turn}
