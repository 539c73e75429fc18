"""Voiding takes only what was not verified: a quarantine voids the node's events won since its
last passed audit (``Quarantine.since``); credit for work before it stays, in the market and in
the backbone's wins not yet sent to it."""

from __future__ import annotations

from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from market.service import Market
from tests.market.fakes import FP, FakeBackbone, make_manifest, stream_read
from tests.trust.test_market_attacks import config

from backbone.audit import AuditConfig, Auditor
import numpy as np

S_MODEL = FP


def test_the_backbone_names_the_last_passed_audit_in_its_verdict():
    auditor = Auditor(AuditConfig(seed=1))
    ref = np.ones((1, 4), np.float32)
    assert auditor.last_pass_at("n") == 0.0
    auditor.should_audit("n", 0)
    auditor.judge("n", ref, ref, exact=True, weight_type=0)
    passed = auditor.last_pass_at("n")
    auditor.should_audit("n", 0)
    auditor.judge("n", ref * 0, ref, exact=True, weight_type=0)
    assert auditor.is_quarantined("n") and auditor.last_pass_at("n") == passed > 0


def test_a_quarantine_voids_only_the_events_since_the_last_passed_audit(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(tmp_path / "m.db")).start()
        bb = await FakeBackbone(nats_server.url, make_manifest()).start()
        try:
            events = tuple(mc.LedgerEvent(f"e:{t}", "w", 0, t % 24, 10, float(t)) for t in range(1, 11))
            await bb.ledger(mc.LedgerBatch(FP, "backbone", "b1", events))
            await stream_read(bb.nc)
            q = mc.Quarantine(FP, "w", 0, 3, "ggml", True, 1.0, at=11.0, since=5.5)  # passed at 5.5, failed at 11
            await bb.nc.jetstream().publish(bb.subjects.quarantine(), q.encode(), headers={ledger_stream.MSG_ID: "q"})
            await stream_read(bb.nc)
            st = await market.status(FP)
            assert {t.node: t.rows for t in st.totals} == {"w": 50}  # events at 1..5 stay, 6..10 void
            assert "w" in st.quarantined
        finally:
            await bb.stop()
            await market.stop()
            await nc.close()

    arun(go(), timeout=30)


def test_a_verdict_is_applied_with_no_backbone_left_to_send_the_manifest(nats_server, arun, tmp_path):
    """The backbone that caught a liar may be gone before the market has its manifest: the
    verdict needs none (it bans and voids), so it is applied, not held 30 s and then refused."""
    async def go():
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(tmp_path / "m.db")).start()
        try:
            js = nc.jetstream()
            await ledger_stream.ensure_stream(js)
            q = mc.Quarantine(FP, "liar", 0, 3, "ggml", True, 1.0, at=11.0, since=0.0)
            await js.publish(Subjects(FP).quarantine(), q.encode(), headers={ledger_stream.MSG_ID: "q"})
            await stream_read(nc, timeout=10.0)
            assert market.models[FP].manifest is None  # nobody answered for it
            assert "liar" in market.models[FP].coverage.banned
            assert "liar" in (await market.status(FP)).quarantined
        finally:
            await market.stop()
            await nc.close()

    arun(go(), timeout=30)


# -- the backbone's side: what it has not sent yet ---------------------------------------------

def test_a_quarantine_on_the_backbone_keeps_the_audited_wins_it_has_not_sent_yet():
    """The dispatcher with the real market link as its recorder, never started (no stream: every
    win waits in it, unsent). A node answers honestly for 12 steps (its probation of 4 and sampled
    audits after), then lies. Its unsent wins up to its last passed audit, that audited win
    included, stay; those after it (unaudited lies the backbone used) are dropped."""
    from backbone.dispatch import DispatchConfig, RemoteExperts
    from backbone.market_link import MarketLink
    from kvasir_bus.loopthread import LoopThread
    from tests.backbone.test_dispatch import MODEL, ROWS, D, DoublingLocal, FakeNats, reply

    honest_steps = 12
    bus = LoopThread("test-voiding")
    try:
        nc, local = FakeNats(), DoublingLocal()
        link = MarketLink(None, MODEL, "bb")
        cfg = DispatchConfig(timeout_s=5.0, bundles=False, audit=AuditConfig(rate=0.2, probation=4, seed=7))
        remote = RemoteExperts(bus, nc, MODEL, local, D, cfg, recorder=link)
        bus.run(remote.start())
        replies = 0

        def answer(subject, req):
            nonlocal replies
            replies += 1
            return [reply(req, (2 if replies <= honest_steps else 5) * req.rows, "w")]  # the local result is 2x

        nc.answer = answer
        audited_steps = []
        for step in range(200):
            before = len(local.calls)
            remote.run_layer(0, [(step % 4, ROWS)])
            if len(local.calls) > before:
                audited_steps.append(step)
            if remote.auditor.is_quarantined("w"):
                break
        assert remote.auditor.is_quarantined("w") and step >= honest_steps
        last_pass = max(s for s in audited_steps if s < honest_steps)
        lies_used = step - honest_steps  # unaudited lying steps before the catching one
        assert lies_used > 0 or step == honest_steps
        # wins of steps 0..last_pass stay (the audited one too); those after it go
        assert link.unacked_events == last_pass + 1, (audited_steps, step)
        assert all(e.at < remote.auditor.last_pass_at("w") for e in link._events)
        link.record_win("w", 0, 1, 2)  # and nothing more of it is recorded
        assert link.unacked_events == last_pass + 1
    finally:
        bus.stop()


def test_the_spool_replays_a_void_as_the_link_made_it():
    from backbone import spool

    events = [mc.LedgerEvent(f"e{t}", "w", 0, 0, 1, float(t)) for t in (1, 4, 9)]
    records = [spool.event_record(e) for e in events]
    assert [e.at for e in spool.parse([*records, ["V", "w", 5.0]]).pending] == [1.0, 4.0]
    assert spool.parse([*records, ["V", "w"]]).pending == []  # a spool written before ``since``: all
