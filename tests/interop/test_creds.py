"""The official ``nats`` CLI under ``kvasir creds init --jwt``: ``nats --creds DIR/<identity>.creds``
connects as each identity, the observer reads ``kvasir.>``, and the server refuses a worker's
creds where ``tests/net/test_permissions.py`` says, with the CLI printing the server's reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvasir_bus import jwt
from kvasir_bus.cli import main as kvasir
from kvasir_bus.server import EmbeddedNats
from kvasir_bus.subjects import Subjects
from tests.interop.cli import Cli, record
from tests.interop.test_swarm import ROLES, Sub

M = Subjects("abc123")
IDENTITIES = ("operator", "backbone", "market", "observer", "w1")


def user_key(creds_file) -> str:
    """The identity's public key (its user JWT's subject): its inbox is ``_INBOX_<key>``."""
    return jwt.decode(creds_file.read_text().splitlines()[1])["sub"]


@pytest.fixture(scope="module")
def secure(nats_cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("creds") / "dep"
    assert kvasir(["creds", "init", str(out), "--listen", "127.0.0.1:0", "--workers", "w1,worker-0,worker-1",
                   "--jwt"]) == 0
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


# ---- a whole swarm under its identities, seen by the observer's CLI ----------------------------

def observer(dep) -> list[str]:
    obs = dep / "observer.creds"
    return ["--creds", str(obs), "--inbox-prefix", f"_INBOX_{user_key(obs)}"]


@pytest.fixture(scope="module")
def secure_swarm(secure, models, tmp_path_factory):
    """backbone (kvasir serve), market and two workers, each under its own JWT identity."""
    dep, cli = secure
    model = models("qwen3moe", "q8_0")
    logs = tmp_path_factory.mktemp("secure-logs")
    base = [sys.executable, "-m", "kvasir_bus.cli"]
    procs = []

    def spawn(name: str, *args: str) -> None:
        log = open(logs / f"{name}.log", "w")
        procs.append(subprocess.Popen([*base, *args, "--nats", cli.url, "--creds", str(dep / f"{name}.creds")],
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))

    try:
        spawn("backbone", "serve", "--model", str(model), "--spool", "off")
        for i, experts in enumerate(("0-3", "4-7")):
            spawn(f"worker-{i}", "worker", "--model", str(model), "--layer", "all", "--experts", experts)
        spawn("market", "market", "--db", str(logs / "market.db"))
        end = time.monotonic() + 90
        services = []
        while time.monotonic() < end and len(services) < 4:
            r = cli.run(*observer(dep), "micro", "list", "--json")
            services = json.loads(r.stdout) if r.returncode == 0 and r.stdout.startswith("[") else []
            if any(p.poll() is not None for p in procs):
                break
        if len(services) < 4:
            tails = {p.name: p.read_text()[-500:] for p in logs.glob("*.log")}
            raise AssertionError(f"the secure swarm did not come up: {services}\n{tails}")
        yield dep, cli, services
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_the_observer_sees_every_role_of_a_swarm_under_creds(secure_swarm):
    dep, cli, services = secure_swarm
    assert sorted(s["name"] for s in services) == sorted([*ROLES, "kvasir-worker"])
    nodes = sorted(s["metadata"]["node"] for s in services)
    assert nodes == ["backbone", "market", "worker-0", "worker-1"]  # each its identity's name
    ping = cli.run(*observer(dep), "micro", "ping")
    assert ping.returncode == 0 and "iolation" not in ping.text, ping.text
    assert sorted(ln.split()[0] for ln in ping.text.splitlines() if ln.startswith("kvasir-")) == sorted(
        [*ROLES, "kvasir-worker"]), ping.text
    record("creds-observer-ping", ping.transcript().replace(user_key(dep / "observer.creds"), "<observer key>"))
    # and it reads the workers' heartbeats
    sub = Sub(cli, "--creds", str(dep / "observer.creds"), "sub", "kvasir.*.coverage.*", "--headers-only")
    try:
        sub.wait_for(lambda t: '.coverage.worker-0"' in t and '.coverage.worker-1"' in t, "both workers' heartbeats")
    finally:
        sub.stop()


def test_a_workers_creds_may_not_ask_the_services_nor_hear_another_worker(secure_swarm):
    dep, cli, services = secure_swarm
    fp = next(s["metadata"]["model"] for s in services if s["name"] == "kvasir-worker")
    w0 = ["--creds", str(dep / "worker-0.creds"), "--inbox-prefix", f"_INBOX_{user_key(dep / 'worker-0.creds')}"]
    r = cli.run(*w0, "micro", "ping", "--timeout", "1s")
    assert violation("Publish", "$SRV.PING") in r.text, r.text
    other = Subjects(fp).node("worker-1")
    r = cli.run(*w0, "sub", other, "--count", "1")
    assert r.returncode == 1 and violation("Subscription", other) in r.text, r.text
