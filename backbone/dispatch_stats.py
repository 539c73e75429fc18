"""What the dispatch counted: per layer, who answered, what fell back and why, bytes and latency.

Plain records, written by :class:`backbone.dispatch.RemoteExperts` and read by the CLI, ``kvasir
up``, the benchmark and the tests (``to_dict`` is the JSON they print).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class LayerStats:
    remote: int = 0  # expert calls answered by a worker
    local_choice: int = 0  # computed here without asking (known uncovered)
    no_responders: int = 0  # asked, nobody subscribed: computed here at once
    timeouts: int = 0
    invalid: int = 0  # error replies and replies that failed validation
    bus_errors: int = 0  # the request could not be sent
    late: int = 0  # replies after their timeout (dropped)
    duplicates: int = 0  # replies from replicas that lost the race (dropped)
    rows_remote: int = 0
    rows_local: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    silent: int = 0  # computed here at once: the expert timed out and nothing answered since (probed)
    unanswered: int = 0  # computed here while asked, before anything on the bus had ever answered (no wait)
    probes_answered: int = 0  # valid replies to those probes: the expert is alive again
    ignored: int = 0  # replies of quarantined nodes (dropped; a replica may still win)
    audits: int = 0  # remote replies recomputed here and compared (the local result was used)
    audit_failures: int = 0
    bundles: int = 0  # bundle messages sent (one per bundle-capable node and step, usually)
    bundled_calls: int = 0  # calls sent in them (a call in several holders' bundles counts once)
    bundles_unheard: int = 0  # "no responders" on a node's bundle subject: its calls went per expert
    foreign: int = 0  # answers in a bundle reply for calls not sent in that bundle (dropped)
    recomputed: int = 0  # won calls recomputed here: their node failed an audit in the same step
    disputes: int = 0  # race losers whose reply differed from the winner's (both audited here)
    forged: int = 0  # replies naming an enrolled node without its proof (dropped; kvasir_bus.attribution)
    confirm_waits: int = 0  # won steps that waited for racing replicas' replies to check the winners
    confirm_missed: int = 0  # racing bundles that did not answer within that wait (their lies, if any, used)

    @property
    def local(self) -> int:
        return (self.local_choice + self.no_responders + self.timeouts + self.invalid + self.bus_errors
                + self.silent + self.unanswered)


@dataclass
class DispatchStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)
    nodes: Counter = field(default_factory=Counter)  # expert calls won per worker node
    node_rows: Counter = field(default_factory=Counter)
    node_latency_s: Counter = field(default_factory=Counter)  # summed over the calls in ``nodes``
    quarantined: list = field(default_factory=list)  # nodes caught by an audit, in order

    def layer(self, il: int) -> LayerStats:
        stats = self.layers.get(il)  # not setdefault: that builds a LayerStats on every call
        if stats is None:
            stats = self.layers[il] = LayerStats()
        return stats

    def totals(self) -> LayerStats:
        total = LayerStats()
        for s in self.layers.values():
            for k, v in asdict(s).items():
                setattr(total, k, max(getattr(total, k), v) if k == "latency_max_s" else getattr(total, k) + v)
        return total

    def to_dict(self) -> dict:
        t = self.totals()
        calls = t.remote + t.local
        summary = {k: v for k, v in asdict(t).items() if k != "latency_sum_s"}
        summary["latency_mean_ms"] = round(1000 * t.latency_sum_s / t.remote, 3) if t.remote else None
        summary["latency_max_ms"] = round(1000 * t.latency_max_s, 3)
        summary.pop("latency_max_s")
        summary["local"] = t.local
        summary["calls"] = calls
        summary["fallback_rate"] = round(1 - t.remote / calls, 4) if calls else None
        return {
            "audits": t.audits,
            "audit_failures": t.audit_failures,
            "quarantined": list(self.quarantined),
            "totals": summary,
            "per_node": {n: {"calls": c, "rows": self.node_rows[n],
                             "latency_mean_ms": round(1000 * self.node_latency_s[n] / c, 3)}
                         for n, c in sorted(self.nodes.items())},
            "per_layer": {str(il): {k: v for k, v in asdict(s).items() if not k.startswith("latency")}
                          for il, s in sorted(self.layers.items())},
        }

