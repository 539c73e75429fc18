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


def test_a_stranger_out_of_turn_is_kept_alive_by_its_heartbeats_without_decoding_them():
    import asyncio

    clock = Clock()
    view = CoverageView(1.0, clock, n_layer=LAYERS, n_expert=EXPERTS)
    view.track_nodes = True
    view.limit_unproven(MAX_UNPROVEN_BUNDLE_NODES)
    subjects = Subjects(MODEL)

    def beat(node: str, experts: int) -> None:
        hb = codec.Heartbeat(model=MODEL, node=node, holdings=(Holding(0, 0, experts),), budget_bytes=0, load=0.0,
                             served=0, version="0.1.0", kernel="fake", sent_at=0.0, bundles=True)
        msg = type("Msg", (), {"subject": subjects.coverage(node), "data": hb.encode()})()
        asyncio.run(view._on_heartbeat(msg))

    for i in range(10):
        beat(f"s{i}", 8)
    in_turn, out = view._turn[0], "s9"
    clock.now += 1.0
    beat(out, 1)  # new claims, out of turn: not read yet, but alive
    beat(in_turn, 1)  # in turn: read at once
    assert view._nodes[out] == ({0: [(0, 8)]}, clock.now) and view._nodes[in_turn][0] == {0: [(0, 1)]}
    clock.now += view.reread_s
    beat(out, 1)  # read again after reread_s
    assert view._nodes[out][0] == {0: [(0, 1)]}


def test_turns_of_strangers_that_never_answer_come_ever_more_seldom_until_one_answers():
    from backbone.coverage_view import MAX_TURN_GAP

    view = CoverageView(1.0, Clock(), n_layer=LAYERS, n_expert=EXPERTS)
    view.track_nodes = True
    view.limit_unproven(MAX_UNPROVEN_BUNDLE_NODES)

    def beat(node: str) -> None:
        view.heard(codec.Heartbeat(model=MODEL, node=node, holdings=(Holding(0, 0, 8),), budget_bytes=0, load=0.0,
                                   served=0, version="0.1.0", kernel="fake", sent_at=0.0, bundles=True))

    for i in range(100):
        beat(f"mute-{i}")
    given = 0
    for _ in range(1000):  # each bundle in turn gets "no responders"; the node heartbeats again
        turn = view.next_turn()
        given += bool(turn)
        for node in turn:
            view.forget_node(node)
            beat(node)
    assert given <= 1000 // MAX_TURN_GAP + 8  # 2, 4, ... 64 steps apart: not every step
    beat("honest")
    while "honest" not in view.next_turn():
        pass
    view.bundle_answered("honest")  # an unproven node that answers: turns every step again
    assert all(view.next_turn() for _ in range(5))
