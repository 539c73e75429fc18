"""The backbone's Prometheus metrics: dispatch outcomes per layer, reply latency, tokens.

:class:`DispatchCollector` reads the dispatch statistics the backbone already keeps (a
``DispatchStats``: per layer, who answered and why an expert fell back; per node, calls won)
at scrape time, so nothing in the dispatch path is instrumented for counters. Only the reply
latency needs each observation: ``observe_reply(layer, seconds)`` feeds the histogram (hook it
where the dispatch observes a winning reply's latency), and the serving loop counts ``tokens``
and ``steps``.

==================================================  =======================================
``kvasir_dispatch_calls_total{model,layer,outcome}``  expert calls by outcome: ``remote``
                                                    (a worker answered), ``local_choice``
                                                    (known uncovered, not asked),
                                                    ``no_responders``, ``timeout``,
                                                    ``invalid``, ``bus_error``
``kvasir_dispatch_late_replies_total{model,layer}``  replies after their timeout (dropped)
``kvasir_dispatch_duplicate_replies_total{...}``    replicas that lost the race (dropped)
``kvasir_dispatch_rows_total{model,layer,where}``   rows computed ``remote`` / ``local``
``kvasir_dispatch_bytes_total{model,direction}``    request bytes ``out``, reply bytes ``in``
``kvasir_dispatch_node_calls_total{model,node}``    calls won per worker node
``kvasir_dispatch_fallback_rate{model}``            local calls / all calls since start
``kvasir_dispatch_reply_seconds{model,layer}``      histogram of winning reply round trips
``kvasir_backbone_tokens_total{model}``             tokens generated
``kvasir_backbone_steps_total{model}``              forward steps (prefill or decode)
==================================================  =======================================
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvasir_bus.metrics import LATENCY_BUCKETS, Registry, registry

#: outcome label -> the LayerStats field that counts it
OUTCOMES = (("remote", "remote"), ("local_choice", "local_choice"),
            ("no_responders", "no_responders"), ("timeout", "timeouts"),
            ("invalid", "invalid"), ("bus_error", "bus_errors"))


class DispatchCollector:
    """Metrics of one backbone. ``stats``: returns the current ``DispatchStats`` (or None
    while no dispatch runs); read with ``getattr`` only, so any record with those fields will
    do."""

    def __init__(self, stats: Callable[[], Any], model: str) -> None:
        self.stats, self.model = stats, model
        # Plain metrics the collector owns; registered with it by backbone_registry().
        self.reply_seconds = LatencyHistogram("kvasir_dispatch_reply_seconds",
                                              "Round trip of winning expert replies", model)
        self.token_counter = Counter("kvasir_backbone_tokens", "Tokens generated", ["model"],
                                     registry=None)
        self.step_counter = Counter("kvasir_backbone_steps", "Forward steps (prefill or decode)",
                                    ["model"], registry=None)
        self.tokens = self.token_counter.labels(model)  # .inc(n) from the serving loop
        self.steps = self.step_counter.labels(model)

    def observe_reply(self, layer: int, seconds: float) -> None:
        self.reply_seconds.observe(layer, seconds)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.model
        calls = CounterMetricFamily("kvasir_dispatch_calls", "Expert calls by outcome",
                                    labels=["model", "layer", "outcome"])
        late = CounterMetricFamily("kvasir_dispatch_late_replies",
                                   "Replies after their timeout (dropped)",
                                   labels=["model", "layer"])
        dup = CounterMetricFamily("kvasir_dispatch_duplicate_replies",
                                  "Replies of replicas that lost the race (dropped)",
                                  labels=["model", "layer"])
        rows = CounterMetricFamily("kvasir_dispatch_rows", "Rows computed remote or local",
                                   labels=["model", "layer", "where"])
        nbytes = CounterMetricFamily("kvasir_dispatch_bytes", "Dispatch bytes on the wire",
                                     labels=["model", "direction"])
        nodes = CounterMetricFamily("kvasir_dispatch_node_calls", "Expert calls won per node",
                                    labels=["model", "node"])
        fallback = GaugeMetricFamily("kvasir_dispatch_fallback_rate",
                                     "Expert calls computed locally / all, since start",
                                     labels=["model"])
        stats = self.stats()
        if stats is not None:
            total = local = out = got = 0
            for layer, s in sorted(stats.layers.items()):
                il = str(layer)
                for label, name in OUTCOMES:
                    n = getattr(s, name)
                    calls.add_metric([m, il, label], n)
                    total += n
                    local += 0 if label == "remote" else n
                late.add_metric([m, il], s.late)
                dup.add_metric([m, il], s.duplicates)
                rows.add_metric([m, il, "remote"], s.rows_remote)
                rows.add_metric([m, il, "local"], s.rows_local)
                out += s.bytes_out
                got += s.bytes_in
            nbytes.add_metric([m, "out"], out)
            nbytes.add_metric([m, "in"], got)
            for node, n in sorted(stats.nodes.items()):
                nodes.add_metric([m, node], n)
            if total:
                fallback.add_metric([m], local / total)
        yield from (calls, late, dup, rows, nbytes, nodes, fallback)


class LatencyHistogram:
    """A histogram per layer with the ``LATENCY_BUCKETS``, exposed as prometheus_client's
    ``Histogram(name, doc, ["model", "layer"])`` would be (``_bucket``, ``_sum``, ``_count``).
    It is observed on the engine's thread for every winning reply: a bucket index and three
    additions under one lock, where the client's histogram takes a lock and a value object per
    bucket; the cumulative counts are made at scrape time."""

    def __init__(self, name: str, doc: str, model: str) -> None:
        self.name, self.doc, self.model = name, doc, model
        self._layers: dict[int, list] = {}  # layer -> [count per bucket (+Inf last), sum]
        self._lock = threading.Lock()  # two micro-batches observe at once

    def observe(self, layer: int, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # the first bound >= seconds (le)
        with self._lock:
            counts = self._layers.get(layer)
            if counts is None:
                counts = self._layers[layer] = [0] * (len(LATENCY_BUCKETS) + 2)
            counts[i] += 1
            counts[-1] += seconds

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model", "layer"])
        with self._lock:
            layers = {layer: list(counts) for layer, counts in self._layers.items()}
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for layer, counts in sorted(layers.items()):
            total, buckets = 0, []
            for bound, n in zip(bounds, counts):
                total += n
                buckets.append((bound, total))
            family.add_metric([self.model, str(layer)], buckets, sum_value=counts[-1])
        yield family


def backbone_registry(collector: DispatchCollector) -> Registry:
    """A registry with the collector and the metrics it owns."""
    return registry(collector, collector.reply_seconds, collector.token_counter,
                    collector.step_counter)
