"""Two micro-batches in flight: two lanes step the engine at once, and no token changes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import GenRequest, Scheduler, SchedulerConfig
from kvasir_bus.errors import UsageError
from kvasir_bus.threads import usable_cores
from tests.serve.test_scheduler import run_all


class MeetingExperts:
    """The engine's local experts, except that each lane's first layer call waits until the
    other lane is inside a step too: the test fails (BrokenBarrierError -> "error" events)
    unless two micro-batches really are in flight at once."""

    def __init__(self, local, lanes: int):
        self.local, self.barrier = local, threading.Barrier(lanes, timeout=60)
        self.seen: set[str] = set()
        self.threads: set[int] = set()  # what a ggml call inside a lane may take
        self.lock = threading.Lock()

    def run_layer(self, layer, calls):
        from kernels import ggml

        name = threading.current_thread().name
        with self.lock:
            first = name not in self.seen
            self.seen.add(name)
            self.threads.add(ggml.n_threads())
        if first:
            self.barrier.wait()
        return self.local.run_layer(layer, calls)


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models("qwen2moe", "q8_0"))


def test_two_micro_batches_run_at_once_and_each_sequence_gets_its_tokens_alone(engine):
    rng = np.random.default_rng(5)
    reqs = [GenRequest(tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(2, 30)))), max_tokens=4 + i % 5,
                       sampler=SamplerConfig(temperature=0.7 * (i % 2), seed=i), stop_on_eos=False)
            for i in range(8)]
    meeting = MeetingExperts(engine.local_experts, 2)
    engine.use_experts(meeting)
    try:
        cfg = SchedulerConfig(max_active=8, step_tokens=16, deterministic=True, micro_batches=2)
        with Scheduler(engine, cfg) as sched:
            outs, stats = run_all(sched, reqs)
    finally:
        engine.use_experts(None)
    assert meeting.seen == {"kvasir-scheduler-0", "kvasir-scheduler-1"}
    # each lane's OpenMP team within its half of the cores (kernels.ggml.thread_cap): two lanes'
    # teams never outnumber the CPUs, where libgomp would throttle every barrier of both
    assert max(meeting.threads) <= max(1, usable_cores() // 2), meeting.threads
    assert stats["completed"] == 8 and stats["failed"] == 0 and stats["active"] == 0
    assert stats["kv_reserved_bytes"] == 0
    for r, out in zip(reqs, outs):
        alone = generate(engine, list(r.prompt), r.max_tokens, Sampler(r.sampler), stop_on_eos=False)
        assert (out.tokens, out.finish) == (alone.tokens, "length")


def test_micro_batches_out_of_range_are_refused():
    with pytest.raises(UsageError, match="micro-batches must be 1..4, got 0"):
        SchedulerConfig(micro_batches=0)


@pytest.mark.parametrize("hot", ["off", "auto"])
def test_two_micro_batches_over_the_swarm_keep_every_token(nats_server, models, tmp_path, hot):
    """Both lanes dispatch through one RemoteExperts (and the hot-expert planner) at once."""
    from backbone.dispatch import DispatchConfig
    from backbone.hot_experts import HotConfig
    from backbone.replicas import BALANCE_QUEUE, ReplicaConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.connect import connect
    from kvasir_bus.loopthread import LoopThread
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice
    from workers.runtime import Worker, WorkerConfig

    path = models("qwen2moe", "q4_k")
    out = write_slice(plan_slice(path, [(parse_span("all", "--layer"), parse_span("all", "--experts"))]),
                      tmp_path / "all.gguf").path
    bus = LoopThread("mb-workers")
    nc = bus.run(connect(nats_server.url, "mb-workers"))
    workers = [Worker(load_slice(out), WorkerConfig(node=f"m{i}", heartbeat_s=60, queue_group=BALANCE_QUEUE))
               for i in range(2)]
    for w in workers:
        bus.run(w.start(nc))
    rng = np.random.default_rng(9)
    reqs = [GenRequest(tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(2, 20)))), max_tokens=6,
                       stop_on_eos=False) for _ in range(6)]
    engine = Engine(path)
    try:
        cfg = BackboneConfig(model_path=engine.path, nats_url=nats_server.url, market=False, serve_manifest=False,
                             dispatch=DispatchConfig(timeout_s=10.0), replicas=ReplicaConfig(mode="balance"),
                             hot=HotConfig(mode=hot))
        with BackboneService(engine, cfg) as service:
            with Scheduler(engine, SchedulerConfig(max_active=6, step_tokens=32, deterministic=True,
                                                   micro_batches=2)) as sched:
                outs, stats = run_all(sched, reqs)
            remote = service.stats.totals().remote
    finally:
        for w in workers:
            bus.run(w.stop())
        bus.run(nc.close())
        bus.stop()
    assert stats["completed"] == 6 and stats["failed"] == 0
    assert remote > 0
    alone_engine = Engine(path)
    for r, o in zip(reqs, outs):
        assert o.tokens == generate(alone_engine, list(r.prompt), 6, Sampler(r.sampler), stop_on_eos=False).tokens
