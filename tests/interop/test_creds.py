"""The official ``nats`` CLI under ``kvasir creds init --jwt``: ``nats --creds DIR/<identity>.creds``
connects as each identity, the observer reads ``kvasir.>``, and the server refuses a worker's
creds where ``tests/net/test_permissions.py`` says, with the CLI printing the server's reason."""

from __future__ import annotations

import pytest

from kvasir_bus import jwt
from kvasir_bus.cli import main as kvasir
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import Subjects
from tests.interop.cli import Cli, record
from tests.interop.test_swarm import Sub

M = Subjects("abc123")
IDENTITIES = ("operator", "backbone", "market", "observer", "w1")


def user_key(creds_file) -> str:
    """The identity's public key (its user JWT's subject): its inbox is ``_INBOX_<key>``."""
    return jwt.decode(creds_file.read_text().splitlines()[1])["sub"]


@pytest.fixture(scope="module")
def secure(nats_cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("creds") / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1", "--jwt"]) == 0
    with EmbeddedNats(config=out / "nats.conf", port=None, host=None) as server:
        cli = Cli(nats_cli, server.url, tmp_path_factory.mktemp("nats-cli-home"), {str(out): "DIR"})
        yield out, cli


def violation(what: str, subject: str) -> str:
    return f'nats: permissions violation: Permissions Violation for {what} to "{subject}"'


def check_refused_publish(text: str, subject: str) -> None:
    assert f"nats: error: {violation('Publish', subject)}" in text, text


def test_every_identity_connects_and_anonymous_is_refused(secure):
    dep, cli = secure
    for name in IDENTITIES:
        r = cli.run("--creds", str(dep / f"{name}.creds"), "rtt")
        assert r.returncode == 0 and "failed" not in r.text and "rror" not in r.text, (name, r.text)
        assert "µs" in r.text or "ms" in r.text, r.text
        if name == "observer":
            record("creds-rtt", r.transcript())
    anon = cli.run("pub", M.coverage("w1"), "x")
    assert anon.returncode == 1 and "Authorization Violation" in anon.text, anon.text
    record("creds-anonymous", anon.transcript())


def test_the_observer_reads_kvasir_and_asks_services_from_its_own_inbox(secure):
    dep, cli = secure
    obs = dep / "observer.creds"
    sub = Sub(cli, "--creds", str(obs), "sub", "kvasir.>")
    try:
        sub.wait_for(lambda t: "Subscribing on kvasir.>" in t, "subscription")
        # the worker's own heartbeat subject is the one thing it may publish there: the observer hears it
        end_marker = "hello from w1"
        for _ in range(50):  # the subscription line comes before the server has it: publish until heard
            pub = cli.run("--creds", str(dep / "w1.creds"), "pub", M.coverage("w1"), end_marker)
            assert pub.returncode == 0, pub.text
            try:
                sub.wait_for(lambda t: end_marker in t, "heartbeat from w1", deadline_s=0.2)
                break
            except AssertionError:
                continue
    finally:
        text = sub.stop()
    assert f'Received on "{M.coverage("w1")}"' in text and end_marker in text, text

    # Without its inbox prefix the CLI's replies would come to _INBOX.<random>, which only its
    # own _INBOX_<key>.> allows; with it, asking every service ($SRV.>) is allowed.
    plain = cli.run("--creds", str(obs), "micro", "ping", "--timeout", "1s")
    assert violation("Subscription", "_INBOX.")[:-1] in plain.text, plain.text  # _INBOX.<random>
    prefixed = cli.run("--creds", str(obs), "--inbox-prefix", f"_INBOX_{user_key(obs)}", "micro", "ping",
                       "--timeout", "1s")
    assert prefixed.returncode == 0 and "iolation" not in prefixed.text, prefixed.text
    record("creds-observer-inbox", plain.transcript())
    # and it never writes
    r = cli.run("--creds", str(obs), "pub", M.demand(), "x")
    assert r.returncode == 1
    check_refused_publish(r.text, M.demand())


def test_a_worker_is_refused_where_the_permission_tests_say(secure):
    dep, cli = secure
    w1 = ["--creds", str(dep / "w1.creds")]
    # as tests/net/test_permissions.py: dispatch, ledger, demand, another node's heartbeat, routing
    for subject in (M.dispatch(0, 1), M.ledger(), M.demand(), M.coverage("w2"), M.routing()):
        r = cli.run(*w1, "pub", subject, "x")
        assert r.returncode == 1, r.text
        check_refused_publish(r.text, subject)
        if subject == M.dispatch(0, 1):
            record("creds-worker-dispatch", r.transcript())
    # other nodes' replies and heartbeats, and other nodes' bundles: no subscription
    for subject in ("_INBOX.>", M.coverage_all(), M.node("w2")):
        r = cli.run(*w1, "sub", subject, "--count", "1")
        assert r.returncode == 1, r.text
        assert f"nats: error: {violation('Subscription', subject)}" in r.text, r.text
        if subject == "_INBOX.>":
            record("creds-worker-inbox", r.transcript())
    # $SYS is the operator's: the worker's request is refused, the operator's answered
    inbox = ["--inbox-prefix", f"_INBOX_{user_key(dep / 'w1.creds')}"]
    r = cli.run(*w1, *inbox, "req", "$SYS.REQ.SERVER.PING.CONNZ", "", "--timeout", "1s")
    assert violation("Publish", "$SYS.REQ.SERVER.PING.CONNZ") in r.text, r.text
    op = cli.run("--creds", str(dep / "operator.creds"), "req", "$SYS.REQ.SERVER.PING.CONNZ", "", "--raw")
    assert op.returncode == 0 and '"connections"' in op.text, op.text
    # a worker may not ask the services either
    r = cli.run(*w1, *inbox, "micro", "ping", "--timeout", "1s")
    assert violation("Publish", "$SRV.PING") in r.text, r.text
