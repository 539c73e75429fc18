"""The codec's hot path (one request and one reply per remote expert call): the encoders that
check the constant parts once write exactly the records' bytes, and the cached checks refuse
what the full checks refuse."""

from __future__ import annotations

import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.codec import CodecError, DispatchReply, DispatchRequest, ReplyEncoder, RequestEncoder

MODEL = "0123456789abcdef"


def rows(n=3, width=8, dtype=np.float32):
    return np.random.default_rng(n).standard_normal((n, width)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_request_encoder_writes_the_records_bytes(dtype):
    x = rows(dtype=dtype)
    fast = RequestEncoder(MODEL).encode(3, 17, "1a", x)
    assert fast == DispatchRequest(model=MODEL, layer=3, expert=17, rows=x, request_id="1a").encode()
    back = codec.decode_request(fast, n_embd=8)
    assert (back.model, back.layer, back.expert, back.request_id) == (MODEL, 3, 17, "1a")
    assert np.array_equal(back.rows, x)


@pytest.mark.parametrize("kernel", ["ggml-x86_64", ""])
def test_the_reply_encoder_writes_the_records_bytes(kernel):
    x = rows()
    fast = ReplyEncoder("w0", kernel).encode("1a", x)
    assert fast == DispatchReply(request_id="1a", node="w0", rows=x, kernel=kernel).encode()


def test_the_encoders_refuse_what_the_records_refuse():
    with pytest.raises(CodecError, match="model"):
        RequestEncoder("not a model!")
    enc = RequestEncoder(MODEL)
    for layer, expert, rid, x, field in [(-1, 0, "a", rows(), "layer"), (0, True, "a", rows(), "expert"),
                                         (0, 0, "no spaces", rows(), "request_id"),
                                         (0, 0, "a", rows().ravel(), "rows"),
                                         (0, 0, "a", rows().astype(np.float64), "rows")]:
        with pytest.raises(CodecError, match=field):
            enc.encode(layer, expert, rid, x)
    with pytest.raises(CodecError, match="node"):
        ReplyEncoder("bad node!")
    with pytest.raises(CodecError, match="kernel"):
        ReplyEncoder("w0", "two words")
    with pytest.raises(CodecError, match="rows"):
        ReplyEncoder("w0").encode("1a", rows().astype(np.float16))  # replies are float32


def test_a_cached_valid_string_does_not_let_an_invalid_one_through():
    x = rows()
    DispatchReply(request_id="1a", node="w0", rows=x).encode()  # "w0" is now cached as valid
    for node in ("w0 ", "w0.x", "", 7):
        with pytest.raises(CodecError, match="node"):
            DispatchReply(request_id="1a", node=node, rows=x)
    DispatchRequest(model=MODEL, layer=0, expert=0, rows=x, request_id="a")
    with pytest.raises(CodecError, match="model"):
        DispatchRequest(model=MODEL + ".", layer=0, expert=0, rows=x, request_id="a")


def test_decoded_shapes_are_checked_whatever_their_type():
    import msgpack

    x = rows(2, 4)
    good = msgpack.unpackb(RequestEncoder(MODEL).encode(0, 1, "a", x))
    for shape in ([2.0, 4], [True, 4], [2, "4"], [0, 4], [2, 1 << 40]):
        with pytest.raises(CodecError, match="shape"):
            codec.decode_request(msgpack.packb({**good, "shape": shape}, use_bin_type=True))


def test_all_finite_spots_nan_and_inf_and_passes_huge_finite_values():
    big = np.full((64, 64), 3.0e38, np.float32)  # finite, however big
    assert codec.all_finite(big)
    for bad in (np.nan, np.inf, -np.inf):
        x = big.copy()
        x[5, 7] = bad
        assert not codec.all_finite(x)
    y = np.full((2, 2), -np.inf, np.float32)
    y[0, 0] = np.inf  # inf + -inf is NaN: still spotted
    assert not codec.all_finite(y)
