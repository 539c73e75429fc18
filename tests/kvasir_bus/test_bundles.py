"""Bundle records: a layer step's calls for one worker in one request, and its one reply.

Round trips, every bound a receiver relies on (calls, ids, counts, indices, rows, sizes), and a
few hundred malformed bundles that must each become a named CodecError, never anything else."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec, wire
from kvasir_bus.codec import BundleReply, BundleRequest, CodecError, PayloadTooLargeError

MODEL = "0123456789abcdef"
D = 4


def union(n=2, dtype=np.float32):
    return np.arange(n * D, dtype=dtype).reshape(n, D)


def bundle(**kw) -> BundleRequest:
    args = dict(model=MODEL, layer=3, bundle_id="b1", rows=union(), ids=("q1", "q2"), experts=(5, 9),
                counts=(1, 2), index=np.array([1, 0, 1], np.uint32))
    args.update(kw)
    return BundleRequest(**args)


def body(**changes) -> dict:
    b = msgpack.unpackb(bundle().encode())
    b.update(changes)
    return {k: v for k, v in b.items() if v is not None}


def test_a_bundle_round_trips_and_each_call_reads_its_rows():
    for dtype in (np.float32, np.float16):
        sent = bundle(rows=union(dtype=dtype))
        got = codec.decode_bundle(sent.encode(), n_embd=D, max_rows=16)
        assert (got.model, got.layer, got.bundle_id) == (MODEL, 3, "b1")
        assert (got.ids, got.experts, got.counts) == (("q1", "q2"), (5, 9), (1, 2))
        assert got.rows.dtype == dtype and np.array_equal(got.rows, sent.rows)
        assert got.call_index(0).tolist() == [1] and got.call_index(1).tolist() == [0, 1]
        assert got.encode() == sent.encode()


def test_a_bundle_reply_round_trips_with_outputs_and_errors():
    out = union(3)
    sent = BundleReply("b1", "w0", ("q2", "q1"), (2, 1), out, (("q3", "not_held", "no"),), "ggml-x86_64")
    got = codec.decode_bundle_reply(sent.encode(), n_embd=D)
    assert isinstance(got, BundleReply) and got.encode() == sent.encode()
    (a, ra), (b, rb) = got.results()
    assert (a, b) == ("q2", "q1") and np.array_equal(ra, out[:2]) and np.array_equal(rb, out[2:])
    assert got.errors == (("q3", "not_held", "no"),) and got.kernel == "ggml-x86_64"
    nothing = BundleReply("b1", "w0", (), (), np.zeros((0, D), np.float32), (("q1", "not_held", "no"),))
    assert codec.decode_bundle_reply(nothing.encode(), n_embd=D).results() == []
    refusal = codec.ErrorReply("b1", "w0", codec.ERR_BAD_REQUEST, "bad")
    assert codec.decode_bundle_reply(refusal.encode()) == refusal


@pytest.mark.parametrize("changes, field", [
    (dict(ids=()), "ids"),
    (dict(ids=("q1", "q1")), "ids"),
    (dict(ids=("q1", "no spaces")), "ids"),
    (dict(experts=(5,)), "experts"),
    (dict(experts=(5, -1)), "experts"),
    (dict(counts=(1, 0)), "counts"),
    (dict(counts=(1, 1)), "index"),  # the counts add up to 2, the index has 3 entries
    (dict(index=np.array([1, 0, 2], np.uint32)), "index"),  # row 2 of a 2-row union
    (dict(index=np.array([1, 0, 1], np.int64)), "index"),
    (dict(rows=union().astype(np.float64)), "rows"),
    (dict(bundle_id=""), "bundle_id"),
    (dict(layer=True), "layer"),
    (dict(model="a.b"), "model"),
])
def test_a_bundle_that_breaks_a_rule_cannot_be_built(changes, field):
    with pytest.raises(CodecError, match=field):
        bundle(**changes)


def test_too_many_calls_are_refused():
    n = codec.MAX_BUNDLE_CALLS + 1
    with pytest.raises(CodecError, match="ids"):
        bundle(ids=tuple(f"q{i}" for i in range(n)), experts=(0,) * n, counts=(1,) * n,
               index=np.zeros(n, np.uint32))


def test_the_receiver_bounds_rows_width_and_bytes():
    data = bundle().encode()
    with pytest.raises(CodecError, match="n_embd"):
        codec.decode_bundle(data, n_embd=D + 1)
    with pytest.raises(PayloadTooLargeError):
        codec.decode_bundle(data, max_rows=1)  # a 2-row union
    with pytest.raises(PayloadTooLargeError, match="counts"):
        codec.decode_bundle(bundle(rows=union(1), index=np.zeros(3, np.uint32)).encode(), max_rows=2)
    with pytest.raises(PayloadTooLargeError):
        codec.decode_bundle(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize("changes, field", [
    (dict(index=b"\x00\x00\x00"), "index"),  # not whole uint32s
    (dict(index=[1, 0, 1]), "index"),  # a list, not bin
    (dict(index=None), "index"),
    (dict(ids=None), "ids"),
    (dict(counts=[1, 2, 3]), "counts"),
    (dict(counts="12"), "counts"),
    (dict(experts=[5, "9"]), "experts"),
    (dict(shape=[3, D]), "data"),
    (dict(data=b"\x00" * 4), "data"),
    (dict(t="x"), "t"),
    (dict(v=2), "v"),
])
def test_a_malformed_bundle_is_a_named_error(changes, field):
    with pytest.raises(CodecError) as info:
        codec.decode_bundle(msgpack.packb(body(**changes), use_bin_type=True), n_embd=D)
    assert field in str(info.value)


@pytest.mark.parametrize("changes, field", [
    (dict(counts=(3,)), "shape"),  # 3 rows counted, 2 sent
    (dict(ids=("q1", "q1"), counts=(1, 1)), "ids"),
    (dict(errors=(("q1", "not_held", "no"),)), "ids"),  # answered and refused at once
    (dict(errors=(("", "not_held", "no"),)), "errors"),
    (dict(errors=(("q9", "Not Held", "no"),)), "errors"),
    (dict(errors=(("q9", "not_held"),)), "errors"),
    (dict(rows=union().astype(np.float16)), "rows"),  # outputs are float32
    (dict(node="a b"), "node"),
])
def test_a_bundle_reply_that_breaks_a_rule_cannot_be_built(changes, field):
    args = dict(bundle_id="b1", node="w0", ids=("q1",), counts=(2,), rows=union(), errors=(), kernel="")
    args.update(changes)
    with pytest.raises(CodecError, match=field):
        BundleReply(**args)


def test_fuzzed_bundles_are_refused_with_a_codec_error_or_decoded_valid():
    """Every byte flip, cut and random field value either decodes into a bundle that satisfies
    every bound, or raises CodecError: never IndexError, ValueError or a bundle out of bounds."""
    rng = np.random.default_rng(0)
    good = bundle(rows=union(3), ids=("a", "b", "c"), experts=(1, 2, 3), counts=(2, 1, 3),
                  index=np.array([0, 2, 1, 2, 1, 0], np.uint32)).encode()
    candidates = [good[:k] for k in range(0, len(good), 7)]
    for _ in range(300):
        flipped = bytearray(good)
        for at in rng.integers(0, len(good), 3):
            flipped[at] = rng.integers(0, 256)
        candidates.append(bytes(flipped))
    junk = [None, -1, 0, 2**40, "x", [], [1], {}, b"\xff" * 8, 1.5, True]
    for key in ("layer", "ids", "experts", "counts", "index", "shape", "bundle_id", "dtype"):
        for value in junk:
            candidates.append(msgpack.packb(body(**{key: value}) | ({key: value} if value is None else {}),
                                            use_bin_type=True))
    decoded = 0
    for data in candidates:
        try:
            got = codec.decode_bundle(data, n_embd=D, max_rows=64)
        except CodecError:
            continue
        decoded += 1
        assert len(got.ids) == len(got.experts) == len(got.counts) >= 1
        assert len(set(got.ids)) == len(got.ids)
        assert sum(got.counts) == len(got.index) <= 64 and got.rows.shape[0] <= 64
        assert int(got.index.max()) < got.rows.shape[0]
    assert decoded >= 1  # the untouched prefix cut at full length is not in the list, flips may keep it valid


def test_heartbeats_say_whether_the_worker_takes_bundles_and_old_ones_do_not():
    new = codec.Heartbeat(MODEL, "w0", [(0, 0, 4)], 10, 0.0, 0, "0.1.0", "numpy", 1.0, bundles=True)
    assert codec.decode_heartbeat(new.encode()).bundles is True
    old = codec.Heartbeat(MODEL, "w0", [(0, 0, 4)], 10, 0.0, 0, "0.1.0", "numpy", 1.0)
    body = msgpack.unpackb(old.encode())
    assert "bundles" not in body  # the bytes of a heartbeat from before bundles
    assert codec.decode_heartbeat(old.encode()).bundles is False
    with pytest.raises(CodecError, match="bundles"):
        wire.decode(msgpack.packb({**body, "bundles": "yes"}), ("hb",), "heartbeat")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_bundle_encoder_writes_the_records_bytes_and_refuses_what_it_refuses(dtype):
    sent = bundle(rows=union(dtype=dtype))
    enc = codec.BundleEncoder(MODEL)
    assert enc.encode(3, "b1", sent.rows, ["q1", "q2"], [5, 9], [1, 2], [1, 0, 1]) == sent.encode()
    for args, field in [((3, "b1", sent.rows, ["q1", "q1"], [5, 9], [1, 2], [1, 0, 1]), "ids"),
                        ((3, "b1", sent.rows, [], [], [], []), "ids"),
                        ((3, "b1", sent.rows, ["q1", "q2"], [5, 9], [1, 1], [1, 0, 1]), "index"),
                        ((3, "b1", sent.rows, ["q1", "q2"], [5, 9], [1, 2], [1, 0, 2]), "index"),
                        ((3, "b1", sent.rows, ["q1", "q2"], [5, -9], [1, 2], [1, 0, 1]), "experts"),
                        ((-3, "b1", sent.rows, ["q1", "q2"], [5, 9], [1, 2], [1, 0, 1]), "layer"),
                        ((3, "b 1", sent.rows, ["q1", "q2"], [5, 9], [1, 2], [1, 0, 1]), "bundle_id")]:
        with pytest.raises(CodecError, match=field):
            enc.encode(*args)
