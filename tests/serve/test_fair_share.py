"""The generate API serves everyone fairly: one client's flood holds at most its share of the
queue, and another client's request takes the next free slot, ahead of the flood."""

from __future__ import annotations

import threading

import pytest

from backbone.generate_bus import client_of
from backbone.model import Engine
from backbone.scheduler import GenRequest, Overloaded, Scheduler, SchedulerConfig
from tests.serve.test_http import Gate


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models("qwen2moe", "q8_0"))


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_flood_keeps_its_share_of_the_queue_and_the_next_slot_goes_to_another_client(engine):
    gate = Gate(engine)
    try:
        cfg = SchedulerConfig(max_active=1, max_queue=64, max_queue_per_client=8, step_tokens=64)
        order: list[str] = []
        lock = threading.Lock()

        def finished(name: str):
            def on_event(event):
                if event[0] != "token":  # done or error: in the order the scheduler ends them
                    with lock:
                        order.append(name)
            return on_event, None

        with Scheduler(engine, cfg) as sched:
            cb, _ = finished("flood-0")
            sched.submit(GenRequest((1, 2, 3), 2, stop_on_eos=False, client="flooder"), cb)
            _wait(lambda: sched.snapshot()["active"] == 1, "the flooder's first stream running")
            accepted, refused = 1, 0
            for i in range(1, 20):
                cb, _ = finished(f"flood-{i}")
                try:
                    sched.submit(GenRequest((1, 2, 3 + i), 2, stop_on_eos=False, client="flooder"), cb)
                    accepted += 1
                except Overloaded as exc:
                    assert "its share of the queue" in str(exc)
                    refused += 1
            assert (accepted, refused) == (9, 11)  # 1 running + 8 waiting: its share, not the whole queue
            cb, _ = finished("other")
            sched.submit(GenRequest((9, 9), 2, stop_on_eos=False, client="other"), cb)  # room for it
            gate.allow(10**6)
            _wait(lambda: len(order) == 10, "every accepted request done")
    finally:
        engine.forward = gate._forward
    assert order[0] == "flood-0" and order[1] == "other", order  # the next free slot was its


def test_clients_are_named_by_their_inbox_prefix():
    assert client_of("_INBOX_UABC.x1.y") == "_INBOX_UABC"  # a kvasir creds identity's own prefix
    a = client_of("_INBOX.AbCdEfGhIjKl0000000001")
    assert a == client_of("_INBOX.AbCdEfGhIjKl0000000002") == "_INBOX.AbCdEfGhIjKl"  # one connection
    assert a != client_of("_INBOX.ZyXwVuTsRqPo0000000001")


def test_a_flooders_long_streams_are_parked_for_another_clients_request_and_change_no_token(engine):
    """Every slot held by one client's long streams: another client's request starts at the next
    step (one of the flooder's streams waits, its cache kept), and every stream's tokens are its
    solo run's (the suite's deterministic kernel mode, tests/conftest.py)."""
    from backbone.generate import generate
    from backbone.sampling import Sampler, SamplerConfig

    prompts = {"flood-0": (1, 2, 3), "flood-1": (4, 5, 6), "other": (9, 9)}
    lengths = {"flood-0": 40, "flood-1": 40, "other": 6}
    solo = {name: generate(engine, list(p), lengths[name], Sampler(SamplerConfig()), stop_on_eos=False).tokens
            for name, p in prompts.items()}
    gate = Gate(engine)
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    done: dict[str, str] = {}
    lock = threading.Lock()

    def on_event_of(name: str):
        def on_event(event):
            with lock:
                if event[0] == "token":
                    tokens[name].append(event[1])
                else:
                    done[name] = str(event[1])
        return on_event

    try:
        # two slots, and memory for more streams than that: the slots are what the flood holds
        cfg = SchedulerConfig(max_active=2, max_queue=8, step_tokens=64, kv_bytes=1 << 30)
        with Scheduler(engine, cfg) as sched:
            try:
                for name in ("flood-0", "flood-1"):
                    sched.submit(GenRequest(prompts[name], lengths[name], stop_on_eos=False, client="flooder"),
                                 on_event_of(name))
                gate.allow(3)
                _wait(lambda: len(tokens["flood-0"]) == 3 and len(tokens["flood-1"]) == 3, "three steps of the flood")
                sched.submit(GenRequest(prompts["other"], lengths["other"], stop_on_eos=False, client="other"),
                             on_event_of("other"))
                # The step after the submission (or the one after it, if the engine thread had planned
                # its next step of the flood already): the other client's prompt, beside one of the
                # flooder's streams.
                for steps in (1, 2):
                    gate.allow(1)
                    _wait(lambda: len(tokens["other"]) == 1 or sched.stats.steps == 3 + steps, "a step")
                    if tokens["other"]:
                        break
                assert tokens["other"], "two steps after its submission the other client still waits"
                a, b = sorted(len(tokens[n]) for n in ("flood-0", "flood-1"))
                assert b == a + 1  # one of the flooder's streams waited a step
                assert sched.snapshot()["parked"] == 1
                gate.allow(10**6)
                _wait(lambda: len(done) == 3, "every stream done")
            finally:
                gate.allow(10**6)  # never leave the engine thread waiting at the gate: stop() joins it
    finally:
        engine.forward = gate._forward
    assert done == {name: "length" for name in prompts}
    assert tokens == solo  # parking changed no token
