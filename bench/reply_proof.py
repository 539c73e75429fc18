"""What attributing a reply costs (kvasir_bus.attribution): the worker's HMAC-SHA256 proof and
the backbone's check, per reply, beside the same reply's decode (codec.decode_reply) and beside
an ed25519 signature and verification by the node's nkey (the alternative the proof replaced),
all measured in one run on the same payloads.

Payloads: a dispatch reply of R rows of width H in f32, as the worker encodes it: 1 x 64 (the
tiny test model's decode row), 1 x 3072 (one decode row at the 122B shapes), 16 x 3072 and
512 x 3072 (a prefill chunk). Each figure is the best of --rounds medians (a shared machine's
bursts fall on every method alike).

    python bench/reply_proof.py [--calls 2000] [--rounds 3] [--save]
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

from kvasir_bus import codec  # noqa: E402
from kvasir_bus.attribution import PROOF_HEADER, ProofChecker, proof, reply_key  # noqa: E402

SHAPES = ((1, 64), (1, 3072), (16, 3072), (512, 3072))


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python bench/reply_proof.py --calls 2000 --rounds 3 --save")
    p.add_argument("--calls", type=int, default=2000,
                   help="calls per method and round for a one-row payload (R rows: calls / R, at least 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each method keeps its best)")
    record.add_save_flag(p)
    args = p.parse_args()
    if args.calls < 10 or args.rounds < 1:
        raise SystemExit("reply_proof: error: --calls >= 10 and --rounds >= 1")
    import nkeys

    from kvasir_bus import jwt

    secret = b"\x01" * 32
    node = "vabcdefghijkl"
    key = reply_key(secret, node)
    checker = ProofChecker(secret)
    seed, public = jwt.new_keypair("user")
    kp = nkeys.from_seed(bytearray(seed))
    vk = jwt.verify_key(public)
    rng = np.random.default_rng(0)
    rows_out = []
    for rows, width in SHAPES:
        payload = codec.DispatchReply(request_id="r1", node=node,
                                      rows=rng.standard_normal((rows, width)).astype(np.float32)).encode()
        headers = {PROOF_HEADER: proof(key, payload)}
        sig = kp.sign(payload)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, fn in (("proof_us", lambda: proof(key, payload)),
                             ("check_us", lambda: checker.holds(node, payload, headers)),
                             ("decode_us", lambda: codec.decode_reply(payload, n_embd=width)),
                             ("ed25519_sign_us", lambda: kp.sign(payload)),
                             ("ed25519_verify_us", lambda: vk.verify(payload, sig))):
                us = _median_us(fn, max(20, args.calls // rows))  # fewer calls for the big payloads
                best[name] = min(best.get(name, us), us)
        assert checker.holds(node, payload, headers) and not checker.holds(node, payload + b"x", headers)
        rows_out.append({"rows": rows, "width": width, "payload_bytes": len(payload),
                         **{k: round(v, 2) for k, v in best.items()},
                         "check_over_decode": round(best["check_us"] / best["decode_us"], 3),
                         "verify_over_check": round(best["ed25519_verify_us"] / best["check_us"], 1)})
    header = f"NATS/1.0\r\n{PROOF_HEADER}: {'0' * 32}\r\n\r\n"
    result = {"bench": "reply_proof", "calls": args.calls, "rounds": args.rounds,
              "header_bytes_per_reply": len(header), "payloads": rows_out}
    print(json.dumps(result, indent=2))
    record.save(args, "reply_proof", result)


if __name__ == "__main__":
    main()
