"""The README and docs/ as a reader meets them: short, every link going somewhere, every table of
figures what bench/report.py makes of the saved runs, every cited test real, and no sentence
about the project's own development history outside benchmarks.md's dated history."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
#: pages other helpers write; a link to one that does not exist yet is checked on its own below
PENDING = {ROOT / "docs" / "scale.md"}


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code (links in code are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = _strip_code(path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_is_at_most_250_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves_to_a_file_and_its_anchor(page):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s):, mailto: ... not checked offline
            continue
        file_part, _, frag = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if dest in PENDING and not dest.exists():
            continue  # test_the_pages_the_readme_promises_exist says so
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_pages_the_readme_promises_exist():
    missing = [p.relative_to(ROOT).as_posix() for p in PENDING if not p.exists()]
    if missing:
        pytest.xfail(f"{', '.join(missing)} is written by the planner's work (kvasir plan), not here yet")


def test_the_four_readers_start_from_the_readmes_first_screen():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:20])
    for doc in ("docs/quickstart.md", "docs/deploy.md", "docs/protocol.md", "docs/quickstart.md#join-a-swarm"):
        assert doc in first, f"{doc} is not linked from the README's first screen"


def test_the_committed_tables_are_what_report_py_renders():
    report = _report()
    # the saved runs git tracks: a run another job saved a moment ago is not committed yet
    for rel, (committed, rendered) in report.rendered(ROOT, only=report.tracked_results(ROOT)).items():
        assert committed == rendered, f"{rel} differs from bench/report.py's rendering: run python bench/report.py"


def test_report_check_exits_1_on_a_stale_table(tmp_path):
    """``--check`` on a copy whose headline lost a row says so and exits 1; the real tree exits 0."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check", "--tracked"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = _report()
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for rel in report.TARGETS:
        (tmp_path / rel).write_text((ROOT / rel).read_text(encoding="utf-8"), encoding="utf-8")
    tracked = report.tracked_results(ROOT)
    for f in (ROOT / "bench" / "results").glob("*.json"):
        if f.name not in tracked:
            continue
        (tmp_path / "bench" / "results" / f.name).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    assert all(old == new for old, new in report.rendered(tmp_path).values())
    stale = (tmp_path / "README.md").read_text(encoding="utf-8").replace("| 0.", "| 9.", 1)
    (tmp_path / "README.md").write_text(stale, encoding="utf-8")
    assert any(old != new for old, new in report.rendered(tmp_path).values())


def test_every_figure_of_the_readmes_headline_comes_from_a_saved_run():
    """Each number in the headline table is in a bench/results file, or is a ratio report.py
    computes from two saved figures (its column says so)."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- report:headline begin -->\n(.*?)<!-- report:headline end -->", text, re.S).group(1)
    saved = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "bench" / "results").glob("*.json"))
    rows = [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert rows, "the headline table is empty"
    for row in rows:
        cells = row.split(" | ")
        figures = re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", cells[2])
        assert figures, row
        for fig in figures:
            if "computed by bench/report.py" in row:
                continue
            assert re.search(rf"(?<![\d.]){re.escape(fig)}\d*(?![\d])", saved), f"{fig} of {cells[0]} is in no saved run"


def test_every_cited_test_exists():
    """A `tests/...py` or `tests/...py::name` named in README.md or docs/ is a real file and
    function."""
    bad = []
    for page in PAGES:
        for m in re.finditer(r"tests/[\w/]+\.py(?:::(\w+))?|tests/[\w/]+/", page.read_text(encoding="utf-8")):
            path = ROOT / m.group(0).split("::")[0]
            if not path.exists():
                bad.append(f"{page.name}: {m.group(0)}")
            elif m.group(1) and not re.search(rf"def {m.group(1)}\b", path.read_text(encoding="utf-8")):
                bad.append(f"{page.name}: {m.group(0)} (no such test)")
    assert not bad, bad


HISTORY = re.compile(r"\bsession \d+\b|\bthis round\b|\blast round\b|\bthe round before\b|\bthis session\b|\bthis week\b", re.I)


def _outside_history(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    if path.name == "benchmarks.md":
        text = text.split("\n## History (dated)\n", 1)[0]
    return text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_development_history_in_the_readme_and_docs(page):
    found = [m.group(0) for m in HISTORY.finditer(_outside_history(page))]
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_no_development_history_in_the_code():
    files = subprocess.run(["git", "ls-files", "*.py", "*.js", "*.mjs"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for rel in files:
        path = ROOT / rel
        if not path.exists() or rel == "tests/docs/test_docs.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:80]}")
    assert not found, "\n".join(found)


def test_saved_runs_carry_machine_commit_date_and_command():
    for f in sorted((ROOT / "bench" / "results").glob("*.json")):
        rec = json.loads(f.read_text(encoding="utf-8"))
        assert {"bench", "date", "commit", "machine", "command", "result"} <= set(rec), f.name
        assert {"cpu", "cores", "load_avg_1m"} <= set(rec["machine"]), f.name


def test_every_bench_script_takes_save():
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name in ("record.py", "report.py"):
            continue
        text = script.read_text(encoding="utf-8")
        assert "record.add_save_flag(" in text and "record.save(" in text, f"{script.name} has no --save"


def test_anchor_follows_githubs_rule():
    assert anchor("Will my swarm be fast?") == "will-my-swarm-be-fast"
    assert anchor("`kvasir up --logs DIR`") == "kvasir-up---logs-dir"
    assert anchor("Exactness: `kvasir verify`") == "exactness-kvasir-verify"
