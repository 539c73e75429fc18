"""`kvasir slice` and `load_slice`: a slice is the source's expert byte ranges, copied verbatim.

The source models are built here with gguf's writer: 3 layers (layer 0 dense, layers 1-2 MoE
with 8 experts), layer 1's experts in Q8_0/Q8_0/F32, layer 2's in F16. n_ff = 36 makes the
Q8_0 slabs 3,672 bytes, not a multiple of the 32-byte alignment, so the padding between
tensors matters.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFValueType  # noqa: E402

from kvasir_bus.cli import main  # noqa: E402
from kvasir_bus.errors import ModelFileError  # noqa: E402
from kvasir_bus.fingerprint import SLICE_SOURCE_KEY, compute_fingerprint, model_fingerprint  # noqa: E402
from modelfile import slicer  # noqa: E402
from kvasir_bus.wire import Holding  # noqa: E402
from modelfile.slice_file import KEYS, load_slice  # noqa: E402
from kernels.tensors import tensors_from_reader  # noqa: E402

N_EMBD, N_FF, N_EXP = 96, 36, 8
LAYER_TYPES = {1: (T.Q8_0, T.Q8_0, T.F32), 2: (T.F16, T.F16, T.F16)}
KINDS = ("gate", "up", "down")


def build_source(path, *, alignment: int | None = None, seed: int = 0, moe: bool = True) -> str:
    """A small llama-arch MoE GGUF with non-trivial random weights."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("tiny-moe")
    w.add_block_count(3)
    w.add_context_length(64)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(4)
    w.add_expert_count(N_EXP)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, N_EMBD), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    # layer 0 is dense, like the leading dense layers of some MoE models
    w.add_tensor("blk.0.ffn_gate.weight", rng.standard_normal((N_FF, N_EMBD), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((N_FF, N_EMBD), dtype=np.float32))
    w.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((N_EMBD, N_FF), dtype=np.float32))
    for layer, types in LAYER_TYPES.items():
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(N_EMBD, np.float32))
        if not moe:
            continue
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((N_EXP, N_EMBD), dtype=np.float32))
        for kind, qtype in zip(KINDS, types):
            shape = (N_EXP, N_EMBD, N_FF) if kind == "down" else (N_EXP, N_FF, N_EMBD)  # numpy order
            x = rng.standard_normal(shape, dtype=np.float32)
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            if qtype == T.F32:
                w.add_tensor(name, x)
            elif qtype == T.F16:
                w.add_tensor(name, x.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return build_source(tmp_path_factory.mktemp("src") / "tiny-moe.gguf")


def run_slice(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["slice", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def source_slab(src: GGUFReader, layer: int, kind: str, expert: int) -> bytes:
    t = next(t for t in src.tensors if t.name == f"blk.{layer}.ffn_{kind}_exps.weight")
    nb2 = int(t.n_bytes) // int(t.shape[2])
    start = int(t.data_offset) + expert * nb2
    return src.data[start:start + nb2].tobytes()


def held(reader: GGUFReader) -> list[Holding]:
    """The holdings a slice's metadata names (stored as inclusive first..last)."""
    f = reader.fields
    return [Holding.inclusive(*x) for x in zip(f[KEYS.LAYERS].contents(), f[KEYS.EXPERT_FIRST].contents(),
                                     f[KEYS.EXPERT_LAST].contents())]


# --- the bytes -------------------------------------------------------------------------------


def test_slice_bytes_are_the_source_byte_ranges_of_every_held_expert(source, tmp_path, capsys):
    out = tmp_path / "part.gguf"
    rc, stdout, err = run_slice(capsys, source, "--layer", 1, "--experts", "2-4",
                                "--layer", 2, "--experts", 0, "--layer", 2, "--experts", 7, "-o", out)
    assert rc == 0, err
    src, sl = GGUFReader(source), GGUFReader(out)
    assert held(sl) == [Holding.parse("L1:2-4"), Holding.parse("L2:0-0"), Holding.parse("L2:7-7")]
    pairs = [(1, 2), (1, 3), (1, 4), (2, 0), (2, 7)]
    for layer, expert in pairs:
        for kind in KINDS:
            h = next(h for h in held(sl) if h.covers(layer, expert))
            t = next(t for t in sl.tensors if t.name == f"blk.{layer}.ffn_{kind}_exps.{h.lo}-{h.last}.weight")
            nb2 = int(t.n_bytes) // h.count
            start = int(t.data_offset) + (expert - h.lo) * nb2
            assert sl.data[start:start + nb2].tobytes() == source_slab(src, layer, kind, expert), (layer, kind, expert)
    # and each whole tensor is exactly the source slabs concatenated, nothing else
    t = next(t for t in sl.tensors if t.name == "blk.1.ffn_gate_exps.2-4.weight")
    assert t.data.tobytes() == b"".join(source_slab(src, 1, "gate", e) for e in (2, 3, 4))
    assert len(stdout.strip().splitlines()) == 1
    assert str(out) in stdout and "5 experts" in stdout and f"{os.path.getsize(out)} bytes" in stdout


def test_slice_is_a_gguf_with_source_fingerprint_shapes_types_and_metadata(source, tmp_path, capsys):
    out = tmp_path / "part.gguf"
    assert run_slice(capsys, source, "--layer", 1, "--experts", "0-7", "--layer", 2, "--experts", 3, "-o", out)[0] == 0
    src, sl = GGUFReader(source), GGUFReader(out)
    f = sl.fields
    assert f["general.architecture"].contents() == "llama"
    assert f[KEYS.VERSION].contents() == 1
    assert f[SLICE_SOURCE_KEY].contents() == model_fingerprint(src) == compute_fingerprint(src)
    assert model_fingerprint(sl) == model_fingerprint(src)  # a slice names the model it came from
    assert (f[KEYS.N_EMBD].contents(), f[KEYS.N_FF].contents()) == (N_EMBD, N_FF)
    assert (f[KEYS.EXPERT_COUNT].contents(), f[KEYS.BLOCK_COUNT].contents()) == (N_EXP, 3)
    assert f[KEYS.LAYERS].types == [GGUFValueType.ARRAY, GGUFValueType.UINT32]
    got = {t.name: (int(t.tensor_type), tuple(int(n) for n in t.shape)) for t in sl.tensors}
    assert got == {
        "blk.1.ffn_gate_exps.0-7.weight": (T.Q8_0, (N_EMBD, N_FF, 8)),
        "blk.1.ffn_up_exps.0-7.weight": (T.Q8_0, (N_EMBD, N_FF, 8)),
        "blk.1.ffn_down_exps.0-7.weight": (T.F32, (N_FF, N_EMBD, 8)),
        "blk.2.ffn_gate_exps.3-3.weight": (T.F16, (N_EMBD, N_FF, 1)),
        "blk.2.ffn_up_exps.3-3.weight": (T.F16, (N_EMBD, N_FF, 1)),
        "blk.2.ffn_down_exps.3-3.weight": (T.F16, (N_FF, N_EMBD, 1)),
    }
    # a whole layer's tensor is byte-identical to the source tensor
    assert sl.tensors[0].data.tobytes() == next(
        t for t in src.tensors if t.name == "blk.1.ffn_gate_exps.weight").data.tobytes()
    for t in sl.tensors:
        assert int(t.data_offset) % 32 == 0


def test_load_slice_expert_weights_equal_the_source_experts(source, tmp_path, capsys):
    out = tmp_path / "part.gguf"
    assert run_slice(capsys, source, "--layer", 1, "--experts", "1-3", "--layer", 2, "--experts", "5-7",
                     "--layer", 2, "--experts", 0, "-o", out)[0] == 0
    info = load_slice(out)
    assert (info.arch, info.n_embd, info.n_ff, info.n_expert, info.n_layer) == ("llama", N_EMBD, N_FF, N_EXP, 3)
    assert info.fingerprint == model_fingerprint(GGUFReader(source))
    assert info.holdings == (Holding.parse("L1:1-3"), Holding.parse("L2:0-0"), Holding.parse("L2:5-7"))
    assert info.types == {1: LAYER_TYPES[1], 2: LAYER_TYPES[2]}
    assert info.layers == (1, 2) and info.n_held == 7
    src = tensors_from_reader(GGUFReader(source))
    pairs = list(info.experts())
    assert pairs == [(1, 1), (1, 2), (1, 3), (2, 0), (2, 5), (2, 6), (2, 7)]
    for layer, expert in pairs:
        assert info.holds(layer, expert)
        weights = info.expert_weights(layer, expert)
        for kind, w in zip(KINDS, weights):
            want = src[f"blk.{layer}.ffn_{kind}_exps.weight"].expert(expert)
            assert (w.name, w.ggml_type, w.ne) == (want.name, want.ggml_type, want.ne)
            assert w.data.tobytes() == want.data.tobytes()
            assert w.data.base is not None  # a view of the mapped file, not a copy
        np.testing.assert_array_equal(weights[0].f32(), src[f"blk.{layer}.ffn_gate_exps.weight"].expert(expert).f32())
    assert weights[2].ne == (N_FF, N_EMBD)


def test_expert_not_held_raises_key_error_naming_it(source, tmp_path, capsys):
    out = tmp_path / "part.gguf"
    assert run_slice(capsys, source, "--layer", 1, "--experts", "2-3", "-o", out)[0] == 0
    info = load_slice(out)
    assert not info.holds(1, 4) and not info.holds(2, 2)
    with pytest.raises(KeyError, match="no expert 4 of layer 1"):
        info.expert_weights(1, 4)
    with pytest.raises(KeyError, match="layer 2"):
        info.expert_weights(2, 2)


def test_overlapping_and_adjacent_ranges_are_merged_and_stored_once(source, tmp_path, capsys):
    out = tmp_path / "part.gguf"
    rc, stdout, _ = run_slice(capsys, source, "--layer", 1, "--experts", "0-2", "--layer", 1, "--experts", "2-4",
                              "--layer", 1, "--experts", 5, "--layer", 1, "--experts", 7, "-o", out)
    assert rc == 0
    assert load_slice(out).holdings == (Holding.parse("L1:0-5"), Holding.parse("L1:7-7"))
    assert "7 experts (layer 1 experts 0-5,7)" in stdout


def test_layer_all_and_layer_ranges(source, tmp_path, capsys):
    out = tmp_path / "a.gguf"
    rc, stdout, _ = run_slice(capsys, source, "--layer", "all", "--experts", 3, "-o", out)
    assert rc == 0 and load_slice(out).holdings == (Holding.parse("L1:3-3"), Holding.parse("L2:3-3"))
    assert "layers 1-2 experts 3" in stdout
    out2 = tmp_path / "b.gguf"
    assert run_slice(capsys, source, "--layer", "1-2", "--experts", "all", "-o", out2)[0] == 0
    assert load_slice(out2).holdings == (Holding.parse("L1:0-7"), Holding.parse("L2:0-7"))


def test_source_alignment_is_kept(tmp_path, capsys):
    src = build_source(tmp_path / "aligned.gguf", alignment=64)
    out = tmp_path / "part.gguf"
    assert run_slice(capsys, src, "--layer", 1, "--experts", 1, "--layer", 2, "--experts", "1-2", "-o", out)[0] == 0
    sl = GGUFReader(out)
    assert sl.alignment == 64 and all(int(t.data_offset) % 64 == 0 for t in sl.tensors)
    srcr = GGUFReader(src)
    for t in sl.tensors:
        layer, kind = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
        first = int(t.name.split(".")[3].split("-")[0])
        assert t.data.tobytes() == b"".join(source_slab(srcr, layer, kind, e)
                                            for e in range(first, first + int(t.shape[2])))


# --- streaming and atomic output --------------------------------------------------------------


def test_copy_streams_through_a_bounded_buffer(source, tmp_path, monkeypatch):
    requests = [((1, 2), (1, 6)), ((2, 2), None)]
    plan = slicer.plan_slice(source, requests)
    reference = slicer.write_slice(plan, tmp_path / "ref.gguf")
    monkeypatch.setattr(slicer, "CHUNK_BYTES", 1000)
    steps = []
    result = slicer.write_slice(plan, tmp_path / "small.gguf", progress=lambda done, total: steps.append((done, total)))
    assert (tmp_path / "small.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()
    assert result.nbytes == reference.nbytes
    deltas = np.diff([0] + [d for d, _ in steps])
    assert deltas.max() <= 1000 and len(steps) >= plan.nbytes // 1000
    assert steps[-1] == (plan.nbytes, plan.nbytes)


def test_a_failed_write_leaves_no_file_and_keeps_the_old_output(source, tmp_path):
    plan = slicer.plan_slice(source, [((1, 1), (0, 7))])
    out = tmp_path / "part.gguf"
    out.write_bytes(b"previous")

    def boom(done, total):
        if done > total // 2:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        slicer.write_slice(plan, out, progress=boom)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.gguf"]


def test_progress_line_on_a_terminal():
    from workers.download import TerminalProgress

    stream = io.StringIO()
    p = TerminalProgress(stream, "slicing")
    p(5_000_000, 10_000_000)
    p(10_000_000, 10_000_000)
    p.close()
    text = stream.getvalue()
    assert text.startswith("\rslicing: 5.0 / 10.0 MB") and "MB/s" in text and "100.0%" in text
    assert text.endswith("\n")


# --- bad input: one line, exit code 2, no file ------------------------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    return build_source(tmp_path_factory.mktemp("dense") / "dense.gguf", moe=False)


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory, source) -> str:
    path = tmp_path_factory.mktemp("corrupt") / "truncated.gguf"
    path.write_bytes(open(source, "rb").read()[:5000])
    return str(path)


@pytest.fixture(scope="module")
def a_slice(tmp_path_factory, source) -> str:
    path = tmp_path_factory.mktemp("slice") / "s.gguf"
    slicer.write_slice(slicer.plan_slice(source, [((1, 1), (0, 1))]), path)
    return str(path)


BAD = {
    "missing source": (["{missing}", "--layer", "1", "--experts", "0"], "no such file"),
    "corrupt source": (["{corrupt}", "--layer", "1", "--experts", "0"], "truncated"),
    "not moe": (["{dense}", "--layer", "1", "--experts", "0"], "not a Mixture-of-Experts"),
    "slice of a slice": (["{a_slice}", "--layer", "1", "--experts", "0"], "already a kvasir slice"),
    "layer out of range": (["{source}", "--layer", "3", "--experts", "0"], "layer 3 out of range"),
    "layer range out of range": (["{source}", "--layer", "1-5", "--experts", "0"], "layer 5 out of range"),
    "dense layer": (["{source}", "--layer", "0", "--experts", "0"], "layer 0 has no expert tensors"),
    "expert out of range": (["{source}", "--layer", "1", "--experts", "0-8"], "expert 8 out of range"),
    "reversed range": (["{source}", "--layer", "1", "--experts", "5-3"], "reversed"),
    "unparsable experts": (["{source}", "--layer", "1", "--experts", "x"], "expected A-B"),
    "unparsable layer": (["{source}", "--layer", "1-2-3", "--experts", "0"], "expected A-B"),
    "negative expert": (["{source}", "--layer", "1", "--experts=-1"], "expected A-B"),
    "unpaired": (["{source}", "--layer", "1", "--layer", "2", "--experts", "0"], "needs its own --experts"),
    "no pairs": (["{source}"], "at least one --layer"),
    "output dir missing": (["{source}", "--layer", "1", "--experts", "0", "-o", "{tmp}/nope/s.gguf"],
                           "does not exist"),
    "output is source": (["{source}", "--layer", "1", "--experts", "0", "-o", "{source}"], "source file itself"),
    "output is a directory": (["{source}", "--layer", "1", "--experts", "0", "-o", "{tmp}"], "is a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_code_2(case, source, dense, corrupt, a_slice, tmp_path, capsys):
    argv, message = BAD[case]
    names = dict(source=source, dense=dense, corrupt=corrupt, a_slice=a_slice, tmp=tmp_path,
                 missing=tmp_path / "missing.gguf")
    argv = [a.format(**names) for a in argv]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.gguf")]
    before = os.path.getsize(source)
    rc = main(["slice", *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("kvasir slice: error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert out == ""
    assert not (tmp_path / "out.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    assert os.path.getsize(source) == before


# --- load_slice refuses what is not a valid slice --------------------------------------------


def write_fake_slice(path, *, version=1, fingerprint="abcd", drop=(), down_ne=(N_FF, N_EMBD, 2)) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    if version is not None:
        w.add_uint32(KEYS.VERSION, version)
    if fingerprint is not None:
        w.add_string(SLICE_SOURCE_KEY, fingerprint)
    for key, value in ((KEYS.BLOCK_COUNT, 2), (KEYS.EXPERT_COUNT, 8), (KEYS.N_EMBD, N_EMBD), (KEYS.N_FF, N_FF)):
        w.add_uint32(key, value)
    for key, value in ((KEYS.LAYERS, [1]), (KEYS.EXPERT_FIRST, [3]), (KEYS.EXPERT_LAST, [4])):
        w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    for kind in KINDS:
        name = f"blk.1.ffn_{kind}_exps.3-4.weight"
        if kind in drop:
            continue
        ne = down_ne if kind == "down" else (N_EMBD, N_FF, 2)
        w.add_tensor(name, np.zeros(tuple(reversed(ne)), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_load_slice_accepts_a_minimal_valid_slice(tmp_path):
    info = load_slice(write_fake_slice(tmp_path / "ok.gguf"))
    assert info.holdings == (Holding.parse("L1:3-4"),) and info.fingerprint == "abcd"
    assert info.expert_weights(1, 4)[2].ne == (N_FF, N_EMBD)


@pytest.mark.parametrize("kwargs, message", [
    (dict(version=None), "not a kvasir slice"),
    (dict(version=3), "format version 3"),
    (dict(fingerprint=None), f"{SLICE_SOURCE_KEY} is missing"),
    (dict(drop=("up",)), "no tensor blk.1.ffn_up_exps.3-4.weight"),
    (dict(down_ne=(N_EMBD, N_FF, 2)), "blk.1.ffn_down_exps.3-4.weight has ne="),
])
def test_load_slice_rejects_invalid_slices_clearly(tmp_path, kwargs, message):
    path = write_fake_slice(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ModelFileError, match=message.replace(".", r"\.")):
        load_slice(path)


def test_load_slice_of_a_whole_model_says_to_slice_it(source):
    with pytest.raises(ModelFileError, match="cut a slice from it"):
        load_slice(source)


# --- the 122B expert size ---------------------------------------------------------------------

SLAB_122B = 1_769_472  # hidden 3072, expert FFN 1024, Q4_K: 1024 rows x 12 blocks x 144 bytes
EXPERT_122B = 3 * SLAB_122B  # 5,308,416


def test_one_q4k_expert_of_122b_shape_is_5308416_bytes(tmp_path, capsys):
    block, type_size = GGML_QUANT_SIZES[T.Q4_K]
    assert (block, type_size) == (256, 144)
    path = tmp_path / "q4k.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(1)
    w.add_embedding_length(3072)
    w.add_expert_feed_forward_length(1024)
    w.add_expert_count(2)
    for kind in KINDS:
        ne = (1024, 3072, 2) if kind == "down" else (3072, 1024, 2)
        raw = np.zeros((ne[2], ne[1], ne[0] // block * type_size), np.uint8)
        raw[1] = 7  # tell the experts apart
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", raw, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "one.gguf"
    assert run_slice(capsys, path, "--layer", 0, "--experts", 1, "-o", out)[0] == 0
    sl = GGUFReader(out)
    assert [int(t.n_bytes) for t in sl.tensors] == [SLAB_122B] * 3
    assert sum(int(t.n_bytes) for t in sl.tensors) == EXPERT_122B
    assert all((t.data == 7).all() for t in sl.tensors)
    assert sum(t.nbytes for t in load_slice(out).expert_weights(0, 1)) == EXPERT_122B


@pytest.fixture(scope="module")
def synth_122b_layer(tmp_path_factory) -> str:
    synth = pytest.importorskip("synth.model")
    pytest.importorskip("llama_cpp")
    path = tmp_path_factory.mktemp("synth122b") / "122b-layer-q4_k.gguf"
    # the preset's per-expert shapes with 8 experts instead of 256: 42 MB, not 1.4 GB, to build
    synth.synth_model(path, arch="qwen2moe", preset="122b-layer", qtype="q4_k", seed=0, layers=1, vocab=512,
                      experts=8, experts_used=2)
    return str(path)


def test_one_expert_of_synth_122b_layer_q4k_is_5308416_bytes(synth_122b_layer, tmp_path, capsys):
    out = tmp_path / "one.gguf"
    rc, _, err = run_slice(capsys, synth_122b_layer, "--layer", 0, "--experts", 5, "-o", out)
    assert rc == 0, err
    sl = GGUFReader(out)
    assert sum(int(t.n_bytes) for t in sl.tensors) == EXPERT_122B
    src = GGUFReader(synth_122b_layer)
    for kind in KINDS:
        t = next(t for t in sl.tensors if t.name == f"blk.0.ffn_{kind}_exps.5-5.weight")
        assert t.tensor_type == T.Q4_K and int(t.n_bytes) == SLAB_122B
        assert t.data.tobytes() == source_slab(src, 0, kind, 5)
