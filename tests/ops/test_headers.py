"""Headers everywhere: every message kind says what it is, and every publish site sends them.

``nats sub 'kvasir.>'`` (or any NATS tool) shows a message's headers without decoding msgpack:
routing statistics and ledger batches carried none before this test existed.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import numpy as np

from backbone.market_link import MarketLink
from kvasir_bus import codec, ledger_stream, market_codec as mc, wire
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects

ROOT = Path(__file__).resolve().parents[2]
FP = "0123456789abcdef"


def samples() -> dict[str, wire.Record]:
    """One valid record of every kind the wire registry knows (the wire tests' own samples)."""
    from tests.kvasir_bus.test_wire import one_of_each

    return {type(r).kind: r for r in one_of_each()}


def test_every_record_kind_has_readable_headers_with_its_kind_and_model():
    made = samples()
    missing = set(wire.RECORDS) - set(made) - {"mf"}  # the manifest: tests/kvasir_bus builds one
    assert not missing, f"add a sample of {missing}"
    for kind, msg in made.items():
        h = wire.headers_for(msg)
        assert h["Kvasir-Kind"] == type(msg).what.replace(" ", "_"), kind
        if getattr(msg, "model", None):
            assert h["Kvasir-Model"] == msg.model
        assert len(h) > 2 and all(isinstance(v, str) and v for v in h.values()), (kind, h)
    assert wire.headers_for(made["hb"])["Kvasir-Node"] == "w-1"
    assert wire.headers_for(made["q"])["Kvasir-Layer"] == str(made["q"].layer)


def _parse(source: str) -> ast.AST:
    """ast.parse, once more on CPython 3.11's "AST constructor recursion depth mismatch": its
    recursion counter is not thread-safe and other tests leave threads running (gh-106905)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def _publish_calls(path: Path):
    """(line, method, has headers) of every ``.publish``/``.request`` whose payload is a
    record's ``.encode()``."""
    for node in ast.walk(_parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("publish", "request") and len(node.args) >= 2):
            payload = node.args[1]
            if isinstance(payload, ast.Call) and isinstance(payload.func, ast.Attribute) \
                    and payload.func.attr == "encode":
                yield node.lineno, node.func.attr, any(k.arg == "headers" for k in node.keywords)


def test_every_publish_site_of_a_record_sends_its_headers():
    sites = [(f"{p.relative_to(ROOT)}:{line}", has)
             for folder in ("kvasir_bus", "workers", "backbone", "market", "launch", "synth")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for line, _, has in _publish_calls(p)]
    assert len(sites) >= 6  # the scan sees the roles' publish sites
    assert [where for where, has in sites if not has] == []


def test_routing_and_ledger_messages_carry_headers_on_the_bus(nats_server, arun):
    subjects = Subjects(FP)

    async def go():
        seen = {}
        tap = await connect(nats_server.url, "test-tap")

        async def on_msg(msg):  # ledger batches go into a JetStream stream: a plain subscriber sees them too
            seen[msg.subject] = msg.headers or {}

        await tap.subscribe(subjects.everything(), cb=on_msg)
        await tap.flush()
        nc = await connect(nats_server.url, "test-backbone")
        await ledger_stream.ensure_stream(nc.jetstream())
        link = MarketLink(nc, FP, "bb", interval_s=0.05)
        link.record_call(0, 1, 3, remote=True)
        link.record_win("w1", 0, 1, 3)
        await link.start()
        for _ in range(1000):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
        await link.stop(flush_timeout_s=0.5)  # no market here to acknowledge anything
        await nc.close()
        await tap.close()
        return seen

    seen = arun(go(), timeout=30)
    routing, ledger = seen[subjects.routing()], seen[subjects.ledger()]
    assert routing["Kvasir-Kind"] == "routing_stats" and routing["Kvasir-Node"] == "bb"
    assert routing["Kvasir-Model"] == FP
    assert ledger["Kvasir-Kind"] == "ledger_batch" and ledger["Kvasir-Events"] == "1"
