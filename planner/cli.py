"""``kvasir calibrate`` and ``kvasir plan``: measure what the swarm's pieces cost, then ask what
a swarm of any size would do (planner/sim.py), from a model's GGUF header or a published shape."""

from __future__ import annotations

import argparse
import json
import sys

from kvasir_bus.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    _add_calibrate(subparsers)
    _add_plan(subparsers)


def _add_calibrate(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine's costs for a model (a profile for kvasir plan)",
        description="Measure, on this machine and for this model's shapes, what each piece of the swarm "
        "costs: the backbone's dense step per layer kind against rows and context, its CPU per dispatched "
        "message, call and row, the expert kernel against experts and rows, a worker's CPU per message "
        "outside the kernel, nats-server's CPU per message, bytes per call. The backbone part runs the "
        "real engine and one real worker process on an embedded nats-server. A few minutes (--quick: "
        "well under one); progress on stderr; the profile (JSON) names the model it belongs to.",
        epilog="example: kvasir calibrate --model m.gguf -o here.json; on a phone: "
        "kvasir calibrate --model m.gguf --role worker -o phone.json")
    p.add_argument("--model", required=True, metavar="FILE", help="the GGUF (its shapes and weights are measured)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="ggml threads of the backbone (default: as kvasir serve, half the cores for a decode step)")
    p.add_argument("--worker-threads", type=int, default=1, metavar="N",
                   help="ggml threads of a worker's kernel (default 1: a worker beside others on one machine)")
    p.add_argument("--role", choices=("backbone", "worker", "both"), default="both",
                   help="backbone: the dense path, the dispatch and a worker beside it; worker: the expert "
                   "kernel only (what a phone or laptop owner runs); both (default) = backbone")
    p.add_argument("--deterministic", action="store_true",
                   help="measure the batch-invariant kernels (what kvasir serve --deterministic runs; "
                   "default: the fast ones)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter samples (seconds; for tests)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    for name in ("threads", "worker_threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    from kernels.backend import apply_kernel_flags
    from kvasir_bus.logs import configure
    from planner.calibrate import calibrate
    from planner.shapes import from_gguf

    # The backbone and dispatch it measures log as they run: warnings only, on stderr beside the
    # progress lines (unconfigured, structlog would print every debug line to stdout).
    configure("warning")
    apply_kernel_flags(argparse.Namespace(deterministic=args.deterministic, threads=None))

    from_gguf(args.model)  # a clear error before anything loads
    profile = calibrate(args.model, args.threads, args.role, args.quick, args.worker_threads)
    try:
        with open(args.output, "w") as f:
            json.dump(profile, f, indent=1)
    except OSError as exc:
        raise UsageError(f"-o {args.output}: {exc.strerror or exc}") from None
    print(args.output)
    return 0


def _add_plan(subparsers) -> None:
    from planner import plan_cli

    plan_cli.add_parser(subparsers)
