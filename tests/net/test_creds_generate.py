"""The generate API under `kvasir creds`: a client identity may ask a backbone for text (and
cancel its own stream, and read its own inbox) and nothing else; the backbone serves generate
only in its queue group; no worker may call generate. Against a real nats-server running the
generated config."""

from __future__ import annotations

import pytest

from backbone.generate_bus import QUEUE, GenerateBus, generate, generate_all, new_request
from backbone.model import Engine
from backbone.scheduler import Scheduler, SchedulerConfig
from kvasir_bus import creds
from kvasir_bus import generate_codec as gc
from kvasir_bus.cli import main as kvasir
from kvasir_bus.connect import inbox_prefix_for
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import Subjects
from tests.net.test_permissions import Client
from tests.polling import until

pytest.importorskip("llama_cpp", reason="the backbone's tokenizer is llama.cpp's vocabulary")

FP = "abc123"
M = Subjects(FP)


@pytest.fixture
def with_clients(tmp_path, capsys):
    """A deployment with clients c1 (from init) and c2 (from add-client), workers w1, w2."""
    out = tmp_path / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1,w2",
                   "--clients", "c1"]) == 0
    assert kvasir(["creds", "add-client", str(out), "c2"]) == 0
    capsys.readouterr()
    return out


def test_a_client_may_generate_and_cancel_and_nothing_else(with_clients, models, arun):
    from backbone.tokenizer import Tokenizer

    path = models("mixtral", "q8_0", ctx=4096)
    engine = Engine(path)
    dep = creds.load(with_clients)
    assert {i.name: i.role for i in dep.identities}["c2"] == "client"
    with EmbeddedNats(config=with_clients / "nats.conf", port=None, host=None) as server, \
            Scheduler(engine, SchedulerConfig(max_active=2, step_tokens=16)) as sched:
        async def go():
            bb = await Client.open(server.url, with_clients / "backbone.creds")
            c1 = await Client.open(server.url, with_clients / "c1.creds")
            c2 = await Client.open(server.url, with_clients / "c2.creds")
            w1 = await Client.open(server.url, with_clients / "w1.creds")
            # The backbone serves generate in the queue group only: alone it could starve the others.
            await bb.nc.subscribe(M.generate())
            assert "subscription" in await bb.refused(M.generate())
            bus = await GenerateBus(bb.nc, FP, "bb", sched, Tokenizer(path), engine.cfg.eos_id).start()

            # Both clients get their streams (c2 was added after init).
            for c in (c1, c2):
                tokens, _, done = await generate_all(c.nc, FP, new_request([1, 2, 3], 4, stop_on_eos=False))
                assert len(tokens) == 4 and done.node == "bb"
            # A client cancels its own stream (publish to generate.cancel is allowed) ...
            stream = generate(c1.nc, FP, new_request([1, 2, 3], 3000, stop_on_eos=False))
            await stream.__anext__()
            await stream.aclose()
            await until(lambda: bus.dropped["cancel"] == 1 and sched.snapshot()["active"] == 0, "the cancel")
            # ... and a client that vanishes is noticed under these permissions too (no responders).
            gone = await Client.open(server.url, with_clients / "c2.creds")
            stream = generate(gone.nc, FP, new_request([4, 5], 3000, stop_on_eos=False))
            await stream.__anext__()
            await gone.nc.close()
            await until(lambda: bus.dropped["gone"] == 1 and sched.snapshot()["active"] == 0, "the gone client")

            # Nothing else: no other subject, no other inbox, no requests meant for backbones.
            for subject in (M.dispatch(0, 1), M.coverage("c1"), M.ledger(), M.manifest(), M.status()):
                await c1.nc.publish(subject, b"x")
                assert subject in await c1.refused(subject)
            for subject in ("_INBOX.>", f"{inbox_prefix_for(dep_key(dep, 'c2'))}.>", M.generate(), "kvasir.>"):
                await c1.nc.subscribe(subject)
                assert "subscription" in await c1.refused(subject)
            # A worker may not call generate, nor cancel anyone's stream.
            for subject in (M.generate(), M.generate_cancel()):
                await w1.nc.publish(subject, gc.GenerateCancel("x").encode())
                assert subject in await w1.refused(subject)
            served = bus.served
            await bus.stop()
            for c in (bb, c1, c2, w1):
                await c.nc.close()
            return served, bb.errors

        served, bb_errors = arun(go(), timeout=180)
    assert served == 4
    assert [e for e in bb_errors if "permissions violation" in e.lower()] == [
        e for e in bb_errors if M.generate() in e]  # the backbone's only refusal was the test's


def dep_key(dep: creds.Deployment, name: str) -> str:
    return next(i.public_key for i in dep.identities if i.name == name)


def test_client_names_are_checked_and_the_permissions_name_the_queue_group(tmp_path, capsys):
    out = tmp_path / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1"]) == 0
    for bad in ("w1", "backbone", "bad.name"):
        assert kvasir(["creds", "add-client", str(out), bad]) == 2
    err = capsys.readouterr().err
    assert "exists already" in err and "reserved" in err and "Traceback" not in err
    perms = creds.permissions("backbone", "backbone", "UKEY", ("UCLIENT",))
    assert f"kvasir.*.generate {QUEUE}" in perms["subscribe"]["allow"]
    assert "kvasir.*.generate" not in perms["subscribe"]["allow"]
    assert f"{inbox_prefix_for('UCLIENT')}.>" in perms["publish"]["allow"]
    for role in ("worker", "market", "observer"):
        allowed = creds.permissions(role, "n1", "UKEY")["publish"]["allow"]
        assert not any("generate" in s for s in allowed), role
