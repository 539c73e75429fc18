"""``kvasir tap`` shows a bundle and its reply in one bounded line, however many calls it carries."""

import numpy as np

from kvasir_bus import codec
from market.tap import summarize_payload

FP = "0123456789abcdef"


def test_a_bundle_and_its_reply_are_one_line_each():
    rows = np.zeros((1, 8), np.float16)
    bundle = codec.BundleRequest(FP, 3, "b1", rows, ("1a", "1b"), (17, 20), (1, 1), np.zeros(2, np.uint32))
    assert summarize_payload(bundle.encode()) == "bundle L3 calls=2 [17x1 20x1] rows=1 f16 id=b1"
    reply = codec.BundleReply("b1", "w-1", ("1a",), (1,), np.zeros((1, 8), np.float32),
                              (("1b", "not_held", "no"),))
    assert summarize_payload(reply.encode()) == "bundle-reply node=w-1 answered=1 rows=1 errors=1(not_held) id=b1"


def test_a_bundle_of_many_calls_stays_one_short_line():
    n = 4000
    bundle = codec.BundleRequest(FP, 0, "b2", np.zeros((1, 8), np.float32), tuple(f"q{i}" for i in range(n)),
                                 tuple(range(n)), (1,) * n, np.zeros(n, np.uint32))
    line = summarize_payload(bundle.encode())
    assert "\n" not in line and len(line) < 200 and f"calls={n}" in line and "+3992" in line
