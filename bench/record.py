"""Benchmark results as data: ``--save`` writes a run's JSON to ``bench/results/``.

Every bench script calls :func:`add_save_flag` on its parser and :func:`save` with the JSON
object it printed. The saved file wraps that object with what a reader needs to trust it: the
machine (CPU model, cores, load), the commit (and whether the tree was dirty), the date and the
command line. ``bench/report.py`` renders the docs' tables from these files only, so no figure
in README.md or docs/ is typed by hand.

File name: ``bench/results/<bench>-<UTC date and time>-<commit>.json``; ``<bench>`` is the
name the script passes (``engine``, ``kernel``, ``throughput``...).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1


def add_save_flag(parser: argparse.ArgumentParser) -> None:
    """``--save``: also write the printed JSON, with machine and commit, to bench/results/."""
    parser.add_argument("--save", action="store_true",
                        help="also write the result with the machine, commit and date to bench/results/")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the numbers depend on: CPU model, cores, the load when the run ended, memory."""
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
            "mem_gib": mem_gib, "load_avg_1m": round(os.getloadavg()[0], 2),
            "os": platform.system().lower(), "python": platform.python_version()}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict:
    sha = _git("rev-parse", "--short=12", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def envelope(bench: str, result: dict, argv: list[str] | None = None) -> dict:
    """The saved record: the bench's own JSON under ``result``, and where it came from."""
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), REPO) if argv else bench
    return {"schema": SCHEMA, "bench": bench, "date": now.isoformat().replace("+00:00", "Z"),
            "commit": commit(), "machine": machine(),
            "command": " ".join(["python", script, *[a for a in argv[1:] if a != "--save"]]),
            "result": result}


def save(args: argparse.Namespace, bench: str, result: dict, argv: list[str] | None = None) -> Path | None:
    """Write ``result`` to bench/results/ when ``args.save`` is set; returns the path written."""
    if not getattr(args, "save", False):
        return None
    record = envelope(bench, result, argv)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace(":", "").replace("-", "")
    path = RESULTS_DIR / f"{bench}-{stamp}-{record['commit']['sha'] or 'nogit'}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"saved {os.path.relpath(path, REPO)}", file=sys.stderr)
    return path


def load_all(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """Every saved record, oldest first (by date, then file name)."""
    records = []
    for p in sorted(results_dir.glob("*.json")):
        rec = json.loads(p.read_text(encoding="utf-8"))
        rec["_file"] = p.name
        records.append(rec)
    return sorted(records, key=lambda r: (r.get("date", ""), r["_file"]))


def latest(bench: str, results_dir: Path = RESULTS_DIR) -> dict | None:
    """The newest saved record of one bench, or None."""
    found = [r for r in load_all(results_dir) if r.get("bench") == bench]
    return found[-1] if found else None
