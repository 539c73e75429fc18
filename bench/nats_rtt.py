"""The bus's own request/reply round trip (the official ``nats`` CLI's ``nats bench``) beside our
dispatch round trip, on one nats-server in one run: the dispatch's overhead over raw NATS as a
measured ratio.

Three sequential request/reply loops (one request in flight, as a layer step's serial wait),
each against the same embedded nats-server, alternating over ``--rounds``:

* ``cli``: ``nats bench service request`` against ``nats bench service serve`` (Go client and Go
  responder: NATS itself), the CLI's own latency figures (its CSV);
* ``nats_py``: a nats.py requester in this process against the same CLI responder (what our
  client library adds, no codec, no worker);
* ``dispatch``: a dispatch request ``x`` of one row (encoded with ``kvasir_bus.codec``) to a real
  ``kvasir worker`` process holding every expert of a tiny model, its reply decoded and checked:
  the whole remote expert call as the backbone pays it, kernel included (a trivial one: hidden
  64, expert FFN 32).

The request payload of ``cli`` and ``nats_py`` is the dispatch request's size. Each mode's
figure is its best round's median (a shared machine's bursts fall on every mode alike; the
quietest round is closest to the cost itself); every round is in the JSON. Also the CLI's
``nats bench pub`` message rate (16-byte messages, no subscriber): the bus's raw publish rate.

    python bench/nats_rtt.py [--calls 2000] [--rounds 3] [--save]

Needs the nats CLI (``make nats-cli``; ``$KVASIR_NATS_CLI``, the cache folder, or PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)

import numpy as np  # noqa: E402

from kvasir_bus import codec  # noqa: E402
from kvasir_bus.server import SHARED_MACHINE_PROCS, EmbeddedNats  # noqa: E402
from kvasir_bus.subjects import Subjects  # noqa: E402

SUBJECT = "bench.rtt"


def find_cli() -> str:
    from tests.interop.cli import find_cli as find

    path, why = find()
    if path is None:
        sys.exit(f"nats_rtt: error: {why}")
    return path


def cli_env(url: str, home: str) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env.update(NATS_URL=url, XDG_CONFIG_HOME=home, HOME=home)
    return env


def cli_csv(cli: str, args: list[str], env: dict, tmp: Path) -> dict:
    """Run one ``nats bench ... --csv`` and return its first data row."""
    out = tmp / "bench.csv"
    subprocess.run([cli, "bench", *args, "--no-progress", "--csv", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    rows = [r for r in csv.reader(out.read_text().splitlines()) if r and not r[0].startswith("#")]
    header = next(r for r in csv.reader(out.read_text().splitlines()) if r and r[0].startswith("#"))
    header[0] = header[0].lstrip("#")
    return dict(zip(header, rows[0]))


def cli_round(cli: str, env: dict, tmp: Path, calls: int, size: int) -> dict:
    row = cli_csv(cli, ["service", "request", SUBJECT, "--msgs", str(calls), "--size", f"{size}B"], env, tmp)
    return {"p50_us": float(row["P50LatencyMicroSecs"]), "mean_us": float(row["AvgLatencyMicroSecs"]),
            "min_us": float(row["MinLatencyMicroSecs"]), "p99_us": float(row["P99LatencyMicroSecs"]),
            "calls_per_s": float(row["MsgsPerSec"])}


def summary(times_s: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times_s)
    return {"p50_us": round(statistics.median(us), 2), "mean_us": round(statistics.fmean(us), 2),
            "min_us": round(us[0], 2), "p99_us": round(us[int(0.99 * (len(us) - 1))], 2),
            "calls_per_s": round(len(us) / (sum(us) / 1e6), 1)}


async def nats_py_round(url: str, calls: int, size: int) -> dict:
    import nats

    nc = await nats.connect(url)
    payload, times = bytes(size), []
    for i in range(calls + 100):
        t0 = time.perf_counter()
        await nc.request(SUBJECT, payload, timeout=5)
        if i >= 100:  # the first ones warm up
            times.append(time.perf_counter() - t0)
    await nc.close()
    return summary(times)


async def dispatch_round(url: str, model: str, n_embd: int, n_expert: int, calls: int) -> dict:
    import nats

    nc = await nats.connect(url)
    subjects, rows, times = Subjects(model), np.ones((1, n_embd), np.float32), []
    for i in range(calls + 100):
        layer, expert = i % 2, i % n_expert
        req = codec.DispatchRequest(model=model, layer=layer, expert=expert, rows=rows, request_id=f"b{i}")
        t0 = time.perf_counter()
        msg = await nc.request(subjects.dispatch(layer, expert), req.encode(), timeout=5)
        reply = codec.decode_reply(msg.data)
        if i >= 100:
            times.append(time.perf_counter() - t0)
        if not isinstance(reply, codec.DispatchReply) or reply.request_id != f"b{i}" or reply.rows.shape != rows.shape:
            raise SystemExit(f"nats_rtt: error: the worker answered {reply!r}")
    await nc.close()
    return summary(times)


async def wait_for_responder(url: str) -> None:
    import nats

    nc = await nats.connect(url)
    for _ in range(200):
        try:
            await nc.request(SUBJECT, b"x", timeout=0.5)
            break
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.05)
    else:
        raise SystemExit("nats_rtt: error: nats bench service serve never answered")
    await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python bench/nats_rtt.py --calls 2000 --rounds 3 --save")
    p.add_argument("--calls", type=int, default=2000, help="sequential round trips per mode per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the modes alternating")
    p.add_argument("--model", default=None, help="a GGUF (default: a tiny synthetic qwen3moe, q8_0)")
    record.add_save_flag(p)
    args = p.parse_args()
    if args.calls < 10 or args.rounds < 1:
        p.error("--calls must be >= 10 and --rounds >= 1")
    from kvasir_bus.logs import configure

    configure("warning")  # stdout is the JSON; the bus's own log lines stay out of it
    cli = find_cli()
    version = subprocess.run([cli, "--version"], capture_output=True, text=True).stdout.strip()

    from launch.swarm import spawn_worker, wait_for_nodes
    from gguf import GGUFReader

    from kvasir_bus.fingerprint import model_fingerprint

    def field(reader, key):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else int(value[0])

    with tempfile.TemporaryDirectory(prefix="kvasir-nats-rtt-") as tmpdir:
        tmp = Path(tmpdir)
        model = args.model
        if model is None:
            from synth.model import synth_model

            model = str(tmp / "tiny.gguf")
            synth_model(model, arch="qwen3moe", preset="tiny", qtype="q8_0", seed=1)
        reader = GGUFReader(model)
        fp = model_fingerprint(reader)
        arch = field(reader, "general.architecture")
        n_embd, n_expert = field(reader, f"{arch}.embedding_length"), field(reader, f"{arch}.expert_count")
        size = len(codec.DispatchRequest(model=fp, layer=0, expert=0, rows=np.ones((1, n_embd), np.float32),
                                         request_id="b1000").encode())
        with EmbeddedNats(procs=SHARED_MACHINE_PROCS) as server:
            env = cli_env(server.url, str(tmp / "home"))
            worker = spawn_worker(server.url, "bench-w", ["--model", model, "--layer", "all",
                                                          "--experts", f"0-{n_expert - 1}"])
            serve = subprocess.Popen([cli, "bench", "service", "serve", SUBJECT, "--msgs", str(10 ** 9),
                                      "--size", f"{size}B", "--no-progress"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                asyncio.run(wait_for_nodes(server.url, fp, {"bench-w"}, procs=[worker], timeout=120))
                asyncio.run(wait_for_responder(server.url))
                rounds = []
                for r in range(args.rounds):
                    print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    rounds.append({
                        "cli": cli_round(cli, env, tmp, args.calls, size),
                        "nats_py": asyncio.run(nats_py_round(server.url, args.calls, size)),
                        "dispatch": asyncio.run(dispatch_round(server.url, fp, n_embd, n_expert, args.calls)),
                    })
                pub = cli_csv(cli, ["pub", "bench.pub", "--msgs", "200000", "--size", "16B"], env, tmp)
            finally:
                serve.kill()
                serve.wait()
                worker.stop()

    best = {m: min((rd[m] for rd in rounds), key=lambda x: x["p50_us"]) for m in ("cli", "nats_py", "dispatch")}
    result = {
        "nats_cli": version, "calls_per_round": args.calls, "rounds": args.rounds,
        "request_bytes": size, "model": {"fingerprint": fp, "n_embd": n_embd, "n_expert": n_expert},
        "best": best,
        "ratio_dispatch_over_cli_p50": round(best["dispatch"]["p50_us"] / best["cli"]["p50_us"], 2),
        "ratio_nats_py_over_cli_p50": round(best["nats_py"]["p50_us"] / best["cli"]["p50_us"], 2),
        "ratio_dispatch_over_nats_py_p50": round(best["dispatch"]["p50_us"] / best["nats_py"]["p50_us"], 2),
        "ratio_dispatch_over_cli_p50_per_round": [round(rd["dispatch"]["p50_us"] / rd["cli"]["p50_us"], 2)
                                                   for rd in rounds],
        "cli_pub_16B_msgs_per_s": float(pub["MsgsPerSec"]),
        "per_round": rounds,
    }
    print(json.dumps(result, indent=1))
    record.save(args, "nats_rtt", result)


if __name__ == "__main__":
    main()
