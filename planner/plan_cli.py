"""``kvasir plan``: the swarm's throughput and latency for any size, from a calibrated profile.

Every point of a sweep (``--workers``, ``--streams`` and ``--rtt-ms`` each take a comma list) is
one run of :func:`planner.sim.simulate`; a table (or ``--json``, one object per line) on stdout,
a PNG plot of tokens/s with ``--plot FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kvasir_bus.errors import UsageError


def _ints(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} wants integers separated by commas, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} wants integers >= 1, got {text!r}")
        return values
    return parse


def _floats(flag: str):
    def parse(text: str) -> list[float]:
        try:
            values = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} wants numbers separated by commas, got {text!r}") from None
        if not values or min(values) < 0 or any(np.isnan(values)):
            raise argparse.ArgumentTypeError(f"{flag} wants numbers >= 0, got {text!r}")
        return values
    return parse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="predict a swarm's tokens/s, latency and bottleneck (discrete-event model)",
        description="Simulate the swarm as the code runs it (continuous batching, layer steps, bundles, "
        "race or balance replicas, timeouts and local fallback, audits recomputed on the backbone, hot "
        "experts, micro-batches, workers' cores and queues, nats-server, links with round trips and "
        "bandwidth, churn) with costs measured by kvasir calibrate, and print aggregate tokens/s, time "
        "to first token and inter-token latency (p50/p95), each resource's utilisation, the backbone's "
        "uplink and the bottleneck. Comma lists in --workers, --streams and --rtt-ms make a sweep.",
        epilog="example: kvasir plan --shape qwen35moe-122b-a10b --profile here.json --rescale "
        "--workers 1,16,256,1024 --streams 64 --tokens 32 --rtt-ms 40 --plot scale.png")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="FILE", help="the GGUF whose shapes to plan for (its header alone is read)")
    src.add_argument("--shape", metavar="NAME",
                     help="a published model shape: qwen35moe-122b-a10b, gpt-oss-120b, deepseek-v3")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="the backbone's profile (kvasir calibrate)")
    p.add_argument("--worker-profile", action="append", default=[], metavar="P",
                   help="a worker device's profile (kvasir calibrate --role worker); repeat for a mix, "
                   "the workers take them in turn (default: the --profile's worker)")
    p.add_argument("--rescale", action="store_true",
                   help="allow a profile of another model: its costs scaled by the weights' bytes (said in the output)")
    p.add_argument("--workers", type=_ints("--workers"), default=[1], metavar="N[,N...]", help="expert workers (default 1)")
    p.add_argument("--streams", type=_ints("--streams"), default=[1], metavar="S[,S...]",
                   help="concurrent streams, all starting at once (default 1)")
    p.add_argument("--tokens", type=_ints("--tokens"), default=[32], metavar="T", help="tokens generated per stream (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=16, metavar="P", help="prompt tokens per stream (default 16)")
    rtt = p.add_mutually_exclusive_group()
    rtt.add_argument("--rtt-ms", type=_floats("--rtt-ms"), default=[0.0], metavar="R[,R...]",
                     help="round trip between the bus and every worker, ms (default 0)")
    rtt.add_argument("--rtt-dist", metavar="lan|wan|cdn|FILE",
                     help="round trips drawn per worker: lan (median 1 ms), wan (40), cdn (90; lognormal), or "
                     "a file of round trips in ms (whitespace or commas)")
    p.add_argument("--audit", type=float, default=0.0, metavar="R", help="kvasir serve --audit: the share of remote replies recomputed on the backbone, one in every "
                   "ceil(1/R) of a worker's replies on a layer once its probation is over (0..1, default 0)")
    p.add_argument("--audit-probation", type=int, default=None, metavar="N",
                   help="with --audit: every reply of a new worker is audited until it has passed N audits "
                   "(backbone/audit.py; default 16, as kvasir serve)")
    p.add_argument("--worker-kernel", metavar="LABEL", default=None,
                   help="the kernel label the workers announce (ggml-x86_64, ggml-x86_64-det, numpy-aarch64, "
                   "js-wasm32...): with --audit, whether an audit compares bits with the backbone's own result "
                   "or recomputes with numpy (default: the worker profile's, as calibrated)")
    p.add_argument("--dequant-cache-mb", type=float, default=None, metavar="MB",
                   help="with --audit and a worker kernel the backbone cannot rerun (audits by numpy): the "
                   "backbone's cache of float64 expert weights, KVASIR_DEQUANT_CACHE_MB (default 1024); an audit "
                   "whose expert is not in it pays the weights' dequantization (kvasir calibrate measures it)")
    p.add_argument("--replicas", choices=("race", "balance"), default="race",
                   help="replicas of an expert (past one worker per expert index): race (all compute) or balance (one, hedged)")
    p.add_argument("--race-confirm", type=float, default=None, metavar="X",
                   help="race mode: a won layer step waits up to X times its round trip for the other replicas' "
                   "replies, as kvasir serve --race-confirm (default: kvasir serve's)")
    p.add_argument("--replicated", action="store_true",
                   help="every worker holds every expert (default: the experts split over the workers, "
                   "repeated past one worker per expert index)")
    p.add_argument("--bundles", choices=("on", "off"), default="on", help="one message per worker per layer step (default on)")
    p.add_argument("--micro-batches", type=int, default=1, metavar="M", help="lanes of streams in flight on the backbone (1..4, default 1)")
    p.add_argument("--hot", type=float, default=0.0, metavar="F", help="share of calls the backbone computes itself (hot experts, default 0)")
    p.add_argument("--remote-layers", type=int, default=None, metavar="N",
                   help="only the first N MoE layers are served by workers, the backbone computes the rest "
                   "(default: every layer)")
    p.add_argument("--worker-speedup", type=float, default=1.0, metavar="F",
                   help="workers' expert kernels F times faster than the profile's (a GPU worker; an assumption, "
                   "stated as such; default 1)")
    p.add_argument("--churn", type=float, default=0.0, metavar="MTBF_S",
                   help="workers die after an exponential lifetime of this mean (s) and come back (0: never)")
    p.add_argument("--churn-down", type=float, default=60.0, metavar="S", help="mean time a dead worker stays away (default 60)")
    p.add_argument("--stop-at", type=float, default=None, metavar="S",
                   help="one worker freezes (SIGSTOP) at this time: one timeout, then its experts run locally")
    p.add_argument("--timeout-ms", type=float, default=None, metavar="MS", help="fixed per-request timeout (default: adaptive)")
    p.add_argument("--colocated", type=int, default=0, metavar="CORES",
                   help="backbone, nats-server and every worker share one machine of CORES cores (as on one test box)")
    p.add_argument("--background-load", type=float, default=0.0, metavar="R",
                   help="with --colocated: other programs' load on those cores, in cores busy on average (a "
                   "shared test machine): while k of our tasks run, each takes max(1, (R + k) / CORES) times "
                   "its CPU time (default 0)")
    p.add_argument("--backbone-cores", type=int, default=None, metavar="N",
                   help="a backbone of N cores, its dense path scaled linearly from the profile's (optimistic; said in the output)")
    p.add_argument("--worker-cores", type=int, default=1, metavar="N", help="cores per worker for its kernel (default 1)")
    p.add_argument("--uplink-mbps", type=float, default=0.0, metavar="X", help="the backbone's uplink, Mbit/s (default unbounded)")
    p.add_argument("--max-active", type=int, default=1024, metavar="N", help="streams in one step at most (kvasir serve's default 1024)")
    p.add_argument("--routing", choices=("measured", "uniform"), default="measured",
                   help="which experts each row picks: by the shares of the rows each expert got while the "
                   "profile was calibrated on this model (measured; uniform where the profile has none or is "
                   "another model's), or uniformly (default measured)")
    p.add_argument("--seed", type=int, default=0, help="routing and churn draws (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per point on stdout")
    p.add_argument("--plot", metavar="FILE.png", help="for a sweep: tokens/s against workers (or streams) as a PNG")
    p.set_defaults(func=cmd_plan)


def _rtts(args, n: int) -> list[tuple[float, ...]]:
    """Per point of the RTT sweep: the round trips (s) of the workers."""
    if not args.rtt_dist:
        return [(r / 1000.0,) for r in args.rtt_ms]
    from planner.sim import RTT_DISTS

    rng = np.random.default_rng(args.seed + 7)
    if args.rtt_dist in RTT_DISTS:
        median, sigma = RTT_DISTS[args.rtt_dist]
        return [tuple(float(v) / 1000.0 for v in median * np.exp(sigma * rng.standard_normal(max(1, n))))]
    try:
        text = open(args.rtt_dist).read()
        values = [float(v) for v in text.replace(",", " ").split()]
    except OSError as exc:
        raise UsageError(f"--rtt-dist {args.rtt_dist}: not lan, wan or cdn, and {exc.strerror or exc}") from None
    except ValueError:
        raise UsageError(f"--rtt-dist {args.rtt_dist}: not a list of round trips in ms") from None
    if not values or min(values) < 0:
        raise UsageError(f"--rtt-dist {args.rtt_dist}: wants round trips >= 0 ms")
    return [tuple(v / 1000.0 for v in rng.choice(values, max(1, n)))]


def race_confirm(args) -> float:
    """``--race-confirm``, or kvasir serve's default (backbone.dispatch.DispatchConfig's; 0 where
    the dispatcher has no such wait)."""
    if args.race_confirm is not None:
        return args.race_confirm
    from backbone.dispatch import DispatchConfig

    return float(getattr(DispatchConfig(), "confirm", 0.0))


def check(args) -> None:
    if not 0.0 <= args.audit <= 1.0:
        raise UsageError(f"--audit must be between 0 and 1, got {args.audit}")
    if not 0.0 <= args.hot <= 1.0:
        raise UsageError(f"--hot must be between 0 and 1, got {args.hot}")
    if not 1 <= args.micro_batches <= 4:
        raise UsageError(f"--micro-batches must be 1..4, got {args.micro_batches}")
    for name in ("prompt_tokens", "churn", "churn_down", "colocated", "uplink_mbps", "background_load"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("worker_cores", "max_active"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.backbone_cores is not None and args.backbone_cores < 1:
        raise UsageError(f"--backbone-cores must be >= 1, got {args.backbone_cores}")
    if args.timeout_ms is not None and args.timeout_ms <= 0:
        raise UsageError(f"--timeout-ms must be positive, got {args.timeout_ms}")
    if args.race_confirm is not None and not 0 <= args.race_confirm <= 100:
        raise UsageError(f"--race-confirm must be between 0 and 100, got {args.race_confirm}")
    if args.dequant_cache_mb is not None and args.dequant_cache_mb < 0:
        raise UsageError(f"--dequant-cache-mb must be >= 0, got {args.dequant_cache_mb}")
    if args.audit_probation is not None and args.audit_probation < 0:
        raise UsageError(f"--audit-probation must be >= 0, got {args.audit_probation}")
    if args.stop_at is not None and args.stop_at < 0:
        raise UsageError(f"--stop-at must be >= 0, got {args.stop_at}")
    if args.remote_layers is not None and args.remote_layers < 0:
        raise UsageError(f"--remote-layers must be >= 0, got {args.remote_layers}")
    if not args.worker_speedup > 0:
        raise UsageError(f"--worker-speedup must be positive, got {args.worker_speedup}")
    if args.prompt_tokens < 1:
        raise UsageError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")


def points(args, shapes=None) -> list[dict]:
    """Every point of the sweep, simulated: dicts ready for --json. ``shapes``: the model's, when
    the caller has them already (bench/plan_check.py --repredict: a saved profile's own)."""
    from planner import profile as prof
    from planner.shapes import from_gguf, published
    from planner.sim import Config, simulate

    check(args)
    if shapes is None:
        shapes = from_gguf(args.model) if args.model else published(args.shape)
    profile = prof.load(args.profile)
    costs = prof.costs_for(profile, shapes, rescale=args.rescale, backbone_cores=args.backbone_cores,
                           worker_kernel=args.worker_kernel)
    routing = prof.routing_of(profile, shapes) if args.routing == "measured" else None
    worker_costs = None
    if args.worker_profile:
        worker_costs = []
        for path in args.worker_profile:
            wp = prof.load(path)
            if not prof.same_model(wp, shapes) and not args.rescale:
                raise UsageError(f"--worker-profile {path}: calibrated for {wp['model'].get('name')}, not {shapes.name} "
                                 "(pass --rescale to scale it by the experts' bytes)")
            worker_costs.append(prof.costs_for(profile, shapes, rescale=True, worker=wp,
                                               backbone_cores=args.backbone_cores, worker_kernel=args.worker_kernel))
    out = []
    n_max = max(args.workers)
    for rtt in _rtts(args, n_max):
        for workers in args.workers:
            for streams in args.streams:
                cfg = Config(workers=workers, streams=streams, tokens=args.tokens[0], prompt_tokens=args.prompt_tokens,
                             rtt_s=rtt, audit=args.audit, replicas=args.replicas,
                             **({} if args.audit_probation is None else {"probation": args.audit_probation}),
                             **({} if args.dequant_cache_mb is None else {"dequant_cache_mb": args.dequant_cache_mb}),
                             race_confirm=race_confirm(args), bundles=args.bundles == "on",
                             micro_batches=args.micro_batches, hot_fraction=args.hot, churn_mtbf_s=args.churn,
                             churn_down_s=args.churn_down, stop_at_s=args.stop_at,
                             timeout_s=args.timeout_ms / 1000.0 if args.timeout_ms else None,
                             colocated_cores=args.colocated, worker_cores=args.worker_cores,
                             uplink_bps=args.uplink_mbps * 1e6, max_active=args.max_active,
                             step_tokens=max(256, args.max_active), replicated=args.replicated,
                             background_runnable=args.background_load, remote_layers=args.remote_layers,
                             worker_speedup=args.worker_speedup,
                             seed=args.seed)
                r = simulate(shapes, costs, cfg, worker_costs, routing)
                print(f"plan: {workers} workers, {streams} streams, rtt {1000 * float(np.median(rtt)):.0f} ms: "
                      f"{r.tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
                out.append({"model": shapes.name, "workers": workers, "streams": streams, "tokens": cfg.tokens,
                            "rtt_ms": round(1000 * float(np.median(rtt)), 3), "tokens_per_s": r.tokens_per_s,
                            "ttft_ms": r.ttft_ms, "itl_ms": r.itl_ms, "bottleneck": r.bottleneck,
                            "utilisation": r.utilisation, "uplink_bytes_per_s": r.uplink_bytes_per_s,
                            "uplink_mbit_s": round(r.uplink_bytes_per_s * 8 / 1e6, 2),
                            "downlink_bytes_per_s": r.downlink_bytes_per_s, "messages_per_token": r.messages_per_token,
                            "local_fraction": r.local_fraction, "timeouts": r.timeouts, "bounds": r.bounds,
                            "simulated_s": r.seconds, "routing": "measured" if routing else "uniform",
                            "notes": list(costs.notes)})
    return out


def cmd_plan(args) -> int:
    rows = points(args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'workers':>7} {'streams':>7} {'rtt ms':>7} {'tok/s':>9} {'TTFT p50/p95 ms':>17} "
              f"{'ITL p50/p95 ms':>16} {'uplink Mbit/s':>13}  bottleneck")
        for r in rows:
            print(f"{r['workers']:>7} {r['streams']:>7} {r['rtt_ms']:>7g} {r['tokens_per_s']:>9.1f} "
                  f"{r['ttft_ms']['p50']:>8.1f}/{r['ttft_ms']['p95']:<8.1f} {r['itl_ms']['p50'] or 0:>7.1f}/"
                  f"{r['itl_ms']['p95'] or 0:<8.1f} {r['uplink_mbit_s']:>13.1f}  {r['bottleneck']}")
        for note in rows[0]["notes"] if rows else ():
            print(f"note: {note}")
    if args.plot:
        from planner.png import plot_sweep

        plot_sweep(rows, args.plot)
        print(f"plan: plot written to {args.plot}", file=sys.stderr)
    return 0
