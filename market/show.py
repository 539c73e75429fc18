"""Text and JSON views of the market for people: ``kvasir status`` and ``kvasir rewards``."""

from __future__ import annotations

from typing import Any

from kvasir_bus.wire import Holding
from kvasir_bus.market_codec import DemandEntry, MarketStatus, NodeTotals


def size(n: float) -> str:
    """Bytes in binary units: ``5.1 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def holdings_text(holdings: tuple[Holding, ...] | list, limit: int = 6) -> str:
    """``L0:0-7 L3:16-31`` (inclusive, as everywhere people read ranges), shortened after
    ``limit``."""
    parts = [str(Holding(*h)) for h in holdings]
    if len(parts) > limit:
        parts = parts[:limit] + [f"+{len(parts) - limit} more"]
    return " ".join(parts) or "-"


def latency_text(ms: float | None) -> str:
    """A worker's mean reply latency: ``4.2 ms``, ``-`` when it has not served lately."""
    return "-" if ms is None else f"{ms:.1f} ms"


# -- JSON -----------------------------------------------------------------------------------

def _entry_json(e: DemandEntry) -> dict[str, Any]:
    return {"layer": e.layer, "lo": e.lo, "hi": e.hi, "replicas": e.replicas,
            "target": e.target, "usage": e.usage, "demand": e.demand,
            "reward_rate": e.reward_rate}


def totals_json(totals: tuple[NodeTotals, ...] | list[NodeTotals]) -> dict[str, Any]:
    nodes = [{"node": t.node, "events": t.events, "rows": t.rows, "reward": t.reward}
             for t in totals]
    return {"nodes": nodes,
            "total": {"events": sum(t.events for t in totals),
                      "rows": sum(t.rows for t in totals),
                      "reward": sum(t.reward for t in totals)}}


def status_json(st: MarketStatus) -> dict[str, Any]:
    return {
        "model": st.model, "market": st.market, "sent_at": st.sent_at,
        "manifest_known": st.manifest_known, "n_layer": st.n_layer, "n_expert": st.n_expert,
        "range_experts": st.range_experts, "expiry_s": st.expiry_s,
        "fallback_rate": st.fallback_rate,
        "holes": sum(1 for e in st.demand if e.replicas == 0),
        "covered": bool(st.demand) and all(e.replicas > 0 for e in st.demand),
        "nodes": [{"node": n.node, "holdings": [list(h) for h in n.holdings],
                   "pending": [list(h) for h in n.pending], "budget_bytes": n.budget_bytes,
                   "load": n.load, "served": n.served, "age_s": n.age_s,
                   "version": n.version, "kernel": n.kernel, "latency_ms": n.latency_ms,
                   "oversubscribed": n.oversubscribed}
                  for n in st.nodes],
        "demand": [_entry_json(e) for e in st.demand],
        "rewards": totals_json(st.totals),
        "revoked": [revocation_json(r) for r in st.revoked],
        "audits": {a.node: {"passed": a.passed, "failed": a.failed} for a in st.audits},
    }


# -- text -----------------------------------------------------------------------------------

def _table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def status_text(st: MarketStatus, top: int = 8) -> str:
    out = [f"model {st.model}   market {st.market}   expiry {st.expiry_s:g} s"]
    if not st.manifest_known:
        out.append("  manifest: not yet received from the backbone (no demand map yet)")
    else:
        holes = sum(1 for e in st.demand if e.replicas == 0)
        out.append(f"  {st.n_layer} layers x {st.n_expert} experts, ranges of "
                   f"{st.range_experts}: {len(st.demand)} ranges, {holes} holes")
    fb = "unknown" if st.fallback_rate is None else f"{100 * st.fallback_rate:.1f}%"
    out.append(f"  backbone fallback rate: {fb}")

    if st.demand:
        out.append("")
        out.append("coverage: replicas per range (/target where more are wanted; "
                   "'.' = hole)")
        layers = sorted({e.layer for e in st.demand})
        starts = sorted({(e.lo, e.hi) for e in st.demand})
        cells = {(e.layer, e.lo): e for e in st.demand}
        # column headers in the same inclusive text as the holdings listed under "workers"
        rows = [["layer"] + [Holding(0, lo, hi).span for lo, hi in starts]]
        for layer in layers:
            row = [str(layer)]
            for lo, _hi in starts:
                e = cells.get((layer, lo))
                if e is None:
                    row.append("")
                elif e.replicas == 0:
                    row.append("." if e.target <= 1 else f"./{e.target}")
                else:
                    row.append(str(e.replicas) if e.replicas >= e.target
                               else f"{e.replicas}/{e.target}")
            rows.append(row)
        out += ["  " + line for line in _table(rows, right=set(range(1, len(starts) + 1)))]

        wanted = sorted((e for e in st.demand if e.demand > 0),
                        key=lambda e: (e.replicas > 0, -e.demand, e.layer, e.lo))[:top]
        out.append("")
        if wanted:
            out.append(f"demand (top {len(wanted)}):")
            rows = [["range", "replicas", "target", "usage", "demand", "reward/row"]]
            rows += [[str(e.holding), str(e.replicas), str(e.target),
                      f"{100 * e.usage:.1f}%", f"{e.demand:.2f}", f"{e.reward_rate:.3f}"]
                     for e in wanted]
            out += ["  " + line for line in _table(rows, right={1, 2, 3, 4, 5})]
        else:
            out.append("demand: none (every range at its target)")

    out.append("")
    if st.nodes:
        out.append(f"workers ({len(st.nodes)}):")
        rewards = {t.node: t for t in st.totals}
        audits = {a.node: a for a in st.audits}
        rows = [["node", "holdings", "budget", "load", "served", "latency", "last heartbeat",
                 "rows", "reward", "audits passed/failed"]]
        for n in st.nodes:
            held = holdings_text(n.holdings)
            if n.pending:
                held = (held + " " if n.holdings else "") + \
                    f"(pending {holdings_text(n.pending)})"
            t, a = rewards.get(n.node), audits.get(n.node)
            if n.oversubscribed:  # its ggml threads spin against other processes' on shared cores
                held += " [cores oversubscribed]"
            rows.append([n.node, held, size(n.budget_bytes), f"{n.load:g}", str(n.served),
                         latency_text(n.latency_ms),
                         "never" if n.age_s is None else f"{n.age_s:.1f} s ago",
                         str(t.rows) if t else "0", f"{t.reward:.2f}" if t else "0.00",
                         f"{a.passed}/{a.failed}" if a else "0/0"])
        out += ["  " + line for line in _table(rows, right={2, 3, 4, 5, 7, 8, 9})]
    else:
        out.append("workers: none")
    if st.revoked:
        out += ["", f"revoked ({len(st.revoked)}, the enrolment service locked them out):"]
        rows = [["node", "when (UTC)", "why"]]
        rows += [[r.node, _utc(r.at), r.why] for r in reversed(st.revoked)]  # the most recent first
        out += ["  " + line for line in _table(rows)]
    return "\n".join(out)


def _utc(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def revocation_json(r) -> dict[str, Any]:
    """One revocation of :attr:`MarketStatus.revoked` for people and the dashboard."""
    return {"node": r.node, "key": r.key, "at": r.at, "why": r.why, "model": r.model}


def rewards_text(totals: list[NodeTotals] | tuple[NodeTotals, ...], model: str | None) -> str:
    head = f"rewards{' for model ' + model if model else ''}"
    if not totals:
        return f"{head}: no ledger events yet"
    rows = [["node", "events", "rows served", "reward"]]
    rows += [[t.node, str(t.events), str(t.rows), f"{t.reward:.3f}"] for t in totals]
    rows.append(["total", str(sum(t.events for t in totals)), str(sum(t.rows for t in totals)),
                 f"{sum(t.reward for t in totals):.3f}"])
    return "\n".join([head + ":"] + ["  " + line for line in _table(rows, right={1, 2, 3})])
