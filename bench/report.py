"""Render the docs' result tables from the saved runs in bench/results/.

``python bench/report.py`` rewrites, in place, every block between a pair of marker comments

    <!-- report:NAME begin -->
    ...
    <!-- report:NAME end -->

in README.md (``headline``: one row per measurement, each a ratio against the peer measured in
the same run) and docs/benchmarks.md (``results``: the latest saved run of each kind in full;
``runs``: every saved file). ``--check`` rewrites nothing and exits 1 if a file differs from
what it would write (tests/docs/ runs it), so no figure in those tables is typed by hand.

Numbers are printed as the bench wrote them to its JSON (a ratio the bench computed is not
recomputed); where this script divides two saved figures itself it says so in the column name.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import record  # noqa: E402

REPO = record.REPO
TARGETS = {"README.md": ("headline", "browser_audit"), "docs/benchmarks.md": ("results", "runs"),
           "docs/trust.md": ("attacks",)}
MARK = re.compile(r"(<!-- report:(?P<name>[a-z_]+) begin -->\n)(?P<body>.*?)(<!-- report:(?P=name) end -->)", re.S)


# ---------------------------------------------------------------------------------------- helpers

def num(v) -> str:
    """A saved figure as it reads in the JSON (floats keep their digits, None is a dash)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 100:
        return str(int(v))
    if isinstance(v, float) and len(repr(v)) > 8:  # a measured rate or error to all its digits: 4 are enough
        return f"{v:.4g}"
    return str(v)


def r3(v) -> str:
    """A ratio this script computes from two saved figures: three decimals."""
    return "-" if v is None else f"{v:.3f}"


def machine(rec: dict) -> str:
    m = rec.get("machine", {})
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, load {num(m.get('load_avg_1m'))}"


def provenance(rec: dict) -> str:
    c = rec.get("commit", {})
    dirty = " (uncommitted changes)" if c.get("dirty") else ""
    return (f"`{rec.get('command', '?')}` on {machine(rec)}; {rec.get('date', '?')}, commit "
            f"{c.get('sha') or '?'}{dirty}; [{rec['_file']}](../bench/results/{rec['_file']})")


def table(head: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "|" + "|".join("---" if i == 0 else "--:" for i in range(len(head))) + "|"
    return ["| " + " | ".join(head) + " |", align] + ["| " + " | ".join(r) + " |" for r in rows]


def latest(records: list[dict], bench: str, has=None) -> dict | None:
    """The newest run of ``bench``; a ``--quick`` run (a smoke test's few samples) only where
    the bench has no full run."""
    found = [r for r in records if r.get("bench") == bench and (has is None or has(r["result"]))]
    full = [r for r in found if "--quick" not in r.get("command", "").split()]
    return (full or found)[-1] if found else None


def short_cmd(rec: dict) -> str:
    return f"`{rec.get('command', '?')}`"


def when(rec: dict) -> str:
    m = rec.get("machine", {})
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, load {num(m.get('load_avg_1m'))}; "
            f"{rec.get('date', '?')[:10]}")


# ------------------------------------------------------------------------- what each bench holds

def serve_rows(res: dict) -> list[dict]:
    return [r for r in res.get("results", []) if isinstance(r, dict) and "kvasir_serve" in r]


def has_serve(res: dict) -> bool:
    return bool(serve_rows(res))


def has_section(key: str):
    return lambda res: bool(res.get(key))


def render_serve(rec: dict) -> list[str]:
    res = rec["result"]
    rows = []
    with_cpu = any("cpu_ms_per_token" in r["kvasir_serve"] for r in serve_rows(res))
    for r in serve_rows(res):
        ours, batched, server = r["kvasir_serve"], r.get("llama_cpp_batched", {}), r.get("llama_server", {})
        rows.append([num(r["concurrency"]), num(ours.get("tok_s")),
                     f"{num(ours.get('ttft_ms', {}).get('p50'))} / {num(ours.get('ttft_ms', {}).get('p95'))}",
                     f"{num(ours.get('itl_ms', {}).get('p50'))} / {num(ours.get('itl_ms', {}).get('p95'))}",
                     num(batched.get("tok_s")), num(r.get("ratio")),
                     num(server.get("tok_s")), num(r.get("ratio_vs_llama_server"))]
                    + ([_cpu_cell(ours), _cpu_cell(server)] if with_cpu else []))
    rounds = (f" Each side's best of {num(res['rounds'])} alternating rounds (the servers started once)."
              if res.get("rounds") else " One run per side.")
    return [f"`{res.get('model')}` ({num(res.get('file_mb'))} MB, {num(res.get('moe_layers'))} MoE layers), "
            f"{num(res.get('tokens_per_client'))} tokens per client after a {num(res.get('prompt_tokens'))}-token "
            f"prompt, every expert local; the peer is llama.cpp's batched decode (one context, one "
            f"`llama_decode` of all streams per step) in the same run, and `llama-server` where it was built."
            + rounds,
            "", *table(["streams", "kvasir serve tok/s", "TTFT p50 / p95 ms", "ITL p50 / p95 ms",
                        "llama.cpp batched tok/s", "ours / batched", "llama-server tok/s", "ours / llama-server"]
                       + (["kvasir serve CPU ms per token: all (its threads)", "llama-server's"] if with_cpu else []),
                       rows),
            *(["", "CPU per generated token of each best round: the server process, and in brackets "
                   "its threads from the busiest (`cpu_ms_per_token`)."] if with_cpu else []),
            "", provenance(rec)]


def _cpu_cell(side: dict) -> str:
    cpu = side.get("cpu_ms_per_token")
    if not cpu:
        return ""
    return f"{num(cpu['server'])} ({' / '.join(num(v) for v in cpu['server_threads'][:4])})"


def render_sharded(rec: dict) -> list[str]:
    rows = []
    for run in rec["result"]["sharded"]:
        for r in run.get("results", []):
            rows.append([num(run.get("workers")), num(run.get("rtt_ms")), num(r.get("concurrency")),
                         num(r.get("tok_s")),
                         f"{num(r.get('ttft_ms', {}).get('p50'))} / {num(r.get('ttft_ms', {}).get('p95'))}",
                         f"{num(r.get('itl_ms', {}).get('p50'))} / {num(r.get('itl_ms', {}).get('p95'))}"])
    return ["`kvasir serve --http --nats` with worker processes on a loopback nats-server (an injected "
            "round trip r per expert call where r > 0).", "",
            *table(["workers", "r ms", "streams", "tok/s", "TTFT p50 / p95 ms", "ITL p50 / p95 ms"], rows),
            "", provenance(rec)]


def render_handstarted(rec: dict) -> list[str]:
    hs = rec["result"]["handstarted"]
    modes = list(hs.get("results", {}))
    conc = sorted({r["concurrency"] for m in modes for r in hs["results"][m]})
    rows = []
    for c in conc:
        row = [num(c)]
        for m in modes:
            got = next((r for r in hs["results"][m] if r["concurrency"] == c), {})
            row.append(num(got.get("tok_s")))
        for key in ("default_over_threads_1", "all_cores_over_threads_1"):
            row.append(num(hs.get(key, {}).get(str(c))))
        rows.append(row)
    return [f"{num(hs.get('workers'))} hand-started `kvasir worker` processes on one machine, each mode's best "
            f"of {num(hs.get('rounds', 1))} alternating rounds: `default` (a worker takes its share of the cores), "
            "`threads_1` (`--threads 1`), `all_cores` (every worker on every core).", "",
            *table(["streams", *[f"{m} tok/s" for m in modes], "default / threads_1", "all_cores / threads_1"], rows),
            "", provenance(rec)]


def render_kernel(rec: dict) -> list[str]:
    res = rec["result"]
    shape = res.get("shape", {})
    out = [f"The expert function at the 122B expert shape ({num(shape.get('n_embd'))} x {num(shape.get('n_ff'))}, "
           f"`{shape.get('op', '')}`) beside raw prebuilt ggml graphs of the same three matmuls (plain and "
           "repacked weights); each figure the least call over interleaved rounds.", ""]
    rows = []
    for mode, m in res.get("modes", {}).items():
        for qtype, by_rows in m.get("rows_per_s", {}).items():
            for n, r in by_rows.items():
                bits = r.get("ours_bit_identical_to", {})
                same = ", ".join(k for k, v in bits.items() if v) or "-"
                rows.append([mode, qtype, n, num(r.get("ours")), num(r.get("raw_plain")),
                             num(r.get("raw_repacked")), num(r.get("ours_over_best")), num(r.get("numpy")), same])
    out += table(["mode", "weights", "rows", "ours rows/s", "raw ggml rows/s", "raw repacked rows/s",
                  "ours / best raw", "numpy rows/s", "ours bit-identical to"], rows)
    return out + ["", provenance(rec)]


def render_browser(rec: dict) -> list[str]:
    res = rec["result"]
    rows = []
    for n, s in res.get("speed_122b_q4_k", {}).items():
        rows.append([n.replace("rows_", ""), num(s.get("wasm_simd_rows_per_s")), num(s.get("js_rows_per_s")),
                     num(s.get("numpy_rows_per_s")), num(s.get("ggml_rows_per_s")),
                     r3(ratio(s.get("wasm_simd_rows_per_s"), s.get("ggml_rows_per_s")))])
    err = []
    for qtype, e in res.get("errors", {}).items():
        if isinstance(e, dict):
            err.append([qtype, num(e.get("js_vs_ggml")), num(e.get("numpy_vs_ggml")), num(e.get("audit_tolerance"))])
    return [f"The browser worker's kernels ({res.get('kernel', '')}): speed at the 122B expert shape in Q4_K, "
            "and the relative error of each kernel against ggml per weight type beside the audit's tolerance.", "",
            *table(["rows", "wasm SIMD rows/s", "js rows/s", "numpy rows/s", "ggml rows/s",
                    "wasm / ggml (computed here)"], rows), "",
            *table(["weights", "js vs ggml", "numpy vs ggml", "audit tolerance"], err),
            "", provenance(rec)]


def pct(v) -> str:
    """A relative gap this script prints as a percentage (three significant digits)."""
    return "-" if v is None else f"{100 * v:.3g} %"


def pct1(v) -> str:
    """A percentage with one decimal always (9.0 %, never 9 %): the headline's figures are the
    saved run's, and a test finds them by their decimal point."""
    return "-" if v is None else f"{100 * v:.1f} %"


def browser_audit_sentence(rec: dict) -> str:
    """What the saved run says of default-audit generations with tabs against the monolithic run."""
    res = rec["result"]
    runs, k, audit = res.get("runs"), res.get("runs_differing"), res.get("audit", {})
    at = ", ".join(str(t) for t in res.get("first_differences_at", []))
    closest = min((m.get("min_top2_gap") for m in res.get("monolithic", []) if m.get("min_top2_gap") is not None),
                  default=None)
    differ = (f"none differed from the monolithic run's tokens" if not k else
              f"{num(k)} differed from the monolithic run's tokens, first at token {at}, where the monolithic top two "
              f"logits were at most {pct(res.get('max_mono_top2_gap_at_difference'))} apart")
    quarantined = "no tab was quarantined" if not res.get("runs_quarantined") else \
        f"a tab was quarantined in {num(res.get('runs_quarantined'))} runs"
    return (f"Measured (`bench/browser_audit.py`): {num(runs)} generations of {num(res.get('tokens'))} tokens, each "
            f"with a fresh default audit (rate {num(audit.get('rate'))}, probation {num(audit.get('probation'))}), "
            f"{num(res.get('tabs'))} tabs and a Python worker, {num(res.get('prompts'))} prompts: {differ}; the "
            f"monolithic top two logits come within {pct(closest)} at the prompts' closest token, and in "
            f"{num(res.get('runs_same_tokens_logits_moved_over_1e-3'))} runs the logits moved by over 1e-3 with the "
            f"tokens equal; {quarantined}; {num(res.get('computed_on_backbone'))} calls fell "
            f"back to the backbone after a timeout. The test accepts a first difference only where the monolithic "
            f"top two are within {pct(res.get('test_tolerance'))}.")


def render_browser_audit(rec: dict) -> list[str]:
    res = rec["result"]
    rows = [[num(m.get("seed")), num(m.get("runs")), num(m.get("runs_differing")), pct(m.get("min_top2_gap")),
             num(m.get("min_top2_gap_at")), num(m.get("tokens_within_tolerance"))] for m in res.get("monolithic", [])]
    return [browser_audit_sentence(rec), "",
            *table(["prompt seed", "runs", "runs differing", "monolithic smallest top-2 gap", "at token",
                    f"tokens within {pct(res.get('test_tolerance'))}"], rows), "", provenance(rec)]


def render_browser_audit_readme(records: list[dict]) -> str:
    rec = latest(records, "browser_audit")
    if rec is None:
        return ""
    return "\n".join([browser_audit_sentence(rec), f"({when(rec)}, commit {rec.get('commit', {}).get('sha')}.)", ""])


def render_engine(rec: dict) -> list[str]:
    rows = []
    for m in rec["result"].get("results", []):
        fast, users = m.get("ours_fast", {}), m.get("llama_cpp_as_users_run_it", {})
        ru, rm = m.get("ratio_ours_fast_over_llama_cpp_users", {}), m.get("ratio_ours_fast_over_llama_cpp_matched", {})
        dc = m.get("deterministic_cost", {})
        rows.append([m.get("model", "?"), f"{num(fast.get('prefill_tok_s'))} / {num(fast.get('decode_tok_s'))}",
                     f"{num(users.get('prefill_tok_s'))} / {num(users.get('decode_tok_s'))}",
                     f"{num(ru.get('prefill'))} / {num(ru.get('decode'))}",
                     f"{num(rm.get('prefill'))} / {num(rm.get('decode'))}",
                     f"{num(dc.get('prefill'))} / {num(dc.get('decode'))}",
                     f"{num(fast.get('rss_mb'))} / {num(users.get('rss_mb'))}"])
    return ["Prefill / decode tokens/s of one stream, each configuration in its own processes, interleaved; "
            "the peer is llama.cpp as its users run it (llama-cpp-python's defaults).", "",
            *table(["model", "ours fast", "llama.cpp as users run it", "ours / users' llama.cpp",
                    "ours / matched llama.cpp", "deterministic mode's cost", "RSS MB ours / llama.cpp"], rows),
            "", provenance(rec)]


def render_dispatch(rec: dict) -> list[str]:
    rows = []
    for m in rec["result"].get("results", []):
        rows.append([f"`{m.get('model', '?')}`", num(m.get("workers")), num(m.get("monolithic_tok_s")),
                     num(m.get("sharded_tok_s")), num(m.get("ratio_sharded_over_monolithic")),
                     num(m.get("ratio_median_of_rounds")), num(m.get("same_tokens")),
                     num(m.get("messages_out_per_token")), num(m.get("sharded_cores_busy"))])
    return ["Decode with every expert on worker processes over a loopback nats-server, against the "
            "monolithic decode on the same machine, alternated round by round (bundles on).", "",
            *table(["model", "workers", "monolithic tok/s", "sharded tok/s", "sharded / monolithic (best round)",
                    "median round", "same tokens", "messages out per token", "cores busy, sharded"], rows),
            "", provenance(rec)]


def render_nats_rtt(rec: dict) -> list[str]:
    res = rec["result"]
    labels = {"cli": "`nats bench` requester and responder (NATS itself)",
              "nats_py": "nats.py requester, `nats bench` responder", "dispatch": "dispatch call to a `kvasir worker`"}
    rows = [[labels.get(mode, mode), num(b.get("p50_us")), num(b.get("mean_us")), num(b.get("p99_us")),
             num(b.get("calls_per_s"))] for mode, b in res.get("best", {}).items()]
    return [f"One request in flight at a time on one nats-server, {num(res.get('request_bytes'))}-byte requests "
            f"(the size of a one-row dispatch request of the tiny model), {num(res.get('calls_per_round'))} calls per "
            f"round, each mode's best of {num(res.get('rounds'))} alternating rounds (nats CLI {res.get('nats_cli')}).",
            "", *table(["requester, responder", "p50 µs", "mean µs", "p99 µs", "calls/s"], rows), "",
            f"Dispatch / `nats bench` p50: {num(res.get('ratio_dispatch_over_cli_p50'))}; nats.py / `nats bench`: "
            f"{num(res.get('ratio_nats_py_over_cli_p50'))}; dispatch / nats.py: "
            f"{num(res.get('ratio_dispatch_over_nats_py_p50'))}. The CLI's raw publish rate (16-byte messages, no "
            f"subscriber): {num(res.get('cli_pub_16B_msgs_per_s'))} messages/s.",
            "", provenance(rec)]


def render_attacks(rec: dict) -> list[str]:
    """bench/attacks.py: one row per attack, each pointing at the test that pins it down."""
    res = rec["result"]
    rows = []
    for r in res.get("rows", []):
        test = r.get("test", "-")
        where = f"[`{test}`](../{test.split('::')[0]})" if test.startswith("tests/") else "-"
        rows.append([r.get("attack", "?"), r.get("summary", ""), r.get("bound", ""),
                     "yes" if r.get("pass") else "**no**", where])
    model = res.get("model")
    return [f"Each attack on a fresh swarm of real processes (nats-server, `kvasir worker` processes, the market, "
            f"the backbone, the API server), generating with `{model}` ({num(res.get('prompt_tokens'))}-token "
            f"prompt, {num(res.get('decode_tokens'))} tokens, greedy, compared token by token with the monolithic "
            f"run); time ratios are medians of {num(res.get('repeat'))} alternating rounds, each generation in a "
            f"fresh backbone, the attacker in a process of its own on the same machine (load "
            f"{num(res.get('load_avg_1m_start'))} at the start, {num(res.get('load_avg_1m_end'))} at the end). "
            f"{num(res.get('passed'))} of {num(res.get('passed', 0) + res.get('failed', 0))} rows within their bound.",
            "", *table(["attack", "measured", "bound", "held", "test"], rows, align="|---|---|---|---|---|"),
            "", provenance(rec)]


def render_ledger(rec: dict) -> list[str]:
    res = rec["result"]
    rows = [[num(r.get("events")), num(r.get("kept_events")), num(r.get("totals_ms")), num(r.get("scan_totals_ms")),
             num(r.get("file_mb")), num(r.get("unfolded_file_mb"))] for r in res.get("sizes", [])]
    return [f"One-row wins applied as the market applies them, folded after each batch of 5,000 "
            f"(`--keep-events {num(res.get('keep_events'))}`): the totals a status reads (median of 20) beside "
            "a GROUP BY over every event, and the file with and without folding.",
            "", *table(["events applied", "kept one by one", "totals ms", "GROUP BY ms", "file MB",
                        "unfolded MB"], rows), "", provenance(rec)]


def render_kernel_gap(rec: dict) -> list[str]:
    res = rec["result"]

    def flips(v):
        counts = v.get("one_row_flips") or {}
        return ", ".join(f"{a} of {b} ({k})" for k, (a, b) in counts.items()) or "-"

    rows = [[name, num(v.get("worst_gap")), flips(v), num(v.get("audit_bound")),
             num(v.get("worst_explained_gap")), num(v.get("explained_headroom")), num(v.get("liar_explained_gap")),
             num(v.get("other_arch_gap"))]
            for name, v in res.get("types", {}).items()]
    shapes = ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in res.get("shapes", {}).items())
    other = res.get("other_arch") or {}
    lines = [f"The numpy worker's expert output against ggml's (relative L2), worst over "
             f"{num(res.get('experts_per_case'))} random experts a case at the {shapes} shapes, "
             f"{', '.join(str(r) for r in res.get('rows', []))}-row calls and "
             f"{num(res.get('one_row_calls_per_expert'))} one-row calls per expert, on {res.get('machine_arch')}: "
             "the plain gap (flips: one-row calls above 1e-5, an activation on the other side of a quant step) "
             "with the plain bound (the replica check); the gap once the flips that summation order could cause "
             "are taken out (kernels/flips.py), which an audit of a kernel the backbone cannot rerun bounds by "
             f"{num(res.get('explained_tolerance'))}, its headroom, and a liar at honest x (1 + 1e-3) measured the "
             "same way; last, the numpy kernel on another CPU against this one's."]
    if other:
        lines.append(f"Other CPU: {other.get('machine_arch')} ({other.get('how')}): {num(other.get('identical_calls'))} "
                     f"of {num(other.get('calls'))} calls bit-identical, worst gap {num(other.get('worst_gap'))} "
                     f"(bound {num(res.get('numpy_tolerance'))}).")
    return [*lines, "", *table(["weight type", "plain gap", "flips", "plain bound", "explained gap",
                                "headroom", "liar (explained)", "other CPU"], rows), "", provenance(rec)]


def signed_pct(v) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def render_plan_check(rec: dict) -> list[str]:
    res = rec["result"]
    goal, summary = res.get("goal", {}), res.get("summary", {})
    rows = []
    for c in res.get("configs", []):
        m, p = c.get("measured", {}), c.get("predicted", {})
        rows.append([num(c.get("workers")), num(c.get("rtt_ms")), num(c.get("streams")), num(c.get("audit")),
                     c.get("replicas", "-"), "-" if c.get("stop_at_s") is None else f"at {num(c['stop_at_s'])} s",
                     num(m.get("tokens_per_s")), num(p.get("tokens_per_s")), signed_pct(c.get("tokens_per_s_error")),
                     num(m.get("itl_ms", {}).get("p50")), num(p.get("itl_ms", {}).get("p50")),
                     signed_pct(c.get("itl_p50_error")), p.get("bottleneck", "-"),
                     "yes" if c.get("within_goal") else "**no**"])
    return [f"`kvasir plan`'s prediction beside the same configuration run for real (`kvasir serve --nats`, "
            f"`kvasir worker` processes, streaming clients; `{res.get('model')}`, {num(res.get('tokens'))} tokens "
            f"per stream after a {num(res.get('prompt_tokens'))}-token prompt), from a profile `kvasir calibrate` "
            f"measured in the same run. Goal: tokens/s within {pct(goal.get('tokens_per_s'))}, p50 inter-token "
            f"latency within {pct(goal.get('itl_p50'))}. In this run {num(summary.get('within_goal'))} of "
            f"{num(summary.get('configurations'))} configurations within the goal (largest tokens/s error "
            f"{pct(summary.get('max_tokens_per_s_error'))}, mean {pct(summary.get('mean_abs_tokens_per_s_error'))}); "
            "every saved run is listed below, and [scale.md](scale.md) shows today's model on each of them.", "",
            *table(["workers", "r ms", "streams", "audit", "replicas", "worker stopped", "measured tok/s",
                    "predicted tok/s", "error", "measured ITL p50 ms", "predicted ITL p50 ms", "ITL error",
                    "predicted bottleneck", "within goal"], rows,
                   align="|--:|--:|--:|--:|---|---|--:|--:|--:|--:|--:|--:|---|---|"),
            "", provenance(rec)]


def render_generic(rec: dict) -> list[str]:
    keys = ", ".join(f"`{k}`" for k in list(rec["result"])[:12])
    return [f"Saved fields: {keys}.", "", provenance(rec)]


def ratio(a, b):
    return a / b if a and b else None


#: (title, bench, predicate on its result, renderer), in the order docs/benchmarks.md shows them
SECTIONS = [
    ("Engine: one stream against llama.cpp (`bench/engine.py`)", "engine", None, render_engine),
    ("Serving: `kvasir serve` against llama.cpp batched (`bench/throughput.py`)", "throughput", has_serve, render_serve),
    ("Serving with workers (`bench/throughput.py --sharded`)", "throughput", has_section("sharded"), render_sharded),
    ("Hand-started workers sharing the cores (`bench/throughput.py --handstarted`)", "throughput",
     has_section("handstarted"), render_handstarted),
    ("Dispatch: sharded against monolithic decode (`bench/dispatch.py`)", "dispatch", None, render_dispatch),
    ("A remote call's round trip against raw NATS (`bench/nats_rtt.py`)", "nats_rtt", None, render_nats_rtt),
    ("Expert kernel against raw ggml (`bench/kernel.py`)", "kernel", None, render_kernel),
    ("Browser worker kernels (`bench/browser_kernel.py`)", "browser_kernel", None, render_browser),
    ("Browser tabs under the default audit against the monolithic run (`bench/browser_audit.py`)", "browser_audit",
     None, render_browser_audit),
    ("The market's ledger at size (`bench/ledger.py`)", "ledger", None, render_ledger),
    ("The trust issue's attacks (`bench/attacks.py`)", "attacks", None, render_attacks),
    ("An honest numpy worker against ggml: the audit's bounds (`bench/kernel_gap.py`)", "kernel_gap", None,
     render_kernel_gap),
    ("The swarm model against real runs (`bench/plan_check.py`)", "plan_check", None, render_plan_check),
]
KNOWN = {bench for _, bench, _, _ in SECTIONS}


def render_results(records: list[dict]) -> str:
    out = []
    for title, bench, has, render in SECTIONS:
        rec = latest(records, bench, has)
        if rec is None:
            continue
        out += [f"### {title}", "", *render(rec), ""]
    for bench in sorted({r.get("bench") for r in records} - KNOWN):
        rec = latest(records, bench)
        out += [f"### `{bench}`", "", *render_generic(rec), ""]
    return "\n".join(out)


def render_runs(records: list[dict]) -> str:
    rows = [[f"[{r['_file']}](../bench/results/{r['_file']})", r.get("bench", "?"), r.get("date", "?"),
             (r.get("commit", {}).get("sha") or "?") + ("+" if r.get("commit", {}).get("dirty") else ""),
             machine(r), f"`{r.get('command', '?')}`"] for r in reversed(records)]
    return "\n".join([f"{len(records)} saved runs, newest first (a `+` after the commit: the tree had "
                      "uncommitted changes).", "",
                      *table(["file", "bench", "date", "commit", "machine", "command"], rows,
                             align="|---|---|---|---|---|---|"), ""])


# ------------------------------------------------------------------------------- README headline

def headline_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    rec = latest(records, "engine")
    if rec:
        for m in rec["result"].get("results", []):
            ru = m.get("ratio_ours_fast_over_llama_cpp_users", {})
            rows.append([f"engine, one stream, {m.get('model', '?')}", "llama.cpp as its users run it",
                         f"{num(ru.get('prefill'))} prefill, {num(ru.get('decode'))} decode", short_cmd(rec), when(rec)])
    rec = latest(records, "throughput", has_serve)
    if rec:
        rs = serve_rows(rec["result"])
        streams = "/".join(num(r["concurrency"]) for r in rs)
        rows.append([f"`kvasir serve`, {streams} streams, every expert local", "llama.cpp batched decode, same run",
                     " / ".join(num(r.get("ratio")) for r in rs), short_cmd(rec), when(rec)])
        if any(r.get("ratio_vs_llama_server") is not None for r in rs):
            rows.append([f"`kvasir serve`, {streams} streams", "`llama-server`, same run",
                         " / ".join(num(r.get("ratio_vs_llama_server")) for r in rs), short_cmd(rec), when(rec)])
    rec = latest(records, "dispatch")
    if rec:
        for m in rec["result"].get("results", []):
            rows.append([f"decode, every expert on {num(m.get('workers'))} workers, `{m.get('model', '?')}`",
                         "monolithic decode, same run", num(m.get("ratio_sharded_over_monolithic")),
                         short_cmd(rec), when(rec)])
    rec = latest(records, "nats_rtt")
    if rec and rec["result"].get("ratio_dispatch_over_cli_p50") is not None:
        rows.append(["a remote expert call's round trip, p50 (a time: lower is better)",
                     "`nats bench` request/reply, same server", num(rec["result"]["ratio_dispatch_over_cli_p50"]),
                     short_cmd(rec), when(rec)])
    rec = latest(records, "kernel")
    if rec:
        fast = rec["result"].get("modes", {}).get("fast", {}).get("rows_per_s", {})
        for qtype in ("q4_k",):
            by = fast.get(qtype, {})
            got = [f"{num(by[n].get('ours_over_best'))} ({n} row{'s' if n != '1' else ''})" for n in ("1", "512") if n in by]
            if got:
                rows.append([f"expert function, 122B shape, {qtype.upper()}", "raw ggml graph, same run",
                             ", ".join(got), short_cmd(rec), when(rec)])
    rec = latest(records, "plan_check")
    if rec and rec["result"].get("summary"):
        sm = rec["result"]["summary"]
        before = [r["result"]["summary"] for r in records
                  if r.get("bench") == "plan_check" and r is not rec and r["result"].get("summary")][-3:]
        earlier = ", ".join(f"{num(b.get('within_goal'))}" for b in reversed(before))
        rows.append([f"`kvasir plan`'s tokens/s and ITL, {num(sm.get('configurations'))} configurations run for real",
                     "the measured runs, same run", f"{num(sm.get('within_goal'))} of {num(sm.get('configurations'))} "
                     f"within the goal, mean tokens/s error {pct1(sm.get('mean_abs_tokens_per_s_error'))}"
                     + (f" (the {len(before)} runs before it, as they ran: {earlier})" if before else ""),
                     short_cmd(rec), when(rec)])
    rec = latest(records, "browser_kernel")
    if rec:
        s = rec["result"].get("speed_122b_q4_k", {}).get("rows_1", {})
        q = ratio(s.get("wasm_simd_rows_per_s"), s.get("ggml_rows_per_s"))
        if q is not None:
            rows.append(["browser worker's WebAssembly kernel, 1 row, Q4_K", "ggml, same run (ratio computed "
                         "by bench/report.py)", r3(q), short_cmd(rec), when(rec)])
    return rows


def render_headline(records: list[dict]) -> str:
    return "\n".join([*table(["what", "against", "ours / theirs", "command", "machine, date"], headline_rows(records),
                             align="|---|---|--:|---|---|"), ""])


def render_attacks_block(records: list[dict]) -> str:
    rec = latest(records, "attacks")
    if rec is None:
        return "No saved run of `bench/attacks.py` yet.\n"
    return "\n".join([*render_attacks(rec), ""])


RENDER = {"headline": render_headline, "results": render_results, "runs": render_runs,
          "attacks": render_attacks_block,
          "browser_audit": render_browser_audit_readme}


def rewrite(text: str, names: tuple[str, ...], records: list[dict], path: str) -> str:
    seen = set()

    def fill(m: re.Match) -> str:
        seen.add(m.group("name"))
        if m.group("name") not in RENDER:
            raise SystemExit(f"{path}: unknown report block {m.group('name')!r}")
        return m.group(1) + RENDER[m.group("name")](records) + m.group(4)

    out = MARK.sub(fill, text)
    missing = set(names) - seen
    if missing:
        raise SystemExit(f"{path}: no <!-- report:{sorted(missing)[0]} begin/end --> markers")
    return out


def tracked_results(repo: Path = REPO) -> set[str] | None:
    """The names of the saved runs git tracks (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "bench/results"], cwd=repo, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {Path(line).name for line in out.stdout.split()} if out.returncode == 0 else None


def rendered(repo: Path = REPO, results_dir: Path | None = None,
             only: set[str] | None = None) -> dict[str, tuple[str, str]]:
    """path -> (as it is, as rendered); ``only``: the names of the saved runs to use (default all)."""
    records = record.load_all(results_dir or repo / "bench" / "results")
    if only is not None:
        records = [r for r in records if r["_file"] in only]
    out = {}
    for rel, names in TARGETS.items():
        text = (repo / rel).read_text(encoding="utf-8")
        out[rel] = (text, rewrite(text, names, records, rel))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/report.py --check")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from its rendering")
    ap.add_argument("--tracked", action="store_true",
                    help="use only the saved runs git tracks (what the committed tables must equal), not new files")
    args = ap.parse_args(argv)
    stale = []
    for rel, (old, new) in rendered(only=tracked_results() if args.tracked else None).items():
        if old != new:
            stale.append(rel)
            if not args.check:
                (REPO / rel).write_text(new, encoding="utf-8")
    if args.check:
        for rel in stale:
            print(f"{rel}: its tables differ from bench/results/ (run python bench/report.py)", file=sys.stderr)
        return 1 if stale else 0
    for rel in stale:
        print(f"rewrote {rel}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
