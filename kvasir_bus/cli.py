"""The ``kvasir`` command: one parser, subcommands registered by each role.

Subcommands come from the ``kvasir.commands`` entry points (``pyproject.toml``): each names a
module with ``register(subparsers)``, so this package names no role. A module keeps its heavy
imports inside the command functions, so ``kvasir --help`` stays fast and a worker-only install
can run ``kvasir worker`` without the backbone's extras.

Every command function takes the parsed arguments and returns an exit status. A
:class:`~kvasir_bus.errors.KvasirError` becomes one line on stderr and a non-zero exit; any
other exception is reported on one line too (set ``KVASIR_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from kvasir_bus import __version__
from kvasir_bus.errors import KvasirError

#: The entry-point group in which each package registers its subcommands.
COMMAND_GROUP = "kvasir.commands"
#: The bus' own commands: there whenever kvasir_bus is, even where the installed entry points
#: are older than the checkout (an editable install made before a command was added).
CORE_MODULES = ("kvasir_bus.nats_cli", "kvasir_bus.creds_cli")


def command_modules() -> list[str]:
    """Module names that register subcommands, in the order their entry points are named."""
    points = importlib.metadata.entry_points(group=COMMAND_GROUP)
    names = [point.value for point in sorted(points, key=lambda point: point.name)]
    return names + [m for m in CORE_MODULES if m not in names]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every other error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvasir",
        description="Swarm inference for Mixture-of-Experts GGUF models, sharded at the grain "
        "of single experts over NATS.",
        epilog="quick start: kvasir synth --preset small --type q4_k -o small.gguf; "
        "kvasir up --model small.gguf --workers 4 --prompt 'Hello' --check   "
        "(kvasir COMMAND --help for each command's flags and an example)",
    )
    parser.add_argument("--version", action="version", version=f"kvasir {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in command_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that role is not part of this install
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed on one line
        return int(exc.code or 0)
    try:
        if hasattr(args, "creds"):  # a command that connects: --creds/--tls-* for it and its children
            from kvasir_bus.connect import ConnectOptions

            ConnectOptions.from_args(args).install()
        return int(args.func(args) or 0)
    except KvasirError as exc:
        print(f"kvasir {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"kvasir {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # last resort: still one line, never a traceback
        if os.environ.get("KVASIR_DEBUG"):
            raise
        print(f"kvasir {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(set KVASIR_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
