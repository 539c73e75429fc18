"""A bus client of ``kvasir.<model>.generate`` that leaves mid-stream frees its sequence at the
next engine step, as an HTTP client that disconnects does, whether it says so (a cancel
message) or just goes (unsubscribes its inbox, or closes its connection): the backbone keeps
serving the others.

Every test runs one backbone with a single slot and a long stream in it; a second request
waits in the queue. It can only finish if the first one's slot is freed, long before the first
one's 4000 tokens."""

from __future__ import annotations

import asyncio

import pytest

from backbone.generate_bus import cancel, generate, generate_all, new_request
from backbone.model import Engine
from backbone.scheduler import SchedulerConfig
from backbone.server_http import ServerConfig, ServerThread
from backbone.tokenizer import Tokenizer
from kvasir_bus import generate_codec as gc
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.subjects import Subjects
from kvasir_bus.wire import encode, headers_for
from tests.polling import until

LONG = 16000  # far more than the test takes to cancel, even with a fast engine: a finished stream cannot be cancelled


@pytest.fixture(scope="module")
def model(models):
    return models("mixtral", "q8_0", ctx=16384)


@pytest.fixture(scope="module")
def fp(model):
    return model_fingerprint(Engine(model).reader)


def one_slot_backbone(model, url, fp) -> ServerThread:
    cfg = ServerConfig(port=0, model_name="tiny", bus_model=fp, bus_url=url, node="bb",
                       scheduler=SchedulerConfig(max_active=1, max_queue=4, step_tokens=16))
    return ServerThread(Engine(model), Tokenizer(model), cfg)


async def leave_mid_stream(url: str, fp: str, how: str, bb) -> tuple[list[int], dict]:
    """Start a long stream, read two tokens, leave ``how``; meanwhile a second client waits for
    the slot. Returns the second client's tokens and the scheduler's counters after."""
    sched = bb.server.scheduler
    leaver, other = await connect(url, "leaver"), await connect(url, "other")
    try:
        long_req = new_request([1, 2, 3], LONG, stop_on_eos=False)
        if how == "cancel":  # the library client: breaking out of generate() sends the cancel
            stream = generate(leaver, fp, long_req)
            for _ in range(2):
                assert isinstance(await stream.__anext__(), gc.GenerateToken)
        else:  # a bare NATS client that just goes away, without a word
            inbox = leaver.new_inbox()
            sub = await leaver.subscribe(inbox)
            await leaver.publish(Subjects(fp).generate(), encode(long_req), reply=inbox,
                                 headers=headers_for(long_req))
            for _ in range(2):
                assert isinstance(gc.decode_generate_reply((await sub.next_msg(timeout=60)).data), gc.GenerateToken)
        waiting = asyncio.ensure_future(generate_all(other, fp, new_request([4, 5, 6], 3, stop_on_eos=False)))
        await until(lambda: sched.snapshot()["queued"] == 1, "the second request queued behind the first")
        assert sched.snapshot()["active"] == 1 and not waiting.done()
        if how == "cancel":
            await stream.aclose()
        elif how == "unsubscribe":
            await sub.unsubscribe()
        else:
            await leaver.close()
        tokens, _, done = await asyncio.wait_for(waiting, 120)
        assert done.finish_reason == "length"
        await until(lambda: sched.snapshot()["active"] == 0, "the slot freed")
        return tokens, sched.snapshot()
    finally:
        for nc in (leaver, other):
            if not nc.is_closed:
                await nc.close()


@pytest.mark.parametrize("how, why", [("cancel", "cancel"), ("unsubscribe", "gone"), ("disconnect", "gone")])
def test_a_bus_client_that_leaves_mid_stream_frees_its_slot_and_the_backbone_serves_on(
        nats_server, model, fp, arun, how, why):
    with one_slot_backbone(model, nats_server.url, fp) as bb:
        tokens, snap = arun(leave_mid_stream(nats_server.url, fp, how, bb), timeout=180)
        assert len(tokens) == 3
        assert snap["cancelled"] == 1 and snap["completed"] == 1 and snap["active"] == 0 and snap["queued"] == 0
        assert snap["generated_tokens"] < LONG // 2  # the long stream stopped early
        assert bb.server.bus.dropped == {"cancel": 0, "gone": 0, why: 1}

        async def after():  # and it keeps serving
            nc = await connect(nats_server.url, "after")
            try:
                return await generate_all(nc, fp, new_request([7, 8], 2, stop_on_eos=False))
            finally:
                await nc.close()

        assert len(arun(after(), timeout=60)[0]) == 2


def test_a_cancel_drops_a_queued_request_and_strangers_cancels_are_ignored(nats_server, model, fp, arun):
    with one_slot_backbone(model, nats_server.url, fp) as bb:
        sched = bb.server.scheduler

        async def go():
            nc = await connect(nats_server.url, "client")
            try:
                running = new_request([1, 2, 3], LONG, stop_on_eos=False)
                first = generate(nc, fp, running)
                await first.__anext__()
                queued = new_request([4, 5], LONG, stop_on_eos=False)
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                await nc.publish(Subjects(fp).generate(), encode(queued), reply=inbox, headers=headers_for(queued))
                await until(lambda: sched.snapshot()["queued"] == 1, "the second request queued")
                await cancel(nc, fp, new_request([1], 1))  # nobody runs it: ignored
                await nc.publish(Subjects(fp).generate_cancel(), b"not a cancel")  # logged, ignored
                for stranger in (gc.GenerateCancel(queued.request_id), gc.GenerateCancel(queued.request_id, "guess")):
                    await nc.publish(Subjects(fp).generate_cancel(), encode(stranger))  # no secret: ignored
                await nc.flush()
                await until(lambda: bb.server.bus.refused_cancels == 2, "the strangers' cancels refused")
                assert sched.snapshot()["queued"] == 1
                await cancel(nc, fp, queued)  # with its secret; never started: it leaves the queue
                await until(lambda: sched.snapshot()["queued"] == 0, "the queued request dropped")
                assert sched.snapshot()["active"] == 1  # the running stream is untouched
                await first.aclose()
                await until(lambda: sched.snapshot()["active"] == 0, "the running stream dropped")
                await sub.unsubscribe()
                return sched.snapshot(), dict(bb.server.bus.dropped)
            finally:
                await nc.close()

        snap, dropped = arun(go(), timeout=180)
    assert snap["cancelled"] == 2 and snap["completed"] == 0
    assert dropped == {"cancel": 2, "gone": 0}


def test_cancel_records_round_trip_and_validate():
    msg = gc.GenerateCancel("r-1.a")
    assert gc.decode_generate_cancel(msg.encode()) == msg
    assert Subjects("abc").generate_cancel() == "kvasir.abc.generate.cancel"
    for bad in ("", "a b", "x" * 65):
        with pytest.raises(gc.CodecError, match="request_id"):
            gc.GenerateCancel(bad)
    with pytest.raises(gc.CodecError):
        gc.decode_generate_cancel(gc.GenerateToken("r", 0, 1).encode())
    # only the requester's secret cancels: the request carries its hash, never the secret itself
    req = new_request("hello", 4)
    assert req.cancel_token and req.cancel_token.encode() not in req.encode()
    back = gc.decode_generate_request(req.encode())
    assert back.cancel_hash == req.cancel_hash and back.cancel_token == ""
    assert back.may_cancel(req.cancel_token) and not back.may_cancel("") and not back.may_cancel("guess")
    with_token = gc.GenerateCancel(req.request_id, req.cancel_token)
    assert gc.decode_generate_cancel(with_token.encode()) == with_token
    assert not gc.GenerateRequest("r", (1,)).may_cancel("")  # no hash: no message cancels it
    with pytest.raises(gc.CodecError, match="cancel_hash"):
        gc.GenerateRequest("r", (1,), cancel_hash="abc")


def test_a_queued_request_whose_client_vanished_leaves_the_queue_before_it_reaches_the_front(
        nats_server, model, fp, arun):
    with one_slot_backbone(model, nats_server.url, fp) as bb:
        sched = bb.server.scheduler

        async def go():
            runner, vanisher = await connect(nats_server.url, "runner"), await connect(nats_server.url, "vanisher")
            try:
                stream = generate(runner, fp, new_request([1, 2, 3], LONG, stop_on_eos=False))
                await stream.__anext__()  # running: it holds the only slot
                queued = new_request([4, 5], 4, stop_on_eos=False)
                inbox = vanisher.new_inbox()
                sub = await vanisher.subscribe(inbox)
                await vanisher.publish(Subjects(fp).generate(), encode(queued), reply=inbox, headers=headers_for(queued))
                await until(lambda: sched.snapshot()["queued"] == 1, "the second request queued")
                notice = await sub.next_msg(timeout=30)  # the backbone checks the client is there
                assert notice.data == b"" and notice.headers["Kvasir-Kind"] == "generate_queued"
                await vanisher.close()  # gone without a cancel
                await until(lambda: sched.snapshot()["queued"] == 0, "the vanished client's request dropped")
                assert sched.snapshot()["active"] == 1  # the running stream goes on
                assert bb.server.bus.dropped["gone"] == 1
                await stream.aclose()
            finally:
                for nc in (runner, vanisher):
                    if not nc.is_closed:
                        await nc.close()

        arun(go(), timeout=120)
