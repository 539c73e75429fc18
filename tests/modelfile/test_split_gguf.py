"""Split GGUF files (``name-00001-of-00003.gguf``, as llama.cpp's gguf-split writes them): the
engine, ``kvasir slice`` and ``kvasir info`` read them as the single file they were split from.

The split copy is written here with gguf-py, as gguf-split lays it out: every part a GGUF of its
own with ``split.no`` (0-based), ``split.count`` and ``split.tensors.count``; the first part has
all the metadata, the others only the split keys; tensors in the original order, spread over parts.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter

from kernels.tensors import open_gguf
from kvasir_bus.errors import ModelFileError
from kvasir_bus.fingerprint import model_fingerprint

pytest.importorskip("llama_cpp", reason="the synthetic models are made with llama.cpp's quantizer")


def write_split(src, out_dir, parts: int) -> list:
    """A gguf-split style copy of ``src`` in ``parts`` parts; returns their paths."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tensors = list(r.tensors)
    bounds = np.linspace(0, len(tensors), parts + 1).astype(int)
    paths = []
    for no in range(parts):
        path = out_dir / f"model-{no + 1:05d}-of-{parts:05d}.gguf"
        w = GGUFWriter(path, arch)  # writes general.architecture first, as the source has it
        if no == 0:
            for key, f in r.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
                w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
        w.add_uint16("split.no", no)
        w.add_uint16("split.count", parts)
        w.add_int32("split.tensors.count", len(tensors))
        for t in tensors[bounds[no]:bounds[no + 1]]:
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            ne = [int(n) for n in t.shape]
            byte_shape = (*reversed(ne[1:]), ne[0] // block * size)
            w.add_tensor(t.name, np.asarray(t.data).view(np.uint8).reshape(byte_shape), raw_shape=byte_shape,
                         raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def split_model(models, tmp_path_factory):
    single = models("gpt-oss", "mxfp4")
    return single, write_split(single, tmp_path_factory.mktemp("split"), 3)


def test_split_copy_reads_as_the_single_file(split_model):
    single, parts = split_model
    a, b = open_gguf(single), open_gguf(parts[1])  # any part opens the whole
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    assert len({str(p) for p in b.paths}) == 3
    assert model_fingerprint(b) == model_fingerprint(a)  # the split.* keys are not the model's


def test_split_copy_gives_the_same_logits(split_model):
    from backbone.model import Engine

    single, parts = split_model
    tokens = np.random.default_rng(0).integers(0, 300, 40)
    one, split = Engine(single), Engine(parts[0])
    assert np.array_equal(split.forward([(split.new_sequence(), tokens)])[0],
                          one.forward([(one.new_sequence(), tokens)])[0])


def test_split_copy_gives_the_same_slice(split_model, tmp_path):
    from modelfile.slice_file import load_slice
    from modelfile.slicer import parse_span, plan_slice, write_slice

    single, parts = split_model
    req = [(parse_span("0-1", "layers"), parse_span("3-6", "experts"))]
    write_slice(plan_slice(single, req), tmp_path / "a.gguf")
    write_slice(plan_slice(parts[0], req), tmp_path / "b.gguf")
    a, b = load_slice(tmp_path / "a.gguf"), load_slice(tmp_path / "b.gguf")
    assert a.fingerprint == b.fingerprint and a.holdings == b.holdings
    for layer, e in a.experts():
        for x, y in zip(a.expert_weights(layer, e), b.expert_weights(layer, e)):
            assert bytes(x.data) == bytes(y.data) and np.array_equal(x.bias, y.bias)
    # the files differ only in the source's file name they record
    ra, rb = GGUFReader(tmp_path / "a.gguf"), GGUFReader(tmp_path / "b.gguf")
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.name == tb.name and bytes(ta.data) == bytes(tb.data)


def test_kvasir_info_reads_a_split_copy(split_model, capsys):
    from kvasir_bus.cli import main

    single, parts = split_model
    assert main(["info", "--json", str(parts[2])]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert main(["info", "--json", str(single)]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == whole["fingerprint"] and info["tensor_types"] == whole["tensor_types"]
    assert info["file_bytes"] == sum(p.stat().st_size for p in parts)


def test_a_missing_or_foreign_part_is_one_clear_error(split_model, tmp_path, capsys):
    from kvasir_bus.cli import main

    _, parts = split_model
    lone = tmp_path / "model-00001-of-00002.gguf"
    lone.write_bytes(parts[0].read_bytes())
    with pytest.raises(ModelFileError, match="part 2 of 2 .* is missing"):
        open_gguf(lone)
    (tmp_path / "model-00002-of-00002.gguf").write_bytes(parts[1].read_bytes())  # a part of a 3-way split
    with pytest.raises(ModelFileError, match="split.count 3"):
        open_gguf(lone)
    assert main(["info", str(lone)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_manifest_of_a_split_copy_has_the_single_files_slabs_in_their_parts(split_model):
    """gpt-oss' bias rows included; the download itself: tests/workers/test_download_arch.py."""
    from backbone.manifest import build_manifest

    single, parts = split_model
    one, split = build_manifest(single, cache=False), build_manifest(parts[0], cache=False)
    assert split.model == one.model and len(split.parts) == 3 and not one.parts
    assert [(s.layer, s.expert, s.kind, s.sha256) for s in split.slabs] == \
        [(s.layer, s.expert, s.kind, s.sha256) for s in one.slabs]
    assert any(s.kind.endswith("_bias") for s in split.slabs)
