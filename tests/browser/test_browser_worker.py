"""A browser tab joins the swarm: Debian's headless Chromium opens ``/worker`` on the backbone's
weights server, against a real nats-server with its WebSocket listener and a real market.

The tab volunteers, downloads only its assigned slabs (counted by the weights server), serves
its experts over WebSocket, and the backbone's output stays the monolithic run's:

* ``--audit 1``: bit-identical logits with the tab holding a share of every layer and winning calls;
* the default audit rate: the tab passes probation and sampled audits (never quarantined) over
  64 tokens, and the tokens equal the monolithic run's;
* closing the tab mid-generation changes no token;
* two tabs and one Python worker cover the model, and the market's status shows each.

Needs chromium + chromedriver (``.ci/run`` installs them), selenium, and the built page
(``make install`` runs npm); each missing piece skips with its reason.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from backbone.audit import AuditConfig, Auditor
from backbone.dispatch import DispatchConfig
from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig
from backbone.service import BackboneConfig, BackboneService
from backbone.weights_http import WORKER_DIR, WeightsServer
from kvasir_bus import market_codec as mc
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.loopthread import LoopThread
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import Subjects
from launch.swarm import spawn_worker, wait_for_nodes
from market.service import Market, MarketConfig

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")

RANGE = 4  # experts per range: 2 layers x 8 experts = 4 ranges
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "browser-worker.png"


def _browser_paths() -> tuple[str, str]:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium; .ci/run does)")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no chromium/chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run does)")
    if not os.path.isfile(os.path.join(WORKER_DIR, "worker.js")):
        pytest.skip("the browser worker is not built (make install runs `npm ci` and browser/build.mjs; needs npm)")
    return browser, driver


class Tabs:
    """One headless Chromium; each tab a volunteer."""

    def __init__(self) -> None:
        path, driver_path = _browser_paths()
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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    path = tmp_path_factory.mktemp("browser") / "tiny-q4k.gguf"
    return synth_model(path, arch="qwen3moe", preset="tiny", qtype="q4_k", seed=7)


@pytest.fixture(scope="module")
def swarm(model, tmp_path_factory):
    """nats-server (with WebSocket), a market, and a backbone serving its weights and manifest."""
    tmp = tmp_path_factory.mktemp("browser-swarm")
    server = EmbeddedNats(port=0, websocket_port=0).start()
    fp = model_fingerprint(Engine(model).reader)
    bus = LoopThread("browser-market")

    async def start_market():
        nc = await connect(server.url, "market")
        cfg = MarketConfig(db_path=str(tmp / "ledger.db"), expiry_s=2.0, assign_grace_s=30.0,
                           range_experts=RANGE, demand_interval_s=0.5, models=(fp,))
        return nc, await Market(nc, cfg).start()
    nc, market = bus.run(start_market(), timeout=30)
    engine = Engine(model)
    cfg = BackboneConfig(model_path=str(model), nats_url=server.url, serve_weights="127.0.0.1:0",
                         market_interval_s=0.2, dispatch=DispatchConfig(timeout_s=10.0))
    backbone = BackboneService(engine, cfg).start()
    try:
        wait_until(lambda: bus.run(_status(market, fp), timeout=10) is not None, 30, "the market to know the model")
        yield {"server": server, "fp": fp, "engine": engine, "backbone": backbone, "market": market,
               "bus": bus, "model": model, "tmp": tmp}
    finally:
        backbone.stop()

        async def stop():
            await market.stop()
            await nc.drain()
        bus.run(stop(), timeout=20)
        bus.stop()
        server.stop()


async def _status(market, fp):
    try:
        return await market.status(fp)
    except Exception:
        return None


def page_url(swarm, node: str, budget: int) -> str:
    w = swarm["backbone"].weights
    return f"http://127.0.0.1:{w.port}/worker?nats={swarm['server'].websocket_url}&budget={budget}&node={node}"


def run(engine, prompt, n, dispatch: DispatchConfig | None = None):
    gen = generate(engine, prompt, n, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    return gen.tokens, gen.logits_array()


def same_as_monolithic(tokens, logits, mono_tokens, mono_logits, n_prompt: int, what: str) -> None:
    """The tokens equal the monolithic run's, or differ from a token where the monolithic run's
    top two logits were a near tie (within 0.5 %). ``logits`` has a row per token of the whole
    sequence (prompt first): generated token ``i`` is chosen from row ``n_prompt - 1 + i``.

    Why they may differ: the tab computes the numpy worker's bits (tests/browser/test_kernel_node),
    up to ~5e-7 relative from ggml's, the backbone's kernel; its unaudited replies (9 in 10 after
    probation) are used as they are. Such a difference can move a router's top-k choice in a
    later layer, which moves the logits by far more, and that flips a greedy choice where the
    monolithic top two are that close: on this model and prompt (deterministic mode) token 60,
    whose top two are 5.597520 and 5.593394 (0.074 % apart). Audits cannot catch it: the reply is
    right within any tolerance a cross-kernel audit can use."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, mono_tokens)) if a != b), len(tokens))
    if same == len(tokens):
        print(f"{what}: {same} of {same} tokens equal the monolithic run's")
        return
    row = n_prompt - 1 + same
    top = np.sort(mono_logits[row])[::-1]
    delta = np.abs(logits[:row + 1] - mono_logits[:row + 1]).max(axis=-1)
    print(f"{what}: tokens equal the monolithic run's for {same} of {len(tokens)}; at {same} the monolithic "
          f"top-2 logits were {top[0]:.6f} and {top[1]:.6f}; max |logit delta| before it {delta[:row].max():.3g}, "
          f"at it {delta[row]:.3g}")
    assert top[0] - top[1] < 5e-3 * abs(top[0]), (what, same, top[:2])


def test_tabs_volunteer_download_only_their_slabs_and_serve_exactly(swarm):
    engine, backbone, fp = swarm["engine"], swarm["backbone"], swarm["fp"]
    manifest, weights, remote = backbone.manifest, backbone.weights, backbone.dispatch
    range_bytes = RANGE * manifest.expert_bytes(0)
    budget = int(range_bytes * 1.3)  # one range fits, two do not
    prompt = np.random.default_rng(3).integers(0, engine.cfg.n_vocab, 16).tolist()

    mono_tokens, mono_logits = run(Engine(swarm["model"]), prompt, 64)  # monolithic: every expert here

    tabs, procs = Tabs(), []
    try:
        # A bus that does not answer is said in plain words, and retried with backoff.
        tabs.open(page_url(swarm, "tab-nobus", budget).replace(swarm["server"].websocket_url, "ws://127.0.0.1:9"),
                  "tab-nobus")
        st = wait_until(lambda: (s := tabs.state("tab-nobus"))["state"] == "retrying" and s, 30, "the retry notice")
        assert "unreachable" in st["error"] and "retrying in" in st["error"], st["error"]
        tabs.close("tab-nobus")

        # A budget too small for one expert is said in plain words.
        tabs.open(page_url(swarm, "tab-small", 1000), "tab-small")
        st = wait_until(lambda: (s := tabs.state("tab-small"))["state"] == "error" and s, 30, "the small tab's error")
        assert "too small for one expert" in st["error"], st["error"]
        tabs.close("tab-small")

        # Two tabs volunteer and each takes one range, downloading only its slabs.
        for node in ("tab-a", "tab-b"):
            tabs.open(page_url(swarm, node, budget), node)
            st = wait_until(lambda: (s := tabs.state(node))["state"] in ("serving", "error") and s, 60, f"{node} serving")
            assert st["state"] == "serving", st
            assert len(st["holdings"]) == 1 and st["holdings"][0][2] - st["holdings"][0][1] == RANGE, st
            assert st["slabBytes"] == range_bytes
            assert weights.served_to(node) == st["headerBytes"] + range_bytes  # nothing else fetched
        # A Python worker takes the rest: two tabs and one Python worker cover the model, and
        # the market's status shows each of them with its own kernel.
        log = open(swarm["tmp"] / "py.log", "w")
        proc = spawn_worker(swarm["server"].url, "py-0", ["--budget", str(int(range_bytes * 2.3)), "--source",
                                                          weights.url, "--cache-dir", str(swarm["tmp"] / "py")],
                            heartbeat_s=0.5, log_file=log)
        procs.append(proc)
        asyncio.run(wait_for_nodes(swarm["server"].url, fp, {"py-0"}, procs=[proc], timeout=120))

        def covered():
            status = swarm["bus"].run(_status(swarm["market"], fp), timeout=10)
            nodes = {n.node: n for n in status.nodes}
            held = {(h.layer, e) for n in nodes.values() for h in n.holdings for e in range(h.lo, h.hi)}
            full = {(layer, e) for layer in manifest.moe_layers for e in range(manifest.n_expert)}
            return held == full and {"tab-a", "tab-b", "py-0"} <= nodes.keys() and nodes
        nodes = wait_until(covered, 30, "two tabs and the Python worker to cover the model")
        print("holdings:", {n: [(h.layer, h.lo, h.hi) for h in nodes[n].holdings] for n in ("tab-a", "tab-b", "py-0")})
        assert nodes["tab-a"].kernel == nodes["tab-b"].kernel == "js-wasm32" != nodes["py-0"].kernel  # WebAssembly SIMD in Chromium

        # --audit 1: every reply recomputed and replaced: bit-identical, with the tabs winning calls.
        default_auditor = remote.auditor
        remote.auditor = strict = Auditor(AuditConfig(rate=1.0))
        before = remote.stats.totals()
        tokens, logits = run(engine, prompt, 16)
        after = remote.stats.totals()
        assert np.array_equal(logits, mono_logits[:len(logits)])
        assert after.remote > before.remote, remote.stats.to_dict()["totals"]
        assert after.local == before.local, "every call was answered by a worker"
        served_tabs = {n: tabs.state(n)["rows"] for n in ("tab-a", "tab-b")}
        assert all(served_tabs.values()), served_tabs
        print("audit 1:", after.remote - before.remote, "remote calls; rows served by the tabs:", served_tabs)

        # The default audit: probation, then sampled; an honest tab is never quarantined over 64 tokens.
        for node in ("tab-a", "tab-b"):
            assert not strict.is_quarantined(node), node
        remote.auditor = default_auditor
        rows_before = {n: tabs.state(n)["rows"] for n in ("tab-a", "tab-b")}
        audits_before = default_auditor.stats.audits
        tokens, logits = run(engine, prompt, 64)
        same_as_monolithic(tokens, logits, mono_tokens, mono_logits, len(prompt), "default audit")
        rows_served = {n: tabs.state(n)["rows"] - rows_before[n] for n in ("tab-a", "tab-b")}
        assert all(rows_served.values()), rows_served  # the tabs served this run, mostly unaudited
        print("default audit: rows served by the tabs", rows_served, "audits of all workers",
              default_auditor.stats.audits - audits_before)
        for node in ("tab-a", "tab-b"):
            assert not remote.auditor.is_quarantined(node), node
            assert not tabs.state(node)["quarantined"]
        errors = [tabs.state(n)["errors"] for n in ("tab-a", "tab-b")]
        assert errors == [0, 0], errors
        text = tabs.driver.find_element("id", "audits").text
        assert text.startswith("none failed"), text

        # The page as a person sees it.
        tabs.driver.switch_to.window(tabs.handles["tab-a"])
        wait_until(lambda: tabs.state("tab-a")["creditedRows"] > 0, 30, "the market to credit tab-a")
        tabs.driver.switch_to.window(tabs.handles["tab-a"])
        tabs.driver.save_screenshot(str(swarm["tmp"] / "browser-worker.png"))
        if os.environ.get("KVASIR_SAVE_SCREENSHOT"):
            tabs.driver.save_screenshot(str(SCREENSHOT))
        print("screenshot:", swarm["tmp"] / "browser-worker.png")

        # Closing a tab mid-generation changes no token.
        result = {}

        def gen():
            result["tokens"], result["logits"] = run(engine, prompt, 48)
        t = threading.Thread(target=gen)
        t.start()
        wait_until(lambda: remote.stats.totals().remote > after.remote + 40, 60, "generation under way")
        tabs.close("tab-b")
        t.join(120)
        assert not t.is_alive()
        same_as_monolithic(result["tokens"], result["logits"], mono_tokens, mono_logits, len(prompt),
                           "tab closed mid-generation")

        # A slab that fails its SHA-256 is refused, in plain words: a second weights server
        # serves a copy whose expert bytes were changed, against the real backbone's manifest.
        bad = swarm["tmp"] / "doctored.gguf"
        data = bytearray(Path(swarm["model"]).read_bytes())
        for slab in manifest.slabs:
            data[slab.offset] ^= 0xFF
        bad.write_bytes(bytes(data))
        with WeightsServer(bad, port=0, model=fp) as doctored:
            url = page_url(swarm, "tab-bad", budget).replace(f":{weights.port}/", f":{doctored.port}/")
            tabs.open(url, "tab-bad")
            st = wait_until(lambda: (s := tabs.state("tab-bad"))["state"] == "error" and s, 60, "the hash error")
            assert "failed its SHA-256 check" in st["error"] and st["holdings"], st["error"]
            tabs.close("tab-bad")
    finally:
        tabs.quit()
        for p in procs:
            p.proc.kill()
            p.proc.wait()


def test_a_lying_tab_is_quarantined_and_changes_no_token(swarm):
    """A tab whose replies are corrupted (``&lie=1``, honoured only because this test switches the
    weights server's test setting on) is caught on probation as any liar: its first audited
    reply fails, it is quarantined (the page says so, from the backbone's quarantine notice), and
    the tokens and logits are the monolithic run's, bit for bit: every reply of a node on
    probation is audited and replaced."""
    engine, backbone, fp = swarm["engine"], swarm["backbone"], swarm["fp"]
    manifest, weights, remote = backbone.manifest, backbone.weights, backbone.dispatch
    budget = int(RANGE * manifest.expert_bytes(0) * 1.3)
    prompt = np.random.default_rng(4).integers(0, engine.cfg.n_vocab, 12).tolist()
    mono_tokens, mono_logits = run(Engine(swarm["model"]), prompt, 24)

    tabs = Tabs()
    try:
        # Without the server's test setting the page ignores &lie=1.
        tabs.open(page_url(swarm, "tab-nolie", budget) + "&lie=1", "tab-nolie")
        st = wait_until(lambda: (s := tabs.state("tab-nolie"))["state"] in ("serving", "error") and s, 60, "tab-nolie")
        assert st["state"] == "serving" and st["lying"] is False, st
        tabs.close("tab-nolie")

        weights.worker_test_lies = True
        try:
            tabs.open(page_url(swarm, "tab-liar", budget) + "&lie=1", "tab-liar")
            st = wait_until(lambda: (s := tabs.state("tab-liar"))["state"] in ("serving", "error") and s, 60, "tab-liar")
        finally:
            weights.worker_test_lies = False
        assert st["state"] == "serving" and st["lying"] is True, st

        def listed():
            status = swarm["bus"].run(_status(swarm["market"], fp), timeout=10)
            return any(n.node == "tab-liar" and n.holdings for n in status.nodes)
        wait_until(listed, 30, "the market to list the lying tab")
        assert remote.auditor.cfg.rate < 1.0  # the default audit: probation, then sampled
        tokens, logits = run(engine, prompt, 24)
        assert tabs.state("tab-liar")["rows"] > 0, "the liar was asked"
        assert remote.auditor.is_quarantined("tab-liar")
        assert tokens == mono_tokens and np.array_equal(logits, mono_logits)
        st = wait_until(lambda: (s := tabs.state("tab-liar"))["quarantined"] and s, 30, "the page to hear its quarantine")
        tabs.driver.switch_to.window(tabs.handles["tab-liar"])
        text = tabs.driver.find_element("id", "audits").text
        assert text.startswith("FAILED"), text
        print("lying tab: quarantined after", st["served"], "calls; page says:", text)
    finally:
        tabs.quit()
