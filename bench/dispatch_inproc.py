"""The engine thread's CPU per layer step of the dispatch's direct path, with the bus faked in
process: no socket, no server, no worker, no model. What is left is the dispatch's own Python
(planning, encoding, taking and booking the replies, the audits' verdicts), the part that
``bench/dispatch.py`` cannot separate from system calls and wake-ups on a shared machine.

A fake connection stands in for the engine thread's own (``kvasir_bus.direct``): it decodes each
bundle sent and answers it at once with a worker's encoder (that work is timed apart and
subtracted). Two nodes hold half the experts each, as ``bench/dispatch.py``'s two workers; the
local "expert" doubles its rows, and the replies do the same, so audits pass.

    python bench/dispatch_inproc.py [--calls 8] [--hidden 512] [--audit 0.1] [--steps 3000] [--rounds 5]

Prints JSON: µs of engine-thread CPU per step, the least and the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from backbone.audit import AuditConfig  # noqa: E402
from backbone.coverage_view import CoverageView  # noqa: E402
from backbone.dispatch import DispatchConfig, RemoteExperts  # noqa: E402
from kvasir_bus import codec  # noqa: E402
from kvasir_bus.codec import Holding  # noqa: E402
from kvasir_bus.direct import Message  # noqa: E402
from kvasir_bus.loopthread import LoopThread  # noqa: E402
from tests.backbone.test_dispatch import MODEL, Clock, FakeNats, heartbeat  # noqa: E402

N_EXPERT, N_LAYER, NODES = 64, 8, ("w0", "w1")


class Doubling:
    """The fallback replica: 2 x rows."""

    backend = "ggml"

    def compute(self, layer, expert, rows, *, backend=None):
        return 2 * rows

    def weight_type(self, layer):
        return int(T.F32)


class FakeConnection:
    """What the dispatch uses of a ``DirectConnection``: every bundle sent is answered at once."""

    inbox, closed = "_INBOX.inproc", False

    def __init__(self):
        self.encoders = {node: codec.BundleReplyEncoder(node, "ggml-x86_64") for node in NODES}
        self.replies: list[Message] = []
        self.own_s = 0.0  # CPU spent answering (the workers' part), subtracted

    def poll(self):
        return []

    def send(self, data: bytes) -> None:
        t0 = time.thread_time()
        data, pos = bytes(data), 0
        while pos < len(data):
            end = data.index(b"\r\n", pos)
            _, subject, reply, size = data[pos:end].split()
            payload = data[end + 2:end + 2 + int(size)]
            pos = end + 4 + int(size)
            bundle = codec.decode_bundle(payload)
            rows = np.repeat(2 * bundle.rows[:1].astype(np.float32), len(bundle.ids), axis=0)
            encoder = self.encoders[subject.decode().rsplit(".", 1)[1]]
            self.replies.append(Message(reply.decode(), "", encoder.encode_answers(bundle, rows), None))
        self.own_s += time.thread_time() - t0

    def receive(self, deadline: float):
        out, self.replies = self.replies, []
        return out


def bench(calls: int, hidden: int, audit: float, steps: int, rounds: int) -> dict:
    bus = LoopThread("bench-inproc")
    try:
        nc = FakeNats()
        cfg = DispatchConfig(timeout_s=5.0, audit=AuditConfig(rate=audit))
        remote = RemoteExperts(bus, nc, MODEL, Doubling(), hidden, cfg, coverage=CoverageView(cfg.uncovered_ttl_s, Clock()))
        bus.run(remote.start())
        half = N_EXPERT // 2
        heartbeat(bus, nc, NODES[0], *[Holding(layer, 0, half) for layer in range(N_LAYER)])
        heartbeat(bus, nc, NODES[1], *[Holding(layer, half, N_EXPERT) for layer in range(N_LAYER)])
        conn = remote._conn = FakeConnection()
        rng = np.random.default_rng(0)
        row = rng.standard_normal((1, hidden)).astype(np.float32)

        def step(layer: int) -> None:
            remote.run_layer(layer, [(int(e), row) for e in rng.choice(N_EXPERT, calls, replace=False)])

        for i in range(steps):  # warm: the auditor's probation, the encoders' caches
            step(i % N_LAYER)
        per_step = []
        for _ in range(rounds):
            conn.own_s = 0.0
            t0 = time.thread_time()
            for i in range(steps):
                step(i % N_LAYER)
            per_step.append((time.thread_time() - t0 - conn.own_s) / steps * 1e6)
        if remote.handed_steps or remote.direct_steps < steps * (rounds + 1):
            raise SystemExit(f"not every step took the direct path: {remote.direct_steps} direct, "
                             f"{remote.handed_steps} handed to the bus thread")
        return {"calls_per_step": calls, "nodes": len(NODES), "hidden": hidden, "audit_rate": audit,
                "steps_per_round": steps, "rounds": rounds,
                "engine_thread_us_per_step_min": round(min(per_step), 1),
                "engine_thread_us_per_step_median": round(statistics.median(per_step), 1)}
    finally:
        bus.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=8, help="expert calls per layer step (top-k)")
    ap.add_argument("--hidden", type=int, default=512, help="row width (small: 512, 122b-layer: 3072)")
    ap.add_argument("--audit", type=float, default=0.1, help="audit rate (the default's 0.1)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    record.add_save_flag(ap)
    args = ap.parse_args()
    if not 1 <= args.calls <= N_EXPERT:
        ap.error(f"--calls must be 1..{N_EXPERT}")
    from kvasir_bus.logs import configure

    configure("warning")
    out = {"bench": "dispatch-inproc", **bench(args.calls, args.hidden, args.audit, args.steps, args.rounds)}
    print(json.dumps(out, indent=2))
    record.save(args, "dispatch_inproc", out)


if __name__ == "__main__":
    main()
