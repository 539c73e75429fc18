"""The trust issue's attack table, run on a fresh swarm of real processes: one row per attack.

    python bench/attacks.py [--quick] [--attacks NAME[,NAME...]] [--repeat N] [--save]

Each attack starts its own nats-server (port 0) and whatever it needs (honest ``kvasir worker``
processes, a market, a backbone, the OpenAI API server), runs the attack with the project's own
helpers from ``tests/`` (the liars of ``tests/trust/liars.py``, the fake backbones of
``tests/market/fakes.py``), and measures what the issue bounds: tokens changed against the
monolithic run, credit forged, whether an honest node was quarantined, admission delay, memory,
and the time ratio of the same generation with and without the attacker. Attackers whose cost is
a time ratio (the sybils, the silent subscriber) run in processes of their own, so they do not
share the backbone's interpreter; those ratios are medians of ``--repeat`` alternating rounds,
each generation in a fresh backbone (as ``kvasir generate --nats`` runs one), and the load
average is printed beside them: the box may be shared.

Rows: ``attack``, ``what`` (the attack in words), ``measured`` (the figures), ``summary`` (them
in words), ``bound`` (what the issue allows), ``pass``, ``test`` (where a test pins it down).
Prints one JSON object; ``--save`` writes it to bench/results/ (``bench/report.py`` renders it in
docs/trust.md). Exit status 0 when every row passes, 1 otherwise.

``--quick``: the tiny test model, fewer runs and connections (a smoke test, minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402
import numpy as np  # noqa: E402

from kvasir_bus import codec  # noqa: E402
from kvasir_bus.codec import Holding  # noqa: E402
from kvasir_bus.connect import connect  # noqa: E402
from kvasir_bus.subjects import Subjects  # noqa: E402

N_SYBILS = 2000


# ------------------------------------------------------------------------------- the swarm

class Rig:
    """What every attack shares: the models (built once), a scratch directory, the options."""

    def __init__(self, args, tmp: Path):
        from synth.model import synth_model

        self.args, self.tmp = args, tmp
        self.quick = args.quick
        # the generation model: `small` as the issue ran it; --quick: the tests' tiny one with 48
        # experts and 8 a token, so a prefill step still has more calls than the probation
        if args.model:
            self.model = Path(args.model)
        elif args.quick:
            self.model = synth_model(tmp / "gen.gguf", arch="qwen3moe", preset="tiny", qtype="q4_k", seed=1,
                                     experts=48, experts_used=8)
        else:
            self.model = synth_model(tmp / "gen.gguf", arch="qwen3moe", preset="small", qtype="q4_k", seed=0)
        # the serving model (API attacks): tiny, a long context for streams that outlast the attack
        self.serve_model = synth_model(tmp / "serve.gguf", arch="qwen3moe", preset="tiny", qtype="q8_0", seed=1,
                                       ctx=16384)
        from backbone.model import Engine
        from kvasir_bus.fingerprint import model_fingerprint

        engine = Engine(self.model)
        self.cfg = engine.cfg
        self.fp = model_fingerprint(engine.reader)
        self.n_prompt, self.n_decode = (24, 8) if args.quick else (24, 48)  # the issue: 48 tokens
        self.prompt = np.random.default_rng(5).integers(0, self.cfg.n_vocab, self.n_prompt).tolist()
        self._mono = None

    def monolithic(self) -> list[int]:
        if self._mono is None:
            from backbone.generate import generate
            from backbone.model import Engine
            from backbone.sampling import Sampler, SamplerConfig

            self._mono = generate(Engine(self.model), self.prompt, self.n_decode, Sampler(SamplerConfig()),
                                  stop_on_eos=False).tokens
        return self._mono

    def log(self, name: str):
        return open(self.tmp / f"{name}.log", "a")


@contextlib.contextmanager
def bus():
    from kvasir_bus.server import EmbeddedNats

    server = EmbeddedNats(port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def honest_workers(rig: Rig, url: str, names=("honest",)):
    """``kvasir worker`` processes holding every expert, each heard before this returns."""
    from launch.swarm import spawn_worker, wait_for_nodes

    procs = [spawn_worker(url, name, ["--model", str(rig.model), "--layer", "all", "--experts",
                                      f"0-{rig.cfg.n_expert - 1}"], log_file=rig.log(name), heartbeat_s=0.5)
             for name in names]
    try:
        asyncio.run(wait_for_nodes(url, rig.fp, set(names), procs=procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


def backbone_cfg(rig: Rig, url: str, **dispatch):
    from backbone.dispatch import DispatchConfig
    from backbone.service import BackboneConfig

    return BackboneConfig(model_path=str(rig.model), nats_url=url, market=False, serve_manifest=False,
                          spool="off", dispatch=DispatchConfig(**dispatch))


def generate_in(rig: Rig, engine, n: int | None = None) -> tuple[list[int], float]:
    """One greedy generation on ``engine`` (its experts as the running service set them):
    the tokens and its wall time."""
    from backbone.generate import generate
    from backbone.sampling import Sampler, SamplerConfig

    t0 = time.perf_counter()
    tokens = generate(engine, rig.prompt, n or rig.n_decode, Sampler(SamplerConfig()), stop_on_eos=False).tokens
    return tokens, time.perf_counter() - t0


def changed(tokens: list[int], reference: list[int]) -> int:
    return sum(a != b for a, b in zip(tokens, reference)) + abs(len(tokens) - len(reference))


def wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


def row(attack: str, what: str, measured: dict, summary: str, bound: str, ok: bool, test: str) -> dict:
    return {"attack": attack, "what": what, "measured": measured, "summary": summary, "bound": bound,
            "pass": bool(ok), "test": test}


def closed_by_server(socks: list[socket.socket], within_s: float) -> list[float | None]:
    """When (perf_counter) the server closed each socket (EOF or reset), None if it had not
    within ``within_s``."""
    import selectors

    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    closed: list[float | None] = [None] * len(socks)
    deadline = time.perf_counter() + within_s
    left = len(socks)
    while left and time.perf_counter() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                closed[key.data] = time.perf_counter()
                sel.unregister(key.fileobj)
                left -= 1
    sel.close()
    return closed


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ attackers in their own process

def attacker_main(argv: list[str]) -> int:
    """``attacks.py --attacker KIND URL MODEL [N LAYERS EXPERTS]``: a stranger in a process of its own.

    ``silent``: subscribes to every dispatch subject (``x.>``) and every node subject (``n.>``) of
    the model and never answers. ``sybils``: heartbeats ``N`` fake nodes announcing every expert
    (and bundles), each once a second, sustained; they subscribe to nothing. Prints ``ready``
    once subscribed (or once the first round of heartbeats is out), then runs until killed."""
    from kvasir_bus import logs

    logs.configure("error")  # stdout carries "ready" only
    kind, url, model = argv[:3]
    subjects = Subjects(model)

    async def run() -> None:
        nc = await connect(url, name=f"kvasir-bench-{kind}")
        if kind == "silent":
            async def swallow(msg) -> None:
                pass
            await nc.subscribe(subjects.dispatch_all(), cb=swallow)
            await nc.subscribe(f"{subjects.root}.n.>", cb=swallow)
            await nc.flush()
            print("ready", flush=True)
            await asyncio.Event().wait()
        n, layers, experts = (int(x) for x in argv[3:6])
        holdings = tuple(Holding(layer, 0, experts) for layer in range(layers))
        # Each beat other bytes (its count), as live nodes send: nothing for the backbone to dedupe.
        # Encoded once, ahead, so the attacker's own CPU (on this same box) stays small.
        beats = [[(subjects.coverage(f"sybil-{i:04d}"), codec.Heartbeat(
            model=model, node=f"sybil-{i:04d}", holdings=holdings, budget_bytes=0, load=0.0, served=beat,
            version="0.1.0", kernel="fake", sent_at=time.time(), bundles=True).encode()) for i in range(n)]
            for beat in range(4)]
        first, beat = True, 0
        while True:
            t0 = time.monotonic()
            beat += 1
            for i, (subject, payload) in enumerate(beats[beat % len(beats)]):
                await nc.publish(subject, payload)
                if i % 200 == 199:
                    await asyncio.sleep(0)  # spread over the second, as 2,000 separate nodes would
            await nc.flush()
            if first:
                print("ready", flush=True)
                first = False
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


@contextlib.contextmanager
def attacker(rig: Rig, kind: str, url: str, *extra):
    proc = subprocess.Popen([sys.executable, __file__, "--attacker", kind, url, rig.fp, *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=rig.log(f"attacker-{kind}"), text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} attacker did not start (see {rig.tmp}/attacker-{kind}.log)")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_ratio(rig: Rig, url: str, attack_cm, *, ready=None, repeat: int) -> dict:
    """Generations in fresh backbones, alternating without and with ``attack_cm()`` running, the
    order turned every round (without-with, with-without: neither side always goes first after a
    pause): the median time of each, their ratio, the median of the per-round ratios, the load."""
    from backbone.model import Engine
    from backbone.service import BackboneService

    base, under, ratios, loads, bad, cpu = [], [], [], [], 0, ([], [])
    engine = Engine(rig.model)
    for r in range(repeat):
        pair = [0.0, 0.0]
        for with_attack in ((False, True) if r % 2 == 0 else (True, False)):
            cm = attack_cm() if with_attack else contextlib.nullcontext()
            with cm:
                with BackboneService(engine, backbone_cfg(rig, url)) as backbone:
                    if with_attack and ready is not None:
                        ready(backbone)
                    c0 = resource.getrusage(resource.RUSAGE_SELF)
                    tokens, seconds = generate_in(rig, engine)
                    c1 = resource.getrusage(resource.RUSAGE_SELF)
                    cpu[with_attack].append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
            bad += changed(tokens, rig.monolithic())
            pair[with_attack] = seconds
        base.append(pair[0])
        under.append(pair[1])
        ratios.append(pair[1] / pair[0])
        loads.append(load_avg())
    return {"rounds": repeat, "seconds_without": round(statistics.median(base), 4),
            "seconds_with": round(statistics.median(under), 4),
            "time_ratio": round(statistics.median(under) / statistics.median(base), 3),
            "round_ratios": [round(r, 3) for r in ratios], "median_round_ratio": round(statistics.median(ratios), 3),
            # the backbone's own CPU seconds for the generation (this process: no attacker runs in it)
            "cpu_s_without": round(statistics.median(cpu[0]), 4), "cpu_s_with": round(statistics.median(cpu[1]), 4),
            "cpu_ratio": round(statistics.median(cpu[1]) / statistics.median(cpu[0]), 3),
            "tokens_changed": bad, "load_avg_1m": loads}


# -------------------------------------------------------------------------------- the attacks

def attack_liar_first_reply(rig: Rig) -> list[dict]:
    """The issue's 12 fresh backbone runs, half per-expert and half with bundles, a liar that
    lies from its first reply (zeros, x(1+1e-3), noise in turn) racing one honest worker."""
    from backbone.model import Engine
    from backbone.service import BackboneService
    from tests.trust import liars

    runs = 4 if rig.quick else 12
    lies = [liars.zeros, liars.scaled, liars.noise]
    total, diff, won, caught = 0, 0, 0, 0
    with bus() as server, honest_workers(rig, server.url):
        for run in range(runs):
            bundles = run % 2 == 1
            engine = Engine(rig.model)
            with liars.BusLiar(rig.model, server.url, lies[run % 3], node=f"liar{run}", bundles=bundles) as liar:
                with BackboneService(engine, backbone_cfg(rig, server.url, bundles=bundles)) as backbone:
                    if bundles:
                        wait(lambda: {"honest", liar.node} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                             "both bundle nodes heard")
                    tokens, _ = generate_in(rig, engine)
                    stats = backbone.stats.to_dict()
            total += len(rig.monolithic())
            diff += changed(tokens, rig.monolithic())
            won += stats["per_node"].get(liar.node, {}).get("calls", 0)
            caught += liar.node in stats["quarantined"]
    return [row("liar-first-reply", f"a liar lying from its first reply (zeros, x(1+1e-3), noise) racing an honest "
                f"worker, default --audit 0.1, {runs} fresh backbones (half per-expert, half bundles)",
                {"runs": runs, "tokens_changed": diff, "tokens": total, "liar_calls_won": won, "liars_quarantined": caught},
                f"{diff} of {total} tokens changed; the liars won {won} calls, {caught} of {runs} quarantined",
                "0 tokens changed", diff == 0 and won > 0,
                "tests/trust/test_audit_bound.py::test_a_liar_from_its_first_reply_changes_no_token_in_fresh_backbone_runs")]


def attack_sleeper(rig: Rig) -> list[dict]:
    """A sleeper (honest for 60 replies, then noise) beside one honest replica, 8 generations on
    one backbone, default audit."""
    from backbone.model import Engine
    from backbone.service import BackboneService
    from tests.trust import liars

    gens = 4 if rig.quick else 8
    diff, total = 0, 0
    with bus() as server, honest_workers(rig, server.url):
        engine = Engine(rig.model)
        with liars.BusLiar(rig.model, server.url, liars.sleeper(60), node="sleeper") as sleeper:
            with BackboneService(engine, backbone_cfg(rig, server.url)) as backbone:
                wait(lambda: {"sleeper", "honest"} <= set(backbone.dispatch.coverage.bundle_holders(0, 0)),
                     "both replicas heard")
                for _ in range(gens):
                    tokens, _ = generate_in(rig, engine)
                    diff += changed(tokens, rig.monolithic())
                    total += len(rig.monolithic())
                stats = backbone.stats.to_dict()
        lies = sleeper.lies
    caught = "sleeper" in stats["quarantined"]
    return [row("sleeper", f"a sleeper (honest for 60 replies, then noise) beside one honest replica, {gens} "
                "generations, default audit",
                {"generations": gens, "tokens_changed": diff, "tokens": total, "lies_told": lies,
                 "sleeper_quarantined": caught, "disputes": stats["totals"]["disputes"],
                 "honest_quarantined": "honest" in stats["quarantined"]},
                f"{diff} of {total} tokens changed; {lies} lies told; sleeper quarantined: {'yes' if caught else 'no'}",
                "0 tokens changed, the sleeper quarantined", diff == 0 and caught and lies > 0,
                "tests/trust/test_replicas_check.py::"
                "test_a_sleeper_beside_an_honest_replica_is_caught_by_the_race_and_changes_no_token")]


def attack_impersonation(rig: Rig) -> list[dict]:
    """A liar answering under the honest worker's name, on an open bus: the honest worker is named
    by its key (a self-certifying name, ``--node-key``), the liar answers every per-expert
    request, and in a second generation every bundle too (it subscribes to the honest node's own
    bundle subject and heartbeats as it), with noise and no proof; and under enrolment with reply
    proofs (the test's own run, on creds)."""
    from backbone.model import Engine
    from backbone.service import BackboneService
    from kvasir_bus.attribution import NodeKey
    from launch.swarm import spawn_worker, wait_for_nodes
    from tests.trust import liars

    out = []
    key = NodeKey.fresh()
    path = key.write(rig.tmp / "honest.seed")
    runs = []
    with bus() as server:
        proc = spawn_worker(server.url, key.name, ["--model", str(rig.model), "--layer", "all", "--experts",
                                                   f"0-{rig.cfg.n_expert - 1}"], log_file=rig.log("honest"),
                            heartbeat_s=0.5, extra=["--node-key", str(path)])
        try:
            asyncio.run(wait_for_nodes(server.url, rig.fp, {key.name}, procs=[proc]))
            for bundles in (False, True):
                engine = Engine(rig.model)
                with liars.BusLiar(rig.model, server.url, liars.noise, node=key.name, bundles=bundles) as liar:
                    with BackboneService(engine, backbone_cfg(rig, server.url, bundles=bundles)) as backbone:
                        if bundles:
                            wait(lambda: key.name in backbone.dispatch.coverage.bundle_holders(0, 0),
                                 "the backbone to hear the honest node's bundles")
                        tokens, _ = generate_in(rig, engine)
                        stats = backbone.stats.to_dict()
                runs.append({"bundles": bundles, "tokens_changed": changed(tokens, rig.monolithic()),
                             "tokens": len(rig.monolithic()), "liar_replies": liar.sent,
                             "forged": stats["totals"]["forged"],
                             "honest_quarantined": key.name in stats["quarantined"],
                             "honest_calls": stats["per_node"].get(key.name, {}).get("calls", 0)})
        finally:
            proc.stop()
    diff = sum(r["tokens_changed"] for r in runs)
    total = sum(r["tokens"] for r in runs)
    framed = any(r["honest_quarantined"] for r in runs)
    out.append(row("impersonation (open bus)", "a liar answering under the honest worker's self-certifying name "
                   "(named by its key, replies proved), on an open bus, default audit: per-expert requests, "
                   "then bundles too (subscribed to the honest node's bundle subject, heartbeating as it)",
                   {"name_bits": 130, "runs": runs, "tokens_changed": diff, "tokens": total,
                    "honest_quarantined": framed},
                   f"{diff} of {total} tokens changed; honest node quarantined: {'yes' if framed else 'no'}; "
                   f"forged replies dropped: {runs[0]['forged']} per-expert, {runs[1]['forged']} bundles (the "
                   f"liar answered {runs[0]['liar_replies']} and {runs[1]['liar_replies']} calls); the honest node "
                   f"won {runs[0]['honest_calls']} and {runs[1]['honest_calls']} calls",
                   "0 tokens changed, the honest node not quarantined, its wins kept",
                   diff == 0 and not framed and all(r["forged"] > 0 and r["honest_calls"] > 0 for r in runs),
                   "tests/trust/test_impersonation.py::"
                   "test_an_impersonator_on_an_open_bus_changes_no_token_and_never_gets_the_honest_node_quarantined"))
    # under enrolment, with the deployment's reply secret: the test's own run (creds, JWTs, enrolment)
    import pytest

    from tests.net import test_enrol_liar

    with pytest.MonkeyPatch.context() as mp:
        scratch = Path(tempfile.mkdtemp(dir=rig.tmp))
        mp.setenv("XDG_STATE_HOME", str(scratch / "state"))
        try:
            test_enrol_liar.test_a_liar_under_an_honest_nodes_name_never_gets_it_quarantined(
                True, rig.serve_model, scratch, mp)
            held, why = True, ""
        except (AssertionError, Exception) as exc:  # noqa: BLE001 (reported in the row)
            held, why = False, f"{type(exc).__name__}: {str(exc)[:200]}"
    out.append(row("impersonation (enrolled, reply proofs)", "an enrolled liar answering under an honest enrolled "
                   "node's name, the backbone holding the reply secret (kvasir creds, real nats-server with JWTs)",
                   {"logits_equal_monolithic": held, "honest_quarantined": not held, "error": why},
                   "logits equal to the monolithic run, honest node not quarantined, the forged replies counted"
                   if held else f"failed: {why}",
                   "0 tokens changed, the honest node not quarantined", held,
                   "tests/net/test_enrol_liar.py::test_a_liar_under_an_honest_nodes_name_never_gets_it_quarantined"))
    return out


def attack_forged_records(rig: Rig) -> list[dict]:
    """Forged routing + ledger batches (2,000 events of 1,000 rows for "evil") and a forged
    quarantine naming the honest node, unsigned (also under a made-up backbone name) and signed
    by an unknown key, into a market that trusts the real backbone's key."""
    from kvasir_bus import market_codec as mc
    from kvasir_bus.signing import Signer
    from market.service import Market
    from tests.market.fakes import FP, FakeBackbone, make_manifest, stream_read
    from tests.trust.test_market_attacks import config
    from tests.trust.test_signed_facts import S, SignedBackbone

    signer = Signer.fresh()

    async def go(url: str):
        nc = await connect(url, name="market")
        market = await Market(nc, config(rig.tmp / "forged.db", trusted_backbones=(signer.public_key,))).start()
        bb = await SignedBackbone(url, make_manifest(), signer).start()
        fakes = [await FakeBackbone(url, make_manifest()).start(),  # the real backbone's name, no key
                 await FakeBackbone(url, make_manifest(), node="made-up").start(),  # a made-up name
                 await SignedBackbone(url, make_manifest(), Signer.fresh()).start()]  # a key nobody trusts
        try:
            await bb.ledger(mc.LedgerBatch(FP, "backbone", "real-1", (mc.LedgerEvent("real:1", "honest", 0, 3, 7, 1.0),)))
            for i, fake in enumerate(fakes):
                await fake.ledger(mc.LedgerBatch(FP, fake.node, f"forged-{i}", tuple(
                    mc.LedgerEvent(f"evil:{i}:{k}", "evil", 0, k % 24, 1000, 1.0) for k in range(2000))))
                q = mc.Quarantine(FP, "honest", 0, 3, "ggml", True, 1.0, 1.0)
                await fake._store(S.quarantine(), q.encode(), f"q-forged-{i}")
            await stream_read(bb.nc, timeout=60)
            st = await market.status(FP)
            return ({t.node: t.rows for t in st.totals}, {t.node: t.reward for t in st.totals},
                    "honest" in market.models[FP].coverage.banned or "honest" in st.quarantined,
                    market.unsigned_refused)
        finally:
            for peer in (*fakes, bb):
                await peer.stop()
            await market.stop()
            await nc.close()

    with bus() as server:
        rows, reward, framed, refused = asyncio.run(asyncio.wait_for(go(server.url), 120))
    forged = rows.get("evil", 0)
    return [row("forged ledger/routing/quarantine", "forged routing + ledger batches (3 x 2,000 events of 1,000 rows "
                "for \"evil\") and forged quarantines of the honest node: unsigned under the backbone's name, "
                "unsigned under a made-up name, signed by an unknown key; the market trusts the real key",
                {"rows_forged": forged, "reward_forged": reward.get("evil", 0.0), "honest_rows": rows.get("honest", 0),
                 "honest_quarantined": framed, "records_refused": refused},
                f"{forged} rows credited to the forger, honest node quarantined: {'yes' if framed else 'no'}, "
                f"{refused} records refused; the real backbone's 7 rows counted: {'yes' if rows.get('honest') == 7 else 'no'}",
                "0 rows forged, the honest node not quarantined", forged == 0 and not framed and rows.get("honest") == 7,
                "tests/trust/test_signed_facts.py::test_forged_routing_ledger_and_quarantine_are_refused_and_signed_ones_count")]


def attack_sybils(rig: Rig) -> list[dict]:
    """2,000 fake nodes heartbeating once a second (every expert, bundles), sustained, beside
    one honest worker: the time of the same generation with and without them (fresh backbones,
    alternating), and what the backbone holds for them (tracemalloc over the time it hears them,
    as tests/trust/test_sybils.py measures it, here on the real bus)."""
    import tracemalloc

    from backbone.model import Engine
    from backbone.service import BackboneService

    n = 200 if rig.quick else N_SYBILS
    repeat = rig.args.repeat
    extra = (n, rig.cfg.n_layer, rig.cfg.n_expert)
    with bus() as server, honest_workers(rig, server.url):
        def heard(backbone):
            wait(lambda: backbone.dispatch.coverage.bundle_nodes >= n, f"the backbone hearing {n} sybils", 60)
        timing = time_ratio(rig, server.url, lambda: attacker(rig, "sybils", server.url, *extra), ready=heard,
                            repeat=repeat)
        # memory: one backbone, warm (a generation), then what it allocates while it hears them
        engine = Engine(rig.model)
        with BackboneService(engine, backbone_cfg(rig, server.url)) as backbone:
            generate_in(rig, engine)
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            with attacker(rig, "sybils", server.url, *extra):
                heard(backbone)
                time.sleep(2.0)  # two more rounds of their heartbeats: sustained, not just the first
                held = tracemalloc.get_traced_memory()[0] - before
                nodes = backbone.dispatch.coverage.bundle_nodes
            tracemalloc.stop()
    grew = round(held / 2**20, 2)
    ok = timing["time_ratio"] <= 1.2 and held < 20e6 and timing["tokens_changed"] == 0
    return [row("sybils", f"{n} fake nodes heartbeating once a second (every expert, bundles), sustained, beside "
                "one honest worker; the same generation with and without them, fresh backbones",
                {"sybils": n, "nodes_heard": nodes, **timing, "held_mib": grew},
                f"time x{timing['time_ratio']} (median of {repeat} rounds; {timing['seconds_without']} s -> "
                f"{timing['seconds_with']} s; the backbone's CPU x{timing['cpu_ratio']}), the backbone holds "
                f"{grew} MiB for them, {timing['tokens_changed']} tokens changed",
                "time at most 1.2x, memory at most 20 MB", ok,
                "tests/trust/test_sybils.py::test_two_thousand_silent_sybils_cost_under_20_mb_and_two_bundles_a_step")]


def attack_silent(rig: Rig) -> list[dict]:
    """A subscriber on every dispatch subject (``x.>``) and node subject (``n.>``) that never
    answers, with no worker and with one honest worker: the same generation's time with and
    without it, each in a fresh backbone."""
    repeat = rig.args.repeat
    out = []
    for workers in (0, 1):
        with bus() as server, (honest_workers(rig, server.url) if workers else contextlib.nullcontext()):
            timing = time_ratio(rig, server.url, lambda: attacker(rig, "silent", server.url), repeat=repeat)
        ok = timing["time_ratio"] <= 2.0 and timing["tokens_changed"] == 0
        out.append(row(f"silent subscriber ({'one worker' if workers else 'no workers'})",
                       f"a subscriber on x.> and n.> that never answers, {'beside one honest worker' if workers else 'no workers'}; "
                       "the same generation with and without it, fresh backbones",
                       {"workers": workers, **timing},
                       f"time x{timing['time_ratio']} (median of {repeat} rounds; {timing['seconds_without']} s -> "
                       f"{timing['seconds_with']} s; the backbone's CPU x{timing['cpu_ratio']}), "
                       f"{timing['tokens_changed']} tokens changed",
                       "time at most 2x", ok,
                       "tests/trust/test_silence.py::test_a_subscriber_that_never_answers_costs_no_timeout"))
    return out


def attack_volunteer_budget(rig: Rig) -> list[dict]:
    """A volunteer request with a budget of 2^63 - 1 bytes."""
    from tests.market.fakes import FP
    from tests.market.test_service import Swarm

    async def go(url: str):
        swarm = await Swarm(url, rig.tmp / "volunteer.db").start()
        try:
            w = await swarm.worker("greedy", budget=(1 << 63) - 1)
            lay = swarm.market.models[FP].layout
            model_bytes = lay.n_expert * sum(lay.expert_bytes)
            node = next(n for n in (await swarm.market.status(FP)).nodes if n.node == "greedy")
            return w.assignment.bytes, model_bytes, node.budget_bytes
        finally:
            await swarm.stop()

    with bus() as server:
        assigned, model_bytes, booked = asyncio.run(asyncio.wait_for(go(server.url), 60))
    return [row("volunteer budget 2^63-1", "a volunteer offering 2^63 - 1 bytes",
                {"assigned_bytes": assigned, "model_bytes": model_bytes, "budget_booked": booked},
                f"assigned {assigned} of the model's {model_bytes} bytes; the books keep a budget of {booked}",
                "at most the model's size", assigned <= model_bytes and booked <= model_bytes,
                "tests/market/test_service.py::test_a_volunteer_budget_past_the_model_is_capped_at_the_models_size")]


def _serving(rig: Rig, url: str, **sched):
    from backbone.model import Engine
    from backbone.scheduler import SchedulerConfig
    from backbone.server_http import ServerConfig, ServerThread
    from backbone.tokenizer import Tokenizer
    from kvasir_bus.fingerprint import model_fingerprint

    engine = Engine(rig.serve_model)
    fp = model_fingerprint(engine.reader)
    cfg = ServerConfig(port=0, model_name="tiny", bus_model=fp, bus_url=url, node="bb",
                       scheduler=SchedulerConfig(**sched))
    return ServerThread(engine, Tokenizer(rig.serve_model), cfg), fp


def attack_reply_subjects(rig: Rig) -> list[dict]:
    """Generate requests whose reply subject is a service subject (quarantine, ledger, a
    worker's node subject, the market's status, a $ subject)."""
    from backbone.generate_bus import generate_all, new_request
    from kvasir_bus.wire import encode, headers_for

    with bus() as server:
        srv, fp = _serving(rig, server.url)
        S = Subjects(fp)
        targets = [S.quarantine(), S.ledger(), S.node("w1"), S.status(), S.dispatch(0, 0), "$SYS.REQ.SERVER.PING"]

        async def go():
            watcher = await connect(server.url, "watcher")
            seen = []

            async def saw(msg):
                seen.append(msg.subject)
            for subject in targets[:-1]:
                await watcher.subscribe(subject, cb=saw)
            await watcher.flush()
            attacker_nc = await connect(server.url, "attacker")
            for _ in range(10):
                for subject in targets:
                    req = new_request([1, 2, 3], 8, stop_on_eos=False)
                    await attacker_nc.publish(S.generate(), encode(req), reply=subject, headers=headers_for(req))
            await attacker_nc.flush()
            client = await connect(server.url, "honest")
            tokens, _, done = await generate_all(client, fp, new_request([1, 2, 3], 8, stop_on_eos=False))
            await watcher.flush()
            for nc in (watcher, attacker_nc, client):
                await nc.close()
            return seen, tokens, done

        with srv:
            seen, tokens, done = asyncio.run(asyncio.wait_for(go(), 120))
    sent = 10 * len(targets)
    return [row("reply-subject abuse", f"{sent} generate requests whose reply subject is a service subject "
                "(quarantine, ledger, a node's subject, market status, an expert's subject, $SYS)",
                {"requests": sent, "messages_on_service_subjects": len(seen), "honest_tokens": len(tokens)},
                f"{len(seen)} messages published on service subjects; the next honest request got "
                f"{len(tokens)} of 8 tokens",
                "0 messages on service subjects", not seen and len(tokens) == 8 and done is not None,
                "tests/serve/test_reply_subjects.py::test_tokens_are_never_published_on_a_service_subject")]


def attack_cancel(rig: Rig) -> list[dict]:
    """A stranger cancels a running stream with its request id (which an observer can read),
    with and without a guessed secret."""
    from backbone.generate_bus import generate, new_request
    from kvasir_bus import generate_codec as gc
    from kvasir_bus.wire import encode, headers_for

    n = 100 if rig.quick else 200
    with bus() as server:
        srv, fp = _serving(rig, server.url, max_active=1)

        async def go():
            victim, stranger = await connect(server.url, "victim"), await connect(server.url, "stranger")
            req = new_request([1, 2, 3], n, stop_on_eos=False)
            got, done, cancels = 0, None, 0
            async for rec in generate(victim, fp, req):
                if isinstance(rec, gc.GenerateToken):
                    got += 1
                    if got in (2, 10, 50):  # mid-stream, three times: the id alone, and a guessed secret
                        for token in ("", "guess", "0" * 64):
                            c = gc.GenerateCancel(req.request_id, token) if token else gc.GenerateCancel(req.request_id)
                            await stranger.publish(Subjects(fp).generate_cancel(), encode(c), headers=headers_for(c))
                            cancels += 1
                        await stranger.flush()
                else:
                    done = rec
            for nc in (victim, stranger):
                await nc.close()
            return got, done, cancels

        with srv:
            got, done, cancels = asyncio.run(asyncio.wait_for(go(), 300))
            refused = srv.server.bus.refused_cancels
    return [row("cancel with another's id", f"a stranger sends {cancels} cancels of a running {n}-token stream by its "
                "request id (no secret, guessed secrets)",
                {"tokens_asked": n, "tokens_received": got, "done": done is not None, "cancels_sent": cancels,
                 "cancels_refused": refused},
                f"the victim got {got} of {n} tokens and its done record; {refused} of {cancels} cancels refused",
                "the victim's stream unchanged", got == n and done is not None and refused == cancels,
                "tests/serve/test_bus_cancel.py::test_a_cancel_drops_a_queued_request_and_strangers_cancels_are_ignored")]


def attack_flood(rig: Rig) -> list[dict]:
    """One client sends 200 long requests on one connection and keeps its inbox open; another
    client then asks for a short one: how long until it is admitted (its first token), and once
    the flooder leaves without a word, how long until its streams are gone. Twice: the scheduler
    as ``kvasir serve`` runs it (memory decides how many run), and with 4 slots, where every slot
    is the flood's and the next one frees when a flood stream ends."""
    from backbone.generate_bus import generate, new_request
    from backbone.scheduler import MAX_ACTIVE
    from kvasir_bus import generate_codec as gc
    from kvasir_bus.wire import encode, headers_for

    flood, long = 200, 2000
    out = []
    for slots in (MAX_ACTIVE, 4):
        with bus() as server:
            srv, fp = _serving(rig, server.url, max_active=slots, max_queue=64)
            sched = srv.server.scheduler

            async def go():
                flooder, other = await connect(server.url, "flooder"), await connect(server.url, "other")
                inbox = flooder.new_inbox()

                async def keep(msg) -> None:  # its inbox stays open: it reads and ignores
                    pass
                await flooder.subscribe(inbox, cb=keep)
                for _ in range(flood):
                    req = new_request([1, 2, 3], long, stop_on_eos=False)
                    await flooder.publish(Subjects(fp).generate(), encode(req), reply=inbox, headers=headers_for(req))
                await flooder.flush()
                await asyncio.to_thread(wait, lambda: sched.snapshot()["active"] >= min(slots, 4)
                                        and sum(sched.snapshot()[k] for k in ("active", "queued")) >= min(flood, slots),
                                        "the flood running")
                snap = sched.snapshot()
                t0 = time.perf_counter()
                admitted = None
                async for rec in generate(other, fp, new_request([4, 5, 6], 4, stop_on_eos=False), timeout_s=120):
                    if admitted is None and isinstance(rec, gc.GenerateToken):
                        admitted = time.perf_counter() - t0
                t1 = time.perf_counter()
                await flooder.close()  # gone without a cancel
                await asyncio.to_thread(wait, lambda: sched.snapshot()["queued"] == 0 and sched.snapshot()["active"] == 0,
                                        "the flooder's streams dropped", 60)
                gone = time.perf_counter() - t1
                await other.close()
                return snap, admitted, gone

            with srv:
                snap, admitted, gone = asyncio.run(asyncio.wait_for(go(), 300))
        label = "serve's scheduler" if slots == MAX_ACTIVE else f"{slots} slots"
        out.append(row(f"client flood ({label})", f"one client sends {flood} requests of {long} tokens on one "
                       f"connection (at most {slots} running, a queue of 64), then another client asks for 4 tokens; "
                       "then the flooder leaves without a word",
                       {"flood_requests": flood, "max_active": slots, "flood_running": snap["active"],
                        "flood_queued": snap["queued"], "admission_s": round(admitted, 3),
                        "flood_dropped_after_leaving_s": round(gone, 3)},
                       f"the flood had {snap['active']} streams running and {snap['queued']} waiting; the other "
                       f"client's first token after {admitted:.2f} s; the flood's streams gone {gone:.2f} s after it left",
                       "admission within 2 s; a gone client's requests dropped at once", admitted <= 2.0 and gone <= 2.0,
                       "tests/serve/test_fair_share.py::" + (
                           "test_a_flood_keeps_its_share_of_the_queue_and_the_next_slot_goes_to_another_client"
                           if slots == MAX_ACTIVE else  # every slot the flood's: one of its streams is parked
                           "test_a_flooders_long_streams_are_parked_for_another_clients_request_and_change_no_token")))
    return out


def attack_slow_http(rig: Rig) -> list[dict]:
    """Slowloris on the OpenAI API (defaults: 10 s for the headers): connections that send a
    request's start and never finish it, and one whose body is shorter than its Content-Length;
    and idle connections to the weights server past its per-address cap."""
    import urllib.request

    from backbone import weights_http
    from backbone.http_guard import GuardConfig
    from backbone.model import Engine
    from backbone.scheduler import SchedulerConfig
    from backbone.server_http import ServerConfig, ServerThread
    from backbone.tokenizer import Tokenizer

    n = 100 if rig.quick else 500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * n), hard))
    guard = GuardConfig()
    cfg = ServerConfig(port=0, model_name="tiny", scheduler=SchedulerConfig(max_active=4), guard=guard)
    out = []
    with ServerThread(Engine(rig.serve_model), Tokenizer(rig.serve_model), cfg) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        socks = []
        for i in range(n):
            s = socket.create_connection((host, int(port)), timeout=30)
            if i == 0:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"pro")
            else:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never \r\n\r\n
            socks.append(s)
        t0 = time.perf_counter()
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            healthy = r.status == 200
        closed_at = closed_by_server(socks, guard.header_timeout_s + guard.body_timeout_s + 15)
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            healthy = healthy and r.status == 200
        for s in socks:
            s.close()
        closed = sum(t is not None for t in closed_at)
        headers_s = max((t - t0 for t in closed_at[1:] if t is not None), default=None)
        body_s = closed_at[0] - t0 if closed_at[0] is not None else None
        slow_closed = srv.server.http_limits.slow_closed
    out.append(row("slow HTTP clients", f"{n} connections to the OpenAI API that send a request's start and never "
                   "finish it (one: a body shorter than its Content-Length)",
                   {"connections": n, "closed_by_server": closed, "slow_closed_counted": slow_closed,
                    "headers_unfinished_closed_within_s": round(headers_s, 2) if headers_s is not None else None,
                    "body_short_closed_after_s": round(body_s, 2) if body_s is not None else None,
                    "header_timeout_s": guard.header_timeout_s, "body_timeout_s": guard.body_timeout_s,
                    "health_answered": healthy},
                   f"{closed} of {n} closed by the server: the unfinished headers within {headers_s or 0:.1f} s "
                   f"(header timeout {guard.header_timeout_s:g} s), the short body after {body_s or 0:.1f} s (body "
                   f"timeout {guard.body_timeout_s:g} s); /health answered meanwhile: {'yes' if healthy else 'no'}",
                   "every one closed at its timeout (headers: within 5 s past it); the server keeps answering",
                   closed == n and healthy and headers_s is not None and headers_s <= guard.header_timeout_s + 5,
                   "tests/serve/test_slow_clients.py::test_a_client_that_never_finishes_its_headers_is_closed"))
    # the weights server: idle connections from one address past its cap get no thread
    blob = rig.tmp / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    cap = weights_http.MAX_CONNECTIONS_PER_ADDRESS
    m = cap + 40  # as the test does; far more at once overflows the listen backlog (the kernel's, not the server's)
    with weights_http.WeightsServer(blob, port=0, host="127.0.0.1") as ws:
        before = threading.active_count()
        idle = []
        for i in range(m):
            s = socket.create_connection(("127.0.0.1", ws.port), timeout=30)
            s.sendall(b"GET")  # a slowloris start, never finished
            idle.append(s)
        with contextlib.suppress(RuntimeError):
            wait(lambda: ws.refused_connections >= m - cap, "the weights server refusing past its cap", 30)
        grew = threading.active_count() - before
        refused = ws.refused_connections
        for s in idle:
            s.close()
        answered = False
        for _ in range(200):  # the closed ones leave the books as their threads see EOF
            with socket.create_connection(("127.0.0.1", ws.port), timeout=10) as s:
                s.sendall(b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                with contextlib.suppress(OSError):
                    if s.recv(16).startswith(b"HTTP/1."):
                        answered = True
                        break
            time.sleep(0.05)
    out.append(row("weights server, idle connections", f"{m} idle connections to the weights server from one "
                   f"address (its cap: {cap})",
                   {"connections": m, "cap": cap, "threads_grew": grew, "refused_at_accept": refused,
                    "answered_after": answered},
                   f"{grew} threads for {m} connections; {refused} closed at accept; a request after them answered: "
                   f"{'yes' if answered else 'no'}",
                   "at most the cap's threads; the server still answers", grew <= cap + 6 and refused >= m - cap - 4
                   and answered,
                   "tests/trust/test_weights_slow_clients.py::test_connections_past_the_cap_get_no_thread_and_the_server_still_answers"))
    return out


ATTACKS = {
    "liars": attack_liar_first_reply,
    "sleeper": attack_sleeper,
    "impersonation": attack_impersonation,
    "forgeries": attack_forged_records,
    "sybils": attack_sybils,
    "volunteer": attack_volunteer_budget,
    "reply-subjects": attack_reply_subjects,
    "cancel": attack_cancel,
    "flood": attack_flood,
    "slow-http": attack_slow_http,
    "silent": attack_silent,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--attacker"]:
        return attacker_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python bench/attacks.py --attacks sybils,silent --repeat 5")
    ap.add_argument("--quick", action="store_true", help="the tiny test model, fewer runs and connections")
    ap.add_argument("--attacks", default=",".join(ATTACKS), metavar="NAME[,NAME...]",
                    help=f"which attacks (default all): {', '.join(ATTACKS)}")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="alternating rounds per time ratio (default 5; --quick 2)")
    ap.add_argument("--model", help="a GGUF to generate with (default: a synthetic `small` qwen3moe q4_k)")
    record.add_save_flag(ap)
    args = ap.parse_args(argv)
    names = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in names if a not in ATTACKS]
    if unknown:
        print(f"attacks.py: unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    if args.repeat < 1:
        print("attacks.py: --repeat must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("KVASIR_KERNEL_MODE", "deterministic")  # token for token against the monolithic run
    from kvasir_bus import logs

    logs.configure("error")  # stdout carries the JSON only
    rows, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="kvasir-attacks-") as tmp:
        os.environ["XDG_STATE_HOME"] = str(Path(tmp) / "state")
        rig = Rig(args, Path(tmp))
        load_start = load_avg()
        for name in names:
            print(f"{name} ...", file=sys.stderr, flush=True)
            t0 = time.time()
            try:
                got = ATTACKS[name](rig)
            except Exception as exc:  # noqa: BLE001 (a row that says the attack could not be run)
                got = [row(name, "the attack could not be run", {"error": f"{type(exc).__name__}: {exc}"},
                           f"not run: {type(exc).__name__}: {str(exc)[:200]}", "-", False, "-")]
            for r in got:
                r["seconds"] = round(time.time() - t0, 1)
                print(json.dumps(r), file=sys.stderr, flush=True)
            rows += got
    result = {"bench": "attacks", "quick": args.quick, "model": "tiny-48x8-q4_k" if args.quick and not args.model
              else (args.model or "small-q4_k"), "prompt_tokens": rig.n_prompt, "decode_tokens": rig.n_decode,
              "repeat": args.repeat, "load_avg_1m_start": load_start, "load_avg_1m_end": load_avg(),
              "seconds": round(time.time() - started, 1), "rows": rows,
              "passed": sum(r["pass"] for r in rows), "failed": sum(not r["pass"] for r in rows)}
    print(json.dumps(result))
    record.save(args, "attacks", result)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
