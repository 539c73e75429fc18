"""The swarm runs itself (M3): a market, a backbone serving its weights, and volunteers that
arrive one by one with only a budget and the weights' URL, on a real nats-server.

Throughout, the backbone's logits equal the monolithic run bit for bit: coverage only changes
who computes an expert, never what is computed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import numpy as np
import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from launch.swarm import spawn_worker, wait_for_nodes
from kvasir_bus.cli import main as kvasir
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from market.service import Market, MarketConfig

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

TOKEN = "node-token-1"
RANGE = 4  # experts per range: 3 layers x 8 experts = 6 ranges
N_PROMPT, N_DECODE = 32, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    path = tmp_path_factory.mktemp("swarm") / "tiny3.gguf"
    return synth_model(path, arch="qwen3moe", preset="tiny", qtype="q4_k", seed=5, layers=3)


@pytest.fixture(scope="module")
def monolithic(model):
    engine = Engine(model)
    prompt = np.random.default_rng(3).integers(0, engine.cfg.n_vocab, N_PROMPT).tolist()
    gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    return prompt, gen.logits_array()


class MarketThread:
    """A Market on its own loop thread (its own connection), restartable on the same ledger."""

    def __init__(self, url: str, db: str, model: str):
        self.url, self.db, self.model = url, db, model
        self.bus = LoopThread("market")
        self.market = None
        self.nc = None

    def start(self):
        async def go():
            self.nc = await connect(self.url, "market")
            # No decay within the test (half-life 1e9 s): the market's usage shares are then
            # exactly the shares of the rows the backbone reported, which settle_demand waits for.
            cfg = MarketConfig(db_path=self.db, expiry_s=1.5, assign_grace_s=30.0, range_experts=RANGE,
                               demand_interval_s=0.5, usage_half_life_s=1e9,
                               models=(self.model,))
            self.market = Market(self.nc, cfg)
            await self.market.start()
        self.bus.run(go(), timeout=20)
        return self

    def call(self, fn, *args):
        async def go():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        return self.bus.run(go(), timeout=20)

    def stop(self):
        async def go():
            await self.market.stop()
            await self.nc.drain()
        if self.market is not None:
            self.bus.run(go(), timeout=20)
            self.market = None

    def close(self):
        self.stop()
        self.bus.stop()


def run_generation(engine, prompt):
    gen = generate(engine, prompt, N_DECODE, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    return gen.logits_array()


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_volunteers_cover_the_model_heal_holes_and_get_paid(nats_server, model, monolithic, tmp_path):
    prompt, mono_logits = monolithic
    fp = model_fingerprint(Engine(model).reader)
    db = str(tmp_path / "ledger.db")
    market = MarketThread(nats_server.url, db, fp).start()
    engine = Engine(model)
    procs = []
    try:
        # A fixed, generous reply timeout: "fully covered" below means every call is answered by a
        # volunteer, and the adaptive one (down to its 50 ms floor here) times out a worker that a
        # loaded machine merely paused (5 late replies in one run beside two busy loops). Nothing
        # here waits on a timeout: a killed worker's calls find no responders at once.
        cfg = BackboneConfig(model_path=str(model), nats_url=nats_server.url, serve_weights="127.0.0.1:0",
                             tokens=(TOKEN,), market_interval_s=0.2, dispatch=DispatchConfig(timeout_s=10.0))
        with BackboneService(engine, cfg) as backbone:
            remote, weights, link = backbone.dispatch, backbone.weights, backbone.market_link
            manifest = backbone.manifest
            range_bytes = RANGE * manifest.expert_bytes(0)
            budget = int(range_bytes * 1.3)  # one range fits, two do not

            # The market learns the model from the backbone's manifest.
            wait_until(lambda: market.call(market.market.demand_map, fp), what="the market to know the model")

            def volunteer(node):
                log = open(tmp_path / f"{node}.log", "w")
                proc = spawn_worker(nats_server.url, node, ["--budget", str(budget), "--source", weights.url,
                                                           "--token", TOKEN, "--cache-dir", str(tmp_path / node)],
                                    heartbeat_s=0.3, log_file=log)
                procs.append(proc)
                beats = asyncio.run(wait_for_nodes(nats_server.url, fp, {node}, procs=[proc], timeout=120))
                return proc, beats[node].holdings

            def settle_demand():
                """Wait until the backbone has published every routing count and the market's
                usage shares are the shares of all the rows published so far."""
                wait_until(lambda: not link.pending_hits, what="routing statistics sent")
                hits = link.published_hits
                total = sum(hits.values())
                want = {(layer, lo): sum(rows for (lay, e), rows in hits.items()
                                         if lay == layer and lo <= e < lo + RANGE) / total
                        for layer in range(3) for lo in (0, 4)}

                def counted():
                    got = {(e.layer, e.lo): e.usage for e in market.call(market.market.demand_map, fp).entries}
                    return got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-6 for k in want)
                wait_until(counted, what="the market to count every routing statistic")

            def holes_with_max_demand(assigned):
                """The holes of the top demand. Routed rows are integers, so two ranges often tie;
                their usage is decayed by a factor of the clock, applied per expert, so a tie
                comes out a rounding apart, either way, from one moment to the next (a full-suite
                run saw the market pick the other of two tied ranges): equal within 1e-9.
                ``assigned``: the ranges given to earlier volunteers. The demand map counts a
                node's holdings once it has answered for them, the market's choice counts an
                assignment at once (the next volunteer sees it as a pending replica): a range
                whose volunteer no call has reached yet is a hole in the map, not a choice."""
                demand = market.call(market.market.demand_map, fp)
                holes = [e for e in demand.entries if e.replicas == 0 and (e.layer, e.lo, e.hi) not in assigned]
                top = max(e.demand for e in holes)
                return {(e.layer, e.lo, e.hi) for e in holes if e.demand >= top * (1 - 1e-9)}

            # Six volunteers, one by one: each takes a distinct range, the scarcest first.
            taken = {}
            for i in range(6):
                assert np.array_equal(run_generation(engine, prompt), mono_logits)
                settle_demand()  # this generation's routing statistics have reached the market
                expected = holes_with_max_demand(set(taken.values()))
                node = f"v{i}"
                proc, holdings = volunteer(node)
                assert len(holdings) == 1
                got = (holdings[0].layer, holdings[0].lo, holdings[0].hi)
                assert got in expected, (node, got, expected)
                assert got not in taken.values()
                taken[node] = got
                served = weights.served_to(node)
                assert 0 < served <= 1.05 * (range_bytes + manifest.data_offset), (node, served)
            assert sorted(taken.values()) == [(layer, lo, lo + RANGE) for layer in range(3) for lo in (0, 4)]

            # Fully covered: every expert call is answered by a volunteer, bits unchanged.
            before = remote.stats.totals()
            assert np.array_equal(run_generation(engine, prompt), mono_logits)
            after = remote.stats.totals()
            assert after.remote - before.remote == after.remote + after.local - before.remote - before.local > 0, \
                remote.stats.to_dict()["totals"]

            # Kill two: their ranges become holes within one expiry; two newcomers take exactly those.
            victims = ["v1", "v4"]
            for p in procs:
                if p.node in victims:
                    os.kill(p.proc.pid, signal.SIGKILL)
                    p.proc.wait()
            wait_until(lambda: len(market.call(market.market.demand_map, fp).holes) == 2, what="two holes")
            assert np.array_equal(run_generation(engine, prompt), mono_logits)  # fallback meanwhile
            healed = {volunteer(node)[1][0] for node in ("n0", "n1")}
            assert {(h.layer, h.lo, h.hi) for h in healed} == {taken[v] for v in victims}
            assert np.array_equal(run_generation(engine, prompt), mono_logits)

            # Every winning reply reaches the ledger exactly once.
            assert backbone.wait_ledger_acked(20), "the ledger acknowledgements"
            served_rows = dict(remote.stats.node_rows)
        # Restart the market: the ledger keeps every row.
        market.stop()
        market.start()
    finally:
        for p in procs:
            p.stop()
        market.close()

    def rewards():
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert kvasir(["rewards", "--db", db, "--json"]) == 0
        return json.loads(out.getvalue())

    report = rewards()
    text = json.dumps(report)
    rows = {}
    for entry in _node_entries(report):
        rows[entry["node"]] = rows.get(entry["node"], 0) + entry["rows"]
    assert rows == served_rows, text
    assert len(rows) == 8 and sum(rows.values()) > 0
    assert all(entry["reward"] > 0 for entry in _node_entries(report))


def _node_entries(report):
    """The per-node entries of `kvasir rewards --json`, whatever the nesting by model."""
    if isinstance(report, dict) and "nodes" in report:
        return report["nodes"]
    if isinstance(report, dict) and "models" in report:
        return [n for m in report["models"] for n in _node_entries(m)]
    if isinstance(report, list):
        return [n for m in report for n in (_node_entries(m) if isinstance(m, dict) and "node" not in m else [m])]
    raise AssertionError(f"unexpected rewards JSON: {report!r}")
