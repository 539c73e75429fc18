"""The official ``nats`` CLI, run as an operator runs it, and its output parsed.

:func:`find_cli` looks for the binary as ``make nats-cli`` builds it (``$KVASIR_NATS_CLI``, the
cache folder, then ``PATH``). :class:`Cli` runs it against one server with ``NATS_URL`` in the
environment and a config home of its own (no saved ``nats context`` of the machine's user can
change what it connects to), so the command line is exactly the one the docs show.

Outputs the docs show are kept in ``tests/interop/outputs/NAME.txt`` (``$ command`` on the
first line, then what the CLI printed): a run with ``KVASIR_INTEROP_RECORD=1`` writes them,
``python -m tests.interop.render`` puts them into the docs, and ``test_docs.py`` checks that the
docs equal that render and that each stored output still passes its test's checks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "v0.5.0"
ENV = "KVASIR_NATS_CLI"
CACHE = Path.home() / ".cache" / "kvasir" / f"natscli-{VERSION}" / "nats"
OUTPUTS = Path(__file__).resolve().parent / "outputs"
RECORD_ENV = "KVASIR_INTEROP_RECORD"


def find_cli() -> tuple[str | None, str]:
    """(path, "") of the nats CLI, or (None, why there is none)."""
    explicit = os.environ.get(ENV)
    if explicit and os.access(explicit, os.X_OK):
        return explicit, ""
    if CACHE.is_file() and os.access(CACHE, os.X_OK):
        return str(CACHE), ""
    found = shutil.which("nats")
    if found:
        return found, ""
    why = ("no Go on this machine" if shutil.which("go") is None else "not built yet: run `make nats-cli`")
    return None, (f"the official nats CLI {VERSION} is not here ({why}; looked at ${ENV}, {CACHE}, PATH)")


@dataclass
class Run:
    """One CLI run: the command as an operator types it, its exit status and output (stdout and
    stderr together, as a terminal shows them, unless ``stderr`` is kept apart)."""

    shown: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        return self.stdout + self.stderr

    def transcript(self) -> str:
        """``$ command`` and what the CLI printed (stdout, then stderr), as the docs show it."""
        out = self.stdout if self.stdout.endswith("\n") or not self.stdout else self.stdout + "\n"
        return f"$ {self.shown}\n{out}{self.stderr}".rstrip("\n") + "\n"


@dataclass
class Cli:
    """The nats CLI against ``url``; ``home`` holds its (empty) config folder."""

    binary: str
    url: str
    home: Path
    # tmp paths -> the name the docs give them (the creds folder is DIR)
    aliases: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        env.update(NATS_URL=self.url, XDG_CONFIG_HOME=str(self.home / "config"), HOME=str(self.home),
                   NO_COLOR="1")
        return env

    def argv(self, args: list[str]) -> list[str]:
        return [self.binary, *args]

    def show(self, args: list[str], stdin_from: str = "") -> str:
        text = " ".join(["nats", *(shlex.quote(a) for a in args)])
        for path, name in self.aliases.items():
            text = text.replace(path, name)
        return f"{stdin_from} | {text}" if stdin_from else text

    def run(self, *args: str, input: bytes | None = None, timeout: float = 30, stdin_from: str = "") -> Run:
        # stderr (the CLI's timestamped lines) and stdout (bodies) in one pipe, in the order printed
        p = subprocess.run(self.argv(list(args)), input=input, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, env=self.env(), stdin=None if input is not None else subprocess.DEVNULL)
        return Run(self.show(list(args), stdin_from), p.returncode, p.stdout.decode("utf-8", "replace"), "")

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(list(args)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=self.env())

    def with_url(self, url: str) -> Cli:
        return Cli(self.binary, url, self.home, dict(self.aliases))


def record(name: str, transcript: str) -> None:
    """Keep ``transcript`` as the docs' output NAME, on a run with ``KVASIR_INTEROP_RECORD=1``."""
    if os.environ.get(RECORD_ENV) == "1":
        OUTPUTS.mkdir(exist_ok=True)
        (OUTPUTS / f"{name}.txt").write_text(transcript)


def stored(name: str) -> str:
    return (OUTPUTS / f"{name}.txt").read_text()


# ---- nats sub output --------------------------------------------------------------------

_RECEIVED = re.compile(r'^\[#(\d+)\] Received on "([^"]+)"(?: with reply "([^"]+)")?\s*$')
_HEADER = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*): ?(.*)$")


@dataclass
class Msg:
    number: int
    subject: str
    reply: str | None
    headers: dict[str, str]
    lines: list[str]  # the block as printed

    def block(self) -> str:
        return "\n".join(self.lines).rstrip("\n") + "\n"

    def body(self) -> list[str]:
        """The payload's lines (after the header block and its blank line)."""
        rest = self.lines[1 + len(self.headers):]
        return [ln for ln in rest if ln.strip()]


def parse_sub(text: str) -> list[Msg]:
    """The messages ``nats sub`` printed: subject, reply subject, headers, and the payload lines
    (none with ``--headers-only``; one JSON line each with ``--translate 'python -m kvasir_bus.msgjson'``)."""
    msgs: list[Msg] = []
    for line in text.splitlines():
        m = _RECEIVED.match(line)
        if m:
            msgs.append(Msg(int(m[1]), m[2], m[3], {}, [line]))
            continue
        if not msgs:
            continue
        cur = msgs[-1]
        cur.lines.append(line)
        h = _HEADER.match(line)
        if h and len(cur.lines) == len(cur.headers) + 2:  # header lines follow the Received line
            cur.headers[h[1]] = h[2]
    for m in msgs:
        while m.lines and not m.lines[-1].strip():
            m.lines.pop()
    return msgs


def parse_req(text: str) -> list[dict]:
    """Replies ``nats req`` printed: per reply its headers and its (translated) body lines.

    The CLI prints ``HH:MM:SS Received with rtt ...``, then one timestamped line per header, a
    timestamped empty line, then the body as it came (untimestamped)."""
    replies: list[dict] = []
    stamp = re.compile(r"^\d\d:\d\d:\d\d ?(.*)$")
    cur, in_headers = None, False
    for line in text.splitlines():
        m = stamp.match(line)
        if m and m[1].startswith("Received with rtt"):
            cur, in_headers = {"headers": {}, "body": []}, True
            replies.append(cur)
        elif cur is None:
            continue
        elif m and in_headers:
            h = _HEADER.match(m[1])
            if h:
                cur["headers"][h[1]] = h[2]
            else:
                in_headers = False
        elif line.strip() and not m:
            cur["body"].append(line)
    return replies
