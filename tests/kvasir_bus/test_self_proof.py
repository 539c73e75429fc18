"""Self-certifying names (kvasir_bus.attribution): a node named by its key seals each reply to the
backbone's ``box``; the backbone accepts a reply under such a name only with that name's key and
a tag only the node (or that backbone) could make. Requests carry the box; the encoders, the fast
decoders and the records agree on it byte for byte."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvasir_bus import codec
from kvasir_bus.attribution import (NodeKey, ProofChecker, SEAL_BYTES, is_self_name, self_name)
from kvasir_bus.codec import BundleRequest, CodecError, DispatchRequest

MODEL = "0123456789abcdef"
ROW = np.arange(8, dtype=np.float32).reshape(1, 8)
REQ = codec.RequestEncoder(MODEL).encode(3, 17, "1a", ROW)  # what the replies below answer


def _replies(node: str) -> list[bytes]:
    """A dispatch reply, a bundle reply and an error reply naming ``node``, as workers encode them."""
    return [codec.ReplyEncoder(node, "ggml-x86_64").encode("1a", ROW),
            codec.BundleReplyEncoder(node, "ggml-x86_64").encode("b1", ("1a", "1b"), (1, 1), np.vstack([ROW, ROW])),
            codec.ErrorReply(request_id="1a", node=node, code="not_held", message="no").encode()]


def test_a_name_is_k_and_130_bits_of_the_keys_hash_and_the_same_key_gives_the_same_name(tmp_path):
    key = NodeKey(bytes(range(32)))
    assert is_self_name(key.name) and len(key.name) == 27 and key.name == self_name(key.public)
    assert NodeKey(bytes(range(32))).name == key.name != NodeKey.fresh().name
    assert NodeKey.load(key.write(tmp_path / "k.seed")).name == key.name  # an nkey seed file, mode 0600
    assert (tmp_path / "k.seed").stat().st_mode & 0o777 == 0o600
    assert not is_self_name("w1") and not is_self_name("vabcdefghijkl") and not is_self_name(key.name.upper())


def test_sealed_replies_of_every_kind_check_and_decode_as_the_plain_ones():
    key, checker = NodeKey.fresh(), ProofChecker()
    for plain in _replies(key.name):
        sealed = key.seal(plain, checker.box, REQ)
        assert len(sealed) == len(plain) + SEAL_BYTES
        assert checker.holds(key.name, sealed, request=REQ) and not checker.holds(key.name, plain, request=REQ)
        assert not checker.holds(key.name, sealed)  # no request known: nothing to check it against
        body = msgpack.unpackb(sealed)
        assert body["key"] == key.public and len(body["proof"]) == 16
        assert {k: v for k, v in body.items() if k not in ("key", "proof")} == msgpack.unpackb(plain)
    r, rb, _ = (key.seal(p, checker.box, REQ) for p in _replies(key.name))
    assert codec.decode_reply(r).node == key.name
    fast = codec.decode_bundle_reply(rb)
    assert fast.node == key.name and fast.ids == ("1a", "1b") and np.array_equal(fast.rows[1:], ROW)


def test_a_reply_under_a_self_certifying_name_without_that_nodes_proof_is_refused():
    key, checker = NodeKey.fresh(), ProofChecker()
    plain = _replies(key.name)[0]
    sealed = key.seal(plain, checker.box, REQ)
    other = NodeKey.fresh()

    def holds(payload, node=key.name, request=REQ):
        return checker.holds(node, payload, request=request)

    flipped = bytearray(sealed)
    flipped[len(plain) // 2] ^= 1  # a changed row byte
    assert holds(sealed) and not holds(bytes(flipped))
    assert not holds(sealed[:-1] + bytes([sealed[-1] ^ 1]))  # a changed tag
    assert not holds(other.seal(plain, checker.box, REQ))  # a valid proof of another key
    assert not holds(key.seal(plain, ProofChecker().box, REQ))  # proved to another backbone
    assert not holds(sealed + b"\x00") and not holds(b"")
    # the node's honest answer to a stranger's rows under the backbone's request id and box
    spliced = codec.RequestEncoder(MODEL, checker.box).encode(3, 17, "1a", ROW * 2)
    assert not holds(key.seal(plain, checker.box, spliced))
    # the liar's own key under the liar's own name is fine: that is its own reply
    assert holds(other.seal(_replies(other.name)[0], checker.box, REQ), node=other.name)
    # a name of no special form needs no proof (a chosen --node, a creds identity)
    assert checker.holds("w1", _replies("w1")[0])


def test_a_box_x25519_refuses_leaves_the_reply_unsealed():
    key = NodeKey.fresh()
    plain = _replies(key.name)[0]
    assert key.seal(plain, bytes(32), REQ) == plain  # the all-zero point: no agreed key
    assert key.seal(plain, b"", REQ) == plain


def test_requests_and_bundles_carry_the_box_and_every_encoder_writes_the_records_bytes():
    box = ProofChecker().box
    enc = codec.RequestEncoder(MODEL, box)
    assert enc.encode(3, 17, "1a", ROW) == DispatchRequest(MODEL, 3, 17, ROW, "1a", box).encode()
    assert codec.RequestEncoder(MODEL).encode(3, 17, "1a", ROW) == DispatchRequest(MODEL, 3, 17, ROW, "1a").encode()
    fast = codec.RequestDecoder(MODEL, 8).decode(enc.encode(3, 17, "1a", ROW))
    assert fast.box == box and codec.decode_request(enc.encode(3, 17, "1a", ROW)).box == box
    bundles = codec.BundleEncoder(MODEL, box)
    one = bundles.encode_one_row(3, "b1", ROW, ["1a", "1b"], [17, 20])
    assert one == bundles.encode(3, "b1", ROW, ["1a", "1b"], [17, 20], [1, 1], [0, 0]) == \
        BundleRequest(MODEL, 3, "b1", ROW, ("1a", "1b"), (17, 20), (1, 1), np.zeros(2, np.uint32), box).encode()
    assert codec.BundleDecoder(MODEL, 8).decode(one).box == box == codec.decode_bundle(one).box


@pytest.mark.parametrize("box", [b"\x01" * 31, "x" * 32, 7])
def test_a_box_that_is_not_32_bytes_is_refused_by_name(box):
    body = {"v": 1, "t": "x", "model": MODEL, "layer": 0, "expert": 0, "request_id": "1a",
            "dtype": "float32", "shape": [1, 8], "data": ROW.tobytes(), "box": box}
    data = msgpack.packb(body, use_bin_type=True)
    for decode in (codec.decode_request, codec.RequestDecoder(MODEL, 8).decode):
        with pytest.raises(CodecError, match="box"):
            decode(data)
    with pytest.raises(CodecError, match="box"):
        codec.RequestEncoder(MODEL, b"\x01" * 31)


def test_the_documented_test_vector_is_what_the_reference_computes():
    import hashlib
    from pathlib import Path

    from nacl.public import PrivateKey

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    key = NodeKey(b"\x01" * 32)
    box = bytes(PrivateKey(b"\x02" * 32).public_key)
    row = np.array([[1.0, -2.0, 0.5, 0.0]], dtype=np.float32)
    request = codec.RequestEncoder(MODEL, box).encode(3, 17, "1a", row)
    reply = codec.DispatchReply(request_id="1a", node=key.name, rows=row, kernel="ggml-x86_64").encode()
    sealed = key.seal(reply, box, request)
    for value in (key.public.hex(), key.name, box.hex(), key.agreed(box).hex(),
                  hashlib.sha256(request).hexdigest(), sealed[-16:].hex()):
        assert f"`{value}`" in doc, value


def test_a_refusal_before_decoding_finds_the_box_where_the_reference_encodes_it():
    from workers.runtime import _peek_box

    box = ProofChecker().box
    assert _peek_box(codec.RequestEncoder(MODEL, box).encode(3, 17, "1a", ROW)) == box
    bundle = codec.BundleEncoder(MODEL, box)
    assert _peek_box(bundle.encode_one_row(3, "b1", ROW, ["1a", "1b"], [17, 20])) == box
    assert _peek_box(bundle.encode(3, "b1", ROW, ["1a"], [17], [1], [0])) == box
    assert _peek_box(codec.RequestEncoder(MODEL).encode(3, 17, "1a", ROW)) == b""
