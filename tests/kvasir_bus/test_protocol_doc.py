"""docs/protocol.md is the spec a worker in another language is written from: its hex examples
must be what the reference encodes, and decode back to the records they describe."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvasir_bus import codec

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
ROW = np.array([[1.0, -2.0, 0.5, 0.0]], dtype=np.float32)


def _examples() -> list[bytes]:
    blocks = re.findall(r"```\n([0-9a-f \n]+)```", DOC.read_text())
    return [bytes.fromhex(b.replace("\n", " ")) for b in blocks]


def test_the_documented_bytes_are_what_the_reference_encodes():
    req = codec.DispatchRequest(model="0123456789abcdef", layer=3, expert=17, rows=ROW, request_id="1a")
    rep = codec.DispatchReply(request_id="1a", node="w0", rows=ROW, kernel="ggml-x86_64")
    err = codec.ErrorReply(request_id="1a", node="w0", code="not_held", message="no")
    bundle = codec.BundleRequest("0123456789abcdef", 3, "b1", ROW, ("1a", "1b"), (17, 20), (1, 1),
                                 np.array([0, 0], np.uint32))
    bundle_reply = codec.BundleReply("b1", "w0", ("1a",), (1,), ROW, (("1b", "not_held", "no"),), "ggml-x86_64")
    assert _examples() == [req.encode(), rep.encode(), err.encode(), bundle.encode(), bundle_reply.encode()]


def test_the_documented_bytes_decode_to_the_documented_fields():
    req_bytes, rep_bytes, err_bytes, bundle_bytes, bundle_reply_bytes = _examples()
    req = codec.decode_request(req_bytes, n_embd=4)
    assert (req.model, req.layer, req.expert, req.request_id) == ("0123456789abcdef", 3, 17, "1a")
    assert np.array_equal(req.rows, ROW)
    rep = codec.decode_reply(rep_bytes, n_embd=4)
    assert rep.kernel == "ggml-x86_64" and np.array_equal(rep.rows, ROW)
    err = codec.decode_reply(err_bytes)
    assert (err.code, err.message) == ("not_held", "no")
    bundle = codec.decode_bundle(bundle_bytes, n_embd=4)
    assert (bundle.layer, bundle.bundle_id, bundle.ids, bundle.experts, bundle.counts) == (3, "b1", ("1a", "1b"),
                                                                                          (17, 20), (1, 1))
    assert bundle.index.tolist() == [0, 0] and np.array_equal(bundle.rows, ROW)
    answer = codec.decode_bundle_reply(bundle_reply_bytes, n_embd=4)
    assert [rid for rid, _ in answer.results()] == ["1a"] and answer.errors == (("1b", "not_held", "no"),)
