"""Put the ``nats`` CLI outputs of a test run into the docs.

Each output the docs show sits between two marker comments::

    <!-- nats-cli:micro-list -->
    ```
    $ nats micro list
    ...what the CLI printed...
    ```
    <!-- /nats-cli:micro-list -->

and is rendered from ``tests/interop/outputs/micro-list.txt``, which a run of
``KVASIR_INTEROP_RECORD=1 python -m pytest tests/interop`` writes. ``python -m
tests.interop.render`` rewrites the blocks in place (only them); ``tests/interop/test_docs.py``
checks that the docs equal this render.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.interop.cli import OUTPUTS

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "docs" / "operating.md", REPO / "docs" / "protocol.md")
BLOCK = re.compile(r"(<!-- nats-cli:([a-z0-9-]+) -->\n)(.*?)(<!-- /nats-cli:\2 -->)", re.S)


def names(text: str) -> list[str]:
    return [m[2] for m in BLOCK.finditer(text)]


def render(text: str, outputs: Path = OUTPUTS) -> str:
    """``text`` with every marked block replaced by its stored output in a code fence."""
    def block(m: re.Match) -> str:
        path = outputs / f"{m[2]}.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no stored output for the docs' block {m[2]!r} "
                                    "(run KVASIR_INTEROP_RECORD=1 python -m pytest tests/interop)")
        body = path.read_text()
        return f"{m[1]}```\n{body if body.endswith(chr(10)) else body + chr(10)}```\n{m[4]}"

    return BLOCK.sub(block, text)


def main() -> int:
    for doc in DOCS:
        text = doc.read_text()
        try:
            new = render(text)
        except FileNotFoundError as exc:
            print(f"render: error: {exc}", file=sys.stderr)
            return 2
        if new != text:
            doc.write_text(new)
            print(f"rendered {', '.join(names(text))} into {doc.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
