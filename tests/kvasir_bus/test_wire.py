"""The wire contract: the record registry, the Holding's text form, headers for every record."""

from dataclasses import dataclass
from typing import ClassVar

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec, generate_codec as gc, market_codec as mc, wire
from kvasir_bus.wire import CodecError, Holding, Record
from tests.kvasir_bus.test_market_codec import batch, manifest, status

FP = "0123456789abcdef"


def one_of_each() -> list[Record]:
    """A valid instance of every message record the codecs define."""
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    return [
        codec.DispatchRequest(FP, 1, 2, rows, "q1"),
        codec.DispatchReply("q1", "w-1", rows),
        codec.DispatchReply("q2", "w-1", rows, kernel="numpy-aarch64"),
        wire.ErrorReply("q1", "w-1", wire.ERR_NOT_HELD, "not here"),
        codec.Heartbeat(FP, "w-1", [(0, 0, 4)], 10, 0.0, 0, "0.1.0", "numpy", 1.0),
        codec.BundleRequest(FP, 1, "b1", rows, ("q1", "q2"), (2, 3), (1, 2), np.array([1, 0, 1], np.uint32)),
        codec.BundleReply("b1", "w-1", ("q1",), (2,), rows, (("q2", wire.ERR_NOT_HELD, "not here"),),
                          kernel="numpy-aarch64"),
        manifest(),
        mc.VolunteerRequest(FP, "w-1", 100),
        mc.Assignment(FP, "w-1", [(0, 0, 4)], 10, 1.0),
        mc.RoutingStats(FP, "bb", 1.0, [(0, 1, 2)], remote=[(0, 1, 2)], latency=[("w-1", 1, 2.5)],
                        tokens=1, audits=[("w-1", 3, 0)]),
        mc.DemandMap(FP, 1.0, [(0, 0, 4, 0, 1, 1.0, 1.0, 1.0)]),
        batch(),
        mc.LedgerAck("b-1", 2, 0),
        mc.Quarantine(FP, "w-1", 3, 7, "numpy-x86_64", True, float("inf"), 1.0),
        status(),
        mc.MarketOverview(1.0, (status(),)),
        mc.NodeReport(FP, "w-1", "market", 1.0, 3, 40, 52.5, 19, 0, False),
        mc.Revocation("vabcdefgh2345", "U" + "A" * 55, 1.0, "quarantined: layer 0 expert 1", FP),
        mc.RevocationList((mc.Revocation("vabcdefgh2345", "U" + "B" * 55, 2.0, "by hand"),)),
        gc.GenerateRequest("g-1", (1, 2, 3), "", 8),
        gc.GenerateToken("g-1", 0, 42, "hi"),
        gc.GenerateDone("g-1", "bb", "length", 3, 8),
        gc.GenerateCancel("g-1"),
    ]


# -- the registry ---------------------------------------------------------------------------

def test_every_record_kind_is_registered_once_and_the_samples_cover_them_all():
    samples = one_of_each()
    assert sorted({type(m).kind for m in samples}) == sorted(wire.RECORDS)
    for msg in samples:
        assert wire.RECORDS[msg.kind] is type(msg)


@pytest.mark.parametrize("msg", one_of_each(), ids=lambda m: type(m).__name__)
def test_every_record_round_trips_through_the_registry(msg):
    data = wire.encode(msg)
    body = msgpack.unpackb(data)
    assert list(body)[:2] == ["v", "t"] and body["v"] == wire.VERSION and body["t"] == msg.kind
    back = wire.decode_any(data)
    assert type(back) is type(msg)
    assert wire.encode(back) == data  # same record, same bytes


@pytest.mark.parametrize("msg", one_of_each(), ids=lambda m: type(m).__name__)
def test_every_record_has_headers_beyond_the_version(msg):
    h = wire.headers_for(msg)
    assert h["Kvasir-Version"] == "1"
    assert len(h) >= 2, f"{type(msg).__name__} shows no headers in `nats sub`"
    assert all(isinstance(k, str) and k.startswith("Kvasir-") and isinstance(v, str) and v
               for k, v in h.items())


def test_decode_refuses_kinds_it_was_not_asked_for():
    data = mc.LedgerAck("b-1", 1, 0).encode()
    with pytest.raises(CodecError, match="field 't' is 'la', expected 'x'"):
        codec.decode_request(data)


def test_registering_a_record_without_a_kind_or_methods_or_a_taken_kind_is_refused():
    class NoKind(Record):
        pass

    with pytest.raises(TypeError, match="declares no kind"):
        wire.record(NoKind)

    class NoHeaders(Record):
        kind: ClassVar[str] = "zz-test"

        def body(self):
            return {}

        @classmethod
        def from_body(cls, body, limits=wire.NO_LIMITS):
            return cls()

    with pytest.raises(TypeError, match="does not implement headers"):
        wire.record(NoHeaders)

    @dataclass(frozen=True)
    class Impostor(Record):
        kind: ClassVar[str] = "hb"

        def body(self):
            return {}

        @classmethod
        def from_body(cls, body, limits=wire.NO_LIMITS):
            return cls()

        def headers(self):
            return {}

    with pytest.raises(TypeError, match="taken by Heartbeat"):
        wire.record(Impostor)
    assert "zz-test" not in wire.RECORDS and wire.RECORDS["hb"] is codec.Heartbeat
    with pytest.raises(CodecError, match="not a Kvasir message"):
        wire.encode(Impostor())  # an unregistered class with a known kind


def test_codecs_share_the_wire_constants_instead_of_copying_them():
    for module in (codec, mc):
        assert module.VERSION is wire.VERSION
        assert module.DEFAULT_MAX_BYTES is wire.DEFAULT_MAX_BYTES
        assert module.CodecError is wire.CodecError and module.ErrorReply is wire.ErrorReply
        assert module.Holding is wire.Holding
    assert mc.ERR_BAD_REQUEST is codec.ERR_BAD_REQUEST


def test_ids_are_checked_by_one_public_function():
    assert wire.is_id("a-1.b:c_2") and not wire.is_id("") and not wire.is_id("a b")
    assert not wire.is_id("x" * 65) and not wire.is_id(None)


# -- Holding --------------------------------------------------------------------------------

def test_holding_is_half_open_inside_and_inclusive_in_text():
    h = Holding(3, 16, 32)
    assert h.count == 16 and h.last == 31 and list(h.experts) == list(range(16, 32))
    assert h.covers(3, 31) and not h.covers(3, 32) and not h.covers(2, 16)
    assert str(h) == "L3:16-31" and h.span == "16-31"
    assert Holding.inclusive(3, 16, 31) == h


@pytest.mark.parametrize("h", [Holding(0, 0, 1), Holding(0, 0, 32), Holding(47, 100, 128),
                               Holding(4095, 4095, 4096)])
def test_holding_text_round_trips(h):
    assert Holding.parse(str(h)) == h


def test_holding_parse_takes_what_people_type():
    assert Holding.parse("L3:5") == Holding(3, 5, 6)
    assert Holding.parse(" L0:0-31 ") == Holding(0, 0, 32)


@pytest.mark.parametrize("text,problem", [("L3:7-5", "reversed"), ("3:0-4", "expected L<layer>"),
                                          ("L3:0-", "expected"), ("L-1:0-4", "expected"),
                                          ("", "expected")])
def test_holding_parse_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        Holding.parse(text)


def test_holdings_travel_half_open_and_empty_ranges_are_refused():
    hb = codec.Heartbeat(FP, "w-1", [Holding(0, 0, 32)], 0, 0.0, 0, "0.1.0", "numpy", 1.0)
    assert msgpack.unpackb(hb.encode())["holdings"] == [[0, 0, 32]]
    with pytest.raises(CodecError, match=r"holdings\[0\]' is an empty range"):
        wire.check_holdings("heartbeat", [(0, 4, 4)])
