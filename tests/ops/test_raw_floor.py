"""bench/raw_floor.py: the raw-protocol request/reply loop that the overhead bench prints as the
floor of any Python client. It must really round-trip through a nats-server (every reply has the
request's size) and report per-call CPU on both sides."""

from __future__ import annotations

from tests.bench_script import load


def test_the_raw_floor_round_trips_through_a_real_server_and_counts_both_sides():
    out = load("raw_floor").bench_raw_floor(steps=50, per_step=3, size=123, warm=5)
    assert out["calls"] == 150 and out["per_step"] == 3 and out["payload_bytes"] == 123
    assert out["requester_cpu_us_per_call"] > 0 and out["responder_cpu_us_per_call"] >= 0
    assert out["calls_per_s"] > 0 and out["wall_us_per_step"] > 0
    assert out["server_cpu_us_per_message"] >= 0  # /proc counts in ticks: a short run may read 0
