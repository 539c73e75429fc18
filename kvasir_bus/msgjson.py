"""msgpack <-> JSON on stdin/stdout, for the official ``nats`` CLI.

Kvasir payloads are msgpack maps (docs/protocol.md); the ``nats`` CLI prints bytes. Two uses:

* read a payload: ``nats req ... --translate 'python -m kvasir_bus.msgjson'`` (also ``nats sub``,
  ``nats stream view``) prints each message's record as one JSON line; byte strings (``bin``:
  rows, checksums) become ``"<N bytes: first bytes in hex...>"``.
* build one: ``python -m kvasir_bus.msgjson --pack '{"v": 1, "t": "gq", ...}'`` writes the JSON
  object as msgpack on stdout, for ``nats req SUBJECT --force-stdin``.

A payload that is not msgpack is printed as it came (an empty body stays empty), so
``--translate`` never hides a message; bad ``--pack`` JSON is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgpack

MAX_BYTES = 64 * 1024 * 1024  # nats-server's max_payload ceiling


def readable(value: Any) -> Any:
    """A decoded msgpack value with byte strings shown as ``"<N bytes: hex...>"``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        return f"<{len(b)} bytes: {b[:8].hex()}{'...' if len(b) > 8 else ''}>"
    if isinstance(value, dict):
        return {str(k): readable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [readable(v) for v in value]
    return value


def to_json(data: bytes) -> str:
    """One JSON line for a msgpack payload; a payload that is not msgpack comes back as text."""
    if not data:
        return ""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_BYTES,
                                max_str_len=MAX_BYTES, max_array_len=1 << 20, max_map_len=1 << 16)
    except Exception:
        return data.decode("utf-8", errors="replace")
    return json.dumps(readable(value), ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvasir_bus.msgjson",
        description="Decode a msgpack payload on stdin to one JSON line (for nats --translate), "
        "or with --pack encode a JSON object as msgpack on stdout (for nats req --force-stdin).",
        epilog="examples: nats req kvasir.<model>.manifest '' --translate 'python -m kvasir_bus.msgjson'\n"
        "          python -m kvasir_bus.msgjson --pack '{\"v\": 1, \"t\": \"gc\", \"request_id\": \"r1\"}' "
        "| nats pub kvasir.<model>.generate.cancel --force-stdin",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", metavar="JSON", default=None, help="a JSON object to write as msgpack")
    args = p.parse_args(argv)
    if args.pack is not None:
        try:
            value = json.loads(args.pack)
        except json.JSONDecodeError as exc:
            print(f"msgjson: error: --pack is not JSON: {exc}", file=sys.stderr)
            return 2
        if not isinstance(value, dict):
            print(f"msgjson: error: --pack wants a JSON object (a Kvasir record), got "
                  f"{type(value).__name__}", file=sys.stderr)
            return 2
        sys.stdout.buffer.write(msgpack.packb(value, use_bin_type=True))
        return 0
    text = to_json(sys.stdin.buffer.read(MAX_BYTES + 1))
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
