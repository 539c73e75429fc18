"""Wire codecs: pure functions, no server. Round trips at every size class, every refusal."""

import math
import re

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.codec import (CodecError, DispatchReply, DispatchRequest, ErrorReply, Heartbeat,
                              Holding, PayloadTooLargeError, UnsupportedVersionError)
from kvasir_bus.errors import KvasirError

FP = "0123456789abcdef"
KIB, MIB = 1024, 1024 * 1024


def rows(n=3, width=8, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(dtype)


def request(**kw):
    fields = dict(model=FP, layer=2, expert=7, rows=rows(), request_id="r-1")
    fields.update(kw)
    return DispatchRequest(**fields)


def heartbeat(**kw):
    fields = dict(model=FP, node="phone-1", holdings=((0, 0, 8), (3, 16, 32)),
                  budget_bytes=340 * MIB, load=1.5, served=12, version="0.1.0",
                  kernel="numpy", sent_at=1_700_000_000.25)
    fields.update(kw)
    return Heartbeat(**fields)


def raw_request(**overrides):
    """A valid request body as a dict, then overridden; None deletes a key."""
    r = rows()
    body = {"v": 1, "t": "x", "model": FP, "layer": 2, "expert": 7, "request_id": "r-1",
            "dtype": "float32", "shape": list(r.shape), "data": r.tobytes()}
    for key, value in overrides.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return msgpack.packb(body, use_bin_type=True)


def same_bits(a, b):
    """Bit-for-bit equality (NaN payloads included), not just numeric equality."""
    assert a.shape == b.shape and a.dtype == b.dtype
    unsigned = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return np.array_equal(a.view(unsigned), b.view(unsigned))


def random_bits(shape, dtype, seed=1):
    """Arbitrary bit patterns, NaNs and infinities included: the codec must not care."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


# -- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_request_round_trip(dtype):
    req = request(rows=rows(dtype=dtype))
    back = codec.decode_request(req.encode())
    assert (back.model, back.layer, back.expert, back.request_id) == (FP, 2, 7, "r-1")
    assert back.rows.dtype == np.dtype(dtype)
    assert same_bits(back.rows, req.rows)


# Array byte counts on both sides of msgpack's bin16/bin32 switch (65535 / 65536) and of the
# 64 KiB frame that the relay's length bug corrupted; then beyond 1 MiB and at 4 MiB.
@pytest.mark.parametrize("shape,dtype", [
    ((32767, 1), np.float16),   # 65534 bytes of data
    ((16384, 2), np.float16),   # 65536
    ((32769, 1), np.float16),   # 65538
    ((16383, 1), np.float32),   # 65532: the whole frame lands just over 64 KiB
    ((4, 4096), np.float32),    # 64 KiB of rows
    ((17, 4096), np.float32),   # > 64 KiB, odd row count
    ((86, 3072), np.float32),   # > 1 MiB (1,056,768 bytes)
    ((1, 262145), np.float32),  # 1 MiB + 4 bytes
    ((512, 2048), np.float32),  # 4 MiB
    ((683, 3072), np.float16),  # > 4 MiB of f16
])
def test_request_and_reply_round_trip_across_64k_and_1m(shape, dtype):
    data = random_bits(shape, dtype)
    req = request(rows=data)
    wire = req.encode()
    assert len(wire) > data.nbytes
    back = codec.decode_request(wire)
    assert same_bits(back.rows, data)
    if dtype == np.float32:
        reply = DispatchReply(request_id="r-1", node="n1", rows=data)
        got = codec.decode_reply(reply.encode())
        assert isinstance(got, DispatchReply)
        assert same_bits(got.rows, data)


def test_encoded_frame_sizes_straddle_64k():
    """Find frames of exactly 65535, 65536 and 65537 bytes and round-trip each."""
    seen = set()
    for n in range(16340, 16384):
        for id_len in range(1, 12):
            wire = request(rows=random_bits((n, 1), np.float32), request_id="r" * id_len).encode()
            if len(wire) in (65535, 65536, 65537) and len(wire) not in seen:
                seen.add(len(wire))
                back = codec.decode_request(wire)
                assert back.rows.shape == (n, 1) and back.request_id == "r" * id_len
    assert seen == {65535, 65536, 65537}


def test_truncated_or_padded_frames_are_refused_not_misread():
    wire = request(rows=random_bits((40, 4096), np.float32)).encode()  # ~640 KiB
    for bad in (wire[:-1], wire[:65536], wire[:-65536], wire + b"\0"):
        with pytest.raises(CodecError):
            codec.decode_request(bad)


def test_data_length_must_match_shape_exactly():
    r = rows()
    for data in (r.tobytes()[:-1], r.tobytes() + b"\0\0\0\0", b""):
        with pytest.raises(CodecError, match="'data'.*needs 96") as info:
            codec.decode_request(raw_request(data=data))
        assert info.value.field == "data"


def test_decode_accepts_bytearray_and_memoryview():
    wire = request().encode()
    assert codec.decode_request(bytearray(wire)).layer == 2
    assert codec.decode_request(memoryview(wire)).expert == 7


def test_decoded_rows_are_native_read_only_views():
    back = codec.decode_request(request().encode())
    assert back.rows.dtype.isnative
    assert not back.rows.flags.writeable


def test_big_endian_and_strided_rows_are_sent_as_little_endian_values():
    base = rows(6, 8)
    big = base.astype(">f4")
    strided = base[::2]
    assert np.array_equal(codec.decode_request(request(rows=big).encode()).rows, base)
    assert np.array_equal(codec.decode_request(request(rows=strided).encode()).rows, strided)


def test_reply_round_trip():
    reply = DispatchReply(request_id="abc", node="gpu-box", rows=rows(5, 16))
    back = codec.decode_reply(reply.encode())
    assert isinstance(back, DispatchReply)
    assert (back.request_id, back.node) == ("abc", "gpu-box")
    assert np.array_equal(back.rows, reply.rows)


def test_error_reply_round_trip():
    err = ErrorReply(request_id="abc", node="n1", code=codec.ERR_NOT_HELD,
                     message="layer 3 expert 9 is not held here")
    back = codec.decode_reply(err.encode())
    assert back == err


def test_error_reply_without_request_id():
    err = ErrorReply(request_id="", node="n1", code=codec.ERR_BAD_REQUEST, message="garbage")
    assert codec.decode_reply(err.encode()) == err


def test_heartbeat_round_trip_and_half_open_holdings():
    hb = heartbeat()
    back = codec.decode_heartbeat(hb.encode())
    assert back == hb
    assert back.holdings == (Holding(0, 0, 8), Holding(3, 16, 32))
    assert back.holdings[0].experts == range(0, 8)
    assert back.holdings[1].covers(3, 16) and not back.holdings[1].covers(3, 32)
    assert isinstance(back.load, float) and isinstance(back.sent_at, float)


def test_heartbeat_normalises_lists_and_numpy_numbers():
    hb = heartbeat(holdings=[[np.int64(1), 0, np.int32(4)]], budget_bytes=np.int64(5),
                   load=np.float32(0.5), served=np.uint8(3), sent_at=10)
    assert hb.holdings == (Holding(1, 0, 4),)
    assert type(hb.budget_bytes) is int and type(hb.served) is int
    assert type(hb.load) is float and type(hb.sent_at) is float
    assert codec.decode_heartbeat(hb.encode()) == hb


def test_methods_match_functions():
    req = request()
    assert req.encode() == codec.encode(req)
    assert DispatchRequest.decode(req.encode()).request_id == "r-1"
    hb = heartbeat()
    assert Heartbeat.decode(hb.encode()) == hb


# -- NaN and infinities ---------------------------------------------------------------------

def test_nan_and_inf_pass_the_codec_and_all_finite_spots_them():
    data = rows()
    data[1, 2] = np.nan
    data[0, 0] = np.inf
    back = codec.decode_reply(DispatchReply("r", "n", data).encode())
    assert math.isnan(back.rows[1, 2]) and math.isinf(back.rows[0, 0])
    assert not codec.all_finite(back.rows)
    assert codec.all_finite(rows())
    assert not codec.all_finite(np.array([[np.nan]], dtype=np.float16))


# -- refusals -------------------------------------------------------------------------------

def test_codec_errors_are_kvasir_errors():
    assert issubclass(CodecError, KvasirError)
    assert issubclass(UnsupportedVersionError, CodecError)
    assert issubclass(PayloadTooLargeError, CodecError)


def test_unknown_version_is_refused_with_a_specific_error():
    with pytest.raises(UnsupportedVersionError, match="version 2 is not supported") as info:
        codec.decode_request(raw_request(v=2))
    assert info.value.field == "v"
    with pytest.raises(UnsupportedVersionError):
        codec.decode_reply(msgpack.packb({"v": 0, "t": "r"}))


@pytest.mark.parametrize("v", ["1", 1.0, True])
def test_version_must_be_an_integer(v):
    with pytest.raises(CodecError, match="'v'"):
        codec.decode_request(raw_request(v=v))


@pytest.mark.parametrize("field", ["v", "t", "model", "layer", "expert", "request_id", "dtype",
                                   "shape", "data"])
def test_missing_field_is_named(field):
    with pytest.raises(CodecError, match=f"'{field}'") as info:
        codec.decode_request(raw_request(**{field: None}))
    assert info.value.field == field


@pytest.mark.parametrize("field,value", [
    ("model", 5), ("model", "a.b"), ("layer", "2"), ("layer", 2.0), ("layer", True),
    ("expert", [7]), ("request_id", 7), ("request_id", "a b"), ("request_id", "x" * 65),
    ("data", "not bytes"), ("shape", "3x8"), ("shape", [3]), ("shape", [3, 8, 1]),
    ("shape", [3, "8"]),
])
def test_wrong_type_or_value_is_named(field, value):
    with pytest.raises(CodecError, match=f"'{field}'") as info:
        codec.decode_request(raw_request(**{field: value}))
    assert info.value.field == field


@pytest.mark.parametrize("field", ["layer", "expert"])
def test_negative_layer_or_expert_is_refused(field):
    with pytest.raises(CodecError, match=f"'{field}' is out of range: -1"):
        codec.decode_request(raw_request(**{field: -1}))
    with pytest.raises(CodecError, match=f"'{field}'"):
        request(**{field: -1})


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "int8", "<f4", 4])
def test_bad_dtype_is_refused(dtype):
    with pytest.raises(CodecError, match="'dtype'"):
        codec.decode_request(raw_request(dtype=dtype))


def test_reply_must_be_float32():
    body = {"v": 1, "t": "r", "request_id": "r", "node": "n", "dtype": "float16",
            "shape": [1, 2], "data": b"\0" * 4}
    with pytest.raises(CodecError, match="'dtype'"):
        codec.decode_reply(msgpack.packb(body))
    with pytest.raises(CodecError, match="'rows'.*float16"):
        DispatchReply("r", "n", rows(dtype=np.float16))


@pytest.mark.parametrize("shape", [[0, 8], [3, 0], [-1, 8]])
def test_empty_or_negative_shape_is_refused(shape):
    with pytest.raises(CodecError, match="'shape'"):
        codec.decode_request(raw_request(shape=shape, data=b""))


def test_oversize_payload_is_refused_before_decoding():
    wire = request(rows=rows(100, 64)).encode()
    with pytest.raises(PayloadTooLargeError, match="over the limit of 1000"):
        codec.decode_request(wire, max_bytes=1000)
    assert codec.decode_request(wire, max_bytes=len(wire)).rows.shape == (100, 64)
    with pytest.raises(PayloadTooLargeError):
        codec.decode_reply(DispatchReply("r", "n", rows(100, 64)).encode(), max_bytes=1000)
    with pytest.raises(PayloadTooLargeError):
        codec.decode_heartbeat(heartbeat().encode(), max_bytes=10)


def test_default_limit_is_the_deployment_max_payload():
    assert codec.DEFAULT_MAX_BYTES == 8 * MIB
    with pytest.raises(PayloadTooLargeError):
        codec.decode_request(b"\0" * (8 * MIB + 1))


def test_too_many_rows_and_wrong_width_are_refused():
    wire = request(rows=rows(10, 8)).encode()
    with pytest.raises(PayloadTooLargeError, match="10 rows, over the limit of 9"):
        codec.decode_request(wire, max_rows=9)
    assert codec.decode_request(wire, max_rows=10, n_embd=8).rows.shape == (10, 8)
    with pytest.raises(CodecError, match="n_embd 8, expected 16"):
        codec.decode_request(wire, n_embd=16)
    with pytest.raises(CodecError, match="n_embd"):
        codec.decode_reply(DispatchReply("r", "n", rows(2, 8)).encode(), n_embd=16)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01\x02", msgpack.packb([1, 2]),
                                     msgpack.packb({"v": 1, "t": "x"}) + b"\x00", "text"])
def test_garbage_is_a_codec_error(payload):
    with pytest.raises(CodecError):
        codec.decode_request(payload)


def test_wrong_kind_is_refused():
    with pytest.raises(CodecError, match="'t' is 'hb'"):
        codec.decode_request(heartbeat().encode())
    with pytest.raises(CodecError, match="'t'"):
        codec.decode_reply(request().encode())
    with pytest.raises(CodecError, match="'t'"):
        codec.decode_heartbeat(ErrorReply("r", "n", "internal", "x").encode())


def test_unknown_keys_are_ignored_within_a_version():
    assert codec.decode_request(raw_request(extra="later field")).layer == 2


@pytest.mark.parametrize("bad", [
    dict(rows=[[1.0, 2.0]]),
    dict(rows=np.zeros((2, 3), np.float64)),
    dict(rows=np.zeros(3, np.float32)),
    dict(rows=np.zeros((0, 3), np.float32)),
    dict(rows=np.zeros((2, 3, 1), np.float32)),
    dict(model="a.b"), dict(layer=-3), dict(expert=1.5), dict(request_id=""),
    dict(layer=np.True_), dict(expert=np.float64(2.0)), dict(layer=None),
])
def test_bad_requests_cannot_be_built(bad):
    with pytest.raises(CodecError):
        request(**bad)


@pytest.mark.parametrize("bad,field", [
    (dict(code="Not-A-Code"), "code"), (dict(code=""), "code"), (dict(node="a.b"), "node"),
    (dict(message="x" * (codec.MAX_ERROR_MESSAGE + 1)), "message"), (dict(message=None), "message"),
    (dict(request_id="a b"), "request_id"),
])
def test_bad_error_replies_cannot_be_built(bad, field):
    fields = dict(request_id="r", node="n", code="internal", message="boom")
    fields.update(bad)
    with pytest.raises(CodecError, match=f"'{field}'"):
        ErrorReply(**fields)


@pytest.mark.parametrize("bad,field", [
    (dict(holdings=((0, 8, 8),)), "holdings[0]"),
    (dict(holdings=((0, 9, 8),)), "holdings[0]"),
    (dict(holdings=((0, -1, 8),)), "holdings[0].lo"),
    (dict(holdings=((-1, 0, 8),)), "holdings[0].layer"),
    (dict(holdings=((0, 1),)), "holdings[0]"),
    (dict(holdings="0-8"), "holdings"),
    (dict(budget_bytes=-1), "budget_bytes"),
    (dict(load=-0.5), "load"), (dict(load=float("nan")), "load"), (dict(load="1"), "load"),
    (dict(served=1.0), "served"),
    (dict(version=""), "version"), (dict(version="1 0"), "version"), (dict(kernel=3), "kernel"),
    (dict(sent_at=float("inf")), "sent_at"),
    (dict(node="phone.1"), "node"),
])
def test_bad_heartbeats_are_refused_with_the_field_named(bad, field):
    with pytest.raises(CodecError, match=re.escape(f"'{field}'")) as info:
        heartbeat(**bad)
    assert info.value.field == field


def test_bad_heartbeat_on_the_wire_is_refused():
    body = msgpack.unpackb(heartbeat().encode())
    body["holdings"] = [[0, 4, 2]]
    with pytest.raises(CodecError, match="empty range"):
        codec.decode_heartbeat(msgpack.packb(body))
    del body["sent_at"]
    body["holdings"] = [[0, 2, 4]]
    with pytest.raises(CodecError, match="'sent_at' is missing"):
        codec.decode_heartbeat(msgpack.packb(body))


def test_encoding_something_else_is_refused():
    with pytest.raises(CodecError, match="not a Kvasir message"):
        codec.encode({"v": 1})
    with pytest.raises(CodecError):
        codec.headers_for("x")


# -- headers --------------------------------------------------------------------------------

def test_headers_describe_a_request():
    h = codec.headers_for(request(rows=rows(4, 8, np.float16), layer=11, expert=200,
                                  request_id="q9"))
    assert h == {"Kvasir-Version": "1", "Kvasir-Kind": "dispatch_request", "Kvasir-Model": h["Kvasir-Model"],
                 "Kvasir-Layer": "11", "Kvasir-Expert": "200",
                 "Kvasir-Rows": "4", "Kvasir-Dtype": "float16", "Kvasir-Request": "q9"}


def test_headers_describe_replies_and_heartbeats():
    reply = codec.headers_for(DispatchReply("q9", "gpu-1", rows(4, 8)))
    assert reply == {"Kvasir-Version": "1", "Kvasir-Kind": "dispatch_reply", "Kvasir-Node": "gpu-1",
                     "Kvasir-Request": "q9",
                     "Kvasir-Rows": "4", "Kvasir-Dtype": "float32"}
    err = codec.headers_for(ErrorReply("q9", "gpu-1", "overloaded", "busy"))
    assert err["Kvasir-Error"] == "overloaded" and err["Kvasir-Node"] == "gpu-1"
    assert codec.headers_for(heartbeat())["Kvasir-Node"] == "phone-1"
    anonymous = codec.headers_for(ErrorReply("", "gpu-1", "bad_request", "unreadable"))
    assert "Kvasir-Request" not in anonymous  # no empty header values
    for h in (reply, err):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.items())
