"""``kvasir tap`` lines and the status/rewards views: pure, every message type, never a crash."""

import os

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec, market_codec as mc
from market.show import rewards_text, size, status_json, status_text
from market.tap import headers_text, line, summarize_payload
from tests.kvasir_bus.test_market_codec import batch, manifest, status

FP = "0123456789abcdef"


def rows(n=4, dtype=np.float32):
    return np.zeros((n, 8), dtype=dtype)


MESSAGES = [
    (codec.DispatchRequest(FP, 3, 17, rows(dtype=np.float16), "1a"), "req x.3.17 rows=4 f16 id=1a"),
    (codec.DispatchReply("1a", "w-1", rows(2)), "reply node=w-1 rows=2 f32 id=1a"),
    (codec.ErrorReply("1a", "w-1", "not_held", "layer 3\nexpert 17"),
     'error node=w-1 code=not_held id=1a "layer 3 expert 17"'),
    (codec.Heartbeat(FP, "w-1", ((0, 0, 8), (3, 16, 32)), 340 * 2**20, 1.5, 12, "0.1.0",
                     "numpy", 1.0),
     "heartbeat node=w-1 holds L0:0-7 L3:16-31 budget=340.0 MiB load=1.5 served=12 v0.1.0 "
     "numpy"),
    (manifest(), "manifest qwen3moe layers=2 experts=4 slabs=24"),
    (mc.VolunteerRequest(FP, "w-1", 2**30), "volunteer node=w-1 budget=1.0 GiB"),
    (mc.Assignment(FP, "w-1", ((1, 8, 16),), 28800, 2.0),
     "assignment node=w-1 holds L1:8-15 (28.1 KiB) rate=2.000"),
    (mc.RoutingStats(FP, "bb", 5.0, ((0, 1, 10), (0, 2, 5)), 0.125),
     "routing node=bb window=5s experts=2 rows=15 fallback=12.5%"),
    (mc.DemandMap(FP, 1.0, ((0, 0, 8, 1, 1, 0.5, 0.0, 1.0), (0, 8, 16, 0, 2, 0.5, 3.0, 2.0))),
     "demand ranges=2 holes=1 short=1 top=L0:8-15(0/2 d=3.00)"),
    (batch(), "ledger batch=b-1 source=backbone events=2 rows=5"),
    (mc.LedgerAck("b-1", 2, 1), "ledger-ack batch=b-1 accepted=2 dup=1"),
    (status(), f"status model={FP} nodes=2 ranges=2 holes=1"),
    (mc.MarketOverview(1.0, (status(),)), "overview models=1"),
]


@pytest.mark.parametrize("msg,expected", MESSAGES, ids=[type(m).__name__ for m, _ in MESSAGES])
def test_every_message_type_is_summarised_in_one_line(msg, expected):
    data = msg.encode()
    summary = summarize_payload(data)
    assert summary.startswith(expected), summary
    assert "\n" not in summary


@pytest.mark.parametrize("payload", [b"", b"\x00\x01\x02 garbage", msgpack.packb([1, 2]),
                                     msgpack.packb({"t": 5}), msgpack.packb({"t": "zz"}),
                                     msgpack.packb({"v": 1, "t": "hb"}), os.urandom(300),
                                     msgpack.packb({"v": 1, "t": "mf", "n_slabs": 10**9}),
                                     bytearray(b"\x93\x01"), None])
def test_garbage_never_crashes_the_tap(payload):
    summary = summarize_payload(payload)
    assert isinstance(summary, str) and summary


def test_garbage_shows_size_and_hex_and_invalid_messages_say_why():
    assert summarize_payload(b"") == "(empty)"
    assert summarize_payload(b"\xc1\x01\x02") == "3 bytes c10102"
    long = summarize_payload(bytes(range(40)))
    assert long.endswith("000102030405060708090a0b0c0d0e0f...") and "40 bytes" in long
    bad = summarize_payload(msgpack.packb({"v": 1, "t": "hb", "node": "x"}))
    assert bad.startswith("invalid 'hb': heartbeat: field 'model' is missing")


def test_a_tap_line_has_time_subject_headers_and_summary():
    hb = codec.Heartbeat(FP, "w-1", ((0, 0, 8),), 0, 0.0, 0, "0.1.0", "numpy", 1.0)
    text = line(f"kvasir.{FP}.coverage.w-1", codec.headers_for(hb), hb.encode(), at=0.5)
    stamp, subject, head, rest = text.split(" ", 3)
    assert stamp.endswith(".500") and subject == f"kvasir.{FP}.coverage.w-1"
    assert head == "{node=w-1}" and rest.startswith("heartbeat node=w-1")
    assert headers_text({"Kvasir-Version": "1"}) == "" and headers_text(None) == ""
    assert headers_text({"Nats-Msg-Id": "x", "Kvasir-Rows": "4"}) == "{Nats-Msg-Id=x rows=4}"


def test_status_views():
    st = status()
    text = status_text(st)
    assert "coverage: replicas per range" in text
    assert "fallback rate: 25.0%" in text
    assert "w-1" in text and "(pending L1:2-3)" in text and "never" in text
    assert "./2" in text                               # the hole that wants two replicas
    js = status_json(st)
    assert js["holes"] == 1 and js["covered"] is False
    assert js["rewards"]["total"] == {"events": 3, "rows": 40, "reward": 52.5}
    bare = status_text(status(manifest_known=False, demand=(), nodes=(), totals=(),
                              fallback_rate=None))
    assert "not yet received" in bare and "unknown" in bare and "workers: none" in bare


def test_rewards_view_and_sizes():
    assert "no ledger events yet" in rewards_text([], None)
    text = rewards_text(status().totals, FP)
    assert "w-1" in text and "52.500" in text and "total" in text
    assert size(512) == "512 B" and size(5 * 2**20) == "5.0 MiB"
