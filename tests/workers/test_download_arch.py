"""Volunteers' partial download on the new architectures: gpt-oss (each expert's bias rows are
slabs of the manifest) and a split GGUF (a 3-part copy: every slab is fetched from its part).

In both, the downloaded slice must be byte for byte the slice ``kvasir slice`` cuts from the
single file, and the worker serving it must answer exactly what the monolithic model's expert
computes.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest
from gguf import GGUFReader

from backbone.manifest import build_manifest
from kernels.expert import expert_ffn
from kernels.tensors import tensors_from_reader
from kvasir_bus import codec, market_codec, wire
from kvasir_bus.connect import connect
from kvasir_bus.errors import KvasirError
from kvasir_bus.market_codec import Manifest, ManifestPart, SlabRef, UnsupportedVersionError
from kvasir_bus.subjects import Subjects
from modelfile.slice_file import KINDS, load_slice
from modelfile.slicer import plan_slice, write_slice
from tests.modelfile.test_split_gguf import write_split
from tests.workers.test_download import Bus, assign
from workers import download as dl
from workers.runtime import Worker, WorkerConfig
from workers.source import identify, open_source
from workers.verify import check_slabs
from workers.volunteer import VolunteerConfig, parse_size, volunteer

H = codec.Holding
ASSIGNED = (H(0, 1, 4), H(1, 5, 8))  # 6 of 8 experts in two layers


@pytest.fixture(scope="module")
def gpt_oss(models):
    return models("gpt-oss", "mxfp4")


@pytest.fixture(scope="module")
def split(models, tmp_path_factory):
    single = models("qwen3moe", "q8_0", seed=1)
    return single, write_split(single, tmp_path_factory.mktemp("split3"), 3)


def _kvasir_slice(single, holdings, out):
    plan = plan_slice(single, [((h.layer, h.layer), (h.lo, h.last)) for h in holdings])
    return write_slice(plan, out).path


def _expert(single, layer, e):
    t = tensors_from_reader(GGUFReader(single))
    weights = []
    for kind in KINDS:
        bias = t.get(f"blk.{layer}.ffn_{kind}_exps.bias")
        weights.append(t[f"blk.{layer}.ffn_{kind}_exps.weight"].expert(
            e, None if bias is None else bias.f32(), "swiglu_oai" if bias is not None and kind == "gate"
            else "swiglu"))
    return weights


# -- the manifest --------------------------------------------------------------------------------

def test_a_gpt_oss_manifest_has_each_experts_bias_rows_and_is_version_2(gpt_oss, tmp_path):
    m = build_manifest(gpt_oss, cache_path=tmp_path / "mf")
    t = tensors_from_reader(GGUFReader(gpt_oss))
    for layer in m.moe_layers:
        for e in (0, m.n_expert - 1):
            refs = {s.kind: s for s in m.slabs_for(layer, e)}
            assert set(refs) == set(market_codec.SLAB_KINDS)
            for kind in KINDS:
                row = t[f"blk.{layer}.ffn_{kind}_exps.bias"].f32()[e]
                ref = refs[f"{kind}_bias"]
                assert ref.size == row.nbytes
                assert ref.sha256 == hashlib.sha256(row.astype("<f4").tobytes()).hexdigest()
    assert m.wire_version == market_codec.MANIFEST_V2
    assert market_codec.decode_manifest(m.encode()) == m
    assert build_manifest(gpt_oss, cache_path=tmp_path / "mf") == m  # the cache keeps the bias slabs


def test_a_split_manifest_names_each_slabs_part_and_equals_the_single_files_digests(split, tmp_path):
    single, parts = split
    one = build_manifest(single, cache_path=tmp_path / "one")
    three = build_manifest(parts[1], cache_path=tmp_path / "three")  # any part stands for the whole
    assert one.wire_version == 1 and one.parts == ()
    assert [p.name for p in three.parts] == [p.name for p in parts]
    assert three.model == one.model and three.wire_version == market_codec.MANIFEST_V2
    assert {s.part for s in three.slabs} == {1, 2}  # the experts lie in the later parts, not the first
    digests = lambda m: [(s.layer, s.expert, s.kind, s.size, s.sha256) for s in m.slabs]  # noqa: E731
    assert digests(three) == digests(one)
    assert market_codec.decode_manifest(three.encode()) == three


def test_an_old_reader_refuses_a_version_2_manifest_on_the_envelope(gpt_oss, tmp_path, monkeypatch):
    m = build_manifest(gpt_oss, cache_path=tmp_path / "mf")
    monkeypatch.setattr(Manifest, "versions", (1,))
    monkeypatch.setattr(wire, "_SPOKEN", {})  # the versions cache, as an old build starts it (restored after)  # what a worker built before version 2 speaks
    with pytest.raises(UnsupportedVersionError, match="message version 2 is not supported"):
        market_codec.decode_manifest_reply(m.encode())


def test_a_plain_manifest_is_still_sent_as_version_1_without_new_fields():
    sha = "ab" * 32
    slabs = tuple(SlabRef(0, e, k, 100 + 10 * i + 30 * e, 10, sha) for e in range(2) for i, k in enumerate(KINDS))
    m = Manifest(model="0123456789abcdef", arch="qwen3moe", n_layer=1, n_expert=2, n_embd=4, n_ff=4,
                 file_bytes=1000, data_offset=64, source_url="", slabs=slabs)
    raw = msgpack.unpackb(m.encode(), raw=False)
    assert raw["v"] == 1 and "parts" not in raw and "slab_part" not in raw
    assert market_codec.headers_for(m)["Kvasir-Version"] == "1"


def test_manifest_v2_checks_parts_and_bias_slabs():
    sha = "cd" * 32
    parts = (ManifestPart("m-00001-of-00002.gguf", 500, 64), ManifestPart("m-00002-of-00002.gguf", 900, 32))
    slabs = [SlabRef(0, 0, k, 100 + 10 * i, 10, sha, 1) for i, k in enumerate(market_codec.SLAB_KINDS)]
    base = dict(model="0123456789abcdef", arch="gpt-oss", n_layer=1, n_expert=1, n_embd=4, n_ff=4,
                file_bytes=500, data_offset=64, source_url="", parts=parts)
    m = Manifest(**base, slabs=tuple(slabs))
    assert market_codec.decode_manifest(m.encode()) == m
    with pytest.raises(market_codec.CodecError, match="lack the down_bias slab"):
        Manifest(**base, slabs=tuple(slabs[:-1]))
    with pytest.raises(market_codec.CodecError, match="in part 2"):
        Manifest(**base, slabs=tuple(dataclasses.replace(s, part=2) for s in slabs))
    with pytest.raises(market_codec.CodecError, match=r"outside the tensor data \[32, 900\)"):
        Manifest(**base, slabs=tuple(dataclasses.replace(s, offset=895) if s.kind == "gate" else s for s in slabs))
    with pytest.raises(market_codec.CodecError, match="parts"):
        Manifest(**{**base, "file_bytes": 600}, slabs=tuple(slabs))


# -- downloading -----------------------------------------------------------------------------------

def test_gpt_oss_download_fetches_the_bias_rows_and_equals_kvasir_slice(gpt_oss, serve, tmp_path):
    m = build_manifest(gpt_oss, cache_path=tmp_path / "mf")
    srv = serve(gpt_oss)
    with open_source(srv.url, node="v1") as src:
        ident = identify(src)
        plan = dl.plan_download(ident, m, ASSIGNED)
        result = dl.download_slice(src, plan, tmp_path, cache=ident.cache)
    assert {j.kind for j in plan.jobs} == set(market_codec.SLAB_KINDS)
    assert plan.slab_bytes == sum(m.expert_bytes(h.layer) * h.count for h in ASSIGNED)
    want = _kvasir_slice(gpt_oss, ASSIGNED, tmp_path / "cut.gguf")
    assert open(result.path, "rb").read() == open(want, "rb").read()
    assert check_slabs(load_slice(result.path), m) == []
    assert result.fetched + result.from_cache == plan.slab_bytes


def test_a_doctored_bias_row_is_caught_by_the_workers_check(gpt_oss, tmp_path):
    m = build_manifest(gpt_oss, cache_path=tmp_path / "mf")
    path = _kvasir_slice(gpt_oss, ASSIGNED, tmp_path / "cut.gguf")
    info = load_slice(path)
    row = info.slab(1, 6, "up_bias")
    data = bytearray(open(path, "rb").read())
    at = data.find(row)
    data[at:at + 4] = np.float32(1e3).tobytes()
    open(path, "wb").write(bytes(data))
    bad = check_slabs(load_slice(path), m)
    assert [str(b) for b in bad] == ["layer 1 expert 6 up_bias"]


def test_split_download_fetches_each_slab_from_its_part_and_equals_kvasir_slice(split, serve, tmp_path):
    single, parts = split
    m = build_manifest(parts[0], cache_path=tmp_path / "mf")
    srv = serve(parts[2])  # any part serves them all
    url = srv.url.replace(parts[0].name, parts[1].name)  # and a volunteer may start from any part
    first = open_source(url, node="v1")
    sources, idents = dl.identify_parts(url, first, identify(first), lambda u: open_source(u, node="v1"))
    try:
        assert [s.name.rsplit("/", 1)[-1] for s in sources] == [p.name for p in parts]
        plan = dl.plan_download(idents, m, ASSIGNED)
        result = dl.download_slice(sources, plan, tmp_path, cache=[i.cache for i in idents])
    finally:
        for s in sources:
            s.close()
    assert len({j.part for j in plan.jobs}) > 1
    want = _kvasir_slice(parts[0], ASSIGNED, tmp_path / "cut.gguf")  # its header names the file cut
    assert open(result.path, "rb").read() == open(want, "rb").read()
    got, one = load_slice(result.path), load_slice(_kvasir_slice(single, ASSIGNED, tmp_path / "one.gguf"))
    assert got.fingerprint == one.fingerprint and got.holdings == one.holdings
    assert all(got.slab(layer, e, k) == one.slab(layer, e, k) for layer, e in one.experts() for k in KINDS)
    assert srv.served_to("v1") == sum(s.fetched for s in sources)
    assert result.fetched + result.from_cache == plan.slab_bytes  # every slab byte fetched once
    # beyond the slabs: each part's header reads (8 KiB at least each) and its 1-byte size probe
    assert srv.served_to("v1") <= plan.slab_bytes + sum(i.fetched_header + 1 for i in idents)
    with pytest.raises(dl.DownloadError, match="one part of a split GGUF"):
        dl.plan_download(idents[0], m, ASSIGNED)


@pytest.mark.parametrize("which", ["gpt_oss", "split"])
def test_a_volunteer_downloads_its_range_and_serves_what_the_single_file_computes(
        which, request, serve, tmp_path, nats_server, arun):
    got = request.getfixturevalue(which)
    single, served = (got, got) if which == "gpt_oss" else (got[0], got[1][0])
    m = build_manifest(served, cache_path=tmp_path / "mf")
    srv = serve(served, tokens=["node-token"])
    rows = np.random.default_rng(0).standard_normal((3, m.n_embd)).astype(np.float32)

    async def go():
        nc = await connect(nats_server.url, "backbone")
        await Bus(nc, m, assign(m, ASSIGNED)).start()
        wc = await connect(nats_server.url, "volunteer")
        cfg = VolunteerConfig(source=srv.url, budget_bytes=parse_size("10MB"), node="phone-1",
                              token="node-token", cache_dir=str(tmp_path))
        done = await volunteer(wc, cfg)
        worker = Worker(done.slice, WorkerConfig(node="phone-1", heartbeat_s=60))
        await worker.start(wc)
        replies = {}
        for layer, e in ((0, 1), (1, 7)):
            req = codec.DispatchRequest(model=m.model, layer=layer, expert=e, rows=rows, request_id=f"r{e}")
            msg = await nc.request(Subjects(m.model).dispatch(layer, e), req.encode(), timeout=10)
            replies[(layer, e)] = codec.decode_reply(msg.data)
        await worker.stop()
        await wc.close()
        await nc.close()
        return done, replies

    done, replies = arun(go(), timeout=60)
    assert done.slice.holdings == ASSIGNED
    assert len(done.parts) == (0 if which == "gpt_oss" else 3)
    for (layer, e), reply in replies.items():
        want = expert_ffn(*_expert(single, layer, e), rows, routed=True)
        np.testing.assert_array_equal(reply.rows, want)
    assert srv.served_to("phone-1") == done.fetched


def test_an_old_worker_gets_a_clear_refusal_from_a_version_2_backbone(gpt_oss, tmp_path, nats_server, arun,
                                                                        monkeypatch):
    from workers.verify import ask_manifest

    m = build_manifest(gpt_oss, cache_path=tmp_path / "mf")
    monkeypatch.setattr(Manifest, "versions", (1,))
    monkeypatch.setattr(wire, "_SPOKEN", {})  # the versions cache, as an old build starts it (restored after)

    async def go():
        nc = await connect(nats_server.url, "backbone")
        await Bus(nc, m, assign(m, ASSIGNED)).start(market=False)
        try:
            await ask_manifest(nc, m.model, 5)
        finally:
            await nc.close()

    with pytest.raises(KvasirError, match="newer than this worker reads.*upgrade kvasir"):
        arun(go(), timeout=30)
