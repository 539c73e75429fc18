"""The official ``nats`` CLI against a real ``kvasir up`` swarm: what an operator types, with the
CLI's own output parsed, checked against what docs/operating.md and docs/protocol.md claim.

Each ``check_*`` function takes the CLI's printed text (and the model fingerprint) and asserts
what the docs say about it: the tests apply them to a live run, ``test_docs.py`` to the outputs
the docs show (kept in ``outputs/``)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest

from kvasir_bus import generate_codec as gc
from kvasir_bus import market_codec as mc
from kvasir_bus.signing import Verifier
from tests.interop.cli import Cli, Run, parse_req, parse_sub, record

PY = "python"  # how the docs name the interpreter that has kvasir installed
ROLES = {"kvasir-worker": "worker", "kvasir-market": "market", "kvasir-backbone": "backbone"}
WORKER_META = {"role", "node", "model", "kernel", "version", "pid"}
MARKET_ENDPOINTS = {"coverage", "routing", "volunteer", "volunteer-node", "status", "node", "overview"}
GENERATE_BODY = {"v": 1, "t": "gq", "request_id": "cli-1", "prompt_ids": [], "prompt_text": "Once upon a time",
                 "max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_on_eos": False}


def translate() -> str:
    return f"{sys.executable} -m kvasir_bus.msgjson"


@pytest.fixture(scope="module")
def ops(cli: Cli, swarm) -> Cli:
    c = cli.with_url(swarm.url)
    c.aliases[sys.executable] = PY
    return c


# ---- micro: who is on the bus ----------------------------------------------------------------

def check_micro_ping(text: str, fp: str) -> None:
    lines = [ln.split() for ln in text.splitlines() if ln.startswith("kvasir-")]
    names = sorted(parts[0] for parts in lines)
    assert names == ["kvasir-backbone", "kvasir-market", "kvasir-worker", "kvasir-worker"], text
    assert all(parts[2].startswith("rtt=") for parts in lines), text


def check_micro_list(text: str, fp: str) -> None:
    for name in ROLES:
        assert name in text, text
    assert text.count("Kvasir worker worker-") == 2, text
    assert "Kvasir market market" in text and "Kvasir backbone backbone" in text, text


def check_micro_info_worker(text: str, fp: str) -> None:
    assert "Service: kvasir-worker" in text, text
    for key in WORKER_META:
        assert re.search(rf"^\s+(Metadata:\s+)?{key}: \S", text, re.M), (key, text)
    assert f"model: {fp}" in text and "role: worker" in text, text
    assert f"Subject: kvasir.{fp}.x.*.*" in text, text
    assert re.search(r"holdings: L0:\d-\d,L1:\d-\d", text), text
    assert "replicas: race (first reply wins)" in text, text


def check_micro_stats_worker(text: str, fp: str) -> None:
    rows = [ln for ln in text.splitlines() if "│ experts" in ln]
    assert len(rows) == 2, text  # one row per worker instance
    requests = [int(r.split("│")[3]) for r in rows]
    assert all(n > 0 for n in requests), text  # both served the generation
    assert all(r.split("│")[5].strip() == "0" for r in rows), text  # no error replies


def test_micro_ping_counts_every_role(ops, swarm):
    # `nats micro ping` collects the answers that come within its window; on a loaded 2-core
    # machine one service's answer can miss it (a fresh-clone run: the market's), so it pings
    # again, a few times at most, until a ping hears every role
    for _ in range(3):
        r = ops.run("micro", "ping")
        assert r.returncode == 0, r.text
        if sum(ln.startswith("kvasir-") for ln in r.stdout.splitlines()) >= 4:
            break
    check_micro_ping(r.stdout, swarm.fingerprint)
    record("micro-ping", r.transcript())


def test_micro_list_and_info_show_every_role_with_the_documented_card_and_endpoints(ops, swarm):
    fp = swarm.fingerprint
    r = ops.run("micro", "list")
    assert r.returncode == 0, r.text
    check_micro_list(r.stdout, fp)
    record("micro-list", r.transcript())

    listed = ops.run("micro", "list", "--json")
    services = json.loads(listed.stdout)
    assert sorted(s["name"] for s in services) == sorted([*ROLES, "kvasir-worker"])
    nodes = {}
    for s in services:
        info_run = ops.run("micro", "info", s["name"], s["id"], "--json")
        assert info_run.returncode == 0, info_run.text
        info = json.loads(info_run.stdout)["info"]
        meta = info["metadata"]
        assert set(meta) == WORKER_META, meta
        assert meta["role"] == ROLES[s["name"]] and meta["model"] == fp
        assert meta["pid"].isdigit() and meta["version"] == info["version"]
        endpoints = {e["name"]: e for e in info["endpoints"]}
        assert all(e["queue_group"] == "" for e in endpoints.values())  # plain subscriptions: replicas race
        if meta["role"] == "worker":
            assert meta["kernel"].startswith("ggml-")
            assert set(endpoints) == {"experts"} and endpoints["experts"]["subject"] == f"kvasir.{fp}.x.*.*"
            nodes[meta["node"]] = endpoints["experts"]["metadata"]["holdings"]
        elif meta["role"] == "market":
            assert meta["kernel"] == "none" and meta["node"] == "market"
            assert set(endpoints) == MARKET_ENDPOINTS, endpoints  # the ledger is a stream, not a subscription
            assert endpoints["volunteer"]["subject"] == "kvasir.*.market.volunteer"
        else:
            assert list(endpoints) == ["dispatch", "manifest"]
            assert endpoints["manifest"]["subject"] == f"kvasir.{fp}.manifest"
    assert nodes == {"worker-0": "L0:0-3,L1:0-3", "worker-1": "L0:4-7,L1:4-7"}  # kvasir up's split

    worker = next(s for s in services if s["name"] == "kvasir-worker")
    r = ops.run("micro", "info", "kvasir-worker", worker["id"])
    check_micro_info_worker(r.stdout, fp)
    record("micro-info-worker", r.transcript())


# ---- requests built with the CLI ---------------------------------------------------------

def check_manifest(text: str, fp: str) -> None:
    [reply] = parse_req(text)
    h = reply["headers"]
    assert (h["Kvasir-Kind"], h["Kvasir-Model"], h["Kvasir-Version"]) == ("manifest", fp, "1"), h
    body = json.loads(reply["body"][0])
    assert body["t"] == "mf" and body["model"] == fp and body["n_slabs"] == 6 * body["n_layer"] * body["n_expert"] // 2
    assert body["slab_sha256"].startswith(f"<{32 * body['n_slabs']} bytes:")


def test_manifest_request_with_an_empty_body_gets_the_manifest(ops, swarm):
    fp = swarm.fingerprint
    r = ops.run("req", f"kvasir.{fp}.manifest", "", "--translate", translate())
    assert r.returncode == 0, r.text
    check_manifest(r.text, fp)
    record("req-manifest", r.transcript())
    raw = ops.run("req", f"kvasir.{fp}.manifest", "", "--raw")
    # the raw bytes are the manifest record the protocol describes
    proc = subprocess.run([ops.binary, "req", f"kvasir.{fp}.manifest", "", "--raw"], capture_output=True,
                          env=ops.env(), timeout=30)
    assert raw.returncode == 0 and proc.returncode == 0
    manifest = mc.decode_manifest(proc.stdout.rstrip(b"\n"))
    assert isinstance(manifest, mc.Manifest) and manifest.model == fp


def check_generate(text: str, fp: str) -> None:
    replies = parse_req(text)
    assert [r["headers"]["Kvasir-Kind"] for r in replies] == ["generated_token"] * 4 + ["generation_done"], text
    records = []
    for r in replies:
        body = json.loads(r["body"][0])
        # the JSON is the msgpack record the backbone sent: packed again, it decodes as one
        records.append(gc.decode_generate_reply(msgpack.packb(body, use_bin_type=True)))
    assert [t.index for t in records[:4]] == [0, 1, 2, 3]
    assert all(t.request_id == "cli-1" for t in records)
    done = records[-1]
    assert isinstance(done, gc.GenerateDone)
    assert (done.finish_reason, done.completion_tokens, done.node) == ("length", 4, "backbone")


def generate_argv(fp: str) -> tuple[list[str], bytes, str]:
    body = json.dumps(GENERATE_BODY)
    packed = subprocess.run([sys.executable, "-m", "kvasir_bus.msgjson", "--pack", body],
                            capture_output=True, check=True).stdout
    return (["req", f"kvasir.{fp}.generate", "--force-stdin", "--replies", "5", "--translate", translate()],
            packed, f"{PY} -m kvasir_bus.msgjson --pack '{body}'")


class Sub:
    """``nats sub ...`` in the background, its output collected line by line."""

    def __init__(self, cli: Cli, *args: str):
        self.args = list(args)
        self.shown = cli.show(self.args)
        self.proc = cli.popen(*args)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def wait_for(self, pred, what: str, deadline_s: float = 20) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if pred("\n".join(self.lines)):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)  # polling the collected output, not waiting for readiness
        raise AssertionError(f"nats sub: no {what}:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._reader.join(5)
        return "\n".join(self.lines) + "\n"


HOT_PATH = ("kvasir.*.n.*", "kvasir.*.x.>")


@pytest.fixture(scope="module")
def generation(ops, swarm):
    """A generation requested with ``nats req`` while two ``nats sub`` watch the bus: one with
    ``--headers-only`` on everything (replies too), one decoding every payload off the hot path;
    returns (the request's run, what each subscription printed)."""
    fp = swarm.fingerprint
    heads = Sub(ops, "sub", "kvasir.>", "_INBOX.>", "--headers-only")
    ignore = [a for subject in HOT_PATH for a in ("-I", subject)]
    readable = Sub(ops, "sub", "kvasir.>", "--translate", translate(), *ignore)
    subs = (heads, readable)
    try:
        for sub in subs:
            sub.wait_for(lambda t: "Kvasir-Kind: heartbeat" in t, "heartbeat (is the subscription live?)")
        argv, packed, shown = generate_argv(fp)
        req = ops.run(*argv, input=packed, stdin_from=shown, timeout=60)
        for sub in subs:
            sub.wait_for(lambda t: f'"kvasir.{fp}.ledger"' in t and f'"kvasir.{fp}.routing"' in t
                         and (sub is heads or ('"t": "lb"' in t and '"t": "rs"' in t)),
                         "ledger batch and routing statistics after the generation")
    finally:
        texts = [sub.stop() for sub in subs]
    return req, Run(heads.shown, 0, texts[0], ""), Run(readable.shown, 0, texts[1], "")


def test_generate_request_built_by_the_cli_streams_tokens_then_done(generation, swarm):
    req = generation[0]
    assert req.returncode == 0, req.text
    check_generate(req.text, swarm.fingerprint)
    record("req-generate", req.transcript())


def classify(msgs, fp: str):
    """(hot-path requests, their replies, other kvasir messages, the CLI's generate replies)."""
    hot = [m for m in msgs if re.fullmatch(rf"kvasir\.{fp}\.(x\.\d+\.\d+|n\.[A-Za-z0-9_-]+)", m.subject)]
    hot_replies = {m.reply for m in hot}
    cli_request = [m for m in msgs if m.subject == f"kvasir.{fp}.generate"]
    cli_inboxes = {m.reply for m in cli_request}
    other = [m for m in msgs if m.subject.startswith("kvasir.") and m not in hot and m not in cli_request]
    replies = [m for m in msgs if m.subject in hot_replies]
    generate_replies = [m for m in msgs if m.subject in cli_inboxes]
    return hot, replies, other, generate_replies


def check_sub(text: str, fp: str) -> None:
    msgs = parse_sub(text)
    hot, replies, other, generated = classify(msgs, fp)
    kinds = {m.headers.get("Kvasir-Kind") for m in other}
    # every message the swarm sent off the hot path says what it is
    assert all("Kvasir-Version" in m.headers and "Kvasir-Kind" in m.headers for m in other), \
        [m.block() for m in other if "Kvasir-Kind" not in m.headers]
    assert all(m.headers.get("Kvasir-Model") == fp for m in other)
    assert {"heartbeat", "routing_stats", "ledger_batch"} <= kinds, kinds
    for m in other:
        if m.headers["Kvasir-Kind"] == "heartbeat":
            assert m.subject == f"kvasir.{fp}.coverage.{m.headers['Kvasir-Node']}"
        if m.headers["Kvasir-Kind"] in ("ledger_batch", "routing_stats"):
            # signed facts: the two headers the trust docs name, and a dedupe id for the stream
            assert re.fullmatch(r"U[A-Z2-7]{55}", m.headers["Kvasir-Signer"])
            assert re.fullmatch(r"[A-Za-z0-9_-]{86}", m.headers["Kvasir-Sig"])
            assert m.headers["Nats-Msg-Id"]
    # the hot path: bundle (or per-expert) requests and their replies carry no headers
    assert hot and all(m.headers == {} for m in hot), [m.block() for m in hot if m.headers][:3]
    assert replies and all(m.headers == {} for m in replies), [m.block() for m in replies if m.headers][:3]
    assert all(m.reply for m in hot)
    if generated:  # the CLI's own inbox got the stream, headed
        assert {m.headers.get("Kvasir-Kind") for m in generated} == {"generated_token", "generation_done"}


def sub_excerpt(run: Run, fp: str) -> str:
    """The first message of each kind the subscription printed, verbatim, in their order."""
    msgs = parse_sub(run.stdout)
    hot, replies, other, generated = classify(msgs, fp)
    first_hot = hot[0] if hot else None
    picked, seen = [], set()
    for m in msgs:
        if m is first_hot:
            key = "hot"
        elif first_hot is not None and m.subject == first_hot.reply:
            key = "hot-reply"  # the reply to that request
        elif m in other or m in generated:
            key = m.headers.get("Kvasir-Kind")
        else:
            key = "generate" if m.subject == f"kvasir.{fp}.generate" else None
        if key and key not in seen:
            seen.add(key)
            picked.append(m)
    return f"$ {run.shown}\n" + "\n".join(m.block() for m in picked)


def test_sub_shows_headers_off_the_hot_path_and_none_on_it(generation, swarm):
    sub = generation[1]
    check_sub(sub.stdout, swarm.fingerprint)
    excerpt = sub_excerpt(sub, swarm.fingerprint)
    check_sub(excerpt, swarm.fingerprint)
    record("sub-headers", excerpt)


KIND_OF = {"heartbeat": "hb", "demand_map": "dm", "routing_stats": "rs", "ledger_batch": "lb"}


def check_sub_readable(text: str, fp: str) -> None:
    msgs = parse_sub(text)
    if msgs and not msgs[-1].body():
        msgs.pop()  # stopped while the translator ran for the last message
    msgs = [m for m in msgs if m.subject != f"kvasir.{fp}.generate"]  # the CLI's own request
    assert msgs and not [m for m in msgs if re.fullmatch(rf"kvasir\.{fp}\.(x\..*|n\..*)", m.subject)]
    kinds = set()
    for m in msgs:
        lines = m.body()
        assert len(lines) == 1, m.block()
        body = json.loads(lines[0])  # every payload off the hot path decodes as one record
        kind = m.headers["Kvasir-Kind"]
        kinds.add(kind)
        assert m.headers["Kvasir-Version"] == str(body["v"]) == "1", m.block()
        assert body["model"] == m.headers["Kvasir-Model"] == fp, m.block()
        if kind in KIND_OF:
            assert body["t"] == KIND_OF[kind], m.block()
        if kind == "heartbeat":
            assert body["node"] == m.headers["Kvasir-Node"] and m.subject.endswith("." + body["node"])
    assert {"heartbeat", "routing_stats", "ledger_batch"} <= kinds, kinds


def test_sub_with_translate_reads_every_message_off_the_hot_path(generation, swarm):
    sub = generation[2]
    check_sub_readable(sub.stdout, swarm.fingerprint)
    msgs = parse_sub(sub.stdout)
    picked, seen = [], set()
    for m in msgs:
        key = m.headers.get("Kvasir-Kind", m.subject)
        if key not in seen and m.body():
            seen.add(key)
            picked.append(m)
    excerpt = f"$ {sub.shown}\n" + "\n".join(m.block() for m in picked)
    check_sub_readable(excerpt, swarm.fingerprint)
    record("sub-readable", excerpt)


def test_micro_stats_count_the_generation(ops, swarm, generation):
    r = ops.run("micro", "stats", "kvasir-worker")
    assert r.returncode == 0, r.text
    check_micro_stats_worker(r.stdout, swarm.fingerprint)
    record("micro-stats-worker", r.transcript())
    stats = json.loads(ops.run("micro", "stats", "kvasir-backbone", "--json").stdout)
    [bb] = stats
    ep = {e["name"]: e for e in bb["endpoints"]}
    assert ep["dispatch"]["num_requests"] > 0 and ep["dispatch"]["num_errors"] == 0  # no fallback
    # every expert call the backbone made was answered by exactly one worker (no replicas here)
    workers = json.loads(ops.run("micro", "stats", "kvasir-worker", "--json").stdout)
    served = sum(e["num_requests"] for w in workers for e in w["endpoints"] if e["name"] == "experts")
    assert served == ep["dispatch"]["num_requests"], (served, ep["dispatch"])


# ---- the ledger stream -------------------------------------------------------------------------

def check_stream_info(text: str, fp: str) -> None:
    assert "Information for Stream KVASIR_LEDGER" in text, text
    assert re.search(r"Subjects: kvasir\.\*\.ledger, kvasir\.\*\.routing, kvasir\.\*\.quarantine", text), text
    # docs/trust.md: a replay past the stream's 10-minute duplicate window is still counted once
    assert re.search(r"Duplicate Window: 10m0s", text) and re.search(r"Messages: [1-9]", text), text
    assert re.search(r"Active Consumers: 1\b", text), text  # the market's durable consumer


def check_stream_view(text: str, fp: str) -> None:
    assert re.search(rf"Subject: kvasir\.{fp}\.ledger", text), text
    for h in ("Kvasir-Kind: ledger_batch", "Kvasir-Signer: U", "Kvasir-Sig: ", "Nats-Msg-Id: "):
        assert h in text, (h, text)
    body = json.loads(next(ln for ln in text.splitlines() if ln.startswith('{"v": 1, "t": "lb"')))
    assert body["model"] == fp and body["events"], body
    # the stream dedupes by the batch's own id, so a replayed batch is stored once
    headers = dict(re.findall(r"^\s+(Nats-Msg-Id|Kvasir-Batch|Kvasir-Events): (\S+)$", text, re.M))
    assert headers["Nats-Msg-Id"] == headers["Kvasir-Batch"] == body["batch_id"], headers
    assert int(headers["Kvasir-Events"]) == len(body["events"]), headers


def view_in_a_terminal(cli: Cli, *args: str, timeout: float = 20) -> Run:
    """``nats stream view`` pages on a terminal only: run it on a pseudo-terminal and stop it at
    its "Next Page?" question."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cli.argv(list(args)), stdin=slave, stdout=slave, stderr=slave, env=cli.env())
    os.close(slave)
    out = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end and b"Next Page?" not in out:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    text = out.decode("utf-8", "replace").replace("\r\n", "\n")
    text = text.split("\x1b", 1)[0]  # the page question's terminal codes
    return Run(cli.show(list(args)), 0, text.rstrip() + "\n", "")


def test_ledger_stream_info_and_view_show_signed_batches(ops, swarm, generation):
    fp = swarm.fingerprint
    r = ops.run("stream", "info", "KVASIR_LEDGER")
    assert r.returncode == 0, r.text
    check_stream_info(r.stdout, fp)
    record("stream-info", r.transcript())
    info = json.loads(ops.run("stream", "info", "KVASIR_LEDGER", "--json").stdout)
    assert info["config"]["subjects"] == ["kvasir.*.ledger", "kvasir.*.routing", "kvasir.*.quarantine"]

    view = view_in_a_terminal(ops, "stream", "view", "KVASIR_LEDGER", "1", "--subject", f"kvasir.{fp}.ledger",
                              "--translate", translate())
    check_stream_view(view.stdout, fp)
    record("stream-view", view.transcript())

    # the signature verifies over the payload bytes the CLI fetched from the stream
    got = json.loads(ops.run("stream", "get", "KVASIR_LEDGER", "--last-for", f"kvasir.{fp}.ledger",
                             "--json").stdout)
    import base64

    payload = base64.b64decode(got["data"])
    headers = _parse_header_block(base64.b64decode(got["hdrs"]))
    assert headers["Kvasir-Kind"] == "ledger_batch"
    # the key kvasir up's backbone signs with (its start-up log line) is the one the batch names
    [key] = {m[1] for m in map(re.compile(r"\"public_key\": \"(U[A-Z2-7]{55})\"").search, swarm.lines) if m}
    assert Verifier([key]).check(payload, headers) == key


def _parse_header_block(raw: bytes) -> dict[str, str]:
    lines = raw.decode().split("\r\n")
    assert lines[0].startswith("NATS/1.0")
    return dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
