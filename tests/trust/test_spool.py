"""The backbone's ledger spool (backbone/spool.py) and the market link's use of it.

Pure tests read and write spool files; the link tests run the real MarketLink on a real
nats-server with JetStream (no market needed: the stream's acknowledgement is the watermark).
A "crash" in-process is a link whose spool is let go without ``stop()`` (no flush, no
compaction): what a SIGKILL leaves (tests/trust/test_market_ledger_crash.py kills a real
``kvasir generate``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from backbone import spool
from backbone.market_link import MarketLink
from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.errors import KvasirError
from market.ledger import Ledger
from tests.market.fakes import FP, wait_for


def ev(i: int, node: str = "w") -> mc.LedgerEvent:
    return mc.LedgerEvent(f"bb:x:{i}", node, i % 2, i % 8, 1 + i % 3, 1.0 + i)


def write(path, records):
    path.write_bytes(b"".join(spool.frame(r) for r in [["H", 1, FP, "bb"], *records]))


def test_a_spool_file_keeps_what_was_not_acknowledged(tmp_path):
    routing = mc.RoutingStats(FP, "bb", 1.0, (), remote=((0, 0, 5),)).encode()
    write(tmp_path / spool.FILE, [
        spool.event_record(ev(0)), spool.event_record(ev(1)), ["R", "r1", routing],
        ["B", "b1", [ev(0).event_id, ev(1).event_id]], ["A", "r1"],
        spool.event_record(ev(2)), ["R", "r2", routing], ["B", "b2", [ev(2).event_id]],
        ["A", "b1"],
        spool.event_record(ev(3)), spool.event_record(ev(4, "liar")), ["V", "liar"],
        spool.event_record(ev(5))])
    got = spool.read(tmp_path)
    assert (got.model, got.node) == (FP, "bb")
    assert [m for m, _ in got.routing] == ["r2"]                     # r1 was acknowledged
    assert [(b, [e.event_id for e in es]) for b, es in got.batches] == [("b2", [ev(2).event_id])]
    assert got.pending == [ev(3), ev(5)]                             # the voided node's win dropped
    assert got.events == 3 and len(got.wins) == 6 and not got.torn


def test_a_torn_tail_is_cut_off_and_said(tmp_path):
    write(tmp_path / spool.FILE, [spool.event_record(ev(0)), spool.event_record(ev(1))])
    data = (tmp_path / spool.FILE).read_bytes()
    (tmp_path / spool.FILE).write_bytes(data[:-3])                   # a crash mid-record
    got = spool.read(tmp_path)
    assert got.pending == [ev(0)] and got.torn
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF                                             # a flipped byte: CRC
    (tmp_path / spool.FILE).write_bytes(bytes(flipped))
    assert spool.read(tmp_path).pending == [ev(0)]


def test_two_processes_never_share_a_spool(tmp_path):
    first = spool.Spool(tmp_path)
    first.open(FP, "bb")
    with pytest.raises(KvasirError, match="in use by another process"):
        spool.Spool(tmp_path).open(FP, "bb")
    first.close()
    second = spool.Spool(tmp_path)
    second.open(FP, "bb")
    second.rewrite([])
    second.close()
    with pytest.raises(KvasirError, match="belongs to model"):
        spool.Spool(tmp_path).open("0123456789abcdef", "bb")


def test_the_default_spool_is_per_model_and_node_under_the_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert spool.resolve(None, FP, "bb") == tmp_path / "kvasir" / "spool" / FP / "bb"
    assert spool.resolve("off", FP, "bb") is None
    assert spool.resolve("/x/y", FP, "bb") == spool.Path("/x/y")


async def stream_messages(nc):
    """Every message in the ledger stream: (subject, Nats-Msg-Id, record)."""
    js = nc.jetstream()
    info = await js.stream_info(ledger_stream.STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        m = await js.get_msg(ledger_stream.STREAM, seq)
        decode = mc.decode_ledger if m.subject.endswith(".ledger") else mc.decode_routing
        out.append((m.subject, (m.headers or {}).get(ledger_stream.MSG_ID), decode(m.data)))
    return out


def test_wins_spooled_before_a_crash_are_sent_by_the_next_start_under_their_first_ids(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="bb")
        await ledger_stream.ensure_stream(nc.jetstream())
        # 1: a link that records wins and dies before any flush
        dead = MarketLink(nc, FP, "bb", spool=spool.Spool(tmp_path), flush_s=60, interval_s=60)
        await dead.start()
        for i in range(7):
            dead.record_win("w", i % 2, i % 8, 2, 0.001)
        dead._cut()  # routing and a batch cut (and spooled), never sent
        for i in range(7, 10):
            dead.record_win("w", i % 2, i % 8, 2, 0.001)
        dead._task.cancel()
        dead.spool.close()  # the process is gone: its lock with it
        cut = spool.read(tmp_path)
        assert cut.events == 10 and len(cut.batches) == 1 and len(cut.routing) == 1
        batch_id, routing_id = cut.batches[0][0], cut.routing[0][0]
        # 2: the next start sends them all, the cut ones under the ids they were cut with
        link = MarketLink(nc, FP, "bb", spool=spool.Spool(tmp_path))
        await link.start()
        assert link.replayed_events == 10
        await wait_for(lambda: link.unacked_events == 0, timeout=10, what="the replay stored")
        await link.stop()
        got = await stream_messages(nc)
        ids = [msg_id for _, msg_id, _ in got]
        assert batch_id in ids and routing_id in ids
        events = [e for _, _, r in got if isinstance(r, mc.LedgerBatch) for e in r.events]
        assert sorted(e.event_id for e in events) == sorted(e.event_id for e in cut.wins)
        remote = sum(rows for _, _, r in got if isinstance(r, mc.RoutingStats) for _, _, rows in r.remote)
        assert remote == sum(e.rows for e in cut.wins) == 20        # every win backed, once
        assert spool.read(tmp_path).events == 0                      # compacted at stop
        # 3: a resend of the replayed batch is stored once (the stream's duplicate window)
        again = MarketLink(nc, FP, "bb", spool=spool.Spool(tmp_path))
        await again.start()
        await again.stop()
        assert len(await stream_messages(nc)) == len(got)
        await nc.close()

    arun(go(), timeout=30)


def test_the_spool_stays_small_while_the_stream_keeps_up_and_refuses_past_its_bound(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="bb")
        await ledger_stream.ensure_stream(nc.jetstream())
        link = MarketLink(nc, FP, "bb", flush_s=0.01, interval_s=0.05,
                          spool=spool.Spool(tmp_path / "a", compact_bytes=4096, max_bytes=1 << 20))
        await link.start()
        for i in range(3000):
            link.record_win("w", i % 2, i % 8, 1)
            if i % 100 == 0:
                await asyncio.sleep(0.01)
        await wait_for(lambda: link.unacked_events == 0, timeout=20, what="all stored")
        assert link.spool.size < 50_000   # compacted as it went (3000 wins and their acks: ~200 kB)
        await link.stop()
        # a bound the stream cannot keep under: refused loudly, the wins still go out
        tiny = MarketLink(nc, FP, "bb2",
                          spool=spool.Spool(tmp_path / "b", compact_bytes=512, max_bytes=1024))
        await tiny.start()
        for i in range(100):
            tiny.record_win("w", 0, 0, 1)
        assert tiny.spool_refused > 0
        await tiny.stop()
        assert tiny.acked_events == 100
        await nc.close()

    arun(go(), timeout=40)


def test_kvasir_ledger_replay_flushes_a_dead_backbones_spool(nats_server, tmp_path):
    events = [ev(i) for i in range(5)]
    write(tmp_path / spool.FILE, [spool.event_record(e) for e in events])
    cmd = [sys.executable, "-m", "kvasir_bus.cli", "ledger", "replay", "--spool", str(tmp_path),
           "--nats", nats_server.url, "--json"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["model"], got["node"], got["replayed"], got["stored"], got["unsent"]) == (FP, "bb", 5, 5, 0)
    assert spool.read(tmp_path).events == 0
    bad = subprocess.run([*cmd[:6], str(tmp_path / "nowhere"), *cmd[7:]], capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "no ledger spool at" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_market_adds_a_replayed_routing_bound_once_past_the_streams_window(tmp_path):
    with Ledger(tmp_path / "m.db") as led:
        assert led.apply_routing("S", 1, FP, "bb", [(0, 1, 5)], msg_id="bb:x:r1")
        assert not led.apply_routing("S", 2, FP, "bb", [(0, 1, 5)], msg_id="bb:x:r1")  # replayed
        assert led.apply_routing("S", 3, FP, "bb", [(0, 1, 5)], msg_id="bb:x:r2")
        got = led.apply_batch("S", 4, FP, "bb", "b", [(mc.LedgerEvent(f"e{i}", "w", 0, 1, 5, 1.0), 1.0)
                                                      for i in range(3)], 1.0)
        assert got[0]["accepted"] == 2 and got[0]["unbacked"] == 1


def test_the_ledger_is_idempotent_by_ids_not_by_stream_order(tmp_path):
    """Redelivered messages come with lower stream sequences than ones applied since: they
    are applied if new, once; a held batch stores nothing until its bound is there."""
    def events(tag, n):
        return [(mc.LedgerEvent(f"{tag}{i}", "w", 0, 1, 5, 1.0), 1.0) for i in range(n)]

    with Ledger(tmp_path / "m.db") as led:
        assert led.apply_routing("S", 9, FP, "bb", [(0, 1, 5)], msg_id="bb:x:r2")
        assert led.apply_batch("S", 10, FP, "bb", "b2", events("late", 1), 1.0)[0]["accepted"] == 1
        assert led.apply_batch("S", 8, FP, "bb", "b1", events("early", 1), 1.0, True) is None  # held
        assert led.stream_seq("S") == 10
        assert led.apply_routing("S", 7, FP, "bb", [(0, 1, 5)], msg_id="bb:x:r1")  # redelivered late
        got = led.apply_batch("S", 8, FP, "bb", "b1", events("early", 1), 1.0, True)
        assert got[0]["accepted"] == 1 and led.stream_seq("S") == 10
        again = led.apply_batch("S", 8, FP, "bb", "b1", events("early", 1), 1.0)  # acked too late
        assert again[0]["duplicates"] == 1 and again[0]["accepted"] == 0
        assert led.apply_routing("S", 11, FP, "bb", [(0, 1, 5)])           # no msg id: its seq
        assert not led.apply_routing("S", 11, FP, "bb", [(0, 1, 5)])
        assert led.apply_quarantine("S", 12, FP, "w", 1.0) == 10
        assert led.apply_quarantine("S", 12, FP, "w", 1.0) is None


def test_generate_replays_its_spool_at_start_and_reports_it_in_json(nats_server, models, tmp_path):
    pytest.importorskip("llama_cpp", reason="the backbone's kernel and the synthetic models need llama.cpp")
    from backbone.model import Engine
    from kvasir_bus.fingerprint import model_fingerprint

    model = models("qwen2moe", "q4_k")
    fp = model_fingerprint(Engine(model).reader)
    events = [mc.LedgerEvent(f"backbone:dead:{i}", "w", 1, i % 8, 1, 1.0) for i in range(4)]
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / spool.FILE).write_bytes(b"".join(spool.frame(r) for r in [
        ["H", 1, fp, "backbone"], *(spool.event_record(e) for e in events)]))
    done = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "generate", "--model", str(model), "--prompt", "hi",
                           "-n", "2", "--json", "--nats", nats_server.url, "--spool", str(tmp_path / "sp")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]
    ledger = json.loads(done.stdout)["ledger"]
    assert ledger["replayed"] == 4 and ledger["stored"] >= 4 and ledger["unsent"] == 0
    assert ledger["spool"] == str(tmp_path / "sp")
    assert "ledger_spool_replay" in done.stderr
    assert spool.read(tmp_path / "sp").events == 0


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["up"]])
def test_generate_serve_and_up_take_a_spool_and_hand_it_to_the_backbone(command, tmp_path):
    from backbone.service import BackboneConfig
    from kvasir_bus.cli import build_parser

    args = build_parser().parse_args([command[0], "--model", "m.gguf", *command[1:], "--spool", str(tmp_path)])
    assert BackboneConfig.from_args(args).spool == str(tmp_path)
    args = build_parser().parse_args([command[0], "--model", "m.gguf", *command[1:]])
    assert BackboneConfig.from_args(args).spool is None  # the default place


def test_a_stop_out_of_time_or_cancelled_still_lets_go_of_the_spool(nats_server, arun, tmp_path):
    """A shutdown whose flush cannot finish (a stream that never acknowledges) keeps the wins in
    the spool and releases its lock: the next backbone of the node starts (a CI failure once)."""
    async def go():
        nc = await connect(nats_server.url, name="bb")
        never = asyncio.Event()

        async def hangs(*args):
            await never.wait()

        for cancel in (False, True):
            link = MarketLink(nc, FP, "bb", spool=spool.Spool(tmp_path), flush_s=60, interval_s=60)
            await link.start()
            link._store = hangs
            for i in range(4):
                link.record_win("w", 0, i, 1, 0.001)
            if cancel:  # the service's bus thread stopped under a stop that ran out of time
                stopping = asyncio.create_task(link.stop(flush_timeout_s=60))
                await asyncio.sleep(0.05)
                stopping.cancel()
                await asyncio.gather(stopping, return_exceptions=True)
            else:
                await link.stop(flush_timeout_s=0.2)
            assert link.spool.closed
            kept = spool.Spool(tmp_path)
            assert kept.open(FP, "bb").events == 4 * (1 + cancel)  # nothing lost, and taken again
            kept.close()
        await nc.close()

    arun(go(), timeout=30)
