"""The worker's hot-path codec: the decoders built for one model accept exactly what the full
decoders accept, give the same records, and refuse the rest with the full decoders' errors;
the bundle reply encoder writes the record's bytes and refuses what the record refuses."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.codec import BundleDecoder, BundleReply, BundleReplyEncoder, CodecError, RequestDecoder

MODEL = "0123456789abcdef"
FIELDS = ("model", "layer", "bundle_id", "ids", "experts", "counts", "offsets")


def rows(n=3, width=8, dtype=np.float32):
    return np.random.default_rng(n).standard_normal((n, width)).astype(dtype)


def bundle_bytes(**change) -> bytes:
    body = msgpack.unpackb(codec.BundleEncoder(MODEL).encode(2, "b1", rows(), ["a", "b", "c"], [3, 7, 1],
                                                             [1, 2, 1], [0, 2, 1, 2]))
    body.update(change)
    return msgpack.packb({k: v for k, v in body.items() if v is not ...}, use_bin_type=True)


def same_bundle(a: codec.BundleRequest, b: codec.BundleRequest) -> None:
    assert type(a) is type(b) is codec.BundleRequest
    for f in FIELDS:
        assert getattr(a, f) == getattr(b, f), f
    assert a.rows.dtype == b.rows.dtype and np.array_equal(a.rows, b.rows)
    assert a.index.dtype == b.index.dtype and np.array_equal(a.index, b.index)
    for i in range(len(a.ids)):
        assert np.array_equal(a.call_index(i), b.call_index(i))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_bundle_decoder_gives_the_full_decoders_record(dtype):
    x = rows(dtype=dtype)
    data = codec.BundleEncoder(MODEL).encode(2, "b1", x, ["a", "b"], [3, 7], [1, 2], [0, 2, 1])
    fast = BundleDecoder(MODEL, 8, max_rows=100).decode(data)
    same_bundle(fast, codec.decode_bundle(data, max_rows=100, n_embd=8))
    assert not fast.rows.flags.writeable  # a view on the payload, as the full decoder gives


def test_the_request_decoder_gives_the_full_decoders_record():
    data = codec.RequestEncoder(MODEL).encode(4, 9, "r1", rows(dtype=np.float16))
    fast, full = RequestDecoder(MODEL, 8).decode(data), codec.decode_request(data, n_embd=8)
    assert type(fast) is codec.DispatchRequest
    assert (fast.model, fast.layer, fast.expert, fast.request_id) == (full.model, full.layer, full.expert, full.request_id)
    assert fast.rows.dtype == full.rows.dtype and np.array_equal(fast.rows, full.rows)


# Each: a change to a valid bundle, and what the full decoder says about it (None: it accepts it).
BAD_BUNDLES = [
    ({"v": 2}, "version"), ({"v": True}, "'v'"), ({"t": "x"}, "'t'"), ({"model": "nope!"}, "model"),
    ({"layer": -1}, "layer"), ({"layer": 1.0}, "layer"), ({"bundle_id": "a b"}, "bundle_id"),
    ({"bundle_id": ...}, "bundle_id"), ({"dtype": "float64"}, "dtype"), ({"dtype": ["float32"]}, "dtype"),
    ({"shape": [3, 9]}, "n_embd"), ({"shape": [3]}, "shape"), ({"shape": [0, 8]}, "shape"),
    ({"shape": [3, 8.0]}, "shape"), ({"data": b"\0" * 95}, "data"), ({"data": "text"}, "data"),
    ({"ids": [], "experts": [], "counts": [], "index": b""}, "empty"), ({"ids": ["a", "a", "c"]}, "twice"), ({"ids": ["a", "b,c", "d"]}, "ids"),
    ({"ids": ["a", 7, "c"]}, "ids"), ({"ids": "abc"}, "ids"), ({"experts": [3, 7]}, "experts"),
    ({"experts": [3, -7, 1]}, "experts"), ({"experts": [3, True, 1]}, "experts"),
    ({"counts": [1, 0, 1]}, "counts"), ({"counts": [1, 2, 2]}, "index"), ({"index": b"\0" * 15}, "index"),
    ({"index": np.array([0, 2, 1, 3], "<u4").tobytes()}, "row 3"), ({"index": [0, 2, 1, 2]}, "index"),
    ({"extra": 1}, None),  # unknown keys are ignored
    ({"model": "fedcba9876543210"}, None),  # another model decodes; the worker names the mismatch
]


@pytest.mark.parametrize("change, error", BAD_BUNDLES, ids=[str(c) for c, _ in BAD_BUNDLES])
def test_the_bundle_decoder_refuses_what_the_full_decoder_refuses_with_its_error(change, error):
    data = bundle_bytes(**change)
    fast = BundleDecoder(MODEL, 8, max_rows=100)
    if error is None:
        same_bundle(fast.decode(data), codec.decode_bundle(data, max_rows=100, n_embd=8))
        return
    with pytest.raises(CodecError, match=error) as full:
        codec.decode_bundle(data, max_rows=100, n_embd=8)
    with pytest.raises(CodecError) as got:
        fast.decode(data)
    assert type(got.value) is type(full.value) and str(got.value) == str(full.value)


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([1, 2]), bytearray(bundle_bytes()), "text"])
def test_the_decoders_refuse_what_is_not_a_message_as_the_full_decoders_do(data):
    for fast, full in ((BundleDecoder(MODEL, 8), codec.decode_bundle), (RequestDecoder(MODEL, 8), codec.decode_request)):
        try:
            expected = full(data, n_embd=8)
        except CodecError as exc:
            with pytest.raises(CodecError) as got:
                fast.decode(data)
            assert str(got.value) == str(exc)
        else:
            assert fast.decode(data).model == expected.model


def test_the_decoders_keep_the_size_and_row_limits():
    data = bundle_bytes()
    with pytest.raises(codec.PayloadTooLargeError, match="payload"):
        BundleDecoder(MODEL, 8, max_bytes=len(data) - 1).decode(data)
    with pytest.raises(codec.PayloadTooLargeError, match="rows"):
        BundleDecoder(MODEL, 8, max_rows=2).decode(data)  # 3 rows in the union
    with pytest.raises(codec.PayloadTooLargeError, match="counts"):
        BundleDecoder(MODEL, 8, max_rows=3).decode(data)  # the calls' 4 rows
    req = codec.RequestEncoder(MODEL).encode(0, 1, "r", rows(5))
    with pytest.raises(codec.PayloadTooLargeError, match="rows"):
        RequestDecoder(MODEL, 8, max_rows=4).decode(req)
    with pytest.raises(CodecError, match="n_embd"):
        RequestDecoder(MODEL, 16).decode(req)


@pytest.mark.parametrize("kernel", ["ggml-x86_64", ""])
def test_the_bundle_reply_encoder_writes_the_records_bytes(kernel):
    out = rows(3)
    enc = BundleReplyEncoder("w0", kernel)
    assert enc.encode("b1", ("a", "b"), (1, 2), out) == BundleReply("b1", "w0", ("a", "b"), (1, 2), out,
                                                                     kernel=kernel).encode()
    errors = (("c", "not_held", "layer 0 expert 9 is not held here"),)
    assert enc.encode("b1", ("a",), (3,), out, errors) == BundleReply("b1", "w0", ("a",), (3,), out, errors,
                                                                      kernel=kernel).encode()
    none = np.zeros((0, 8), np.float32)
    assert enc.encode("b1", (), (), none, errors) == BundleReply("b1", "w0", (), (), none, errors, kernel=kernel).encode()


def test_the_bundle_reply_encoder_refuses_what_the_record_refuses():
    with pytest.raises(CodecError, match="node"):
        BundleReplyEncoder("bad node!")
    with pytest.raises(CodecError, match="kernel"):
        BundleReplyEncoder("w0", "two words")
    enc, out = BundleReplyEncoder("w0"), rows(2)
    for args, field in [(("b 1", ("a",), (2,), out), "bundle_id"), (("b1", ("a", "a"), (1, 1), out), "twice"),
                        (("b1", ("a,b", "c"), (1, 1), out), "ids"),
                        (("b1", ("a",), (0,), out), "counts"), (("b1", ("a",), (3,), out), "counts add up"),
                        (("b1", ("a",), (2,), out.astype(np.float16)), "rows"),
                        (("b1", ("a",), (2,), out, (("a", "internal", "x"),)), "twice"),
                        (("b1", ("a",), (2,), out, (("b", "Not A Code", "x"),)), "errors")]:
        with pytest.raises(CodecError, match=field):
            enc.encode(*args)


def test_answering_every_call_of_a_bundle_writes_the_records_bytes_and_checks_the_rows():
    request = BundleDecoder(MODEL, 8).decode(bundle_bytes())  # calls a, b, c with 1, 2, 1 rows
    enc, out = BundleReplyEncoder("w0", "ggml-x86_64"), rows(4)
    assert enc.encode_answers(request, out) == BundleReply("b1", "w0", ("a", "b", "c"), (1, 2, 1), out,
                                                           kernel="ggml-x86_64").encode()
    for bad, field in [(rows(3), "counts add up"), (out.astype(np.float16), "rows"), (out.ravel(), "rows")]:
        with pytest.raises(CodecError, match=field):
            enc.encode_answers(request, bad)
    with pytest.raises(CodecError, match="BundleRequest"):
        enc.encode_answers("b1", out)
