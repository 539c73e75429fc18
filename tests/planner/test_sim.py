"""The simulator and the plan command on hand-made profiles: answers worked out by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvasir_bus.cli import main
from planner import profile as prof
from planner.png import plot_sweep
from planner.shapes import Shapes, published
from planner.sim import Config, holders_of, simulate

TOY = Shapes(name="toy", arch="qwen3moe", fingerprint="f00dfeed", n_layer=2, n_moe_layers=2, n_attention_layers=2,
             n_embd=64, n_expert=8, n_expert_used=2, n_ff_exp=32, n_head=4, n_head_kv=2, head_dim=16, n_vocab=256,
             expert_bytes=6000, dense_bytes_attention=20000, dense_bytes_recurrent=0, head_bytes=16000)

# Seconds, chosen so that each term of the arithmetic below can be told apart.
DENSE, HEAD, PER_MSG, PER_CALL, NATS, W_MSG, K0, K_CALL, K_ROW, HOP = \
    1e-3, 2e-4, 3e-5, 5e-6, 7e-6, 1.1e-4, 1.3e-5, 1.7e-5, 1.9e-5, 2.3e-5


def toy_profile(shapes: Shapes = TOY, **worker) -> dict:
    kernel = {"c0_s": K0, "c_call_s": K_CALL, "c_row_s": K_ROW, **worker}
    return {
        "kind": prof.PROFILE_KIND, "version": prof.PROFILE_VERSION, "model": shapes.to_dict(), "role": "both",
        "machine": {"cpus": 2, "backbone_threads": 1},
        "worker": {"kernel": kernel, "per_message_s": W_MSG},
        "backbone": {"dense": {"attention": {"c0_s": DENSE, "c_row_s": 0.0, "c_row_ctx_s": 0.0},
                               "shared": {"c0_s": 0.0, "c_row_s": 0.0}, "head": {"c0_s": HEAD, "c_row_s": 0.0}},
                     "local_kernel": {"c0_s": K0, "c_call_s": K_CALL, "c_row_s": K_ROW},
                     "dispatch": {"backbone_per_message_s": PER_MSG, "backbone_per_call_s": PER_CALL,
                                  "backbone_per_row_s": 0.0, "hop_s": HOP}},
        "nats": {"per_message_s": NATS}, "wire": {"call_bytes": 96, "message_bytes": 1024}}


def test_zero_rtt_one_worker_equals_the_profile_arithmetic():
    costs = prof.costs_for(toy_profile(), TOY)
    r = simulate(TOY, costs, Config(workers=1, streams=1, tokens=8, prompt_tokens=1))
    # One row, top-2: two calls in one bundle to the one worker, per layer: the dense part, the
    # backbone's planning (half a message's cost and both calls), nats-server both ways, the
    # worker's message and kernel (2 experts, 2 rows), the reply's half, the left-over hop.
    layer = DENSE + PER_MSG + 2 * PER_CALL + 2 * NATS + W_MSG + K0 + 2 * K_CALL + 2 * K_ROW + HOP
    step = TOY.n_layer * layer + HEAD
    assert r.itl_ms["p50"] == pytest.approx(1000 * step, abs=0.01)
    assert r.ttft_ms["p50"] == pytest.approx(1000 * step, abs=0.01)  # a 1-token prompt is one step
    assert r.tokens_per_s == pytest.approx(1 / step, rel=1e-3)
    assert r.messages_per_token == pytest.approx(TOY.n_layer)


def test_more_workers_never_reduce_throughput_when_workers_are_the_bottleneck():
    costs = prof.costs_for(toy_profile(c_row_s=2e-3, c_call_s=1e-3), TOY)
    rates = []
    for n in (1, 2, 4, 8):
        r = simulate(TOY, costs, Config(workers=n, streams=32, tokens=8))
        rates.append(r.tokens_per_s)
        if n == 1:
            assert r.bottleneck == "worker compute"
    assert rates == sorted(rates) and rates[-1] > 2 * rates[0]


def test_predictions_never_beat_the_three_bounds():
    costs = prof.costs_for(toy_profile(), TOY)
    for workers, streams, rtt in ((1, 1, 0.02), (4, 16, 0.05), (8, 64, 0.04)):
        r = simulate(TOY, costs, Config(workers=workers, streams=streams, tokens=16, rtt_s=(rtt,)))
        for name, bound in r.bounds.items():
            if bound is not None:
                assert r.tokens_per_s <= bound * 1.0001, name


def test_a_frozen_worker_costs_one_timeout_then_its_experts_run_locally():
    costs = prof.costs_for(toy_profile(), TOY)
    cfg = Config(workers=2, streams=1, tokens=32, stop_at_s=0.01, timeout_s=0.2)
    r = simulate(TOY, costs, cfg)
    assert 1 <= r.timeouts <= TOY.n_layer * TOY.n_expert  # once per (layer, expert) of the frozen one at most
    assert r.local_fraction > 0.2
    assert r.seconds >= 0.2 * r.timeouts  # each timeout waited in full


def test_placement_splits_then_replicates():
    assert holders_of(8, 2) == [[0]] * 4 + [[1]] * 4
    assert holders_of(4, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_a_profile_of_another_model_is_refused_unless_rescaled():
    other = published("qwen35moe-122b-a10b")
    with pytest.raises(prof.UsageError, match="calibrated for toy"):
        prof.costs_for(toy_profile(), other)
    costs = prof.costs_for(toy_profile(), other, rescale=True)
    assert costs.notes and costs.worker_kernel.c1 > K_CALL  # bigger experts cost more


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy_profile(published("gpt-oss-120b"))))
    return path


@pytest.mark.parametrize("argv, says", [
    (["--shape", "nope"], "unknown"),
    (["--shape", "gpt-oss-120b", "--workers", "-3"], "integers >= 1"),
    (["--shape", "gpt-oss-120b", "--audit", "2"], "between 0 and 1"),
    (["--shape", "gpt-oss-120b", "--audit", "0.1", "--dequant-cache-mb", "-1"], "--dequant-cache-mb must be >= 0"),
    (["--shape", "deepseek-v3"], "calibrated for gpt-oss-120b"),
])
def test_bad_input_is_one_line_and_exit_2(profile_file, capsys, argv, says):
    assert main(["plan", "--profile", str(profile_file), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_a_sweep_prints_json_and_plots_a_png(profile_file, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["plan", "--profile", str(profile_file), "--shape", "gpt-oss-120b", "--workers", "1,4,16",
                 "--streams", "4", "--tokens", "4", "--rtt-ms", "40", "--json", "--plot", str(png)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["workers"] for r in rows] == [1, 4, 16]
    for r in rows:
        assert {"tokens_per_s", "ttft_ms", "itl_ms", "bottleneck"} <= set(r)
        assert set(r["itl_ms"]) == {"p50", "p95"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_nothing_writes_nothing(tmp_path):
    plot_sweep([], str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("cfg", [
    Config(workers=4, streams=16, tokens=8, rtt_s=(0.01, 0.03)),
    Config(workers=16, streams=8, tokens=8, rtt_s=(0.02,), stop_at_s=0.05, timeout_s=0.1),
    Config(workers=3, streams=5, tokens=6, replicated=True, audit=0.1),
])
def test_the_vectorised_path_gives_the_general_paths_answer(cfg, monkeypatch):
    from planner import sim

    costs = prof.costs_for(toy_profile(), TOY)
    fast = simulate(TOY, costs, cfg)
    monkeypatch.setattr(sim, "FAST", False)
    slow = simulate(TOY, costs, cfg)
    assert (fast.tokens_per_s, fast.itl_ms, fast.ttft_ms, fast.timeouts) == \
        (slow.tokens_per_s, slow.itl_ms, slow.ttft_ms, slow.timeouts)


def test_the_models_constants_are_the_dispatchers():
    from backbone.audit import DEFAULT_PROBATION
    from backbone.coverage_view import CoverageView
    from backbone.dispatch import MAX_UNPROVEN_BUNDLE_NODES
    from planner import sim

    from backbone import dispatch

    view = CoverageView(1.0)
    assert (sim.PROBATION, sim.MAX_UNPROVEN_BUNDLE_NODES, sim.SILENCE_HOLD_S, sim.MAX_HOLD_S) == \
        (DEFAULT_PROBATION, MAX_UNPROVEN_BUNDLE_NODES, view.silence_hold_s, view.max_hold_s)
    assert (sim.CONFIRM_FLOOR_S, sim.CONFIRM_MISSES, sim.CONFIRM_RETRY) == \
        (dispatch._CONFIRM_FLOOR_S, dispatch._CONFIRM_MISSES, dispatch._CONFIRM_RETRY)
    assert sim.Config(1, 1, 1).race_confirm == dispatch.DispatchConfig().confirm
    from kernels.backend import DEFAULT_CACHE_MB

    assert (sim.AUDIT_ROWS, sim.DEQUANT_CACHE_MB) == (dispatch.EXPLAINED_ROWS, DEFAULT_CACHE_MB)


def _audits(cfg: Config) -> int:
    return simulate(TOY, prof.costs_for(toy_profile(), TOY), cfg).extra["audits"]


def test_audits_follow_probation_then_one_in_each_window_per_node_and_layer():
    # One worker, one stream, top-2: each layer step is 2 replies of the one node. Without
    # probation, one in every 4 of them per layer: 2 x 8 = 16 replies a layer, 4 audits each.
    base = dict(workers=1, streams=1, tokens=8, prompt_tokens=1)
    assert _audits(Config(**base, audit=0.25, probation=0)) == TOY.n_layer * (2 * 8 // 4)
    # Probation 4: the first step's two layers (2 replies each, all audited, all passed) end it;
    # the windows count those replies too: the first window's pick fell on one of them (no more
    # audit there) or on one of its last two (one more), the other three windows one each.
    for seed in range(6):
        assert 2 + 2 + 3 + 3 <= _audits(Config(**base, audit=0.25, probation=4, seed=seed)) <= 2 + 2 + 4 + 4
    assert _audits(Config(**base, audit=1.0)) == TOY.n_layer * 2 * 8
    assert _audits(Config(**base, audit=0.0)) == 0


def test_an_audit_falls_at_a_random_place_in_its_window_as_the_auditor_draws_it(monkeypatch):
    # backbone/audit.py: one reply at a random place in each window, so every expert a node
    # answers gets audited in time (the model once took each window's first: a few experts only).
    cfg = Config(workers=1, streams=4, tokens=24, prompt_tokens=1, audit=0.1, probation=0)
    costs = prof.costs_for(toy_profile(), TOY)
    from planner import sim

    picked = []

    class Spy(sim._DequantCache):
        def miss(self, key):
            picked.append(key)
            return super().miss(key)

    monkeypatch.setattr(sim._DequantCache, "for_run", staticmethod(lambda *a, **k: Spy(10 ** 6)))
    simulate(TOY, replace(costs, audit_path="explained", audit_miss=1e-3), cfg)
    assert len({e for _, e in picked}) == TOY.n_expert  # every expert of the 8, not the first few


def test_audits_on_the_numpy_paths_pay_a_dequantization_where_the_cache_misses():
    # A foreign kernel's audit reads the expert's weights dequantized (kernels/backend.py's LRU):
    # a cache too small for one expert misses every time, a big one only on first use, and a
    # warm one (a backbone that has served this load) hardly ever.
    profile = toy_profile()
    profile["machine"]["kernel_mode"], profile["machine"]["machine"] = "deterministic", "x86_64"
    profile["backbone"]["audit"] = {"explained": {"c0_s": 1e-4, "c_row_s": 0.0, "miss_s": 5e-3}}
    costs = prof.costs_for(profile, TOY, worker_kernel="ggml-x86_64")
    assert (costs.audit_path, costs.audit_miss) == ("explained", 5e-3)
    base = dict(workers=1, streams=1, tokens=8, prompt_tokens=1, audit=1.0)
    none = simulate(TOY, costs, Config(**base, dequant_cache_mb=0.0))
    cold = simulate(TOY, costs, Config(**base, warm_cache=False))
    warm = simulate(TOY, costs, Config(**base))
    calls = TOY.n_layer * 2 * 8
    assert none.extra["dequant_misses"] == calls
    assert cold.extra["dequant_misses"] <= TOY.n_layer * TOY.n_expert < calls
    assert warm.extra["dequant_misses"] < cold.extra["dequant_misses"]
    assert none.seconds - cold.seconds == pytest.approx((calls - cold.extra["dequant_misses"]) * 5e-3, rel=1e-6)
    # a kernel the backbone reruns reads no dequantized weights: no cache, no misses
    from kernels.backend import kernel_label

    same = prof.costs_for(profile, TOY, worker_kernel=kernel_label("ggml", "x86_64", "deterministic"))
    assert same.audit_path == "exact" and same.audit_miss == 0.0
    assert simulate(TOY, same, Config(**base)).extra["dequant_misses"] is None


def test_an_audit_costs_what_the_workers_kernel_makes_the_backbone_recompute():
    profile = toy_profile()
    profile["machine"]["kernel_mode"], profile["machine"]["machine"] = "deterministic", "x86_64"
    profile["backbone"]["local_call"] = {"c0_s": 1e-4, "c_row_s": 1e-5}
    profile["backbone"]["audit"] = {"numpy": {"c0_s": 1e-3, "c_row_s": 0.0},
                                    "explained": {"c0_s": 3e-3, "c_row_s": 0.0}}
    from kernels.backend import kernel_label

    # a deterministic backbone's own label here (-det-repack where ggml repacks experts)
    same = prof.costs_for(profile, TOY, worker_kernel=kernel_label("ggml", "x86_64", "deterministic"))
    numpy_ = prof.costs_for(profile, TOY, worker_kernel="numpy-aarch64")
    fast = prof.costs_for(profile, TOY, worker_kernel="ggml-x86_64")  # a fast worker, a deterministic backbone
    assert (same.audit_path, numpy_.audit_path, fast.audit_path) == ("exact", "numpy", "explained")
    assert same.audit_recompute(1) == 0 and numpy_.audit_recompute(1) == 1e-3 and fast.audit_recompute(1) == 3e-3
    cfg = Config(workers=1, streams=1, tokens=8, prompt_tokens=1, audit=1.0)
    t = {c.audit_path: simulate(TOY, c, cfg).seconds for c in (same, numpy_, fast)}
    calls = TOY.n_layer * 2 * 8  # every reply audited, each recomputed after its step settles
    assert t["numpy"] - t["exact"] == pytest.approx(calls * 1e-3, rel=1e-6)
    assert t["explained"] - t["exact"] == pytest.approx(calls * 3e-3, rel=1e-6)


def test_balance_mode_steps_take_the_bus_threads_path():
    profile = toy_profile()
    profile["backbone"]["dispatch"]["bus_path_s"] = 4e-4
    costs = prof.costs_for(profile, TOY)
    cfg = dict(workers=1, streams=1, tokens=8, prompt_tokens=1, replicated=True)
    race = simulate(TOY, costs, Config(**cfg, replicas="race"))
    balance = simulate(TOY, costs, Config(**cfg, replicas="balance"))
    assert balance.itl_ms["p50"] - race.itl_ms["p50"] == pytest.approx(1000 * TOY.n_layer * 4e-4, abs=0.01)


def test_other_programs_load_stretches_only_what_runs_beside_our_own_work():
    from planner.sim import Pool

    quiet, loaded = Pool(2), Pool(2, background=1.0)
    assert loaded.run(0.0, 1.0) == quiet.run(0.0, 1.0) == 1.0  # one job and one other thread: a core each
    assert loaded.run(0.0, 1.0) == pytest.approx(1.5)  # two of ours and one other on two cores


def test_race_mode_waits_for_the_racing_replica_to_confirm():
    costs = prof.costs_for(toy_profile(), TOY)
    cfg = dict(workers=2, streams=1, tokens=8, prompt_tokens=1, replicated=True, rtt_s=(0.002, 0.02))
    first = simulate(TOY, costs, Config(**cfg, race_confirm=0.0))
    confirmed = simulate(TOY, costs, Config(**cfg, race_confirm=100.0))
    # Each layer step waits for the 20 ms replica instead of taking the 2 ms one's answers (after
    # the first step: a replica is waited for once it has answered a bundle).
    assert confirmed.itl_ms["p50"] - first.itl_ms["p50"] == pytest.approx(1000 * TOY.n_layer * 0.018, rel=0.05)


def test_the_fanout_fit_recovers_the_cost_a_second_worker_was_measured_at():
    from dataclasses import replace

    from planner.calibrate import fit_fanout

    profile = toy_profile()
    costs = prof.costs_for(profile, TOY)

    def step(workers: int, fanout: float) -> float:
        cfg = Config(workers=workers, streams=1, tokens=14, prompt_tokens=16, colocated_cores=2, race_confirm=0.0,
                     max_active=1, step_tokens=256)
        return simulate(TOY, replace(costs, fanout=fanout), cfg).itl_ms["p50"] / 1e3

    assert step(2, 0.0) == step(2, 0.0) and step(2, 2e-4) > step(2, 0.0)
    assert step(1, 2e-4) == step(1, 0.0)  # one worker: nothing to fan out to
    runs = [{"rows": 1, "steps": 12, "one_worker_s": [12 * step(1, 0.0)] * 3, "two_workers_s": [12 * step(2, 3e-4)] * 3}]
    assert fit_fanout(profile, runs) == pytest.approx(3e-4, rel=0.02)
    # No slower with two: next to nothing to fit (the model's second worker computes its share
    # beside the first, so a few microseconds may even it out).
    runs[0]["two_workers_s"] = runs[0]["one_worker_s"]
    assert fit_fanout(profile, runs) < 0.1 * 3e-4


def test_the_sharing_fit_keeps_the_one_worker_steps_that_were_measured():
    # calibrate's one- and two-worker runs made by the model at a known efficiency and fanout, at
    # three row counts: the fit finds them, and where the one-worker steps were measured as the
    # model has them at efficiency 1 (two workers a bit slower), it does not slow them by a lower
    # efficiency to make the two-worker steps' ratio.
    from dataclasses import replace

    from planner.calibrate import fit_sharing

    profile = toy_profile()
    profile["machine"]["cpus"] = 2
    # a shared expert, run while the worker computes: what a lower efficiency slows in one worker's step
    profile["backbone"]["dense"]["shared"] = {"c0_s": 2e-4, "c_row_s": 0.0}
    costs = prof.costs_for(profile, TOY)

    def step(workers: int, rows: int, fanout: float, efficiency: float) -> float:
        cfg = Config(workers=workers, streams=rows, tokens=14, prompt_tokens=16, colocated_cores=2, race_confirm=0.0,
                     max_active=rows, step_tokens=256)
        return simulate(TOY, replace(costs, fanout=fanout, core_efficiency=efficiency), cfg).itl_ms["p50"] / 1e3

    def runs(fanout: float, efficiency: float) -> list[dict]:
        return [{"rows": rows, "steps": 12, "one_worker_s": [12 * step(1, rows, fanout, efficiency)] * 2,
                 "two_workers_s": [12 * step(2, rows, fanout, efficiency)] * 2} for rows in (1, 2, 4)]

    assert step(1, 1, 0.0, 0.7) > step(1, 1, 0.0, 1.0)  # the one-worker step slows too
    assert fit_sharing(profile, runs(2e-4, 0.7)) == pytest.approx((2e-4, 0.7))
    # One worker as at efficiency 1, two as at 0.5: fitted on the two / one ratios alone this took
    # 0.55, which put the one-worker steps 12-20% above the measured ones.
    measured = runs(0.0, 1.0)
    for run, slow in zip(measured, runs(0.0, 0.5)):
        run["two_workers_s"] = slow["two_workers_s"]
    fanout, efficiency = fit_sharing(profile, measured)
    for run in measured:
        assert 12 * step(1, run["rows"], fanout, efficiency) == pytest.approx(run["one_worker_s"][0], rel=0.02)
        assert 12 * step(2, run["rows"], fanout, efficiency) == pytest.approx(run["two_workers_s"][0], rel=0.05)


def test_the_dispatch_fit_through_the_model_recovers_the_one_worker_steps_measured():
    # calibrate's one-worker dispatch runs made by the model itself with known backbone terms: the
    # fit through the model finds terms whose steps are those, starting from other ones.
    from planner.calibrate import fit_dispatch_model

    profile = toy_profile()
    profile["machine"]["cpus"] = 2
    truth = dict(hop_s=4e-5, backbone_per_call_s=2e-5, backbone_per_row_s=3e-6)
    made = json.loads(json.dumps(profile))
    made["backbone"]["dispatch"].update(truth)
    costs = prof.costs_for(made, TOY)
    runs = []
    for rows in (1, 4, 16):
        cfg = Config(workers=1, streams=rows, tokens=14, prompt_tokens=16, colocated_cores=2, race_confirm=0.0,
                     max_active=rows, step_tokens=256)
        runs.append({"rows": rows, "bundles": True, "via_bus": False, "steps": 12,
                     "wall_s": 12 * simulate(TOY, costs, cfg).itl_ms["p50"] / 1e3})
    profile["backbone"]["dispatch"].update(hop_s=0.0, backbone_per_call_s=1e-4, backbone_per_row_s=0.0, runs=runs)
    fitted = fit_dispatch_model(profile)
    pred, target = fitted["through_model"]["predicted_s"], fitted["through_model"]["targets_s"]
    assert pred == pytest.approx(target, rel=0.01)
    assert fitted["backbone_per_call_s"] == pytest.approx(truth["backbone_per_call_s"], rel=0.2)


def test_the_dispatch_fit_takes_the_quieter_of_the_two_timings_of_the_one_worker_step():
    # calibrate times the one-worker step at 1 and 4 rows twice: in the dispatch runs (their first
    # rounds, on a fresh worker) and as the fanout runs' one worker. A dispatch run 15% slow at 1
    # row must not pull the fit off the step the fanout runs timed right.
    from planner.calibrate import fit_dispatch_model

    profile = toy_profile()
    profile["machine"]["cpus"] = 2
    made = json.loads(json.dumps(profile))
    made["backbone"]["dispatch"].update(hop_s=4e-5, backbone_per_call_s=2e-5, backbone_per_row_s=3e-6)
    costs = prof.costs_for(made, TOY)

    def step(rows):
        cfg = Config(workers=1, streams=rows, tokens=14, prompt_tokens=16, colocated_cores=2, race_confirm=0.0,
                     max_active=rows, step_tokens=256)
        return simulate(TOY, costs, cfg).itl_ms["p50"] / 1e3

    true = {rows: step(rows) for rows in (1, 4, 16)}
    slow = {1: 1.15, 4: 1.0, 16: 1.0}
    runs = [{"rows": rows, "bundles": True, "via_bus": False, "steps": 12, "wall_s": 12 * t * slow[rows]}
            for rows, t in true.items()]
    fanout = [{"rows": rows, "steps": 12, "one_worker_s": [12 * true[rows] * 1.1, 12 * true[rows]],
               "two_workers_s": [12 * true[rows] * 1.2] * 2} for rows in (1, 4)]
    profile["backbone"]["dispatch"].update(hop_s=0.0, backbone_per_call_s=1e-4, backbone_per_row_s=0.0, runs=runs,
                                           fanout_runs=fanout)
    fitted = fit_dispatch_model(profile)["through_model"]
    assert fitted["rows"] == [1, 4, 16]
    assert fitted["targets_s"] == pytest.approx([true[1], true[4], true[16]])
    assert fitted["predicted_s"] == pytest.approx(fitted["targets_s"], rel=0.01)


def test_a_fast_mode_worker_runs_calls_of_8_rows_or_more_on_its_tiled_kernel():
    # calibrate times a fast-mode worker's kernel on big calls (measure_tiled); the workers the
    # plan is for announce that label: each call of 8 rows or more costs the difference less.
    profile = toy_profile()
    profile["worker"]["kernel_label"] = "ggml-x86_64-det-repack"
    profile["worker"]["tiled"] = {"label": "ggml-x86_64-repack", "from_rows": 8,
                                  "c_call_s": K_CALL + 1e-5, "c_row_s": K_ROW - 1.5e-5}
    det = prof.costs_for(profile, TOY)
    fast = prof.costs_for(profile, TOY, worker_kernel="ggml-x86_64-repack")
    assert det.tiled_from == 0 and fast.tiled_from == 8
    assert (fast.tiled_call, fast.tiled_row) == pytest.approx((1e-5, -1.5e-5))
    # one prompt step of 64 rows, top-2 of 8 experts: calls of about 16 rows, run tiled
    cfg = Config(workers=1, streams=1, tokens=1, prompt_tokens=64, step_tokens=256)
    saved = simulate(TOY, det, cfg).seconds - simulate(TOY, fast, cfg).seconds
    assert 0 < saved <= TOY.n_layer * 64 * TOY.n_expert_used * 1.5e-5
    one_row = Config(workers=1, streams=1, tokens=4, prompt_tokens=1)  # decode: 1-row calls, the same kernel
    assert simulate(TOY, det, one_row).seconds == simulate(TOY, fast, one_row).seconds


def test_measured_routing_draws_each_expert_by_its_share_and_only_for_its_own_model():
    from planner.sim import _Routing

    import numpy as np

    profile = toy_profile()
    # Layer 0: expert 0 got 9 rows in 10 of what the calibration saw, 7 never picked; layer 1 even.
    profile["routing"] = {"rows": 0, "counts": [[900, 20, 20, 20, 20, 20, 0, 0], [10] * 8]}
    shares = prof.routing_of(profile, TOY)
    assert shares[0][6] > 0  # never seen is not impossible
    assert sum(shares[0]) == pytest.approx(1.0) and sum(shares[1]) == pytest.approx(1.0)
    other = toy_profile()
    other["model"] = {**other["model"], "fingerprint": "0ther"}
    other["routing"] = profile["routing"]
    assert prof.routing_of(other, TOY) is None  # another model's router says nothing about this one
    broken = toy_profile()
    broken["routing"] = {"rows": 0, "counts": [[-1] * 8, [1] * 8]}
    with pytest.raises(prof.UsageError, match="routing counts"):
        prof.routing_of(broken, TOY)
    router = _Routing(8, 2, np.random.default_rng(0), shares=shares)
    skewed = sum(router.counts(1, 0) for _ in range(2000))
    even = sum(router.counts(1, 1) for _ in range(2000))
    assert skewed.sum() == even.sum() == 4000  # two distinct experts per row
    assert skewed[0] > 1800 and skewed[6] < 40  # expert 0 in nearly every row, 6 seldom
    assert even.min() > 300  # uniform: 500 each
    # The vectorised draw (many rows) is the same distribution.
    many = sum(router.counts(64, 0) for _ in range(50))
    assert many[0] / 3200 == pytest.approx(skewed[0] / 2000, abs=0.05)


def test_a_frozen_worker_costs_a_timeout_per_rare_expert_it_holds():
    # Under uniform routing every expert of the frozen worker is asked within a few steps: a few
    # timeouts, then it is silent. With skewed routing its rarely picked experts time out one by
    # one, steps apart (bench/plan_check.py's frozen-worker run showed it: 40 timeouts, not 24).
    profile = toy_profile()
    # Worker 0 holds experts 0-3: two of them rare. Eight rows a step pick nearly every other one.
    profile["routing"] = {"rows": 0, "counts": [[15, 15, 500, 500, 500, 500, 500, 500]] * 2}
    costs = prof.costs_for(profile, TOY)
    cfg = Config(workers=2, streams=8, tokens=100, prompt_tokens=1, stop_at_s=0.02, timeout_s=0.05,
                 replicas="race")
    uniform = simulate(TOY, costs, cfg)
    skewed = simulate(TOY, costs, cfg, routing=prof.routing_of(profile, TOY))
    assert 0 < uniform.timeouts < skewed.timeouts
    assert skewed.extra["timed_out_calls"] <= 4 * TOY.n_layer  # each of its experts times out once at most


def test_a_prompt_row_costs_what_the_profile_measured_for_prompts_not_a_decode_row():
    # A dense line with a per-sequence part: 16 rows of one prompt cost c0 + 16 c_row + c_seq,
    # 16 decoding sequences c0 + 16 (c_row + c_seq).
    profile = toy_profile()
    profile["backbone"]["dense"]["attention"] = {"c0_s": DENSE, "c_row_s": 1e-4, "c_row_ctx_s": 0.0, "c_seq_s": 5e-4}
    costs = prof.costs_for(profile, TOY)
    assert costs.attention(16, 0, 1) == pytest.approx(DENSE + 16e-4 + 5e-4)
    assert costs.attention(16, 0, 16) == pytest.approx(DENSE + 16 * 6e-4)
    no_seq = toy_profile()
    no_seq["backbone"]["dense"]["attention"] = {"c0_s": DENSE, "c_row_s": 6e-4, "c_row_ctx_s": 0.0}
    cfg = Config(workers=1, streams=1, tokens=4, prompt_tokens=16)
    prompt_cheaper = simulate(TOY, costs, cfg)
    per_row = simulate(TOY, prof.costs_for(no_seq, TOY), cfg)
    # Same decode steps (one sequence of one row: 6e-4 either way), a cheaper prompt step.
    assert prompt_cheaper.itl_ms["p50"] == pytest.approx(per_row.itl_ms["p50"], abs=0.01)
    saved = TOY.n_layer * (16 * 6e-4 - (16e-4 + 5e-4))
    assert per_row.ttft_ms["p50"] - prompt_cheaper.ttft_ms["p50"] == pytest.approx(1000 * saved, rel=0.02)


def test_the_sharing_fit_counts_the_four_worker_steps_where_they_were_timed():
    # Made by the model at a known efficiency and fanout with one, two and four workers, the fit
    # finds them; where four workers were timed slower than one and two extrapolate to (calibrate
    # timed only those once, and the check's 4-worker configurations came out fast), the fit with
    # them puts the model's four-worker steps nearer the measured ones than the fit without.
    from dataclasses import replace

    from planner.calibrate import fit_sharing

    profile = toy_profile()
    profile["machine"]["cpus"] = 2
    profile["backbone"]["dense"]["shared"] = {"c0_s": 2e-4, "c_row_s": 0.0}
    costs = prof.costs_for(profile, TOY)

    def step(workers: int, rows: int, fanout: float, efficiency: float) -> float:
        cfg = Config(workers=workers, streams=rows, tokens=14, prompt_tokens=16, colocated_cores=2, race_confirm=0.0,
                     max_active=rows, step_tokens=256)
        return simulate(TOY, replace(costs, fanout=fanout, core_efficiency=efficiency), cfg).itl_ms["p50"] / 1e3

    def runs(fanout: float, efficiency: float, four_efficiency: float | None = None) -> list[dict]:
        return [{"rows": rows, "steps": 12, "one_worker_s": [12 * step(1, rows, fanout, efficiency)] * 2,
                 "two_workers_s": [12 * step(2, rows, fanout, efficiency)] * 2,
                 "four_workers_s": [12 * step(4, rows, fanout, four_efficiency or efficiency)] * 2}
                for rows in (1, 4)]

    assert step(4, 1, 2e-4, 0.8) > step(4, 1, 0.0, 0.8)  # three workers past the first, each woken
    assert fit_sharing(profile, runs(2e-4, 0.8)) == pytest.approx((2e-4, 0.8))
    measured = runs(0.0, 0.9, four_efficiency=0.6)
    without = fit_sharing(profile, [{k: v for k, v in run.items() if k != "four_workers_s"} for run in measured])
    with_four = fit_sharing(profile, measured)

    def four_error(fitted) -> float:
        return sum(abs(12 * step(4, run["rows"], *fitted) / run["four_workers_s"][0] - 1) for run in measured)

    assert four_error(with_four) < four_error(without)
