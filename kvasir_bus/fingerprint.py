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

:func:`fingerprint` is the one definition, over plain data; :func:`compute_fingerprint` feeds
it from a memory-mapped :class:`gguf.GGUFReader`, and ``modelfile.gguf_header.parse_header``
from the header bytes fetched over HTTP. Both must give the same digits for the same file.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Iterator, Sequence

from gguf import GGUFReader

SLICE_SOURCE_KEY = "kvasir.slice.source_fingerprint"
LENGTH = 16
_PREFIX = b"kvasir-fingerprint-v2\0"

#: One metadata key/value: (key, its record exactly as encoded in the file: key length, key
#: bytes, value type, value). Any object with the buffer protocol will do for the record.
MetadataRecord = tuple[str, "bytes | memoryview"]
#: One tensor of the table: (name, ggml type, ne in ggml order (innermost first), data bytes).
TensorRecord = tuple[str, int, Sequence[int], int]


def fingerprint(metadata: Iterable[MetadataRecord], tensors: Iterable[TensorRecord]) -> str:
    """The fingerprint of a GGUF from its metadata records and tensor table, both in file order.

    Keys starting with ``GGUF.`` are skipped: gguf-py's reader makes pseudo-fields of that
    name for the header's version and counts, which are not key/values of the file.
    """
    h = hashlib.sha256(_PREFIX)
    for key, record in metadata:
        if not key.startswith("GGUF."):
            h.update(record)
    for name, ggml_type, ne, nbytes in tensors:
        h.update(f"{name}|{int(ggml_type)}|{tuple(int(n) for n in ne)}|{int(nbytes)}\n".encode())
    return h.hexdigest()[:LENGTH]


def model_fingerprint(reader: GGUFReader) -> str:
    """The model a file belongs to: its own fingerprint, or for a slice its source's."""
    recorded = reader.fields.get(SLICE_SOURCE_KEY)
    if recorded is not None:
        return bytes(recorded.parts[recorded.data[0]]).decode()
    return compute_fingerprint(reader)


def compute_fingerprint(reader: GGUFReader) -> str:
    """:func:`fingerprint` of the file ``reader`` has open (of a slice: the slice's own)."""
    tensors = ((t.name, int(t.tensor_type), t.shape, int(t.n_bytes)) for t in reader.tensors)
    return fingerprint(_reader_records(reader), tensors)


def _reader_records(reader: GGUFReader) -> Iterator[MetadataRecord]:
    # a field's parts are consecutive views of the mapped file: the record is their span
    for name, field in reader.fields.items():
        size = sum(int(part.nbytes) for part in field.parts)
        yield name, reader.data[field.offset:field.offset + size]
