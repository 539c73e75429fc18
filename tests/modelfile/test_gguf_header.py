"""The pure GGUF header parser, and the one fingerprint both ways of reading a GGUF give.

A volunteer fingerprints a model from the header bytes it fetched over HTTP
(``parse_header``); the backbone and ``kvasir slice`` from a memory-mapped ``GGUFReader``.
Both feed :func:`kvasir_bus.fingerprint.fingerprint`; if they disagreed, a volunteer would
ask for the manifest of a model nobody serves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from kvasir_bus.errors import ModelFileError
from kvasir_bus.fingerprint import SLICE_SOURCE_KEY, compute_fingerprint, fingerprint, model_fingerprint
from modelfile.gguf_header import GGUFHeader, NeedMore, parse_header
from tests.model_cache import ModelCache


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory)


def header_of(path) -> GGUFHeader:
    data = Path(path).read_bytes()
    return parse_header(data[:GGUFReader(path).data_offset], str(path))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
def test_header_parser_agrees_with_gguf_reader(qtype, models):
    path = models("qwen3moe", qtype)
    reader = GGUFReader(path)
    header = header_of(path)
    assert header.data_offset == reader.data_offset
    assert header.metadata["general.architecture"] == "qwen3moe"
    assert [(t.name, int(t.ggml_type), t.ne, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors]


def test_a_short_header_asks_for_more_and_never_past_the_header_end(models):
    data = models("qwen3moe", "q8_0").read_bytes()
    end = parse_header(data).header_end
    for cut in list(range(0, end, 61)) + [end - 1]:
        with pytest.raises(NeedMore) as more:
            parse_header(data[:cut])
        assert cut < more.value.end <= end  # a lower bound: fetching up to it never overshoots


def test_bytes_that_are_not_a_gguf_are_refused_by_name():
    with pytest.raises(ModelFileError, match="x.bin: not a GGUF file"):
        parse_header(b"GGML" + bytes(100), "x.bin")


# The fingerprints of these synthetic models (SYNTH_VERSION 2 files): both implementations gave
# the same values before they became one, and the value names the model on the bus: it must
# not move unless the file's metadata does.
PINNED = {
    ("qwen3moe", "f32"): "8b8537d418b2ac4e",
    ("qwen3moe", "q6_k"): "c8215ca132d0ef5c",
    ("qwen2moe", "q8_0"): "09f1a284e38a2e5a",
    ("qwen2moe", "q4_k"): "b8652f24352f1ab9",
    ("mixtral", "f32"): "0e7373a324ec5096",
    ("mixtral", "q4_k"): "d81b3567f1b29718",
}


@pytest.mark.parametrize("arch,qtype", sorted(PINNED))
def test_header_and_reader_give_the_same_pinned_fingerprint(arch, qtype, models):
    path = models(arch, qtype, seed=3)
    assert header_of(path).fingerprint == compute_fingerprint(GGUFReader(path)) == PINNED[arch, qtype]


def test_a_slice_and_a_custom_alignment_fingerprint_alike_both_ways(tmp_path):
    from modelfile.slicer import plan_slice, write_slice
    from tests.modelfile.test_slice import build_source

    source = build_source(tmp_path / "aligned.gguf", alignment=64)
    sliced = write_slice(plan_slice(source, [((1, 1), (2, 5))]), tmp_path / "s.gguf").path
    for path in (source, sliced):
        assert header_of(path).fingerprint == compute_fingerprint(GGUFReader(path))
    # a slice's own digits differ from its source's; the model it names is the source's
    sliced_header = header_of(sliced)
    assert sliced_header.fingerprint != header_of(source).fingerprint
    assert sliced_header.metadata[SLICE_SOURCE_KEY] == model_fingerprint(GGUFReader(sliced)) \
        == compute_fingerprint(GGUFReader(source))


def test_the_fingerprint_covers_metadata_and_tensor_table_but_not_reader_pseudo_fields():
    kv = [("general.architecture", b"record-a"), ("llama.block_count", b"record-b")]
    table = [("blk.0.ffn_up_exps.weight", 8, (32, 16, 4), 2176)]
    base = fingerprint(kv, table)
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint([("GGUF.version", b"3"), *kv], table) == base  # gguf-py's header fields
    assert fingerprint(kv[::-1], table) != base  # the records as laid out, in order
    assert fingerprint(kv, [("blk.0.ffn_up_exps.weight", 8, (32, 16, 5), 2176)]) != base
    assert fingerprint(kv, [("blk.0.ffn_up_exps.weight", 0, (32, 16, 4), 2176)]) != base
