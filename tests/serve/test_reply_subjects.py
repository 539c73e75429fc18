"""The generate API answers only inbox-shaped reply subjects: a request that names a service
subject (the ledger, the quarantine, another worker's node subject, the market) or a `$` subject
as its reply gets nothing published there, and the next honest request is served."""

from __future__ import annotations

import asyncio

from backbone.generate_bus import generate_all, new_request, reply_subject_ok
from kvasir_bus.connect import connect
from kvasir_bus.subjects import Subjects
from kvasir_bus.wire import encode, headers_for
from tests.serve.test_bus import backbone, fp, model  # noqa: F401 (fixtures)


def test_reply_subjects_must_be_inboxes():
    for ok in ("_INBOX.x1y2", "_INBOX_UABC.inbox.7"):
        assert reply_subject_ok(ok)
    for bad in ("kvasir.fp.quarantine", "kvasir.fp.ledger", "kvasir.fp.n.w1", "kvasir.fp.market.status",
                "$JS.API.STREAM.CREATE.X", "_INBOX.>", "_INBOX.*", "_INBOX", "x._INBOX.a", "_INBOX." + "a" * 300):
        assert not reply_subject_ok(bad), bad


def test_tokens_are_never_published_on_a_service_subject(model, fp, nats_server):
    S = Subjects(fp)
    targets = [S.quarantine(), S.ledger(), S.node("w1"), S.status(), "$SYS.REQ.SERVER.PING"]

    async def go():
        watcher = await connect(nats_server.url, "watcher")
        seen = []

        async def saw(msg):
            seen.append(msg.subject)
        for subject in targets[:-1]:
            await watcher.subscribe(subject, cb=saw)
        await watcher.flush()
        attacker = await connect(nats_server.url, "attacker")
        for subject in targets:
            req = new_request([1, 2, 3], 4, stop_on_eos=False)
            await attacker.publish(S.generate(), encode(req), reply=subject, headers=headers_for(req))
        await attacker.flush()
        client = await connect(nats_server.url, "honest")
        out = await generate_all(client, fp, new_request([1, 2, 3], 4, stop_on_eos=False))  # served after them
        await watcher.flush()
        for nc in (watcher, attacker, client):
            await nc.close()
        return seen, out

    with backbone(model, nats_server.url, fp, "b1"):
        seen, (tokens, _, done) = asyncio.run(go())
    assert seen == []
    assert len(tokens) == 4 and done is not None
