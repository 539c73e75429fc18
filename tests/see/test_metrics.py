"""Prometheus metrics: the shared helper, and each role's collector read from what it keeps.

The market test runs a real market on an embedded NATS with a fake backbone and fake workers
(tests/market/fakes.py) and scrapes ``/metrics`` over HTTP; the backbone and worker collectors
read plain stand-ins of the records they are given in the roles.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backbone.metrics import DispatchCollector, backbone_registry
from kvasir_bus import market_codec as mc
from kvasir_bus.cli import main
from kvasir_bus.codec import Holding
from kvasir_bus.connect import connect
from kvasir_bus.errors import UsageError
from kvasir_bus.metrics import MetricsServer, parse_listen, registry, render
from market.dashboard import Dashboard, DashboardConfig
from market.service import Market, MarketConfig
from tests.market.fakes import FP, FakeBackbone, FakeWorker, make_manifest, stream_read, wait_for
from workers.metrics import WorkerCollector

ONE_RANGE = 8 * 3600 + 1000  # the fakes' layer-0 and layer-1 experts: one range of 8, never two


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text -> {(sample name, sorted label pairs): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_listen_address_parses_host_and_port_and_refuses_junk():
    assert parse_listen("9100") == ("127.0.0.1", 9100)
    assert parse_listen("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("market.local:80") == ("market.local", 80)
    for bad in ("", "http://x:1", "x:", "70000", "a b:1", ":"):
        with pytest.raises(UsageError, match="HOST:]PORT"):
            parse_listen(bad)


def test_market_http_flag_refuses_a_bad_address_in_one_line(capsys):
    assert main(["market", "--http", "nowhere:port"]) == 2
    err = capsys.readouterr().err.strip()
    assert "[HOST:]PORT" in err and len(err.splitlines()) == 1


def test_market_metrics_show_coverage_demand_fallback_and_rewards(nats_server, arun, tmp_path):
    async def go():
        nc = await connect(nats_server.url, name="market")
        cfg = MarketConfig(db_path=str(tmp_path / "m.db"), expiry_s=0.6, range_experts=8,
                           demand_interval_s=0.5, manifest_retry_s=0.05,
                           manifest_retry_max_s=0.2)
        market = await Market(nc, cfg).start()
        backbone = await FakeBackbone(nats_server.url, make_manifest()).start()
        dash = await Dashboard(market, DashboardConfig(port=0, interval_s=0.05)).start()
        workers = []
        try:
            await backbone.routing([(0, e, 10) for e in range(24)], fallback_rate=0.25)
            for name in ("w-a", "w-b"):
                w = FakeWorker(nats_server.url, FP, name, ONE_RANGE)
                await w.start()
                await backbone.serve(name, w.holdings)  # a replica once it served (issue 8)
                workers.append(w)
            held = {w.node: w.holdings[0] for w in workers}
            def confirmed():
                entries = [market.models[FP].coverage.get(n) for n in held]
                return all(e is not None and e.holdings and not e.pending for e in entries)
            await wait_for(confirmed, what="both assignments confirmed by heartbeats")
            batch = mc.LedgerBatch(model=FP, source="backbone", batch_id="b1", events=(
                mc.LedgerEvent("e1", "w-a", held["w-a"].layer, held["w-a"].lo, 5, 1.0),
                mc.LedgerEvent("e2", "w-a", held["w-a"].layer, held["w-a"].lo, 7, 2.0)))
            await backbone.ledger(batch)               # into the ledger stream (routing first)
            await stream_read(backbone.nc, what="the batch read")

            async with aiohttp.ClientSession() as http:
                async with http.get(dash.url + "/metrics") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain")
                    text = await resp.text()
            got = samples(text)
            m = (("model", FP),)
            assert got[("kvasir_market_models", ())] == 1
            assert got[("kvasir_market_nodes", m)] == 2
            assert got[("kvasir_market_experts", m)] == 48           # 2 layers x 24
            assert got[("kvasir_market_experts_covered", m)] == 16    # two ranges of 8
            assert got[("kvasir_market_holes", m)] == 4               # 6 ranges - 2
            assert got[("kvasir_market_fallback_rate", m)] == 0.25
            for h in held.values():
                # inclusive, as `kvasir status` and the dashboard print it: 8 experts 0..7 is "0-7"
                key = (("layer", str(h.layer)), ("model", FP), ("range", f"{h.lo}-{h.hi - 1}"))
                assert got[("kvasir_market_range_replicas", key)] == 1
            assert sum(v for (name, _l), v in got.items()
                       if name == "kvasir_market_range_replicas") == 2
            a = (("model", FP), ("node", "w-a"))
            assert got[("kvasir_market_rows_rewarded_total", a)] == 1 + 12   # + the serve row
            assert got[("kvasir_market_ledger_events_total", a)] == 1 + 2
            assert got[("kvasir_market_reward_total", a)] > 0
            assert got[("kvasir_market_node_info", (("kernel", "fake"), ("model", FP),
                                                    ("node", "w-b"), ("version", "0.1.0")))] == 1

            await workers[0].kill()  # heartbeats stop: the node expires, its range is a hole
            await wait_for(lambda: "w-a" not in market.models[FP].coverage,
                           what="w-a expired from the coverage map")
            got = samples((await render(dash.registry)).decode())
            assert got[("kvasir_market_nodes", m)] == 1
            assert got[("kvasir_market_experts_covered", m)] == 8
            assert got[("kvasir_market_holes", m)] == 5
        finally:
            for w in workers:
                await w.kill()
            await dash.stop()
            await backbone.stop()
            await market.stop()
            await nc.close()
    arun(go(), timeout=30)


def _layer_stats(**kw):
    fields = dict(remote=0, local_choice=0, no_responders=0, timeouts=0, invalid=0,
                  bus_errors=0, late=0, duplicates=0, rows_remote=0, rows_local=0, bytes_out=0,
                  bytes_in=0, latency_sum_s=0.0, latency_max_s=0.0)
    fields.update(kw)
    return SimpleNamespace(**fields)


def test_dispatch_outcomes_per_layer_and_reply_latency_histogram():
    stats = SimpleNamespace(
        layers={0: _layer_stats(remote=5, timeouts=1, invalid=2, rows_remote=40, rows_local=9,
                                latency_sum_s=0.05),
                3: _layer_stats(no_responders=4, local_choice=6, late=1, duplicates=2)},
        nodes={"w-a": 3, "w-b": 2}, node_rows={"w-a": 30, "w-b": 10})
    collector = DispatchCollector(lambda: stats, model=FP)
    reg = backbone_registry(collector)
    for seconds in (0.001, 0.004, 0.03):
        collector.observe_reply(0, seconds)
    collector.tokens.inc(7)
    collector.steps.inc(2)
    got = samples(__import__("prometheus_client").generate_latest(reg).decode())
    calls = lambda layer, outcome: got[("kvasir_dispatch_calls_total", (  # noqa: E731
        ("layer", str(layer)), ("model", FP), ("outcome", outcome)))]
    assert calls(0, "remote") == 5
    assert calls(0, "timeout") == 1
    assert calls(0, "invalid") == 2
    assert calls(3, "no_responders") == 4
    assert calls(3, "local_choice") == 6
    assert got[("kvasir_dispatch_late_replies_total", (("layer", "3"), ("model", FP)))] == 1
    assert got[("kvasir_dispatch_rows_total", (("layer", "0"), ("model", FP),
                                               ("where", "local")))] == 9
    assert got[("kvasir_dispatch_node_calls_total", (("model", FP), ("node", "w-a")))] == 3
    # remote 5 of 5 + 1 + 2 + 4 + 6 = 18 calls
    assert got[("kvasir_dispatch_fallback_rate", (("model", FP),))] == pytest.approx(13 / 18)
    le = lambda b: got[("kvasir_dispatch_reply_seconds_bucket", (  # noqa: E731
        ("layer", "0"), ("le", b), ("model", FP)))]
    assert (le("0.001"), le("0.005"), le("0.05"), le("+Inf")) == (1, 2, 3, 3)
    assert got[("kvasir_backbone_tokens_total", (("model", FP),))] == 7
    assert got[("kvasir_backbone_steps_total", (("model", FP),))] == 2


def test_worker_metrics_count_calls_rows_errors_and_compute_time(arun):
    worker = SimpleNamespace(served=4, errors=1, rows=33, in_flight=2,
                             cfg=SimpleNamespace(node="w-9"),
                             slice=SimpleNamespace(fingerprint=FP,
                                                   holdings=(Holding(1, 0, 8),)))
    collector = WorkerCollector(worker)
    collector.observe_compute(1, 0.002)
    server = MetricsServer(registry(collector), port=0)

    async def go():
        async with server:
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url + "/metrics") as resp:
                    return await resp.text()
    got = samples(arun(go()))
    w = (("model", FP), ("node", "w-9"))
    assert got[("kvasir_worker_requests_total", w + (("outcome", "served"),))] == 4
    assert got[("kvasir_worker_requests_total", w + (("outcome", "error"),))] == 1
    assert got[("kvasir_worker_rows_total", w)] == 33
    assert got[("kvasir_worker_in_flight", w)] == 2
    assert got[("kvasir_worker_experts_held", w)] == 8
    assert got[("kvasir_worker_compute_seconds_count", (("layer", "1"), ("model", FP),
                                                        ("node", "w-9")))] == 1


def test_grafana_dashboard_queries_only_metrics_the_roles_export():
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from market.metrics import MarketCollector

    market = MarketCollector(market=None)
    market.statuses = [mc.MarketStatus(
        model=FP, market="market", sent_at=1.0, manifest_known=True, n_layer=1, n_expert=8,
        range_experts=8, expiry_s=10.0,
        nodes=(mc.NodeStatus("w", (Holding(0, 0, 8),), (), 0, 0.0, 3, 0.5, "0.1.0", "fake"),),
        demand=(mc.DemandEntry(0, 0, 8, 1, 1, 1.0, 0.0, 1.0),),
        totals=(mc.NodeTotals("w", 1, 2, 3.0),), fallback_rate=0.5)]
    dispatch = DispatchCollector(lambda: SimpleNamespace(layers={0: _layer_stats(remote=1)},
                                                         nodes={"w": 1}), model=FP)
    dispatch.observe_reply(0, 0.01)
    dispatch.tokens.inc()
    worker = WorkerCollector(SimpleNamespace(
        served=1, errors=0, rows=1, in_flight=0, cfg=SimpleNamespace(node="w"),
        slice=SimpleNamespace(fingerprint=FP, holdings=(Holding(0, 0, 8),))))
    worker.observe_compute(0, 0.01)
    exported = set()
    for reg in (registry(market), backbone_registry(dispatch), registry(worker)):
        exported |= {name for name, _labels in samples(generate_latest(reg).decode())}

    board = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-kvasir.json").read_text())
    queried = {name for p in board["panels"] for t in p["targets"]
               for name in re.findall(r"\bkvasir_[a-z_]+", t["expr"])}
    assert len(queried) >= 12
    assert queried <= exported, sorted(queried - exported)


def test_market_http_port_in_use_is_one_clear_line(nats_server, tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["market", "--nats", nats_server.url, "--db", str(tmp_path / "m.db"),
                   "--http", f"127.0.0.1:{port}", "--log-level", "error"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"cannot listen on 127.0.0.1:{port}: Address already in use"), err
