"""Market wire codecs: round trips, every refusal naming its field, the manifest at real size."""

import hashlib
import re

import msgpack
import numpy as np
import pytest

from kvasir_bus import market_codec as mc
from kvasir_bus.codec import CodecError, ErrorReply, Holding, UnsupportedVersionError
from kvasir_bus.market_codec import (Assignment, DemandEntry, DemandMap, LedgerAck,
                                     LedgerBatch, LedgerEvent, Manifest, MarketOverview,
                                     MarketStatus, NodeStatus, NodeTotals, RoutingStats,
                                     SlabRef, VolunteerRequest)

FP = "0123456789abcdef"
SHA = "ab" * 32


def sha(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def manifest(n_layer=2, n_expert=4, slab=100, dense=(), **kw) -> Manifest:
    slabs, offset = [], 64
    for layer in range(n_layer):
        if layer in dense:
            continue
        for expert in range(n_expert):
            for kind in mc.KINDS:
                slabs.append(SlabRef(layer, expert, kind, offset, slab + layer,
                                     sha(layer, expert, kind)))
                offset += slab + layer
    fields = dict(model=FP, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, n_embd=8,
                  n_ff=4, file_bytes=offset, data_offset=64, source_url="", slabs=tuple(slabs))
    fields.update(kw)
    return Manifest(**fields)


def status(**kw) -> MarketStatus:
    fields = dict(
        model=FP, market="market", sent_at=1.5e9, manifest_known=True, n_layer=2, n_expert=4,
        range_experts=2, expiry_s=10.0,
        nodes=(NodeStatus("w-1", (Holding(0, 0, 2),), (Holding(1, 2, 4),), 1000, 0.5, 7, 2.5,
                          "0.1.0", "numpy", latency_ms=3.25),
               NodeStatus("w-2", (), (Holding(0, 2, 4),), 500, 0.0, 0, None, "", "")),
        demand=(DemandEntry(0, 0, 2, 1, 1, 0.5, 0.0, 1.0), DemandEntry(0, 2, 4, 0, 2, 0.5, 2.0,
                                                                     2.0)),
        totals=(NodeTotals("w-1", 3, 40, 52.5),), fallback_rate=0.25)
    fields.update(kw)
    return MarketStatus(**fields)


def batch(**kw) -> LedgerBatch:
    fields = dict(model=FP, source="backbone", batch_id="b-1",
                  events=(LedgerEvent("e-1", "w-1", 0, 3, 4, 1.7e9),
                          LedgerEvent("e-2", "w-2", 1, 0, 1, 1.7e9 + 0.5)))
    fields.update(kw)
    return LedgerBatch(**fields)


def patched(record, **overrides) -> bytes:
    """A valid record's wire map with fields replaced (None deletes a key)."""
    body = msgpack.unpackb(record.encode(), raw=False)
    for key, value in overrides.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return msgpack.packb(body, use_bin_type=True)


# -- round trips ----------------------------------------------------------------------------

def test_manifest_round_trip_and_helpers():
    m = manifest(n_layer=3, dense=(0,))
    back = mc.decode_manifest(m.encode())
    assert back == m
    assert back.moe_layers == (1, 2)
    assert back.expert_bytes(1) == 3 * 101 and back.expert_bytes(2) == 3 * 102
    slabs = back.slabs_for(2, 3)
    assert [s.kind for s in slabs] == ["gate", "up", "down"]
    assert all((s.layer, s.expert) == (2, 3) for s in slabs)
    assert slabs[0].sha256 == sha(2, 3, "gate")
    with pytest.raises(KeyError, match="layer 0 has no experts"):
        back.expert_bytes(0)
    with pytest.raises(KeyError, match="no layer 0 expert 1"):
        back.slabs_for(0, 1)


def test_manifest_slabs_are_sorted_whatever_the_order_given():
    m = manifest()
    shuffled = Manifest(**{**m.__dict__, "slabs": tuple(reversed(m.slabs))})
    assert shuffled.slabs == m.slabs and shuffled == m


def test_manifest_reply_may_be_an_error():
    err = ErrorReply("", "backbone", "not_ready", "loading")
    assert mc.decode_manifest_reply(mc.encode(err)) == err
    assert mc.decode_manifest_reply(manifest().encode()) == manifest()


def test_manifest_at_the_real_122b_size_stays_well_under_8_mb():
    slab = 1_769_472  # Q4_K gate/up/down of one expert: hidden 3072, expert FFN 1024
    slabs, offset = [], 10_000
    for layer in range(48):
        for expert in range(256):
            for kind in mc.KINDS:
                slabs.append(SlabRef(layer, expert, kind, offset, slab,
                                     hashlib.sha256(offset.to_bytes(8, "little")).hexdigest()))
                offset += slab
    m = Manifest(model=FP, arch="qwen3moe", n_layer=48, n_expert=256, n_embd=3072, n_ff=1024,
                 file_bytes=offset, data_offset=10_000, source_url="https://example.org/m.gguf",
                 slabs=tuple(slabs))
    data = m.encode()
    assert len(m.slabs) == 36_864
    assert len(data) < 3 * 1024 * 1024  # 57 bytes per slab: ~2.1 MB
    back = mc.decode_manifest(data)
    assert back == m and back.expert_bytes(47) == 3 * slab


def test_volunteer_and_assignment_round_trip():
    req = VolunteerRequest(FP, "phone-1", 340 * 2**20)
    assert mc.decode_volunteer(req.encode()) == req
    a = Assignment(FP, "phone-1", [(0, 0, 32), (3, 32, 64)], 32 * 5_308_416, 2.5)
    assert a.holdings == (Holding(0, 0, 32), Holding(3, 32, 64)) and a.n_experts == 64
    assert mc.decode_volunteer_reply(a.encode()) == a
    err = ErrorReply("", "market", mc.ERR_NO_FIT, "too small")
    assert mc.decode_volunteer_reply(err.encode()) == err


def test_routing_round_trip_sparse_hits_and_fallback_rate():
    rs = RoutingStats(FP, "backbone", 5.0, ((0, 3, 17), (47, 255, 2**40)), fallback_rate=0.125)
    back = mc.decode_routing(rs.encode())
    assert back == rs
    plain = RoutingStats(FP, "backbone", 1.0, [])
    assert mc.decode_routing(plain.encode()) == plain and plain.fallback_rate is None
    arr = RoutingStats(FP, "bb", 1.0, np.array([[1, 2, 3]], dtype=np.int64))
    assert arr.hits == ((1, 2, 3),)


def test_routing_latency_per_node_round_trips_and_is_absent_when_empty():
    rs = RoutingStats(FP, "backbone", 1.0, [(0, 3, 17)], remote=[(0, 3, 17)],
                      latency=[("phone-1", 12, 4.5), ("gpu-2", 5, 0)])
    assert rs.latency == (("phone-1", 12, 4.5), ("gpu-2", 5, 0.0))
    back = mc.decode_routing(rs.encode())
    assert back == rs and isinstance(back.latency[1][2], float)
    # An older backbone's record (no latency key) reads as no latency, and an empty one is
    # encoded as such: older markets see the record they know.
    assert "latency" not in msgpack.unpackb(RoutingStats(FP, "bb", 1.0, []).encode())
    assert mc.decode_routing(patched(rs, latency=None)).latency == ()


def test_routing_audits_per_node_round_trip_are_bounded_and_absent_when_empty():
    rs = RoutingStats(FP, "backbone", 1.0, [(0, 3, 17)], audits=[("tab-a", 16, 0), ("liar", 0, 1)])
    assert mc.decode_routing(rs.encode()) == rs and rs.audits == (("tab-a", 16, 0), ("liar", 0, 1))
    assert "audits" not in msgpack.unpackb(RoutingStats(FP, "bb", 1.0, []).encode())  # older markets' bytes
    assert mc.decode_routing(patched(rs, audits=None)).audits == ()  # an older backbone's record
    for bad, field in (([["tab-a", 1, 0], ["tab-a", 2, 0]], "audits[1].node"),  # a node twice
                       ([["tab-a", 0, 0]], "audits[0]"),  # counts no audit
                       ([["tab-a", -1, 2]], "audits[0].passed"), ([["tab-a", 1, 2**41]], "audits[0].failed"),
                       ([["no spaces", 1, 0]], "audits[0].node"), ([["tab-a", 1]], "audits[0]"),
                       ([["w", 1, 0]] * (mc.MAX_AUDIT_NODES + 1), "audits"), ("tab-a", "audits")):
        with pytest.raises(CodecError) as err:
            mc.decode_routing(patched(rs, audits=bad))
        assert err.value.field == field, (bad, err.value)


def test_node_audits_in_status_round_trip_and_older_status_reads_as_none():
    st = status(audits=(mc.NodeAudits("w-1", 57, 0), mc.NodeAudits("liar", 3, 1)))
    assert mc.decode_status_reply(st.encode()).audits == st.audits
    assert "audits" not in msgpack.unpackb(status().encode(), raw=False)
    assert mc.decode_status_reply(status().encode()).audits == ()
    with pytest.raises(CodecError, match="audits"):
        mc.decode_status_reply(patched(st, audits=[["w-1", -1, 0]]))


def test_a_node_report_round_trips_and_refuses_bad_counts():
    rep = mc.NodeReport(FP, "tab-a", "market", 1.5e9, events=3, rows=40, reward=52.5, audits_passed=19,
                        audits_failed=0, quarantined=False)
    assert mc.decode_node_report_reply(rep.encode()) == rep
    assert len(rep.encode()) < 256  # what a tab asks for every few seconds
    for field, value in (("audits_passed", -1), ("quarantined", 1), ("node", "a b"), ("reward", float("nan"))):
        with pytest.raises(CodecError) as err:
            mc.decode_node_report_reply(patched(rep, **{field: value}))
        assert err.value.field == field
    with pytest.raises(CodecError, match="audits_failed"):
        mc.decode_node_report_reply(patched(rep, audits_failed=None))  # every field is required


def test_routing_tokens_round_trip_and_are_absent_when_zero():
    rs = RoutingStats(FP, "backbone", 1.0, [(0, 3, 8)], tokens=np.int64(4))
    assert rs.tokens == 4 and type(rs.tokens) is int
    assert msgpack.unpackb(rs.encode())["tokens"] == 4
    assert mc.decode_routing(rs.encode()) == rs
    # 0 (not counted) stays off the wire, and an older backbone's record reads as 0.
    zero = RoutingStats(FP, "backbone", 1.0, [(0, 3, 8)])
    assert "tokens" not in msgpack.unpackb(zero.encode())
    assert mc.decode_routing(zero.encode()).tokens == 0
    assert mc.decode_routing(patched(rs, tokens=2**40)).tokens == 2**40


def test_node_latency_in_status_round_trips_and_older_status_reads_as_unknown():
    st = status()
    assert mc.decode_status_reply(st.encode()).nodes[0].latency_ms == 3.25
    assert st.nodes[1].latency_ms is None
    body = msgpack.unpackb(st.encode(), raw=False)
    assert "latency_ms" not in body["nodes"][1]  # None is left out, as older markets sent it
    del body["nodes"][0]["latency_ms"]
    older = mc.decode_status_reply(msgpack.packb(body, use_bin_type=True))
    assert [n.latency_ms for n in older.nodes] == [None, None]


def test_demand_map_round_trip_and_views():
    dm = DemandMap(FP, 1.7e9, [DemandEntry(0, 0, 8, 1, 1, 0.25, 0.0, 1.0),
                               (0, 8, 16, 0, 3, 0.75, 9.0, 3.0)])
    back = mc.decode_demand(dm.encode())
    assert back == dm
    assert back.holes == (back.entries[1],)
    assert back.entries[1].missing == 3 and back.entries[1].holding == Holding(0, 8, 16)
    assert back.entry(0, 8) is back.entries[1]
    with pytest.raises(KeyError):
        back.entry(1, 0)


def test_ledger_batch_ack_and_error_round_trip():
    b = batch()
    assert mc.decode_ledger(b.encode()) == b
    ack = LedgerAck("b-1", 2, 0)
    assert mc.decode_ledger_reply(ack.encode()) == ack
    err = ErrorReply("", "market", mc.ERR_NO_MANIFEST, "later")
    assert mc.decode_ledger_reply(err.encode()) == err


def test_status_and_overview_round_trip():
    st = status()
    assert mc.decode_status_reply(st.encode()) == st
    unknown = status(fallback_rate=None, manifest_known=False, n_layer=0, n_expert=0,
                     demand=(), nodes=(), totals=())
    assert mc.decode_status_reply(unknown.encode()) == unknown
    ov = MarketOverview(1.0, (st, unknown))
    assert mc.decode_status_reply(ov.encode()) == ov
    assert mc.decode_status_reply(MarketOverview(2.0).encode()) == MarketOverview(2.0)


def test_headers_describe_every_message():
    assert mc.headers_for(VolunteerRequest(FP, "n", 5)) == {
        "Kvasir-Version": "1", "Kvasir-Kind": "volunteer_request", "Kvasir-Model": FP,
        "Kvasir-Node": "n", "Kvasir-Budget": "5"}
    assert mc.headers_for(batch())["Kvasir-Events"] == "2"
    assert mc.headers_for(manifest())["Kvasir-Slabs"] == "24"
    for msg in (Assignment(FP, "n", [(0, 0, 1)], 1, 1.0), RoutingStats(FP, "b", 1.0, []),
                DemandMap(FP, 1.0, []), LedgerAck("b", 0, 0), status(), MarketOverview(1.0),
                ErrorReply("", "m", "no_fit", "x")):
        assert mc.headers_for(msg)["Kvasir-Version"] == "1"
    with pytest.raises(CodecError, match="not a Kvasir message"):
        mc.headers_for(object())
    with pytest.raises(CodecError, match="cannot encode"):
        mc.encode(object())


# -- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,field", [
    (dict(layer=-1), "layer"), (dict(expert=1.5), "expert"), (dict(kind="ffn"), "kind"),
    (dict(offset=-1), "offset"), (dict(size=0), "size"), (dict(sha256="AB" * 32), "sha256"),
    (dict(sha256="ab"), "sha256"), (dict(sha256=b"x" * 32), "sha256"),
])
def test_bad_slabs_are_refused(bad, field):
    fields = dict(layer=0, expert=0, kind="gate", offset=0, size=1, sha256=SHA)
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'") as info:
        SlabRef(**fields)
    assert info.value.field == field


@pytest.mark.parametrize("bad,field,why", [
    (dict(model="a.b"), "model", "not valid"),
    (dict(arch="has space"), "arch", "not valid"),
    (dict(n_layer=0), "n_layer", "out of range"),
    (dict(n_expert=0), "n_expert", "out of range"),
    (dict(n_embd=0), "n_embd", "out of range"),
    (dict(n_ff=-1), "n_ff", "out of range"),
    (dict(file_bytes=-1), "file_bytes", "out of range"),
    (dict(data_offset=10**12), "data_offset", "out of range"),
    (dict(source_url=3), "source_url", "must be a string"),
    (dict(source_url="x" * 3000), "source_url", "too long"),
    (dict(slabs="nope"), "slabs", "must be a list"),
    (dict(slabs=(1, 2)), "slabs[0]", "malformed"),
])
def test_bad_manifests_are_refused(bad, field, why):
    m = manifest()
    with pytest.raises(CodecError, match=re.escape(f"'{field}'") + ".*" + why):
        Manifest(**{**m.__dict__, **bad})


def test_manifest_slab_consistency_is_checked():
    m = manifest(n_layer=2, n_expert=2)
    base = {k: v for k, v in m.__dict__.items() if k in Manifest.__dataclass_fields__}
    slabs = list(m.slabs)
    with pytest.raises(CodecError, match="layer 5, but the model has 2 layers"):
        Manifest(**{**base, "slabs": slabs + [SlabRef(5, 0, "gate", 64, 1, SHA)]})
    with pytest.raises(CodecError, match="expert 9, but layers have 2 experts"):
        Manifest(**{**base, "slabs": slabs + [SlabRef(0, 9, "gate", 64, 1, SHA)]})
    with pytest.raises(CodecError, match="outside the tensor data"):
        Manifest(**{**base, "slabs": [SlabRef(0, 0, "gate", 0, 1, SHA)] + slabs[1:]})
    with pytest.raises(CodecError, match="repeats layer 0 expert 0 gate"):
        Manifest(**{**base, "slabs": slabs + [slabs[0]]})
    with pytest.raises(CodecError, match="lack the down slab of layer 1 expert 1"):
        Manifest(**{**base, "slabs": slabs[:-1]})
    with pytest.raises(CodecError, match="cover 1 experts of layer 1, expected all 2"):
        Manifest(**{**base, "slabs": slabs[:-3]})


@pytest.mark.parametrize("override,field", [
    (dict(n_slabs=-1), "n_slabs"), (dict(slab_layer=b"\0" * 3), "slab_layer"),
    (dict(slab_expert=None), "slab_expert"), (dict(slab_kind=b"\x07" * 24), "slab_kind"),
    (dict(slab_offset="x"), "slab_offset"), (dict(slab_sha256=b"\0" * 31), "slab_sha256"),
    (dict(model=None), "model"), (dict(arch=None), "arch"),
])
def test_bad_manifest_payloads_are_refused(override, field):
    with pytest.raises(CodecError, match=f"'{field}'"):
        mc.decode_manifest(patched(manifest(), **override))


@pytest.mark.parametrize("bad,field", [
    (dict(model="a b"), "model"), (dict(node="a.b"), "node"), (dict(budget_bytes=-1),
                                                                "budget_bytes"),
    (dict(budget_bytes="1"), "budget_bytes"), (dict(budget_bytes=True), "budget_bytes"),
])
def test_bad_volunteer_requests_are_refused(bad, field):
    fields = dict(model=FP, node="n", budget_bytes=1)
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'"):
        VolunteerRequest(**fields)
    with pytest.raises(CodecError, match=f"'{field}'"):
        mc.decode_volunteer(patched(VolunteerRequest(FP, "n", 1), **bad))


def test_volunteer_request_field_missing_is_named():
    with pytest.raises(CodecError, match="'budget_bytes' is missing"):
        mc.decode_volunteer(patched(VolunteerRequest(FP, "n", 1), budget_bytes=None))


@pytest.mark.parametrize("bad,field", [
    (dict(holdings=()), "holdings"), (dict(holdings=[(0, 4, 4)]), "holdings[0]"),
    (dict(bytes=0), "bytes"), (dict(reward_rate=-1.0), "reward_rate"),
    (dict(reward_rate=float("nan")), "reward_rate"), (dict(node="*"), "node"),
])
def test_bad_assignments_are_refused(bad, field):
    fields = dict(model=FP, node="n", holdings=[(0, 0, 4)], bytes=10, reward_rate=1.0)
    fields.update(bad)
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")):
        Assignment(**fields)


@pytest.mark.parametrize("bad,field", [
    (dict(window_s=-1.0), "window_s"), (dict(hits="x"), "hits"),
    (dict(hits=[(0, 1)]), "hits[0]"), (dict(hits=[(0, -1, 3)]), "hits[0].expert"),
    (dict(hits=[(0, 1, -3)]), "hits[0].rows"), (dict(fallback_rate=1.5), "fallback_rate"),
    (dict(fallback_rate="x"), "fallback_rate"), (dict(node=""), "node"),
    (dict(latency="x"), "latency"), (dict(latency=[("w", 1)]), "latency[0]"),
    (dict(latency=[("w 1", 1, 2.0)]), "latency[0].node"),
    (dict(latency=[("w", 0, 2.0)]), "latency[0].calls"),
    (dict(latency=[("w", 1, -2.0)]), "latency[0].mean_ms"),
    (dict(latency=[("w", 1, float("nan"))]), "latency[0].mean_ms"),
    (dict(latency=[("w", 1, 2.0), ("w", 2, 3.0)]), "latency[1].node"),
    (dict(latency=[(f"w{i}", 1, 1.0) for i in range(mc.MAX_LATENCY_NODES + 1)]), "latency"),
    (dict(tokens=-1), "tokens"), (dict(tokens=2**40 + 1), "tokens"), (dict(tokens=1.5), "tokens"),
    (dict(tokens=True), "tokens"), (dict(tokens="7"), "tokens"),
])
def test_bad_routing_stats_are_refused(bad, field):
    fields = dict(model=FP, node="bb", window_s=1.0, hits=[(0, 1, 2)])
    fields.update(bad)
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")):
        RoutingStats(**fields)


def test_bad_routing_payloads_are_refused():
    good = RoutingStats(FP, "bb", 1.0, [(0, 1, 2)])
    with pytest.raises(CodecError, match="'hit_rows' has 4 bytes but 1 entries need 8"):
        mc.decode_routing(patched(good, hit_rows=b"\0" * 4))
    with pytest.raises(CodecError, match="'n_hits'"):
        mc.decode_routing(patched(good, n_hits=None))
    with pytest.raises(CodecError, match="'tokens'"):
        mc.decode_routing(patched(good, tokens="many"))


@pytest.mark.parametrize("bad,field", [
    (dict(hi=3), "hi"), (dict(lo=-1), "lo"), (dict(replicas=-1), "replicas"),
    (dict(target=1.0), "target"), (dict(usage=float("inf")), "usage"),
    (dict(demand=-0.5), "demand"), (dict(reward_rate=None), "reward_rate"),
])
def test_bad_demand_entries_are_refused(bad, field):
    fields = dict(layer=0, lo=4, hi=8, replicas=0, target=1, usage=0.0, demand=1.0,
                  reward_rate=1.0)
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'"):
        DemandEntry(**fields)


def test_bad_demand_maps_are_refused():
    with pytest.raises(CodecError, match=re.escape("'entries[0]'")):
        DemandMap(FP, 1.0, [(0, 4, 2, 0, 1, 0.0, 0.0, 1.0)])
    with pytest.raises(CodecError, match="'entries' must be a list"):
        mc.decode_demand(patched(DemandMap(FP, 1.0, []), entries=5))
    with pytest.raises(CodecError, match="'sent_at'"):
        DemandMap(FP, -1.0, [])


@pytest.mark.parametrize("bad,field", [
    (dict(event_id=""), "event_id"), (dict(event_id="a b"), "event_id"),
    (dict(event_id="x" * 65), "event_id"), (dict(node="a.b"), "node"),
    (dict(layer=-1), "layer"), (dict(expert="1"), "expert"), (dict(rows=0), "rows"),
    (dict(at=float("nan")), "at"),
])
def test_bad_ledger_events_are_refused(bad, field):
    fields = dict(event_id="e-1", node="n", layer=0, expert=0, rows=1, at=1.0)
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'"):
        LedgerEvent(**fields)
    with pytest.raises(CodecError, match=re.escape(f"'events[0]'")) as info:
        batch(events=[tuple(fields.values())])
    assert info.value.field == f"events[0].{field}"


@pytest.mark.parametrize("bad,field", [
    (dict(model="m-x"), "model"), (dict(source="a b"), "source"),
    (dict(batch_id=""), "batch_id"), (dict(events="x"), "events"),
    (dict(events=[(1, 2)]), "events[0]"),
])
def test_bad_ledger_batches_are_refused(bad, field):
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")):
        batch(**bad)


def test_ledger_batch_size_is_limited():
    with pytest.raises(CodecError, match="max 100000"):
        batch(events=[LedgerEvent("e", "n", 0, 0, 1, 0.0)] * (mc.MAX_LEDGER_EVENTS + 1))


@pytest.mark.parametrize("bad,field", [
    (dict(batch_id="a b"), "batch_id"), (dict(accepted=-1), "accepted"),
    (dict(duplicates=None), "duplicates"),
])
def test_bad_ledger_acks_are_refused(bad, field):
    fields = dict(batch_id="b", accepted=0, duplicates=0)
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'"):
        LedgerAck(**fields)


@pytest.mark.parametrize("bad,field", [
    (dict(market="a b"), "market"), (dict(manifest_known=1), "manifest_known"),
    (dict(range_experts=0), "range_experts"), (dict(nodes=[5]), "nodes[0]"),
    (dict(nodes=[{"node": "x"}]), "nodes[0]"), (dict(totals=[("x", -1, 0, 0.0)]), "totals[0]"),
    (dict(fallback_rate=2.0), "fallback_rate"), (dict(expiry_s=-1), "expiry_s"),
])
def test_bad_status_is_refused(bad, field):
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")):
        status(**bad)


@pytest.mark.parametrize("bad,field", [
    (dict(age_s=-1.0), "age_s"), (dict(pending=[(0, 2, 1)]), "holdings[0]"),
    (dict(load=-1), "load"), (dict(version=5), "version"),
    (dict(latency_ms=-0.5), "latency_ms"), (dict(latency_ms="fast"), "latency_ms"),
])
def test_bad_node_status_is_refused(bad, field):
    fields = dict(node="n", holdings=(), pending=(), budget_bytes=0, load=0.0, served=0,
                  age_s=None, version="", kernel="")
    fields.update(bad)
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")):
        NodeStatus(**fields)


@pytest.mark.parametrize("decode", [mc.decode_manifest, mc.decode_volunteer,
                                    mc.decode_volunteer_reply, mc.decode_routing,
                                    mc.decode_demand, mc.decode_ledger, mc.decode_ledger_reply,
                                    mc.decode_status_reply, mc.decode_manifest_reply])
@pytest.mark.parametrize("payload", [b"", b"\xc1", b"garbage", msgpack.packb([1, 2]),
                                     msgpack.packb({"v": 1}), msgpack.packb({"t": "vq"}),
                                     msgpack.packb({"v": 1, "t": "zz"}), "text", None])
def test_garbage_is_a_codec_error_for_every_decoder(decode, payload):
    with pytest.raises(CodecError):
        decode(payload)


def test_wrong_kind_and_version_are_named():
    with pytest.raises(CodecError, match="'t' is 'vq', expected 'lb'"):
        mc.decode_ledger(VolunteerRequest(FP, "n", 1).encode())
    with pytest.raises(UnsupportedVersionError, match="version 2 is not supported"):
        mc.decode_volunteer(patched(VolunteerRequest(FP, "n", 1), v=2))
    with pytest.raises(mc.PayloadTooLargeError, match="over the limit"):
        mc.decode_volunteer(VolunteerRequest(FP, "n", 1).encode(), max_bytes=4)


def test_unknown_keys_are_ignored_within_a_version():
    req = VolunteerRequest(FP, "n", 7)
    assert mc.decode_volunteer(patched(req, extra=[1, 2, 3])) == req


def test_transient_refusals_are_retried_and_final_ones_are_not():
    for code in ("no_manifest", "warming_up", "internal"):
        assert mc.should_retry(ErrorReply("", "market", code, "later"))
    for code in ("no_fit", "bad_request", "wrong_model", "unknown_model"):
        assert not mc.should_retry(ErrorReply("", "market", code, "no"))
    assert not mc.should_retry(LedgerAck("b", 1, 0))


def test_revocations_are_bounded_one_line_records_and_ride_in_the_market_status():
    key = "U" + "C" * 55
    rv = mc.Revocation("vabcdefgh2345", key, 5.0, "quarantined: layer 0 expert 1 failed an audit", "m1")
    st = status(revoked=(rv,))
    assert mc.decode_status_reply(st.encode()).revoked == (rv,)
    assert "revoked" not in msgpack.unpackb(status().encode())  # absent: the bytes of a status without
    for bad in (dict(key="N" + "C" * 55), dict(key=key[:-1]), dict(why="two\nlines"), dict(why="x" * 201),
                dict(node="a.b"), dict(at=float("nan")), dict(model="m.1")):
        fields = {"node": "vabcdefgh2345", "key": key, "at": 5.0, "why": "w", **bad}
        with pytest.raises(CodecError):
            mc.Revocation(**fields)
    with pytest.raises(CodecError, match="max 64"):
        mc.RevocationList((rv,) * 65)
    with pytest.raises(CodecError):
        mc.decode_revocation_list(msgpack.packb({"v": 1, "t": "rl", "revoked": [{"node": "x"}]}))
