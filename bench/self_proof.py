"""What a self-certifying node's reply proof costs (kvasir_bus.attribution ``NodeKey.seal`` and
``ProofChecker.sealed_by``), per reply, on both sides, beside the alternative: an ed25519
signature by the node's key over the same bytes and its verification (with the name check,
``name == H(public key)``, a hash per reply unless cached), and beside the reply's decode. All
measured in one run on the same payloads; prints JSON (no --save: a noisy shared box).

* ``seal_us``: the worker appends ``key`` and ``proof`` (the agreed key cached per backbone),
  hashing the request it answers (a request of the reply's size: the proof is bound to it);
* ``check_us``: the backbone checks name and tag (the node's key cached), hashing its request;
* ``agree_us``: the one X25519 agreement per (node, backbone) pair on a cache miss, each side;
* ``ed25519_sign_us`` / ``ed25519_verify_us``: the signature alternative (verify + name hash).

Payloads as in bench/reply_proof.py: R x H float32 dispatch replies, 1 x 64 (the tiny test
model's decode row), 1 x 3072 (one decode row at the 122B shapes), 16 x 3072, 512 x 3072.

    python bench/self_proof.py [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvasir_bus  # noqa: E402,F401  (thread settings before numpy loads)
from bench import record  # noqa: E402  (--save)
import numpy as np  # noqa: E402

from kvasir_bus import codec  # noqa: E402
from kvasir_bus.attribution import NodeKey, ProofChecker, self_name  # noqa: E402

SHAPES = ((1, 64), (1, 3072), (16, 3072), (512, 3072))


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000,
                   help="calls per method and round for a one-row payload (R rows: calls / R, at least 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each method keeps its best)")
    record.add_save_flag(p)
    args = p.parse_args()
    if args.calls < 10 or args.rounds < 1:
        print("self_proof: error: --calls >= 10 and --rounds >= 1", file=sys.stderr)
        return 2
    from nacl.signing import SigningKey

    node_key = NodeKey.fresh()
    checker = ProofChecker()
    box = checker.box
    signing = SigningKey(os.urandom(32))
    verify = signing.verify_key
    public = bytes(verify)
    rng = np.random.default_rng(0)

    def verify_with_name(payload: bytes, signature: bytes) -> None:
        verify.verify(payload, signature)  # the signature over the payload
        self_name(public)  # the name check: a hash of the key

    rows_out = []
    for rows, width in SHAPES:
        payload = codec.DispatchReply(request_id="r1", node=node_key.name,
                                      rows=rng.standard_normal((rows, width)).astype(np.float32)).encode()
        request = codec.RequestEncoder("0123456789abcdef", box).encode(
            0, 0, "r1", rng.standard_normal((rows, width)).astype(np.float32))  # what it answers
        sealed = node_key.seal(payload, box, request)
        assert checker.sealed_by(node_key.name, sealed, request)
        assert not checker.sealed_by(node_key.name, sealed[:-1] + bytes([sealed[-1] ^ 1]), request)
        signature = signing.sign(payload).signature
        best: dict[str, float] = {}
        calls = max(20, args.calls // rows)  # fewer calls for the big payloads
        for _ in range(args.rounds):
            for name, fn in (("seal_us", lambda: node_key.seal(payload, box, request)),
                             ("check_us", lambda: checker.sealed_by(node_key.name, sealed, request)),
                             ("decode_us", lambda: codec.decode_reply(sealed, n_embd=width)),
                             ("ed25519_sign_us", lambda: signing.sign(payload)),
                             ("ed25519_verify_us", lambda: verify_with_name(payload, signature))):
                us = _median_us(fn, calls)
                best[name] = min(best.get(name, us), us)
        rows_out.append({"rows": rows, "width": width, "payload_bytes": len(payload),
                         "sealed_bytes": len(sealed), **{k: round(v, 2) for k, v in best.items()},
                         "sign_over_seal": round(best["ed25519_sign_us"] / best["seal_us"], 1),
                         "verify_over_check": round(best["ed25519_verify_us"] / best["check_us"], 1)})

    t0 = time.perf_counter()
    n = 200
    keys = [NodeKey(os.urandom(32)) for _ in range(n)]
    keygen_us = (time.perf_counter() - t0) / n * 1e6
    worker_agree = _median_us(lambda: keys[0]._peers.clear() or keys[0].agreed(box), 200)
    backbone_agree = _median_us(lambda: checker._agree(keys[1].public), 200)
    result = {"bench": "self_proof", "calls": args.calls, "rounds": args.rounds,
              "name_bits": 130, "bytes_per_reply": len(sealed) - len(payload),
              "once_per_pair_us": {"worker_x25519": round(worker_agree, 1),
                                   "backbone_x25519": round(backbone_agree, 1),
                                   "node_key_generation": round(keygen_us, 1)},
              "payloads": rows_out}
    print(json.dumps(result, indent=2))
    record.save(args, "self_proof", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
