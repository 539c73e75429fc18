"""The backbone's bus path through the lane (kvasir_bus.lane): replies handled where nats.py
parses them and a step's requests written to the socket in one write, with no bit changed
against the monolithic run and against the ordinary path; a headed reply (a 503 "no
responders") still goes the ordinary way and ends its call as before. Steps of bundles only go
on the engine thread's own connection (kvasir_bus.direct): taken there, handed to the bus
thread when anything is unusual, and a lost connection is made again between steps."""

from __future__ import annotations

import json
import os
from dataclasses import replace
import signal
import socket

import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from tests.backbone.test_bundles_sharding import run_sharded as run_bundled
from tests.backbone.test_sharding import (  # noqa: F401 (fixtures)
    N_DECODE, assert_identical, bus_backbone, model, model_args, monolithic, prompt, swarm)
from tests.polling import until

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


def run_sharded(url, model, prompt, cfg: DispatchConfig, bundle_nodes: int):
    """Tokens, logits, stats, and how many replies came inline and requests went direct."""
    out, (inline, direct) = run_bundled(url, model, prompt, cfg, bundle_nodes, read=lambda remote: (
        None if remote._lane is None else remote._lane.delivered,
        None if remote._direct is None else remote._direct.written))
    return out, inline, direct


def test_replies_come_inline_and_steps_go_direct_and_change_no_bit(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    for bundles in (True, False):
        lane_on, inline, direct = run_sharded(nats_server.url, model, prompt,
                                              DispatchConfig(timeout_s=30.0, bundles=bundles, engine_connection=False), 2 * bundles)
        lane_off, inline_off, direct_off = run_sharded(
            nats_server.url, model, prompt,
            DispatchConfig(timeout_s=30.0, bundles=bundles, inline_delivery=False, direct_publish=False,
                           engine_connection=False), 2 * bundles)
        for sharded in (lane_on, lane_off):
            assert_identical(sharded, monolithic)
            t = sharded[2]["totals"]
            assert t["remote"] == t["calls"] > 0 and t["invalid"] == 0
        assert (inline_off, direct_off) == (None, None)
        t = lane_on[2]["totals"]
        messages = t["bundles"] + t["calls"] - t["bundled_calls"]  # one per bundle, one per call outside them
        assert inline == messages  # every reply inline: each message answered once
        assert 0 < direct <= messages  # nearly every step straight to the socket (one may step aside)
        assert t["bytes_out"] == lane_off[2]["totals"]["bytes_out"]  # the same requests, byte for byte


def test_no_responders_still_take_the_ordinary_path_and_fall_back(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3"))])  # nobody holds 4-7: the server answers 503 at once
    sharded, inline, direct = run_sharded(nats_server.url, model, prompt, DispatchConfig(timeout_s=30.0), 1)
    assert_identical(sharded, monolithic)
    t = sharded[2]["totals"]
    assert t["no_responders"] > 0 and t["timeouts"] == 0 and t["invalid"] == 0  # each 503 settled its call at once
    assert inline > 0 and direct > 0


def run_on_engine_connection(url, model, prompt, bundle_nodes: int, between=None, cfg=DispatchConfig(timeout_s=30.0)):
    """Two generations on one backbone (``between(remote)`` runs between them): tokens, logits
    and stats of each, and the engine connection's steps (sent, handed to the bus thread)."""
    engine = Engine(model)
    runs = []
    with bus_backbone(engine, url, cfg) as backbone:
        remote = backbone.dispatch
        remote.bus.run(until(lambda: remote.coverage.bundle_nodes == bundle_nodes, "the bundle heartbeats"))
        for _ in range(2):
            before = remote.stats.to_dict()["totals"]
            gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
            after = remote.stats.to_dict()["totals"]
            runs.append((gen.tokens, gen.logits_array(), {k: after[k] - before[k] for k in
                                                          ("calls", "remote", "timeouts", "no_responders", "invalid")}))
            if between is not None and len(runs) == 1:
                between(remote)
        steps = remote.direct_steps, remote.handed_steps
    return runs, steps


def test_all_bundle_steps_go_on_the_engine_connection_and_change_no_bit(nats_server, swarm, model, prompt, monolithic):
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    runs, (direct, handed) = run_on_engine_connection(nats_server.url, model, prompt, 2)
    for sharded in runs:
        assert_identical(sharded, monolithic)
        t = sharded[2]
        assert t["remote"] == t["calls"] > 0 and t["timeouts"] == 0
    assert direct > 0 and handed == 0  # every step sent and taken by the engine thread


def test_a_lost_engine_connection_is_made_again_before_the_next_step(nats_server, swarm, model, prompt, monolithic):
    """A server that closed the idle connection (or any loss between steps) costs no step: it
    is found before the step is sent, and a new connection takes it."""
    swarm([("w0", model_args(model, "0-3")), ("w1", model_args(model, "4-7"))])
    lost = []

    def lose(remote):
        lost.append(remote._conn)
        remote._conn.sock.shutdown(socket.SHUT_RD)  # reads end as if the server had closed it; writes still go

    runs, (direct, handed) = run_on_engine_connection(nats_server.url, model, prompt, 2, between=lose)
    second = runs[1]
    assert_identical(second, monolithic)
    assert second[2]["remote"] == second[2]["calls"] > 0 and second[2]["timeouts"] == 0
    assert lost[0].closed and handed == 0


def test_a_bundle_node_gone_unheard_hands_its_step_to_the_bus_thread(nats_server, swarm, model, prompt, monolithic):
    """A bundle to a node killed before its heartbeats stop: nats-server answers 503 on the
    engine connection; the bus thread takes the step and ends it as on its own path (the node
    forgotten, its calls asked on their experts' subjects, 503 again, computed here), at once."""
    victim, _ = swarm([("victim", model_args(model, "0-3")), ("steady", model_args(model, "4-7"))])

    def kill(remote):
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()

    runs, (direct, handed) = run_on_engine_connection(nats_server.url, model, prompt, 2, between=kill)
    second = runs[1]
    assert_identical(second, monolithic)
    assert second[2]["no_responders"] > 0 and second[2]["timeouts"] == 0 and second[2]["invalid"] == 0
    assert handed > 0 and direct > handed


def test_fast_paths_off_on_the_command_lines_sends_everything_the_ordinary_way(
        nats_server, swarm, model, prompt, monolithic, tmp_path):
    """``--fast-paths off`` (worker and backbone flags): no engine connection, no inline delivery,
    no one-write publish on the backbone, none on the workers either; the same bits."""
    import argparse

    from backbone.cli import add_bus_flags
    from backbone.service import BackboneConfig

    swarm([(node, model_args(model, experts) + ["--fast-paths", "off"]) for node, experts in (("w0", "0-3"), ("w1", "4-7"))])
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_bus_flags(p)
    off = BackboneConfig.from_args(p.parse_args(["--model", str(model), "--fast-paths", "off"])).dispatch
    assert (off.engine_connection, off.inline_delivery, off.direct_publish) == (False, False, False)
    on = BackboneConfig.from_args(p.parse_args(["--model", str(model)])).dispatch
    assert (on.engine_connection, on.inline_delivery, on.direct_publish) == (True, True, True)
    sharded, inline, direct = run_sharded(nats_server.url, model, prompt, replace(off, timeout_s=30.0), 2)
    assert_identical(sharded, monolithic)
    assert (inline, direct) == (None, None) and sharded[2]["totals"]["remote"] > 0
    for node in ("w0", "w1"):
        started = [json.loads(line) for line in (tmp_path / f"{node}.log").read_text().splitlines()
                   if '"worker_started"' in line]
        assert [(s["inline"], s["direct"]) for s in started] == [(False, False)]


def test_a_strangers_unheard_bundle_beside_an_honest_holder_is_taken_on_the_engine_thread(
        nats_server, swarm, model, prompt, monolithic):
    """A node that heartbeats bundles but subscribes to nothing (2,000 of them cost a generation
    twice its time when each 503 handed its step to the bus thread): its 503 is taken where it is
    read, since the honest holder's bundle carries the same calls; no step leaves the engine thread."""
    import asyncio
    import threading

    from kvasir_bus import codec
    from kvasir_bus.codec import Holding
    from kvasir_bus.connect import connect
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.loopthread import LoopThread
    from kvasir_bus.subjects import Subjects

    swarm([("w0", model_args(model, "0-7"))])
    cfg = Engine(model).cfg
    fp = model_fingerprint(Engine(model).reader)
    stop, bus = threading.Event(), LoopThread("stranger")

    async def beat():
        nc = await connect(nats_server.url, name="stranger")
        hb = codec.Heartbeat(model=fp, node="stranger", holdings=tuple(Holding(la, 0, cfg.n_expert) for la in
                                                                       range(cfg.n_layer)),
                             budget_bytes=0, load=0.0, served=0, version="0", kernel="x", sent_at=0.0, bundles=True)
        while not stop.is_set():
            await nc.publish(Subjects(fp).coverage("stranger"), hb.encode())
            await asyncio.sleep(0.05)
        await nc.close()

    beating = bus.submit(beat())
    try:
        runs, (direct, handed) = run_on_engine_connection(nats_server.url, model, prompt, 2,
                                                          cfg=DispatchConfig(timeout_s=30.0))
    finally:
        stop.set()
        beating.result(10)
        bus.stop()
    for sharded in runs:
        assert_identical(sharded, monolithic)
        t = sharded[2]
        assert t["remote"] == t["calls"] > 0 and t["no_responders"] == 0
    assert direct > 0 and handed == 0
