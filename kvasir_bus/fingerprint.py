"""The model fingerprint: which exact build of a GGUF a node holds.

It is the first 16 hex digits of a SHA-256 over the file's metadata (every key/value exactly as
encoded) and its tensor table (name, type, shape, size): what the header says, so that a
volunteer can compute it from the header alone (a few KiB over HTTP) before it downloads any
weights. The weights themselves are checked slab by slab against the SHA-256 manifest the
backbone publishes, so a source whose bytes differ from the backbone's is refused even when
its header matches. It names the model on the bus
(``kvasir.<fingerprint>....``), so a worker holding another build is on other subjects and
can never answer. A slice records the fingerprint of the file it was cut from
(:data:`SLICE_SOURCE_KEY`); :func:`model_fingerprint` of a slice returns that.
"""

from __future__ import annotations

import hashlib

from gguf import GGUFReader

SLICE_SOURCE_KEY = "kvasir.slice.source_fingerprint"
LENGTH = 16


def model_fingerprint(reader: GGUFReader) -> str:
    recorded = reader.fields.get(SLICE_SOURCE_KEY)
    if recorded is not None:
        return bytes(recorded.parts[recorded.data[0]]).decode()
    return compute_fingerprint(reader)


def compute_fingerprint(reader: GGUFReader) -> str:
    h = hashlib.sha256(b"kvasir-fingerprint-v2\0")
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # header pseudo-fields: version and counts
            continue
        for part in field.parts:
            h.update(part.tobytes())
    for t in reader.tensors:
        h.update(f"{t.name}|{int(t.tensor_type)}|{tuple(int(n) for n in t.shape)}|{int(t.n_bytes)}\n".encode())
    return h.hexdigest()[:LENGTH]
