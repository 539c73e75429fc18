"""The decode step's bundle encoder (``BundleEncoder.encode_one_row``): every call on the one
row, the parts that do not change packed once. It must write exactly the record's bytes and
refuse exactly what the record refuses, whatever it has cached before."""

from __future__ import annotations

import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.codec import BundleRequest, CodecError

MODEL = "0123456789abcdef"


def record(layer, bundle_id, row, ids, experts) -> bytes:
    n = len(ids)
    return BundleRequest(MODEL, layer, bundle_id, row, tuple(ids), tuple(experts), (1,) * n,
                         np.zeros(n, np.uint32)).encode()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_row_bundles_are_the_records_bytes_for_every_layer_width_and_call_count(dtype):
    enc = codec.BundleEncoder(MODEL)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the second pass from the packed parts the first one left behind
        for layer in (0, 1, 127, 128, 65535, 65536):
            for width in (1, 4, 64, 3072):
                row = rng.standard_normal((1, width)).astype(dtype)
                for n in (1, 2, 8, 15, 16, 300):
                    ids = [f"{k:x}" for k in range(1000, 1000 + n)]
                    experts = [int(e) for e in rng.integers(0, 70000, n)]
                    assert enc.encode_one_row(layer, "b7", row, ids, experts) == \
                        record(layer, "b7", row, ids, experts)


def test_a_row_that_is_a_view_or_big_endian_is_sent_as_the_records_little_endian_bytes():
    enc = codec.BundleEncoder(MODEL)
    big = np.arange(32, dtype=np.float32).reshape(4, 8)
    for row in (big[2:3], big[:1, ::2], big.T[:1], big[1:2].astype(">f4")):
        assert enc.encode_one_row(3, "b1", row, ["q1", "q2"], [5, 9]) == \
            record(3, "b1", np.ascontiguousarray(row), ["q1", "q2"], [5, 9])


@pytest.mark.parametrize("args, field", [
    ((3, "b1", np.ones((1, 4), np.float32), ["q1", "q1"], [5, 9]), "ids"),
    ((3, "b1", np.ones((1, 4), np.float32), [], []), "ids"),
    ((3, "b1", np.ones((1, 4), np.float32), ["q 1", "q2"], [5, 9]), "ids"),
    ((3, "b1", np.ones((1, 4), np.float32), ["q1", 7], [5, 9]), "ids"),
    ((3, "b1", np.ones((1, 4), np.float32), ["q1", "q2"], [5, -9]), "experts"),
    ((3, "b1", np.ones((1, 4), np.float32), ["q1", "q2"], [5, 9.0]), "experts"),
    ((3, "b1", np.ones((1, 4), np.float32), ["q1", "q2"], [5]), "experts"),
    ((-3, "b1", np.ones((1, 4), np.float32), ["q1", "q2"], [5, 9]), "layer"),
    ((3, "b 1", np.ones((1, 4), np.float32), ["q1", "q2"], [5, 9]), "bundle_id"),
    ((3, "b1", np.ones((1, 4), np.float64), ["q1", "q2"], [5, 9]), "rows"),
    ((3, "b1", np.ones((1, 4), np.int32), ["q1", "q2"], [5, 9]), "rows"),
    ((3, "b1", np.ones(4, np.float32), ["q1", "q2"], [5, 9]), "rows"),
    ((3, "b1", "rows", ["q1", "q2"], [5, 9]), "rows"),
])
def test_the_one_row_encoder_refuses_what_the_record_refuses(args, field):
    enc = codec.BundleEncoder(MODEL)
    enc.encode_one_row(3, "b1", np.ones((1, 4), np.float32), ["q1", "q2"], [5, 9])  # parts cached first
    with pytest.raises(CodecError, match=field):
        enc.encode_one_row(*args)
