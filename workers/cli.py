"""The worker role's ``kvasir`` subcommands.

``register`` adds each subcommand through its own ``_add_*`` function (listed in
``_COMMANDS``); command functions import their heavy modules themselves so that
``kvasir --help`` stays fast.

``kvasir slice FILE --layer L --experts A-B [--layer L --experts A-B ...] -o SLICE.gguf``
cuts the listed experts out of an MoE GGUF into a mini-GGUF a worker can serve
(layout: :mod:`workers.slice_file`). Ranges are inclusive: ``--experts 0-7`` is eight experts,
``--experts 5`` is one; ``--layer`` also takes a range (``0-3``) or ``all`` (every layer that
has expert tensors), and so does ``--experts`` (``all``). Each ``--layer`` pairs with the
``--experts`` at the same position.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvasir_bus.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    for add in _COMMANDS:
        add(subparsers)


def _add_slice(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "slice",
        help="cut chosen experts out of an MoE GGUF into a mini-GGUF (byte-range copy)",
        description="Cut the gate/up/down weights of chosen experts out of an MoE GGUF into a "
        "small GGUF a worker serves. The bytes are copied as they are (no dequantising), "
        "streaming through a small buffer, so files larger than memory slice fine. Ranges are "
        "inclusive; each --layer pairs with the --experts at the same position.",
        epilog="example: kvasir slice model.gguf --layer 0-3 --experts 0-7 --layer 5 --experts 12 "
        "-o part.gguf",
    )
    p.add_argument("file", metavar="FILE", help="source MoE GGUF")
    p.add_argument("--layer", action="append", default=[], metavar="L",
                   help="layer index, inclusive range A-B, or 'all' (repeatable)")
    p.add_argument("--experts", action="append", default=[], metavar="A-B",
                   help="inclusive expert range A-B, a single expert A, or 'all' (repeatable)")
    p.add_argument("-o", "--output", required=True, metavar="SLICE.gguf", help="slice file to write")
    p.set_defaults(func=_cmd_slice)


def _cmd_slice(args: argparse.Namespace) -> int:
    from workers.slicer import describe_holdings, parse_span, plan_slice, write_slice

    if not args.layer and not args.experts:
        raise UsageError("give at least one --layer L --experts A-B pair")
    if len(args.layer) != len(args.experts):
        raise UsageError(f"each --layer needs its own --experts (got {len(args.layer)} --layer, "
                         f"{len(args.experts)} --experts)")
    requests = [(parse_span(layer, "--layer"), parse_span(experts, "--experts"))
                for layer, experts in zip(args.layer, args.experts)]
    plan = plan_slice(args.file, requests)
    progress = _TerminalProgress(sys.stderr) if sys.stderr.isatty() else None
    try:
        result = write_slice(plan, args.output, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    rate = result.nbytes / 1e6 / max(result.seconds, 1e-9)
    print(f"{result.path}: {result.n_held} experts ({describe_holdings(result.holdings)}), "
          f"{result.nbytes} bytes, {result.seconds:.2f} s ({rate:.0f} MB/s)")
    return 0


class _TerminalProgress:
    """A ``\\r`` progress line (bytes copied / total, MB/s), redrawn at most ten times a second."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        rate = done / 1e6 / max(now - self.t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\rslicing: {done / 1e6:,.1f} / {total / 1e6:,.1f} MB  {pct:5.1f}%  "
                          f"{rate:,.0f} MB/s ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


_COMMANDS = (_add_slice,)
