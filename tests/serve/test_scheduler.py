"""Continuous batching: what runs in a step, who is admitted, and that batching changes no token."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.scheduler import GenRequest, Overloaded, Scheduler, SchedulerConfig
from backbone.server_http import StopText
from kvasir_bus.errors import UsageError


class Collector:
    """on_event for one job: records tokens, signals when it is done."""

    def __init__(self):
        self.tokens, self.finish, self.done = [], None, threading.Event()

    def __call__(self, event):
        kind, value = event
        if kind == "token":
            self.tokens.append(value)
        else:
            self.finish = value
            self.done.set()

    def wait(self):
        assert self.done.wait(60), "the job never finished"
        return self


def run_all(sched, reqs) -> tuple[list[Collector], dict]:
    """Submit every request at once, wait for all of them: their collectors and the scheduler's stats."""
    outs = [Collector() for _ in reqs]
    for r, out in zip(reqs, outs):
        sched.submit(r, out)
    for out in outs:
        out.wait()
    return outs, sched.snapshot()


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models("qwen2moe", "q8_0"))


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 40)))) for _ in range(n)]


def test_batched_sequences_get_exactly_the_tokens_they_get_alone(engine):
    reqs = [GenRequest(p, max_tokens=3 + i % 7, sampler=SamplerConfig(temperature=0.8 * (i % 2), seed=i),
                       stop_on_eos=False) for i, p in enumerate(prompts(12))]
    # A small budget: prompts are read in chunks of a few tokens beside the others' decode steps.
    with Scheduler(engine, SchedulerConfig(max_active=8, step_tokens=12, deterministic=True)) as sched:
        outs, stats = run_all(sched, reqs)
    assert stats["max_step_sequences"] > 1 and stats["max_step_tokens"] <= 12
    assert stats["completed"] == 12 and stats["active"] == 0 and stats["kv_reserved_bytes"] == 0
    for r, out in zip(reqs, outs):
        alone = generate(engine, list(r.prompt), r.max_tokens, Sampler(r.sampler), stop_on_eos=False)
        assert out.tokens == alone.tokens
        assert out.finish == "length"


def test_eos_ends_a_sequence_with_stop(engine):
    # Find a prompt whose greedy continuation is the EOS token, by making it the prompt's answer.
    eos = engine.cfg.eos_id
    with Scheduler(engine, SchedulerConfig(max_active=1, step_tokens=64)) as sched:
        for p in prompts(40, seed=3):
            alone = generate(engine, list(p), 8, Sampler(SamplerConfig()))
            if alone.stop_reason == "eos":
                out = Collector()
                sched.submit(GenRequest(p, 8), out)
                assert out.wait().finish == "stop" and out.tokens == alone.tokens and out.tokens[-1] == eos
                return
    pytest.skip("no prompt of this model reaches EOS greedily within 8 tokens")


def test_admission_bounds_active_sequences_and_the_queue(engine):
    long = GenRequest(prompts(1)[0], max_tokens=150, stop_on_eos=False)
    with Scheduler(engine, SchedulerConfig(max_active=1, max_queue=1, step_tokens=64)) as sched:
        first, second = Collector(), Collector()
        job1 = sched.submit(long, first)
        sched.submit(long, second)  # waits for the slot
        with pytest.raises(Overloaded):
            sched.submit(long, Collector())
        sched.cancel(job1)
        first_count = len(first.tokens)
        second.wait()
        stats = sched.snapshot()
    assert stats["max_step_sequences"] == 1  # never two at once
    assert stats["rejected"] == 1 and stats["cancelled"] == 1 and stats["completed"] == 1
    assert first_count < 150 and first.finish is None


def test_the_kv_bound_holds_sequences_back_and_refuses_what_never_fits(engine):
    c = engine.cfg
    cell = c.n_layer * 2 * c.n_head_kv * c.head_dim * 2
    with Scheduler(engine, SchedulerConfig(max_active=8, kv_bytes=256 * cell)) as sched:
        outs = [Collector() for _ in range(3)]
        for p, out in zip(prompts(3), outs):
            sched.submit(GenRequest(p, max_tokens=4), out)  # 256 cells each: one at a time
        for out in outs:
            out.wait()
        assert sched.snapshot()["max_step_sequences"] == 1
    with Scheduler(engine, SchedulerConfig(max_active=8, kv_bytes=100 * cell)) as sched:
        with pytest.raises(UsageError, match="KV cache"):  # the cache grows in chunks of 256 cells
            sched.submit(GenRequest((1,) * 10, max_tokens=10), Collector())


def test_requests_that_cannot_run_are_refused_up_front(engine):
    with Scheduler(engine) as sched:
        for req, needle in [(GenRequest((), 4), "empty"), (GenRequest((1,), 0), "max_tokens"),
                            (GenRequest((1,) * 200, 100), "exceeds the context")]:
            with pytest.raises(UsageError, match=needle):
                sched.submit(req, Collector())


def test_more_streams_than_step_tokens_still_read_their_prompts(engine):
    """Admission is by memory, so more sequences may decode than a step's token budget: the
    prompts of newcomers still move on (a share of the budget), and every stream completes."""
    reqs = [GenRequest(p, max_tokens=3, stop_on_eos=False) for p in prompts(12, seed=4)]
    with Scheduler(engine, SchedulerConfig(max_active=16, step_tokens=8)) as sched:
        outs, stats = run_all(sched, reqs)
    assert stats["completed"] == 12 and all(len(o.tokens) == 3 for o in outs)


def test_stop_text_holds_back_partial_matches_and_cuts_at_the_first_stop():
    s = StopText(("END", "xy"))
    assert s.push("abcE") == ("abc", False)  # "E" may start "END"
    assert s.push("Nd") == ("ENd", False)
    assert s.push("qqx") == ("qq", False)
    assert s.push("yzz") == ("", True)
    s = StopText(("END",))
    assert s.push("aEN") == ("a", False) and s.flush() == "EN"
    assert StopText(()).push("E") == ("E", False)


def test_a_stream_the_engine_outruns_still_lets_the_loop_serve_others():
    """Events already waiting (the engine ran ahead of the reader) are taken one loop turn at
    a time: a bystander on the same loop runs before the stream has drained them all."""
    import asyncio

    from backbone.scheduler import LoopEvents

    async def main():
        events = LoopEvents()
        for i in range(100):
            events.push(("token", i))
        await asyncio.sleep(0)  # the pushes land: the queue holds all 100
        taken = []

        async def reader():
            while len(taken) < 100:
                taken.append((await events.next())[1])

        seen_by_bystander = []

        async def bystander():
            seen_by_bystander.append(len(taken))

        r = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader starts first, with 100 events waiting
        await bystander()
        await r
        return taken, seen_by_bystander

    taken, seen = asyncio.run(main())
    assert taken == list(range(100))
    assert seen[0] < 100


def test_a_steps_events_wake_the_loop_once_and_keep_each_streams_order():
    """The engine thread hands a step's tokens (of many streams) to the loop with one wake-up,
    after the last of them: a wake-up per token let the loop take the GIL from the engine
    thread while it was still sampling the step's other streams."""
    import asyncio

    from backbone.scheduler import LoopEvents, _one_wakeup

    async def main():
        loop = asyncio.get_running_loop()
        streams = [LoopEvents() for _ in range(4)]
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wakeups.append(1) or real(*a)

        def engine_thread():
            for step in range(3):
                with _one_wakeup():
                    for events in streams:
                        events.push(("token", step))
                    assert not wakeups[step:]  # none while the step is still delivering
            for events in streams:  # outside a step (an error, a shutdown): each wakes as before
                events.push(("done", "length"))

        await asyncio.to_thread(engine_thread)
        got = [[await events.next() for _ in range(4)] for events in streams]
        return got, len(wakeups)

    got, n_wakeups = asyncio.run(main())
    assert all(g == [("token", 0), ("token", 1), ("token", 2), ("done", "length")] for g in got)
    assert 1 <= n_wakeups <= 3 + 4  # at most one per step (fewer when the loop had not drained yet), one per lone push
