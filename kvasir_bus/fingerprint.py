"""The model fingerprint: which exact build of a GGUF a node holds.

It is the first 16 hex digits of a SHA-256 over the file's metadata (every key/value exactly as
encoded), its tensor table (name, type, shape, size) and a sample of each tensor's bytes (the
first and last 4 KiB). The sample is there because two builds can share metadata and shapes
(another seed, another quantizer run) yet differ in weights. It names the model on the bus
(``kvasir.<fingerprint>....``), so a worker holding another build is on other subjects and
can never answer. A slice records the fingerprint of the file it was cut from
(:data:`SLICE_SOURCE_KEY`); :func:`model_fingerprint` of a slice returns that.
"""

from __future__ import annotations

import hashlib

from gguf import GGUFReader

SLICE_SOURCE_KEY = "kvasir.slice.source_fingerprint"
LENGTH = 16
_SAMPLE = 4096


def model_fingerprint(reader: GGUFReader) -> str:
    recorded = reader.fields.get(SLICE_SOURCE_KEY)
    if recorded is not None:
        return bytes(recorded.parts[recorded.data[0]]).decode()
    return compute_fingerprint(reader)


def compute_fingerprint(reader: GGUFReader) -> str:
    h = hashlib.sha256(b"kvasir-fingerprint-v1\0")
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # header pseudo-fields: version and counts
            continue
        for part in field.parts:
            h.update(part.tobytes())
    for t in reader.tensors:
        h.update(f"{t.name}|{int(t.tensor_type)}|{tuple(int(n) for n in t.shape)}|{int(t.n_bytes)}\n".encode())
        start, size = int(t.data_offset), int(t.n_bytes)
        h.update(reader.data[start:start + min(size, _SAMPLE)].tobytes())
        h.update(reader.data[start + max(0, size - _SAMPLE):start + size].tobytes())
    return h.hexdigest()[:LENGTH]
