"""How often a generation with browser tabs under the default audit differs from the monolithic run.

The setup of tests/browser/test_browser_worker.py (tests/browser/harness.py): the tiny qwen3moe
Q4_K model (2 MoE layers of 8 experts, ranges of 4), a Python worker holding L0:0-3 and two
headless-Chromium tabs on ``/worker`` (the ``js-wasm32`` kernel), one holding L0:4-7 and L1:0-3
(a share of every layer), the other L1:4-7, against a real nats-server (over WebSocket for the
tabs), market and backbone, in the kernel mode the tests run (deterministic).
Then ``--runs`` generations of ``--tokens`` greedy tokens, each with a fresh default auditor (rate
0.1, probation 16: every node starts a new probation), compared token by token with the
monolithic run of the same prompt (prompts ``rng(3)``, ``rng(4)``, ...: ``--prompts`` of them,
taken in turn; the first is the test's).

Per run: where its tokens first differ from the monolithic run's (if they do), the monolithic
run's top two logits there and their gap relative to the first, the largest logit change before
it, the audits judged, the rows the tabs served and the calls computed on the backbone instead
(a timeout under load); and whether a tab was quarantined. Per prompt: the monolithic run's
smallest top-two gap over its tokens, and how many tokens have a gap under 0.5 % (the test's
tolerance). Prints one JSON object (``--save``: also into bench/results/).

``python bench/browser_audit.py [--runs 20] [--tokens 64] [--prompts 1] [--save]``; needs what
the browser tests need (chromium, chromedriver, selenium, the built page, llama-cpp-python).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KVASIR_KERNEL_MODE", "deterministic")  # as tests/conftest.py: what the test compares
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import numpy as np  # noqa: E402

import record  # noqa: E402  (bench/record.py)
from backbone.audit import AuditConfig, Auditor  # noqa: E402
from backbone.model import Engine  # noqa: E402
from tests.browser import harness  # noqa: E402
from tests.browser.harness import BUDGETS, RANGE, first_difference, run, wait_until  # noqa: E402

TABS = ("tab-a", "tab-b")
TOLERANCE = 5e-3  # the test's: a first difference only where the monolithic top two are this close


def top2_gaps(logits: np.ndarray, n_prompt: int, n: int) -> np.ndarray:
    """Per generated token, the monolithic top two logits' gap relative to the first."""
    rows = np.sort(logits[n_prompt - 1:n_prompt - 1 + n], axis=-1)[:, ::-1]
    return (rows[:, 0] - rows[:, 1]) / np.abs(rows[:, 0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="fresh default-audit generations (default 20)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per generation (default 64)")
    p.add_argument("--prompts", type=int, default=1, help="prompts taken in turn (default 1: the test's)")
    record.add_save_flag(p)
    args = p.parse_args()
    from kvasir_bus.logs import configure

    configure("warning")  # logs on stderr; stdout is the JSON
    if args.runs < 1 or args.tokens < 1 or args.prompts < 1:
        print("browser_audit: --runs, --tokens and --prompts must be >= 1", file=sys.stderr)
        return 2
    try:
        harness.browser_paths()
    except harness.Missing as exc:
        print(f"browser_audit: {exc}", file=sys.stderr)
        return 2
    load_start = round(os.getloadavg()[0], 2)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = harness.tiny_model(tmp)
        swarm = harness.Swarm(model, tmp)
        browsers: list[harness.Tabs] = []
        procs: list = []
        try:
            result = measure(args, swarm, browsers, procs)
        finally:
            for tabs in browsers:
                tabs.quit()
            for proc in procs:
                proc.proc.kill()
                proc.proc.wait()
            swarm.stop()
    result.update(load_avg_1m_at_start=load_start, wall_s=round(time.monotonic() - t0, 1),
                  kernel_mode=os.environ["KVASIR_KERNEL_MODE"])
    print(json.dumps(result, indent=1))
    record.save(args, "browser_audit", result)
    return 0


def measure(args, swarm: harness.Swarm, browsers: list, procs: list) -> dict:
    """The runs; ``browsers`` and ``procs`` get what it starts (the caller stops them)."""
    backbone, engine = swarm.backbone, swarm.engine
    manifest, remote = backbone.manifest, backbone.dispatch
    range_bytes = RANGE * manifest.expert_bytes(0)
    prompts = [np.random.default_rng(3 + i).integers(0, engine.cfg.n_vocab, 16).tolist() for i in range(args.prompts)]
    mono = []
    for prompt in prompts:  # every expert here, no bus
        tokens, logits = run(Engine(swarm.model), prompt, args.tokens)
        mono.append((tokens, logits))

    swarm.python_worker("py-0", int(range_bytes * BUDGETS["py-0"]), procs)  # the scarcest range first
    tabs = harness.Tabs()
    browsers.append(tabs)
    for node in TABS:
        tabs.open(swarm.page_url(node, int(range_bytes * BUDGETS[node])), node)
        st = wait_until(lambda: (s := tabs.state(node))["state"] in ("serving", "error") and s, 120, f"{node} serving")
        if st["state"] != "serving":
            raise SystemExit(f"browser_audit: {node} did not serve: {st.get('error')}")
    nodes = wait_until(lambda: swarm.covered_by({*TABS, "py-0"}), 60, "two tabs and the Python worker to cover the model")
    kernel = nodes["tab-a"].kernel
    holdings = {n: [[h.layer, h.lo, h.hi] for h in nodes[n].holdings] for n in (*TABS, "py-0")}

    runs = []
    for i in range(args.runs):
        k = i % len(prompts)
        prompt, (mono_tokens, mono_logits) = prompts[k], mono[k]
        remote.auditor = auditor = Auditor(AuditConfig())  # fresh: a new probation for every node
        rows_before = {n: tabs.state(n)["rows"] for n in TABS}
        before = remote.stats.totals()
        tokens, logits = run(engine, prompt, args.tokens)
        after = remote.stats.totals()
        diff = first_difference(tokens, logits, mono_tokens, mono_logits, len(prompt))
        states = {n: tabs.state(n) for n in TABS}
        quarantined = sorted(n for n in TABS if auditor.is_quarantined(n) or states[n]["quarantined"])
        runs.append({
            "run": i, "prompt": k, "same_tokens": diff.same, "first_difference_at": None if diff.same else diff.at,
            "mono_top2_at_difference": None if diff.same else list(diff.top),
            "mono_top2_gap_at_difference": diff.top2_gap,
            "max_logit_delta_before_difference": diff.delta_before,
            "audits": auditor.stats.audits, "audit_failures": auditor.stats.failures,
            "tab_rows": {n: states[n]["rows"] - rows_before[n] for n in TABS},
            "remote_calls": after.remote - before.remote, "computed_on_backbone": after.local - before.local,
            "quarantined": quarantined})
        r = runs[-1]
        print(f"run {i} (prompt {k}): "
              + ("tokens equal" if diff.same else f"first difference at token {diff.at}, monolithic top-2 gap "
                 f"{100 * diff.top2_gap:.3f} %")
              + f"; max |logit delta| {diff.delta_before:.3g}; audits {r['audits']}; tab rows {r['tab_rows']}; "
              f"on the backbone {r['computed_on_backbone']}; quarantined {quarantined or 'none'}",
              file=sys.stderr, flush=True)

    differing = [r for r in runs if not r["same_tokens"]]
    gaps = [r["mono_top2_gap_at_difference"] for r in differing]
    per_prompt = []
    for k, (prompt, (_t, logits)) in enumerate(zip(prompts, mono)):
        g = top2_gaps(logits, len(prompt), args.tokens)
        mine = [r for r in runs if r["prompt"] == k]
        per_prompt.append({"prompt": k, "seed": 3 + k, "min_top2_gap": float(g.min()), "min_top2_gap_at": int(g.argmin()),
                           "tokens_within_tolerance": int((g < TOLERANCE).sum()), "runs": len(mine),
                           "runs_differing": sum(1 for r in mine if not r["same_tokens"])})
    return {
        "model": "tiny qwen3moe q4_k (2 MoE layers x 8 experts, synth seed 7)", "tokens": args.tokens,
        "runs": args.runs, "prompts": args.prompts, "tabs": len(TABS), "kernel": kernel, "holdings": holdings,
        "audit": {"rate": AuditConfig().rate, "probation": AuditConfig().probation},
        "runs_differing": len(differing),
        "first_differences_at": sorted({r["first_difference_at"] for r in differing}),
        "max_mono_top2_gap_at_difference": max(gaps) if gaps else None,
        "test_tolerance": TOLERANCE,
        "all_within_test_tolerance": all(g < TOLERANCE for g in gaps),
        "runs_quarantined": sum(1 for r in runs if r["quarantined"]),
        "audit_failures": sum(r["audit_failures"] for r in runs),
        "computed_on_backbone": sum(r["computed_on_backbone"] for r in runs),
        "max_logit_delta_before_difference": max(r["max_logit_delta_before_difference"] for r in runs),
        "runs_same_tokens_logits_moved_over_1e-3": sum(1 for r in runs if r["same_tokens"]
                                                       and r["max_logit_delta_before_difference"] > 1e-3),
        "mean_audits_per_run": sum(r["audits"] for r in runs) / len(runs),
        "mean_tab_rows_per_run": sum(sum(r["tab_rows"].values()) for r in runs) / len(runs),
        "monolithic": per_prompt, "per_run": runs,
        "note": "counts tokens, not time: the load of a shared box matters only through timeouts, whose calls the "
                "backbone computes itself (computed_on_backbone)",
    }


if __name__ == "__main__":
    sys.exit(main())
