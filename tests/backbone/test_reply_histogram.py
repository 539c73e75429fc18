"""The reply-latency histogram (``backbone.metrics.LatencyHistogram``), observed on the engine's
thread for every winning reply: its exposition must be what prometheus_client's own
``Histogram`` gives for the same observations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backbone.metrics import DispatchCollector, backbone_registry
from kvasir_bus.metrics import LATENCY_BUCKETS

FP = "0123456789abcdef"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_reply_histogram_exposes_what_prometheus_clients_histogram_would():
    collector = DispatchCollector(lambda: None, model=FP)
    reg = backbone_registry(collector)
    ref_reg = CollectorRegistry()
    ref = Histogram("kvasir_dispatch_reply_seconds", "Round trip of winning expert replies", ["model", "layer"],
                    buckets=LATENCY_BUCKETS, registry=ref_reg)
    assert samples(generate_latest(reg).decode()).keys().isdisjoint(samples(generate_latest(ref_reg).decode()))
    values = [0.0, 0.0005, 0.0007, 0.001, 0.0011, 0.05, 2.0, 2.5, 100.0]  # on the bounds, between, beyond
    for layer in (0, 3, 11):
        for v in values[layer % 4:]:
            collector.observe_reply(layer, v)
            ref.labels(FP, str(layer)).observe(v)
    mine = {k: v for k, v in samples(generate_latest(reg).decode()).items()
            if k[0].startswith("kvasir_dispatch_reply_seconds")}
    theirs = samples(generate_latest(ref_reg).decode())
    assert mine == pytest.approx(theirs)
    assert len(mine) == 3 * (len(LATENCY_BUCKETS) + 3)  # buckets with +Inf, _sum, _count per layer
