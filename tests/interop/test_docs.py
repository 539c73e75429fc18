"""The docs' ``nats`` CLI examples are a test run's output: each sits in a marked block rendered
from ``tests/interop/outputs/``; the docs equal the render, every stored output still passes
the checks its test applies to the live CLI, and no ``nats`` command in a code block of the docs
is outside such a block (none typed by hand). Runs without the CLI: it reads stored files."""

from __future__ import annotations

import os
import re

import pytest

from tests.interop import test_creds as tc
from tests.interop import test_swarm as ts
from tests.interop.cli import OUTPUTS, RECORD_ENV, stored
from tests.interop.render import BLOCK, DOCS, names, render

pytestmark = pytest.mark.skipif(os.environ.get(RECORD_ENV) == "1", reason="this run rewrites the stored "
                                "outputs: render them (python -m tests.interop.render), then run these checks")

CHECKS = {
    "micro-list": ts.check_micro_list,
    "micro-ping": ts.check_micro_ping,
    "micro-info-worker": ts.check_micro_info_worker,
    "micro-stats-worker": ts.check_micro_stats_worker,
    "req-manifest": ts.check_manifest,
    "req-generate": ts.check_generate,
    "sub-headers": ts.check_sub,
    "sub-readable": ts.check_sub_readable,
    "stream-info": ts.check_stream_info,
    "stream-view": ts.check_stream_view,
}


def fingerprint() -> str:
    return re.search(r"model: ([0-9a-f]+)", stored("micro-info-worker"))[1]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_equal_the_render_of_the_stored_outputs(doc):
    text = doc.read_text()
    assert text == render(text), f"{doc.name} differs from its render: run python -m tests.interop.render"


def test_every_nats_command_in_the_docs_comes_from_a_test_run():
    shown = set()
    repo = DOCS[0].parents[1]
    for doc in sorted({*DOCS, *repo.glob("docs/*.md"), repo / "README.md"}):
        text = doc.read_text()
        shown |= set(names(text))
        outside = BLOCK.sub("", text)
        for fence in re.findall(r"```[a-z]*\n(.*?)```", outside, re.S):
            typed = [ln for ln in fence.splitlines() if re.match(r"^(\$ )?nats ", ln.strip())]
            assert not typed, f"{doc.name}: a nats command typed by hand: {typed}"
    assert shown >= set(CHECKS), set(CHECKS) - shown  # every checked output is shown somewhere
    for name in shown:
        assert (OUTPUTS / f"{name}.txt").is_file(), name


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_stored_output_still_passes_its_check(name):
    fp = fingerprint()
    text = stored(name)
    first, _, rest = text.partition("\n")
    assert first.startswith("$ ") and " nats " in f" {first}", first
    CHECKS[name](rest, fp)


def test_the_stored_refusals_say_what_the_server_refused():
    tc.check_refused_publish(stored("creds-worker-dispatch"), "kvasir.abc123.x.0.1")
    assert 'Permissions Violation for Subscription to "_INBOX.>"' in stored("creds-worker-inbox")
    assert "Authorization Violation" in stored("creds-anonymous")
    ping = stored("creds-observer-ping")
    assert "--inbox-prefix _INBOX_" in ping.splitlines()[0]
    ts.check_micro_ping(ping.partition("\n")[2], fingerprint())  # all four roles answered the observer
