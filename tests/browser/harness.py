"""What the browser tests and ``bench/browser_audit.py`` share: Debian's headless Chromium with one
tab per volunteer, and a swarm of a real nats-server (with its WebSocket listener), a market and a
backbone serving its weights, manifest and the page (``/worker``).

The swarm they build (:data:`RANGE` experts a range, 4 ranges): a Python worker volunteers first
with a budget of one range (the scarcest, L0:0-3), then tab ``tab-a`` with two ranges' budget
(L0:4-7 and L1:0-3: a share of every layer) and ``tab-b`` with one (L1:4-7).

Nothing here is a test: :class:`Missing` says which piece the machine lacks (the tests skip on
it, the bench stops with it).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from backbone.weights_http import WORKER_DIR
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.server import EmbeddedNats
from market.service import Market, MarketConfig

RANGE = 4  # experts per range: 2 layers x 8 experts = 4 ranges
#: Each volunteer's budget in ranges (a little over, never the next whole range).
BUDGETS = {"py-0": 1.3, "tab-a": 2.3, "tab-b": 1.3}


class Missing(Exception):
    """The machine lacks a piece the browser needs (the message says which and how to get it)."""


def browser_paths() -> tuple[str, str]:
    """Chromium and chromedriver, with selenium and the built page; :class:`Missing` otherwise."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise Missing("selenium is not installed (pip install selenium; .ci/run does)") from None
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        raise Missing("no chromium/chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run does)")
    if not os.path.isfile(os.path.join(WORKER_DIR, "worker.js")):
        raise Missing("the browser worker is not built (make install runs `npm ci` and browser/build.mjs; needs npm)")
    return browser, driver


class Tabs:
    """One headless Chromium; each tab a volunteer."""

    def __init__(self) -> None:
        path, driver_path = browser_paths()
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = path
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1000,720"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(driver_path), options=opts)
        self.handles: dict[str, str] = {}
        self.home = self.driver.current_window_handle  # kept open: closing the last tab ends the session

    def open(self, url: str, node: str) -> None:
        d = self.driver
        d.switch_to.new_window("tab")
        d.get(url)
        self.handles[node] = d.current_window_handle

    def state(self, node: str) -> dict:
        self.driver.switch_to.window(self.handles[node])
        return self.driver.execute_script("return window.kvasir") or {"state": "not loaded"}

    def text(self, node: str, element: str) -> str:
        """What the tab of ``node`` shows in the element with id ``element``."""
        self.driver.switch_to.window(self.handles[node])
        return self.driver.find_element("id", element).text

    def close(self, node: str) -> None:
        self.driver.switch_to.window(self.handles.pop(node))
        self.driver.close()
        self.driver.switch_to.window(self.home)

    def quit(self) -> None:
        self.driver.quit()


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def tiny_model(directory: Path) -> Path:
    """The browser tests' model: tiny qwen3moe, Q4_K, 2 MoE layers of 8 experts (seed 7)."""
    from synth.model import synth_model

    return synth_model(Path(directory) / "tiny-q4k.gguf", arch="qwen3moe", preset="tiny", qtype="q4_k", seed=7)


class Swarm:
    """nats-server (with WebSocket), a market, and a backbone serving its weights and manifest."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp = Path(model), Path(tmp)
        self.server = EmbeddedNats(port=0, websocket_port=0).start()
        self.fp = model_fingerprint(Engine(model).reader)
        self.bus = LoopThread("browser-market")
        self.backbone = None
        cfg = MarketConfig(db_path=str(self.tmp / "ledger.db"), expiry_s=2.0, assign_grace_s=30.0,
                           range_experts=RANGE, demand_interval_s=0.5, models=(self.fp,))

        async def start_market():
            nc = await connect(self.server.url, "market")
            return nc, await Market(nc, cfg).start()
        try:
            self.nc, self.market = self.bus.run(start_market(), timeout=30)
            self.engine = Engine(model)
            bcfg = BackboneConfig(model_path=str(model), nats_url=self.server.url, serve_weights="127.0.0.1:0",
                                  market_interval_s=0.2, dispatch=DispatchConfig(timeout_s=10.0))
            self.backbone = BackboneService(self.engine, bcfg).start()
            wait_until(lambda: self.status() is not None, 30, "the market to know the model")
        except BaseException:
            self.stop()
            raise

    def status(self):
        """The market's status of the model (None while it has none)."""
        async def get():
            try:
                return await self.market.status(self.fp)
            except Exception:
                return None
        return self.bus.run(get(), timeout=10)

    def python_worker(self, node: str, budget: int, procs: list):
        """A ``kvasir worker`` process volunteering with ``budget`` bytes (appended to ``procs``, the
        caller kills it), once the market has its heartbeat."""
        import asyncio

        from launch.swarm import spawn_worker, wait_for_nodes

        log = open(self.tmp / f"{node}.log", "w")
        proc = spawn_worker(self.server.url, node, ["--budget", str(budget), "--source", self.backbone.weights.url,
                                                    "--cache-dir", str(self.tmp / node)], heartbeat_s=0.5, log_file=log)
        procs.append(proc)
        asyncio.run(wait_for_nodes(self.server.url, self.fp, {node}, procs=[proc], timeout=180))
        return proc

    def covered_by(self, nodes: set[str]):
        """The market's nodes once ``nodes`` are among them and every expert is held (else None)."""
        status = self.status()
        if status is None:
            return None
        m = self.backbone.manifest
        held = {n.node: n for n in status.nodes}
        experts = {(h.layer, e) for n in held.values() for h in n.holdings for e in range(h.lo, h.hi)}
        full = {(layer, e) for layer in m.moe_layers for e in range(m.n_expert)}
        return held if experts == full and nodes <= held.keys() else None

    def page_url(self, node: str, budget: int) -> str:
        w = self.backbone.weights
        return f"http://127.0.0.1:{w.port}/worker?nats={self.server.websocket_url}&budget={budget}&node={node}"

    def stop(self) -> None:
        if self.backbone is not None:
            self.backbone.stop()
        if getattr(self, "market", None) is not None:
            async def stop():
                await self.market.stop()
                await self.nc.drain()
            self.bus.run(stop(), timeout=20)
        self.bus.stop()
        self.server.stop()


def run(engine, prompt, n):
    """``n`` greedy tokens of ``prompt`` and the logits of every position (prompt first)."""
    gen = generate(engine, prompt, n, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    return gen.tokens, gen.logits_array()


@dataclass(frozen=True)
class Difference:
    """Where a generation's tokens first differ from the monolithic run's (``at`` = the number of
    tokens that are equal), the monolithic run's top two logits there, and how far the logits
    moved before and at it."""

    at: int
    n: int
    top: tuple[float, float] | None
    delta_before: float
    delta_at: float

    @property
    def same(self) -> bool:
        return self.at == self.n

    @property
    def top2_gap(self) -> float | None:
        """The monolithic top two logits' distance at the difference, relative to the first."""
        return None if self.top is None else (self.top[0] - self.top[1]) / abs(self.top[0])


def first_difference(tokens, logits, mono_tokens, mono_logits, n_prompt: int) -> Difference:
    """``logits`` has a row per token of the whole sequence (prompt first): generated token ``i``
    is chosen from row ``n_prompt - 1 + i``."""
    n = len(tokens)
    same = next((i for i, (a, b) in enumerate(zip(tokens, mono_tokens)) if a != b), n)
    row = n_prompt - 1 + min(same, n - 1)
    delta = np.abs(logits[:row + 1] - mono_logits[:row + 1]).max(axis=-1)
    if same == n:
        return Difference(same, n, None, float(delta.max()), 0.0)
    top = np.sort(mono_logits[row])[::-1]
    return Difference(same, n, (float(top[0]), float(top[1])), float(delta[:row].max()) if row else 0.0,
                      float(delta[row]))
