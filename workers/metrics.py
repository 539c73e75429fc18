"""A worker's Prometheus metrics, read from the counters it keeps.

:class:`WorkerCollector` reads a :class:`workers.runtime.Worker`'s ``served``, ``errors``,
``rows`` and ``in_flight`` at scrape time (nothing in the request path is instrumented for
them). The compute-time histogram needs each observation: ``observe_compute(layer, seconds)``
where the worker times its kernel call.

=====================================================  ====================================
``kvasir_worker_requests_total{model,node,outcome}``   requests ``served`` / ``error``
``kvasir_worker_rows_total{model,node}``               rows computed
``kvasir_worker_in_flight{model,node}``                requests being computed now
``kvasir_worker_experts_held{model,node}``             experts in its slice
``kvasir_worker_compute_seconds{model,node,layer}``    histogram of kernel time per request
=====================================================  ====================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvasir_bus.metrics import LATENCY_BUCKETS


class WorkerCollector:
    """Metrics of one worker; register it, and it registers its histogram along
    (``registry(WorkerCollector(w))`` is all a worker's ``/metrics`` needs)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.model, self.node = worker.slice.fingerprint, worker.cfg.node
        self.compute_seconds = Histogram("kvasir_worker_compute_seconds",
                                         "Kernel time of one expert request",
                                         ["model", "node", "layer"], buckets=LATENCY_BUCKETS,
                                         registry=None)
        self._by_layer: dict[int, Any] = {}  # layer -> its histogram child (labels() per call: a lock and a lookup)

    def observe_compute(self, layer: int, seconds: float) -> None:
        child = self._by_layer.get(layer)
        if child is None:
            child = self._by_layer[layer] = self.compute_seconds.labels(self.model, self.node, str(layer))
        child.observe(seconds)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        w, labels = self.worker, [self.model, self.node]
        requests = CounterMetricFamily("kvasir_worker_requests", "Expert requests by outcome",
                                       labels=["model", "node", "outcome"])
        requests.add_metric(labels + ["served"], w.served)
        requests.add_metric(labels + ["error"], w.errors)
        rows = CounterMetricFamily("kvasir_worker_rows", "Rows computed",
                                   labels=["model", "node"])
        rows.add_metric(labels, w.rows)
        in_flight = GaugeMetricFamily("kvasir_worker_in_flight", "Requests being computed",
                                      labels=["model", "node"])
        in_flight.add_metric(labels, w.in_flight)
        held = GaugeMetricFamily("kvasir_worker_experts_held", "Experts in the slice",
                                 labels=["model", "node"])
        held.add_metric(labels, sum(h.hi - h.lo for h in w.slice.holdings))
        yield from (requests, rows, in_flight, held)
        yield from self.compute_seconds.collect()
