"""The bundle reply's fast decoding accepts exactly what the record's full decoding accepts.

``decode_bundle_reply`` reads the common reply with a few C calls and hands everything else to
the generic :func:`kvasir_bus.wire.decode`; a stranger's reply must get the same verdict (and,
when valid, the same record) either way. Each case below breaks one field of a valid reply."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec

D = 4


def _valid_body() -> dict:
    rows = np.arange(3 * D, dtype=np.float32).reshape(3, D)
    body = codec.BundleReply("b1", "node-a", ("c1", "c2"), (1, 2), rows, (), "ggml-x86_64").body()
    return {"v": 1, "t": "rb"} | body


def _slow(data: bytes, **kw):
    return codec.decode(data, ("rb", "e"), "bundle reply", limits=codec._limits(kw.get("max_rows"), kw.get("n_embd")))


def _verdict(fn, data: bytes, **kw):
    try:
        r = fn(data, **kw)
    except codec.CodecError as exc:
        return ("refused", type(exc).__name__, str(exc))
    if isinstance(r, codec.ErrorReply):
        return ("error", r.request_id, r.node, r.code, r.message)
    return ("reply", r.bundle_id, r.node, r.ids, r.counts, r.offsets, r.rows.shape, r.rows.tobytes(), r.errors, r.kernel)


def _packed(**changes) -> bytes:
    body = _valid_body()
    for k, v in changes.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return msgpack.packb(body, use_bin_type=True)


_DROP = object()

CASES = {
    "valid": {},
    "no kernel": {"kernel": _DROP},
    "empty kernel": {"kernel": ""},
    "version true": {"v": True},
    "version 2": {"v": 2},
    "version float": {"v": 1.0},
    "kind r": {"t": "r"},
    "bad bundle id": {"bundle_id": "a b"},
    "bundle id int": {"bundle_id": 7},
    "bad node": {"node": "no spaces allowed"},
    "node int": {"node": 3},
    "bad kernel": {"kernel": "has space"},
    "kernel zero": {"kernel": 0},
    "ids not list": {"ids": "c1"},
    "id not str": {"ids": ["c1", 2]},
    "bad id": {"ids": ["c1", "c 2"]},
    "id with comma": {"ids": ["c1,c3", "c2"]},
    "duplicate ids": {"ids": ["c1", "c1"]},
    "no ids": {"ids": [], "counts": [], "shape": [0, D], "data": b""},
    "counts short": {"counts": [1]},
    "count zero": {"counts": [0, 3]},
    "count bool": {"counts": [True, 2]},
    "count float": {"counts": [1.0, 2]},
    "rows float": {"shape": [3.0, D]},
    "rows bool": {"shape": [True, D]},
    "rows mismatch": {"shape": [2, D], "data": b"\0" * (2 * D * 4)},
    "width wrong": {"shape": [3, D + 1], "data": b"\0" * (3 * (D + 1) * 4)},
    "data short": {"data": b"\0" * (3 * D * 4 - 1)},
    "data not bytes": {"data": "x" * (3 * D * 4)},
    "dtype f16": {"dtype": "float16", "data": b"\0" * (3 * D * 2)},
    "shape 3d": {"shape": [3, D, 1]},
    "errors zero": {"errors": 0},
    "errors empty string": {"errors": ""},
    "errors given": {"errors": [["c3", "not_held", "no"]]},
    "error id clash": {"errors": [["c1", "not_held", "no"]]},
    "extra field": {"extra": 1},
    "no bundle id": {"bundle_id": _DROP},
    "no data": {"data": _DROP},
}


@pytest.mark.parametrize("case", CASES)
def test_fast_and_full_decoding_agree_on_every_broken_field(case):
    data = _packed(**CASES[case])
    for kw in ({}, {"n_embd": D}, {"n_embd": D + 1}, {"max_rows": 2}, {"max_rows": 3, "n_embd": D}):
        assert _verdict(codec.decode_bundle_reply, data, **kw) == _verdict(_slow, data, **kw), kw


def test_the_common_reply_is_the_one_the_record_encodes():
    body = _valid_body()
    got = codec.decode_bundle_reply(msgpack.packb(body, use_bin_type=True), n_embd=D)
    assert got.ids == ("c1", "c2") and got.counts == (1, 2) and got.offsets == (0, 1, 3)
    assert [rid for rid, _ in got.results()] == ["c1", "c2"]
    assert got.encode() == msgpack.packb(body, use_bin_type=True)


def test_an_error_reply_for_the_whole_bundle_still_decodes():
    err = codec.ErrorReply("b1", "node-a", "overloaded", "busy").encode()
    got = codec.decode_bundle_reply(err)
    assert isinstance(got, codec.ErrorReply) and got.code == "overloaded"


def test_garbage_is_refused_with_the_named_error():
    with pytest.raises(codec.CodecError, match="not valid msgpack"):
        codec.decode_bundle_reply(b"\xc1")
    with pytest.raises(codec.PayloadTooLargeError):
        codec.decode_bundle_reply(_packed(), max_bytes=8)
