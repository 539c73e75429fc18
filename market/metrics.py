"""The market's Prometheus metrics, read from its own view of each model at scrape time.

:class:`MarketCollector` takes :meth:`Market.status` of every known model (the same record
``kvasir status`` prints: coverage map, demand per range, workers, ledger totals, the
backbones' fallback rate) and turns it into metric families. Nothing in the market's message
handlers is instrumented; a scrape costs one ledger query per model.

==============================================  ===========================================
``kvasir_market_models``                        models the market knows
``kvasir_market_nodes{model}``                  live or pending worker nodes
``kvasir_market_experts{model}``                experts in the manifest (layers x experts)
``kvasir_market_experts_covered{model}``        experts with at least one live replica
``kvasir_market_holes{model}``                  ranges with no replica (live or pending)
``kvasir_market_range_replicas{model,layer,range}``   replicas of a range (its least-held
                                                 expert; pending assignments count); ``range``
                                                 is inclusive, ``0-7`` (as ``kvasir status``)
``kvasir_market_range_target{...}``             replicas wanted there
``kvasir_market_range_demand{...}``             usage weight x missing replicas
``kvasir_market_range_usage{...}``              share of routed rows (0..1)
``kvasir_market_range_reward_rate{...}``        reward per row served there now
``kvasir_market_fallback_rate{model}``          backbones' local share of expert calls
``kvasir_market_node_served_total{model,node}`` requests the node says it served
``kvasir_market_node_load{model,node}``         its requests in flight (heartbeat)
``kvasir_market_node_heartbeat_age_seconds``    since its last heartbeat
``kvasir_market_node_info{model,node,version,kernel}``  1 per node
``kvasir_market_reward_total{model,node}``      reward in the ledger
``kvasir_market_rows_rewarded_total{model,node}``  rows served and written to the ledger
``kvasir_market_ledger_events_total{model,node}``  ledger events
==============================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvasir_bus.market_codec import MarketStatus
from kvasir_bus.wire import Holding


def expert_replicas(st: MarketStatus) -> np.ndarray:
    """Live replicas of every expert: int32 (n_layer, n_expert), from the nodes' announced
    holdings (pending assignments are not served yet, so they do not count here)."""
    out = np.zeros((st.n_layer, st.n_expert), dtype=np.int32)
    for node in st.nodes:
        held = np.zeros_like(out, dtype=bool)  # a node counts once however holdings overlap
        for layer, lo, hi in (tuple(h) for h in node.holdings):
            if layer < st.n_layer:
                held[layer, lo:min(hi, st.n_expert)] = True
        out += held
    return out


def expert_pending(st: MarketStatus) -> np.ndarray:
    """Pending (assigned, not yet announced) replicas of every expert: int32 (n_layer,
    n_expert)."""
    out = np.zeros((st.n_layer, st.n_expert), dtype=np.int32)
    for node in st.nodes:
        for layer, lo, hi in (tuple(h) for h in node.pending):
            if layer < st.n_layer:
                out[layer, lo:min(hi, st.n_expert)] += 1
    return out


class MarketCollector:
    """Metrics of every model ``market`` knows; :meth:`refresh` before each collect."""

    def __init__(self, market: Any) -> None:
        self.market = market
        self.statuses: list[MarketStatus] = []

    async def refresh(self) -> None:
        self.statuses = [await self.market.status(m) for m in sorted(self.market.models)]

    def describe(self) -> list[Metric]:
        return []  # names are dynamic per scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily
        models = g("kvasir_market_models", "Models the market knows")
        models.add_metric([], len(self.statuses))
        yield models

        per_model = {
            "nodes": g("kvasir_market_nodes", "Worker nodes live or pending", labels=["model"]),
            "experts": g("kvasir_market_experts", "Routed experts in the manifest",
                         labels=["model"]),
            "covered": g("kvasir_market_experts_covered",
                         "Experts with at least one live replica", labels=["model"]),
            "holes": g("kvasir_market_holes", "Ranges with no replica", labels=["model"]),
            "fallback": g("kvasir_market_fallback_rate",
                          "Share of expert calls the backbones computed themselves "
                          "(last routing window)", labels=["model"]),
        }
        rl = ["model", "layer", "range"]
        per_range = {
            "replicas": g("kvasir_market_range_replicas",
                          "Replicas of a range (its least-held expert, pending counted)",
                          labels=rl),
            "target": g("kvasir_market_range_target", "Replicas wanted for a range", labels=rl),
            "demand": g("kvasir_market_range_demand", "Usage weight x missing replicas",
                        labels=rl),
            "usage": g("kvasir_market_range_usage", "Share of routed rows (0..1)", labels=rl),
            "reward_rate": g("kvasir_market_range_reward_rate", "Reward per row served now",
                             labels=rl),
        }
        nl = ["model", "node"]
        served = CounterMetricFamily("kvasir_market_node_served",
                                     "Requests the node says it served (heartbeat)", labels=nl)
        load = g("kvasir_market_node_load", "Requests in flight at the node (heartbeat)",
                 labels=nl)
        age = g("kvasir_market_node_heartbeat_age_seconds", "Seconds since the node's last "
                "heartbeat", labels=nl)
        info = g("kvasir_market_node_info", "1 per node, with its version and kernel",
                 labels=["model", "node", "version", "kernel"])
        reward = CounterMetricFamily("kvasir_market_reward", "Reward in the ledger", labels=nl)
        rows = CounterMetricFamily("kvasir_market_rows_rewarded",
                                   "Rows served and written to the ledger", labels=nl)
        events = CounterMetricFamily("kvasir_market_ledger_events", "Ledger events",
                                     labels=nl)

        for st in self.statuses:
            m = st.model
            per_model["nodes"].add_metric([m], len(st.nodes))
            per_model["experts"].add_metric([m], sum(e.hi - e.lo for e in st.demand))
            if st.manifest_known:
                routed = {(e.layer, x) for e in st.demand for x in range(e.lo, e.hi)}
                reps = expert_replicas(st)
                per_model["covered"].add_metric(
                    [m], sum(1 for (layer, x) in routed if reps[layer, x] > 0))
            per_model["holes"].add_metric([m], sum(1 for e in st.demand if e.replicas == 0))
            if st.fallback_rate is not None:
                per_model["fallback"].add_metric([m], st.fallback_rate)
            for e in st.demand:
                labels = [m, str(e.layer), Holding(e.layer, e.lo, e.hi).span]
                for key, value in (("replicas", e.replicas), ("target", e.target),
                                   ("demand", e.demand), ("usage", e.usage),
                                   ("reward_rate", e.reward_rate)):
                    per_range[key].add_metric(labels, value)
            for n in st.nodes:
                served.add_metric([m, n.node], n.served)
                load.add_metric([m, n.node], n.load)
                if n.age_s is not None:
                    age.add_metric([m, n.node], n.age_s)
                info.add_metric([m, n.node, n.version, n.kernel], 1)
            for t in st.totals:
                reward.add_metric([m, t.node], t.reward)
                rows.add_metric([m, t.node], t.rows)
                events.add_metric([m, t.node], t.events)

        yield from per_model.values()
        yield from per_range.values()
        yield from (served, load, age, info, reward, rows, events)
