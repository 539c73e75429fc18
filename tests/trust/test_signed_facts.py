"""Facts that move money or trust are signed (kvasir_bus.signing): on an open bus a forger can
publish routing (with its audit counts), ledger and quarantine records into the stream, and the
market counts none of them once it trusts only the real backbone's key."""

from __future__ import annotations

from kvasir_bus import ledger_stream, market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.logs import capture
from kvasir_bus.signing import SIG_HEADER, SIGNER_HEADER, Signer, Verifier, SignatureError
from kvasir_bus.subjects import Subjects
from market.service import Market
from tests.market.fakes import FP, FakeBackbone, make_manifest, stream_read
from tests.trust.test_market_attacks import config

import pytest

S = Subjects(FP)


class SignedBackbone(FakeBackbone):
    """The fake backbone, signing what it stores as the real one does (backbone.market_link)."""

    def __init__(self, url, manifest, signer: Signer, node: str = "backbone"):
        super().__init__(url, manifest, node)
        self.signer = signer

    async def _store(self, subject: str, data: bytes, msg_id: str):
        js = self.nc.jetstream()
        await ledger_stream.ensure_stream(js)
        return await js.publish(subject, data, headers={ledger_stream.MSG_ID: msg_id, **self.signer.headers(data)})


def test_a_signature_covers_the_exact_bytes_and_only_trusted_keys_count():
    real, other = Signer.fresh(), Signer.fresh()
    verifier = Verifier([real.public_key])
    payload = mc.Quarantine(FP, "w1", 0, 3, "ggml", True, 1.0, 1.0).encode()
    assert verifier.check(payload, real.headers(payload)) == real.public_key
    for data, headers, why in [
            (payload + b"\0", real.headers(payload), "bad signature"),  # one byte more
            (payload, {}, "unsigned"),
            (payload, other.headers(payload), "not trusted"),  # a valid signature of an unknown key
            (payload, {**other.headers(payload), SIGNER_HEADER: real.public_key}, "bad signature"),
            (payload, {SIGNER_HEADER: real.public_key, SIG_HEADER: "!!"}, "bad signature")]:
        with pytest.raises(SignatureError, match=why):
            verifier.check(data, headers)


def test_forged_routing_ledger_and_quarantine_are_refused_and_signed_ones_count(nats_server, arun, tmp_path):
    signer = Signer.fresh()

    async def go():
        nc = await connect(nats_server.url, name="market")
        market = await Market(nc, config(tmp_path / "m.db", trusted_backbones=(signer.public_key,))).start()
        bb = await SignedBackbone(nats_server.url, make_manifest(), signer).start()
        forger = await FakeBackbone(nats_server.url, make_manifest()).start()  # same name, no key
        impostor = await SignedBackbone(nats_server.url, make_manifest(), Signer.fresh()).start()  # a key, not trusted
        try:
            await bb.ledger(mc.LedgerBatch(FP, "backbone", "real-1", (mc.LedgerEvent("real:1", "honest", 0, 3, 7, 1.0),)))
            with capture() as lines:
                for i, fake in enumerate((forger, impostor)):
                    # routing that backs the forged rows, then the batch: the 2,000,000 rows
                    await fake.ledger(mc.LedgerBatch(FP, "backbone", f"forged-{i}", tuple(
                        mc.LedgerEvent(f"evil:{i}:{k}", "evil", 0, k % 24, 1000, 1.0) for k in range(2000))))
                    q = mc.Quarantine(FP, "honest", 0, 3, "ggml", True, 1.0, 1.0)
                    await fake._store(S.quarantine(), q.encode(), f"q-forged-{i}")
                    lies = mc.RoutingStats(FP, "backbone", 1.0, (), audits=(("evil", 1000, 0), ("honest", 0, 1000)))
                    await fake._store(S.routing(), lies.encode(), f"audits-forged-{i}")  # audits it never judged
                await bb.ledger(mc.LedgerBatch(FP, "backbone", "real-2", (mc.LedgerEvent("real:2", "honest", 0, 4, 5, 1.0),)))
                audits = mc.RoutingStats(FP, "backbone", 1.0, (), audits=(("honest", 5, 0),))
                await bb._store(S.routing(), audits.encode(), "audits-real")
                await stream_read(bb.nc, timeout=40)
            st = await market.status(FP)
            assert {t.node: t.rows for t in st.totals} == {"honest": 12}
            assert {a.node: (a.passed, a.failed) for a in st.audits} == {"honest": (5, 0)}  # only the signed count
            assert "honest" not in market.models[FP].coverage.banned
            assert market.unsigned_refused >= 6  # 2 x (routing, ledger, quarantine)
            kinds = {line["event"] for line in lines if line.get("note", "").startswith("only records signed")}
            assert kinds == {"routing_refused", "ledger_refused", "quarantine_refused"}
            assert sum(line["event"] == "ledger_refused" for line in lines) == 1  # one line per kind a minute

            q = mc.Quarantine(FP, "liar", 0, 3, "ggml", True, 1.0, 1.0)  # the real backbone's verdict counts
            await bb._store(S.quarantine(), q.encode(), "q-real")
            await stream_read(bb.nc, timeout=20)
            assert "liar" in market.models[FP].coverage.banned
        finally:
            for peer in (impostor, forger, bb):
                await peer.stop()
            await market.stop()
            await nc.close()

    arun(go(), timeout=60)
