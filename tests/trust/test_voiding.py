"""Voiding takes only what was not verified: a quarantine voids the node's events won since its
last passed audit (``Quarantine.since``); credit for work before it stays."""

from __future__ import annotations

from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.connect import connect
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
