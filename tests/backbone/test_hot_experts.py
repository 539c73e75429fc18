"""Hot experts: the backbone computes an expert itself when its round trip costs more."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.hot_experts import HotConfig, HotExperts, LocalCost, plan_split
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from kvasir_bus.connect import connect
from kvasir_bus.errors import UsageError
from kvasir_bus.loopthread import LoopThread

PROMPT, N = [3, 14, 15, 92, 65], 6


def test_a_slow_link_moves_every_expert_here_and_a_fast_one_none():
    assert plan_split([0.05, 0.05, 0.05], [0.001, 0.001, 0.001]) == (3, 0.003, 0.05)
    assert plan_split([0.002, 0.002], [0.001, 0.001]) == (0, 0.002, 0.002)


def test_only_the_slow_nodes_experts_move_when_the_rest_answer_fast():
    # one expert behind a 40 ms link, three at 2 ms; local costs 1 ms each: move the slow one
    k, t_k, t_0 = plan_split([0.040, 0.002, 0.002, 0.002], [0.001] * 4)
    assert (k, t_k, t_0) == (1, 0.002, 0.040)


def test_a_saving_inside_the_margin_keeps_the_experts_remote():
    assert plan_split([0.010], [0.0095], margin=0.9)[0] == 0
    assert plan_split([0.010], [0.0085], margin=0.9)[0] == 1


def test_local_cost_fits_a_fixed_and_a_per_row_part():
    cost = LocalCost()
    for rows in (1, 2, 4, 8, 16) * 4:
        cost.observe(rows, 0.001 + 0.0005 * rows)
    assert cost(10) == pytest.approx(0.006)


def test_hot_mode_is_checked():
    with pytest.raises(UsageError, match="--hot must be one of auto, off"):
        HotConfig(mode="always")


class SlowLink:
    """A worker's connection whose every publish (its replies) waits ``delay_s`` first: the
    worker is one slow link away."""

    def __init__(self, nc, delay_s: float):
        self._nc, self.delay_s = nc, delay_s

    def __getattr__(self, name):
        return getattr(self._nc, name)

    async def publish(self, *args, **kw):
        await asyncio.sleep(self.delay_s)
        await self._nc.publish(*args, **kw)


@pytest.fixture
def slow_worker(nats_server, models, tmp_path):
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen2moe", "q4_k")
    out = write_slice(plan_slice(path, [(parse_span("all", "--layer"), parse_span("all", "--experts"))]),
                      tmp_path / "all.gguf").path
    bus = LoopThread("slow-worker")
    nc = bus.run(connect(nats_server.url, "slow-worker"))
    worker = Worker(load_slice(out), WorkerConfig(node="slow", heartbeat_s=60))
    bus.run(worker.start(SlowLink(nc, 0.03)))
    yield path, worker
    bus.run(worker.stop())
    bus.run(nc.close())
    bus.stop()


def run(path, url, hot: str):
    engine = Engine(path)
    cfg = BackboneConfig(model_path=engine.path, nats_url=url, market=False, serve_manifest=False,
                         dispatch=DispatchConfig(timeout_s=10.0), hot=HotConfig(mode=hot))
    with BackboneService(engine, cfg) as service:
        gen = generate(engine, PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        hot_stats = service.hot.to_dict() if service.hot else None
        totals = service.stats.totals()
    return gen, hot_stats, totals


def test_auto_computes_here_behind_a_slow_link_and_the_output_is_bit_identical(nats_server, slow_worker):
    path, worker = slow_worker
    alone = generate(Engine(path), PROMPT, N, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    off, none, off_totals = run(path, nats_server.url, "off")
    auto, hot, auto_totals = run(path, nats_server.url, "auto")
    assert none is None and off_totals.remote > 0 and off_totals.local == 0  # off: every call over the link
    assert off.tokens == auto.tokens == alone.tokens
    assert np.array_equal(off.logits_array(), alone.logits_array())
    assert np.array_equal(auto.logits_array(), alone.logits_array())
    # auto: a few remote calls teach it the 30 ms round trip; from then on the experts are hot
    assert hot["hot_calls"] > 2 * auto_totals.remote
    assert auto_totals.local_choice == hot["hot_calls"] and auto_totals.rows_local == hot["hot_rows"]
    assert worker.served == off_totals.remote + auto_totals.remote


class _Remote:
    """A RemoteExperts stand-in: records the order of events; every expert returns its rows."""

    def __init__(self, events):
        from backbone.dispatch import DispatchStats

        self.events, self.local, self.recorder, self.stats = events, self, None, DispatchStats()

    def run_layer(self, layer, calls, while_waiting=None):
        self.events.append(("asked", [e for e, _ in calls]))
        if while_waiting is not None:
            while_waiting()
        return [rows for _, rows in calls]

    def compute(self, layer, expert, rows):
        self.events.append(("here", expert))
        return rows


def test_the_callers_work_runs_while_the_remote_part_is_away_with_or_without_hot_experts():
    from backbone.model import _overlaps
    from backbone.replicas import LatencyBook

    events = []
    hot = HotExperts(_Remote(events), LatencyBook(), HotConfig(mode="off"))
    assert _overlaps(HotExperts)
    row = np.ones((1, 4), np.float32)
    hot.run_layer(0, [(1, row), (2, row)], while_waiting=lambda: events.append(("shared",)))
    assert events == [("asked", [1, 2]), ("shared",)]  # off: all remote, the hook goes with them
    hot.close()
    events.clear()
    hot = HotExperts(_Remote(events), LatencyBook(), HotConfig(mode="auto"))  # calibrating: one expert here
    hot.run_layer(0, [(1, row), (2, np.ones((2, 4), np.float32))], while_waiting=lambda: events.append(("shared",)))
    assert sorted(events, key=str) == sorted([("asked", [2]), ("shared",), ("here", 1)], key=str)
    assert events.index(("shared",)) < events.index(("here", 1))  # before the hot expert's compute
    hot.close()
