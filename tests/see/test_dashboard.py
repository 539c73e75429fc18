"""The live dashboard in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium; ``.ci/run`` installs them).

A market, a fake backbone and fake workers (tests/market/fakes.py) run on an embedded NATS in
a background event loop; the page must show each worker's range as covered in the heatmap and
inclusive in its tables (``L1:8-15``, as ``kvasir status``), show the reply latency the
backbone reported for each worker that served, its tokens/s and rows/s, mark the nodes a backbone's audit quarantined
(kept in the workers table though the market drops them, their ranges now holes), then show
a range as a hole once its worker is killed and expires. Every wait polls the page with a
deadline. The last screenshot is saved under the test's tmp dir (``dashboard.png``; its path
is printed), and also to ``$KVASIR_ARTIFACTS`` when that is set.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from kvasir_bus import market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from kvasir_bus.wire import Holding
from kvasir_bus.loopthread import LoopThread
from market.dashboard import Dashboard, DashboardConfig
from market.service import Market, MarketConfig
from tests.market.fakes import FP, FakeBackbone, FakeWorker, make_manifest

N_LAYER, N_EXPERT, RANGE = 4, 32, 8
ONE_RANGE = 8 * 3 * 1200 + 500  # one range of 8 experts of either layer size, never two
EXPIRY = 0.8
# Layer 1 is hot: 40 rows on each of its experts, 10 elsewhere; 2240 rows in all.
HITS = [(layer, e, 40 if layer == 1 else 10) for layer in range(N_LAYER) for e in range(N_EXPERT)]


def _browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver), or skip saying exactly what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium; .ci/run does)")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no chromium/chromedriver on PATH (apt-get install chromium "
                    "chromium-driver; .ci/run does)")
    return browser, driver


@pytest.fixture
def browser():
    path, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = path
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


class Swarm:
    """Market + dashboard + fake backbone + fake workers on a background event loop."""

    def __init__(self, url: str, db: Path) -> None:
        self.url, self.db = url, db
        self.loop = LoopThread("dashboard-test")
        self.workers: dict[str, FakeWorker] = {}

    def start(self) -> Swarm:
        async def go():
            self.nc = await connect(self.url, name="market")
            cfg = MarketConfig(db_path=str(self.db), expiry_s=EXPIRY, range_experts=RANGE,
                               demand_interval_s=0.5, manifest_retry_s=0.05,
                               manifest_retry_max_s=0.2)
            self.market = await Market(self.nc, cfg).start()
            self.backbone = await FakeBackbone(
                self.url, make_manifest(n_layer=N_LAYER, n_expert=N_EXPERT)).start()
            self.dashboard = await Dashboard(
                self.market, DashboardConfig(port=0, interval_s=0.1)).start()
            # Layer 1 is hot, so it wants more replicas; a quarter of calls fell back.
            await self.backbone.routing(HITS, fallback_rate=0.25)
        self.loop.run(go(), timeout=20)
        return self

    def worker(self, name: str) -> FakeWorker:
        w = FakeWorker(self.url, FP, name, ONE_RANGE)
        self.loop.run(w.start(), timeout=20)
        self.loop.run(self.backbone.serve(name, w.holdings), timeout=20)  # counted once served
        self.workers[name] = w
        return w

    def throughput(self, tokens: int, window_s: float) -> None:
        """A routing window that counted ``tokens``, with the hits and fallback rate of
        start() (so demand does not move)."""
        self.loop.run(self.backbone.routing(HITS, fallback_rate=0.25, window_s=window_s,
                                            tokens=tokens), timeout=20)

    def latency(self, mean_ms: dict[str, float]) -> None:
        """What a backbone's routing statistics say of its workers' replies (backbone/market_link.py)."""
        self.loop.run(self.backbone.routing((), latency=[(n, 3, ms) for n, ms in mean_ms.items()]),
                      timeout=20)

    def audits(self, counts: dict[str, tuple[int, int]]) -> None:
        """What a backbone's routing statistics say of the audits it judged (backbone/market_link.py)."""
        self.loop.run(self.backbone.routing((), audits=[(n, p, f) for n, (p, f) in counts.items()]), timeout=20)

    def quarantine(self, name: str, error: float) -> None:
        """What a backbone publishes when its audit catches ``name`` (backbone/dispatch.py)."""
        h = self.workers[name].holdings[0]
        event = mc.Quarantine(model=FP, node=name, layer=h.layer, expert=h.lo, kernel="fake",
                              exact=True, error=error, at=1_700_000_000.0)

        async def go():
            await self.nc.publish(Subjects(FP).quarantine(), event.encode(),
                                  headers=mc.headers_for(event))
            await self.nc.flush()
        self.loop.run(go(), timeout=20)

    def kill(self, name: str) -> None:
        self.loop.run(self.workers.pop(name).kill(), timeout=20)

    def stop(self) -> None:
        async def go():
            for w in self.workers.values():
                await w.kill()
            await self.dashboard.stop()
            await self.backbone.stop()
            await self.market.stop()
            await self.nc.close()
        try:
            self.loop.run(go(), timeout=20)
        finally:
            self.loop.stop()


@pytest.fixture
def swarm(nats_server, tmp_path):
    s = Swarm(nats_server.url, tmp_path / "market.db").start()
    try:
        yield s
    finally:
        s.stop()


def heatmap(driver) -> dict[tuple[int, int], int]:
    """(layer, expert) -> replicas, as the page shows them."""
    cells = driver.execute_script(
        "return [...document.querySelectorAll('.heatmap .cell')]"
        ".map(c => [+c.dataset.layer, +c.dataset.expert, c.dataset.replicas])")
    return {(l, e): int(r) for l, e, r in cells if r is not None}


def expected(workers) -> dict[tuple[int, int], int]:
    want = {(l, e): 0 for l in range(N_LAYER) for e in range(N_EXPERT)}
    for w in workers:
        for h in w.holdings:
            for e in range(h.lo, h.hi):
                want[(h.layer, e)] += 1
    return want


def table(driver, which: str) -> dict[str, list[str]]:
    """First cell -> the row's cells, of the page's ``table.<which>``."""
    rows = driver.execute_script(
        f"return [...document.querySelectorAll('table.{which} tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent))")
    return {r[0]: r for r in rows}


def wait_until(driver, predicate, what: str, timeout: float = 15.0):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d))
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def save_screenshot(driver, tmp_path: Path) -> Path:
    shot = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(shot)), "chromium did not write the screenshot"
    assert shot.stat().st_size > 10_000
    if os.environ.get("KVASIR_ARTIFACTS"):
        out = Path(os.environ["KVASIR_ARTIFACTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / shot.name)
    print(f"dashboard screenshot: {shot}")
    return shot


def test_dashboard_shows_coverage_inclusive_ranges_quarantines_and_a_killed_workers_hole(
        browser, swarm, tmp_path):
    for name in ("phone-1", "laptop-2", "gpu-3", "pi-4", "phone-5"):
        swarm.worker(name)
    workers = list(swarm.workers.values())
    # Each took a distinct range, scarcest first: a range of 8 experts each.
    assert len({w.holdings for w in workers}) == len(workers)

    browser.get(swarm.dashboard.url + "/")
    assert browser.title == "kvasir market"
    want = expected(workers)
    wait_until(browser, lambda d: heatmap(d) == want, "the heatmap to show every worker's range")
    shown = heatmap(browser)
    assert sum(shown.values()) == len(workers) * RANGE
    assert len(shown) == N_LAYER * N_EXPERT

    rows = browser.execute_script(
        "return [...document.querySelectorAll('table.workers tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent))")
    assert sorted(r[0] for r in rows) == sorted(swarm.workers)
    assert all(r[1] == "fake" and r[2] == "0.1.0" for r in rows)
    wait_until(browser, lambda d: d.execute_script(
        "return document.querySelector('.fallback-now').textContent") == "now 25.0%",
        "the fallback rate label")
    # Throughput: tokens/s as the backbone counted them, rows/s per MoE layer beside it.
    swarm.throughput(tokens=160, window_s=2.0)
    wait_until(browser, lambda d: d.execute_script(
        "return document.querySelector('.tokens-now').textContent") == "now 80.0 tokens/s",
        "the tokens/s readout")
    assert browser.execute_script("return document.querySelector('.rows-now').textContent") \
        == "280.0 rows/s per MoE layer"  # 2240 rows / 4 layers / 2 s
    drawn = browser.execute_script(  # one read: the chart is redrawn on every snapshot
        "return [...document.querySelectorAll('svg.tokens polyline')]"
        ".map(p => [p.getAttribute('class'), p.getAttribute('points').split(' ').length])")
    assert [cls for cls, _n in drawn] == ["tokens_per_s", "rows_per_s"] and all(n >= 1 for _c, n in drawn)
    # The page got its data live from the event stream, and /api/state says the same.
    assert browser.find_element("id", "conn").get_attribute("data-state") == "live"
    with urllib.request.urlopen(swarm.dashboard.url + "/api/state", timeout=5) as resp:
        state = json.load(resp)
    assert state["models"][0]["model"] == FP
    assert isinstance(state["models"][0]["history"][-1]["tokens_per_s"], float)

    # Ranges read as `kvasir status` prints them: inclusive, L1:8-15 is experts 8..15.
    for name, cells in table(browser, "workers").items():
        assert cells[3] == " ".join(str(h) for h in swarm.workers[name].holdings), cells
    # Latency: what the backbone measured for the workers whose replies won; "-" for the rest.
    swarm.latency({"phone-1": 3.4, "laptop-2": 41.0, "gpu-3": 0.5})
    column = browser.execute_script(
        "return [...document.querySelectorAll('table.workers thead th')].map(h => h.textContent)"
    ).index("latency")
    want_latency = {"phone-1": "3.4 ms", "laptop-2": "41.0 ms", "gpu-3": "0.5 ms", "pi-4": "-",
                    "phone-5": "-"}
    wait_until(browser, lambda d: {n: c[column] for n, c in table(d, "workers").items()} == want_latency,
               "the latency column to show what the backbone reported")
    with urllib.request.urlopen(swarm.dashboard.url + "/api/state", timeout=5) as resp:
        nodes = {n["node"]: n for n in json.load(resp)["models"][0]["nodes"]}
    assert nodes["laptop-2"]["latency_ms"] == 41.0 and nodes["pi-4"]["latency_ms"] is None
    # Audits: what the backbones judged of each worker's replies, passed / failed, as the market adds them up.
    swarm.audits({"phone-1": (16, 0), "gpu-3": (40, 1)})
    swarm.audits({"phone-1": (2, 0)})
    column = browser.execute_script(
        "return [...document.querySelectorAll('table.workers thead th')].map(h => h.textContent)"
    ).index("audits passed / failed")
    want_audits = {"phone-1": "18 / 0", "laptop-2": "0 / 0", "gpu-3": "40 / 1", "pi-4": "0 / 0", "phone-5": "0 / 0"}
    wait_until(browser, lambda d: {n: c[column] for n, c in table(d, "workers").items()} == want_audits,
               "the audits column to show what the backbone reported")
    shown_ranges = [row[0] for row in table(browser, "demand").values()]
    want_ranges = {str(Holding(e["layer"], e["lo"], e["hi"])) for e in state["models"][0]["demand"]}
    assert shown_ranges and set(shown_ranges) <= want_ranges, (shown_ranges, want_ranges)

    # A backbone's audit catches two nodes (one with a reply that was not even finite).
    swarm.quarantine("laptop-2", 0.37)
    swarm.quarantine("pi-4", float("inf"))
    wait_until(browser, lambda d: {n for n, c in table(d, "workers").items()
                                   if c[-1].startswith("yes")} == {"laptop-2", "pi-4"},
               "the quarantined column to mark laptop-2 and pi-4")
    # Two paths, so two waits: the dashboard reads the quarantine on its own subscription at
    # once, the market drops the node only once it has applied the event from the ledger stream.
    wait_until(browser, lambda d: {n for n, c in table(d, "workers").items()
                                   if c[3] == "- (dropped by the market)"} == {"laptop-2", "pi-4"},
               "the market to drop laptop-2 and pi-4 from its workers")
    rows = table(browser, "workers")
    assert rows["laptop-2"][-1].startswith("yes: L") and "error 0.37" in rows["laptop-2"][-1]
    assert "bad reply" in rows["pi-4"][-1] and rows["phone-1"][-1] == "-"
    marked = browser.execute_script(
        "return [...document.querySelectorAll('table.workers tr.quarantined')].map(r => r.cells[0].textContent)")
    assert sorted(marked) == ["laptop-2", "pi-4"]
    with urllib.request.urlopen(swarm.dashboard.url + "/api/state", timeout=5) as resp:
        state = json.loads(resp.read(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    caught = {q["node"]: q for q in state["models"][0]["quarantined"]}
    assert caught["laptop-2"]["error"] == 0.37 and caught["pi-4"]["error"] is None
    # The market dropped them from its workers: their rows stay, marked, with no holdings, and
    # their ranges are holes in the heatmap.
    assert rows["laptop-2"][3] == rows["pi-4"][3] == "- (dropped by the market)"
    honest = lambda: [w for n, w in swarm.workers.items() if n not in ("laptop-2", "pi-4")]  # noqa: E731
    wait_until(browser, lambda d: heatmap(d) == expected(honest()),
               "the quarantined workers' ranges to turn into holes")

    victim = swarm.workers["gpu-3"]
    gone = {(h.layer, e) for h in victim.holdings for e in range(h.lo, h.hi)}
    swarm.kill("gpu-3")
    want = expected(honest())
    wait_until(browser, lambda d: heatmap(d) == want,
               "the killed worker's range to turn into a hole")
    shown = heatmap(browser)
    assert all(shown[c] == 0 for c in gone)
    assert sum(shown.values()) == (len(workers) - 3) * RANGE
    rows = browser.execute_script(
        "return [...document.querySelectorAll('table.workers tbody tr')]"
        ".map(r => r.cells[0].textContent)")
    assert "gpu-3" not in rows
    save_screenshot(browser, tmp_path)
