"""The backbone's manifest: every expert slab's place and SHA-256, cached, answered on the bus."""

from __future__ import annotations

import hashlib
import os

import pytest

from backbone import manifest as mf
from kvasir_bus import market_codec
from kvasir_bus.connect import connect
from kvasir_bus.fingerprint import model_fingerprint
from kvasir_bus.subjects import Subjects
from kernels.tensors import open_gguf, tensors_from_reader

pytest.importorskip("llama_cpp", reason="synthetic models are built with llama.cpp's quantizer")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="qwen3moe", preset="tiny",
                       qtype="q8_0", seed=1)


def test_manifest_has_every_slab_with_its_offset_size_and_sha256(model, tmp_path):
    m = mf.build_manifest(model, cache_path=tmp_path / "c", source_url="http://h:1/tiny.gguf")
    reader = open_gguf(model)
    tensors = tensors_from_reader(reader)
    starts = {t.name: int(t.data_offset) for t in reader.tensors}
    assert m.model == model_fingerprint(reader)
    assert (m.arch, m.n_layer, m.n_expert, m.n_embd, m.n_ff) == ("qwen3moe", 2, 8, 64, 32)
    assert (m.file_bytes, m.data_offset) == (os.path.getsize(model), reader.data_offset)
    assert m.source_url == "http://h:1/tiny.gguf"
    assert len(m.slabs) == 2 * 8 * 3
    for layer in range(2):
        for e in range(8):
            for slab in m.slabs_for(layer, e):
                t = tensors[f"blk.{layer}.ffn_{slab.kind}_exps.weight"]
                data = t.expert(e).data
                assert slab.size == data.nbytes
                assert slab.offset == starts[t.name] + e * t.expert_bytes
                assert slab.sha256 == hashlib.sha256(data).hexdigest()


def test_the_cache_spares_a_rehash_and_is_rebuilt_when_the_file_changes(model, tmp_path, monkeypatch):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(model.read_bytes())
    first = mf.build_manifest(copy)
    assert os.path.exists(str(copy) + ".kvasir-manifest")

    def no_hashing(*args, **kw):
        raise AssertionError("rehashed although the cache is valid")

    monkeypatch.setattr(mf, "_hash_tensor", no_hashing)
    again = mf.build_manifest(copy, source_url="http://elsewhere/model.gguf")
    assert again.slabs == first.slabs and again.source_url == "http://elsewhere/model.gguf"

    os.utime(copy, ns=(1, 1))  # another mtime: the cache no longer vouches for the file
    with pytest.raises(AssertionError, match="rehashed"):
        mf.build_manifest(copy)
    monkeypatch.undo()
    assert mf.build_manifest(copy).slabs == first.slabs


def test_an_unwritable_cache_is_only_logged(model, tmp_path):
    m = mf.build_manifest(model, cache_path=tmp_path / "no-such-dir" / "cache")
    assert len(m.slabs) == 48


def test_hashing_streams_through_a_bounded_buffer(model, tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "CHUNK_BYTES", 1000)
    reads = []
    real = os.pread
    monkeypatch.setattr(mf.os, "pread", lambda fd, n, off: reads.append(n) or real(fd, n, off))
    small = mf.build_manifest(model, cache=False)
    assert max(reads) <= 1000
    monkeypatch.undo()
    assert small.slabs == mf.build_manifest(model, cache=False).slabs


def test_a_manifest_request_on_the_bus_gets_the_manifest(model, tmp_path, nats_server, arun):
    m = mf.build_manifest(model, cache_path=tmp_path / "c", source_url="http://h/tiny.gguf")

    async def go():
        nc = await connect(nats_server.url, "backbone")
        sub = await mf.serve_manifest(nc, m)
        client = await connect(nats_server.url, "asker")
        reply = await client.request(Subjects(m.model).manifest(), b"", timeout=5)
        got = market_codec.decode_manifest_reply(reply.data)
        await sub.unsubscribe()
        await client.close()
        await nc.close()
        return got

    assert arun(go()) == m
