"""Fuzz every subject the services listen on, while the backbone generates; print JSON.

    python bench/fuzz.py                      # 100k messages per subject (minutes)
    python bench/fuzz.py --messages 500       # the short version `make test` runs

A tiny synthetic model, an embedded nats-server, a worker and a market (separate processes) and
a backbone in this process that generates the same greedy text over and over while a stranger
sends random and mutated messages to every subject a service listens on: random bytes, valid
messages with bytes flipped, cut or appended, well-formed envelopes with random fields, and
claims far outside the model (a billion experts, a million layers). Checked, and reported:

* no process died, and the worker and the market still answer a valid request afterwards;
* every generation during the fuzz equals the monolithic run bit for bit;
* resident memory of the worker and the market after the fuzz is within 10% of what it was
  after warm-up (the first 10% of the messages).

Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)
import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from kvasir_bus import codec, market_codec as mc, wire  # noqa: E402
from kvasir_bus.subjects import MARKET_OVERVIEW, Subjects  # noqa: E402


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def samples(fp: str, n_embd: int) -> list[bytes]:
    """One valid message of every kind a service reads: the seeds of the mutations."""
    rows = np.ones((2, n_embd), np.float32)
    h = [wire.Holding(0, 0, 4)]
    msgs = [
        codec.DispatchRequest(fp, 0, 1, rows, "f1"),
        codec.Heartbeat(fp, "fz", h, 1 << 20, 0.0, 0, "0.1.0", "numpy-x86_64", time.time()),
        mc.VolunteerRequest(fp, "fz", 1 << 20),
        mc.RoutingStats(fp, "backbone", 1.0, [(0, 1, 2)]),
        mc.LedgerBatch(fp, "backbone", "b1", (mc.LedgerEvent("e1", "fz", 0, 1, 2, time.time()),)),
        mc.Quarantine(fp, "fz", 0, 1, "numpy-x86_64", True, 1.0, time.time()),
    ]
    return [m.encode() for m in msgs]


def mutate(rng: random.Random, seeds: list[bytes], fp: str) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(0, 2048))
    base = bytearray(rng.choice(seeds))
    if kind == 1:  # flipped bytes
        for _ in range(rng.randrange(1, 8)):
            base[rng.randrange(len(base))] = rng.randrange(256)
        return bytes(base)
    if kind == 2:  # cut or extended
        return bytes(base[:rng.randrange(len(base))]) if rng.random() < 0.5 else bytes(base) + rng.randbytes(64)
    if kind == 3:  # a well-formed envelope with random fields
        fields = {rng.choice(["model", "node", "layer", "expert", "rows", "holdings", "events", "batch_id",
                              "budget_bytes", "dtype", "shape", "data", "request_id", "hits"]):
                  rng.choice([None, -1, 2**63, 1.5, "x" * rng.randrange(300), [1, 2, 3], {"a": 1}, b"\x00" * 40])
                  for _ in range(rng.randrange(1, 8))}
        return msgpack.packb({"v": 1, "t": rng.choice(["x", "r", "e", "h", "vr", "rs", "lb", "q", "zz"]), **fields})
    # claims far outside the model
    big = rng.choice([999_999_999, 1 << 30, 65_535])
    holdings = [wire.Holding(rng.randrange(big), 0, big) for _ in range(rng.randrange(1, 400))]
    try:
        return codec.Heartbeat(fp, "fz", holdings, 1 << 40, 0.0, 0, "0", "x", time.time()).encode()
    except Exception:
        return bytes(base)


async def fuzz(url: str, fp: str, n_embd: int, n_layer: int, n_expert: int, per_subject: int, seed: int,
               on_progress) -> dict[str, int]:
    from kvasir_bus.connect import connect

    s = Subjects(fp)
    subjects = [s.dispatch(0, 1), s.dispatch(n_layer - 1, n_expert - 1), s.dispatch(999, 999),
                s.coverage("fz"), s.coverage("fz-2"), s.demand(), s.volunteer(), s.routing(), s.ledger(),
                s.manifest(), s.status(), s.node_report("fz"), s.quarantine(), MARKET_OVERVIEW]
    rng = random.Random(seed)
    seeds = samples(fp, n_embd)
    nc = await connect(url, name="kvasir-fuzz-stranger")
    inbox = nc.new_inbox()
    async def drop(msg) -> None:  # the services' answers to the stranger are not read
        return None

    await nc.subscribe(f"{inbox}.>", cb=drop)
    sent = {subject: 0 for subject in subjects}
    total = per_subject * len(subjects)
    done = 0
    try:
        for i in range(per_subject):
            for subject in subjects:
                await nc.publish(subject, mutate(rng, seeds, fp), reply=f"{inbox}.{i}")
                sent[subject] += 1
                done += 1
            if i % 50 == 49:
                await nc.flush()
                on_progress(done / total)
        await nc.flush()
    finally:
        await nc.close()
    return sent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="messages per subject (default 100000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-slack", type=float, default=0.10, help="allowed RSS growth after warm-up (0.10)")
    record.add_save_flag(ap)
    args = ap.parse_args(argv)

    from backbone.generate import generate
    from backbone.model import Engine
    from backbone.sampling import Sampler, SamplerConfig
    from backbone.service import BackboneConfig, BackboneService
    from kvasir_bus.connect import connect
    from kvasir_bus.fingerprint import model_fingerprint
    from kvasir_bus.logs import configure
    from kvasir_bus.server import EmbeddedNats
    from launch.swarm import spawn_worker, wait_for_nodes
    from synth.model import synth_model

    configure("error")
    report: dict = {"messages_per_subject": args.messages}
    with tempfile.TemporaryDirectory(prefix="kvasir-fuzz-") as tmp, EmbeddedNats() as server:
        model = synth_model(Path(tmp) / "tiny.gguf", "qwen3moe", "tiny", "q8_0", seed=1)
        engine = Engine(model)
        fp = model_fingerprint(engine.reader)
        prompt = list(range(3, 40))
        mono = generate(Engine(model), prompt, 8, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        logs = {name: open(Path(tmp) / f"{name}.log", "w") for name in ("worker", "market")}
        import subprocess

        market = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", "market", "--nats", server.url,
                                   "--db", str(Path(tmp) / "m.db"), "--model", fp, "--log-level", "error"],
                                  stdout=logs["market"], stderr=subprocess.STDOUT)
        worker = spawn_worker(server.url, "w0", ["--model", str(model), "--layer", "all", "--experts", "0-7"],
                              log_file=logs["worker"], extra=["--log-level", "error"])
        asyncio.run(wait_for_nodes(server.url, fp, {"w0"}, procs=[worker]))
        cfg = BackboneConfig(model_path=str(model), nats_url=server.url, market_interval_s=0.5)
        results = {"generations": 0, "identical": 0}
        stop = threading.Event()
        rss = {}

        def progress(frac: float) -> None:
            if frac >= 0.10 and "warm" not in rss:
                rss["warm"] = {"worker": rss_kb(worker.proc.pid), "market": rss_kb(market.pid)}

        with BackboneService(engine, cfg):
            def generate_forever() -> None:
                while not stop.is_set():
                    gen = generate(engine, prompt, 8, Sampler(SamplerConfig()), stop_on_eos=False,
                                   keep_logits=True)
                    results["generations"] += 1
                    results["identical"] += (gen.tokens == mono.tokens
                                             and np.array_equal(gen.logits_array(), mono.logits_array()))

            gen_thread = threading.Thread(target=generate_forever, daemon=True)
            gen_thread.start()
            t0 = time.perf_counter()
            sent = asyncio.run(fuzz(server.url, fp, engine.cfg.n_embd, engine.cfg.n_layer, engine.cfg.n_expert,
                                    args.messages, args.seed, progress))
            elapsed = time.perf_counter() - t0
            stop.set()
            gen_thread.join(timeout=120)
            rss.setdefault("warm", {"worker": rss_kb(worker.proc.pid), "market": rss_kb(market.pid)})
            alive = {"worker": worker.proc.poll() is None, "market": market.poll() is None}
            rss["end"] = {"worker": rss_kb(worker.proc.pid) if alive["worker"] else 0,
                          "market": rss_kb(market.pid) if alive["market"] else 0}

            async def answers() -> dict[str, bool]:
                nc = await connect(server.url, name="kvasir-fuzz-check")
                out = {}
                try:
                    req = codec.DispatchRequest(fp, 0, 1, np.ones((1, engine.cfg.n_embd), np.float32), "check")
                    msg = await nc.request(Subjects(fp).dispatch(0, 1), req.encode(), timeout=5)
                    out["worker"] = isinstance(codec.decode_reply(msg.data), codec.DispatchReply)
                    msg = await nc.request(Subjects(fp).status(), b"", timeout=1)
                    out["market"] = len(msg.data) > 0
                except Exception as exc:  # reported, not raised: the JSON says what failed
                    out.setdefault("worker", False)
                    out.setdefault("market", False)
                    out["error"] = f"{type(exc).__name__}: {exc}"
                finally:
                    await nc.close()
                return out

            answering = asyncio.run(answers())
        worker.stop()
        market.terminate()
        try:
            market.wait(timeout=15)
            clean_exit = market.returncode == 0
        except subprocess.TimeoutExpired:
            market.kill()
            market.wait()
            clean_exit = False
    growth = {name: round(rss["end"][name] / rss["warm"][name] - 1, 4) if rss["warm"][name] else None
              for name in ("worker", "market")}
    report.update({
        "messages": sum(sent.values()), "subjects": len(sent), "seconds": round(elapsed, 1),
        "messages_per_second": round(sum(sent.values()) / elapsed),
        "generations": results["generations"], "generations_bit_identical": results["identical"],
        "alive": alive, "answering": answering, "market_clean_exit": clean_exit, "rss_kb": rss, "rss_growth": growth,
    })
    checks = {
        "no_crash": all(alive.values()),
        "still_answering": bool(answering.get("worker")) and bool(answering.get("market")),
        "bit_identical": results["generations"] > 0 and results["identical"] == results["generations"],
        "market_clean_exit": clean_exit,
        "rss_flat": all(g is not None and g <= args.rss_slack for g in growth.values()),
    }
    report["checks"] = checks
    report["ok"] = all(checks.values())
    print(json.dumps(report))
    record.save(args, "fuzz", report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
