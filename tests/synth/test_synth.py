"""kvasir synth / kvasir info: synthetic MoE GGUFs that llama.cpp loads, and their inspector."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from backbone.config import read_config
from kvasir_bus.cli import main
from synth import cli as cli_synth, model as synth, vocab
from kernels.tensors import open_gguf, tensor_from_reader, tensors_from_reader

ARCHS = ("qwen3moe", "qwen2moe", "mixtral")
TEXT = b"The quick brown fox jumps over the lazy dog. Hello world!"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """One tiny f32 model per architecture (about 0.1 s each)."""
    d = tmp_path_factory.mktemp("tiny")
    return {arch: str(synth.synth_model(d / f"{arch}.gguf", arch, "tiny", "f32", seed=1)) for arch in ARCHS}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse rejects before a command runs
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- pure: vocabulary, tables, config ---------------------------------------------------------

def test_cli_choices_match_the_generator_tables():
    assert cli_synth.ARCH_CHOICES == tuple(synth.ARCHS)
    assert cli_synth.PRESET_CHOICES == tuple(synth.PRESETS)
    assert cli_synth.TYPE_CHOICES == tuple(synth.QTYPES)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_has_the_tensors_its_backbone_traits_name(arch, tiny_models):
    # the traits come from backbone.config.ARCHES; the backbone reads them back from the file
    cfg = read_config(open_gguf(tiny_models[arch]))
    assert cfg.traits is synth.ARCHS[arch].traits
    names = {t.name for t in open_gguf(tiny_models[arch]).tensors}
    assert ("blk.0.attn_q_norm.weight" in names) == cfg.traits.qk_norm
    assert ("blk.0.attn_q.bias" in names) == cfg.traits.qkv_bias
    assert ("blk.0.ffn_gate_shexp.weight" in names) == cfg.traits.shared_expert == (cfg.n_ff_shexp > 0)
    assert cfg.n_ff_exp == synth.PRESETS["tiny"]["expert_ffn"]
    assert cfg.tied_output == synth.ARCHS[arch].tied_output


@pytest.mark.parametrize("size", [258, 320, 1024, 12000])
def test_vocab_has_every_byte_then_eos_then_merges_that_make_new_tokens(size):
    v = vocab.build_vocab(size)
    assert len(v.tokens) == size and len(set(v.tokens)) == size
    assert [vocab.decode_token(v.tokens[b]) for b in range(256)] == [bytes([b]) for b in range(256)]
    assert v.tokens[v.eos_id] == "<|endoftext|>" and v.token_types[v.eos_id] == vocab.TOKEN_CONTROL
    assert len(v.merges) >= 1
    ids = {t: i for i, t in enumerate(v.tokens)}
    for rank, merge in enumerate(v.merges):
        left, right = merge.split(" ")
        assert ids[left] < ids[left + right] and ids[right] < ids[left + right]
        assert ids[left + right] == 257 + rank


def test_tiny_k_quant_preset_widens_rows_to_a_k_quant_block():
    cfg = synth.make_config("qwen2moe", "tiny", "q4_k")
    assert cfg.hidden % 256 == 0 and cfg.expert_ffn % 256 == 0 and cfg.shared_expert_ffn % 256 == 0
    assert synth.make_config("qwen2moe", "tiny", "q8_0").hidden == 64


def test_router_top_k_differs_between_tokens(tiny_models):
    # rms_norm(embedding) @ router at layer 0, ignoring attention: enough to see routing spread
    ts = tensors_from_reader(open_gguf(tiny_models["qwen3moe"]))
    x = ts["token_embd.weight"].f32()[:64]  # 64 byte tokens
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * ts["blk.0.ffn_norm.weight"].f32()
    logits = x @ ts["blk.0.ffn_gate_inp.weight"].f32().T  # (64, n_expert)
    top2 = {tuple(sorted(np.argsort(-row)[:2])) for row in logits}
    assert len(top2) >= 10
    assert len(set(np.argsort(-logits, axis=1)[:, 0])) == logits.shape[1]  # every expert wins somewhere


# --- determinism ------------------------------------------------------------------------------

def test_same_seed_gives_identical_bytes(tmp_path, tiny_models):
    again = synth.synth_model(tmp_path / "again.gguf", "qwen3moe", "tiny", "f32", seed=1)
    assert again.read_bytes() == open(tiny_models["qwen3moe"], "rb").read()


# sha256 of files made by SYNTH_VERSION 2 (pinned when the architecture table came from
# backbone.config, then re-pinned when version 2 added the chat template): the same arguments must keep giving the same bytes,
# or SYNTH_VERSION must change. gguf-py writes f32 and quantizes q8_0 (numpy only), so the
# digests do not depend on the machine's llama.cpp build.
PINNED_SHA256 = {
    ("qwen3moe", "f32"): "d91a4bd96216e4ae054a201049b324d0268025fbd648e315099b4bbb395fbd88",
    ("qwen3moe", "q8_0"): "892236dc9ebc12cfc170a55920723144fa178326bec91579144b522b5f8e792d",
    ("qwen2moe", "f32"): "f1e05250001022457c8e05901130ed33c9a9214e282dee5df85a25d223adf404",
    ("qwen2moe", "q8_0"): "ab9bebdb9dc94206940b8ba0bc7a979bbc4a0310430a7510564a030202538b79",
    ("mixtral", "f32"): "87b593e74660fca54cc58de371c53cdf628f7cdee91fe50de6c6f38728d13bd3",
    ("mixtral", "q8_0"): "72f1c58fc11304c04b5407d24a0272cb2d87bdc59ba206aebbdac2ec67bd1681",
}


@pytest.mark.parametrize("arch,qtype", sorted(PINNED_SHA256))
def test_the_same_arguments_give_the_pinned_bytes(arch, qtype, tmp_path):
    assert synth.SYNTH_VERSION == 2  # re-pin the digests above when it changes
    path = synth.synth_model(tmp_path / "m.gguf", arch, "tiny", qtype, seed=3)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == PINNED_SHA256[arch, qtype]


def test_other_seed_gives_other_weights_and_fingerprint(tmp_path, tiny_models):
    other = synth.synth_model(tmp_path / "other.gguf", "qwen3moe", "tiny", "f32", seed=2)
    a, b = synth.describe_model(tiny_models["qwen3moe"]), synth.describe_model(other)
    assert a["fingerprint"] != b["fingerprint"]
    name = "blk.1.ffn_down_exps.weight"
    wa = tensor_from_reader(open_gguf(tiny_models["qwen3moe"]), name).f32()
    wb = tensor_from_reader(open_gguf(other), name).f32()
    assert wa.shape == wb.shape and not np.allclose(wa, wb)


def test_threads_do_not_change_the_bytes(tmp_path):
    cfg = synth.make_config("qwen2moe", "tiny", "q8_0", seed=3)
    one = synth.write_model(tmp_path / "one.gguf", cfg, threads=1).path.read_bytes()
    four = synth.write_model(tmp_path / "four.gguf", cfg, threads=4).path.read_bytes()
    assert one == four


# --- llama.cpp loads them ---------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_llama_cpp_and_tokenizes_text(arch, tiny_models):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tiny_models[arch]
    tok = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    ids = tok.tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT
    assert any(i > 256 for i in ids), "no merge was applied"
    assert ids[0] != vocab.EOS_ID  # no BOS is added
    assert tok.token_eos() == tok.token_bos() == vocab.EOS_ID

    llm = llama_cpp.Llama(path, logits_all=True, flash_attn=False, n_ctx=256, verbose=False)
    ids = (ids * 3)[:40]
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)])
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std() < 5
    assert len(set(logits.argmax(-1))) > 5


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_experts_really_are_k_quants(tmp_path, qtype):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = synth.synth_model(tmp_path / "k.gguf", "qwen2moe", "tiny", qtype, layers=1)
    types = synth.describe_model(path)["tensor_types"]
    for group in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_down_shexp", "token_embd"):
        assert types[group] == {qtype: 1}, (group, types[group])
    for group in ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_norm", "attn_q.bias"):
        assert types[group] == {"f32": 1}
    llm = llama_cpp.Llama(str(path), logits_all=True, flash_attn=False, n_ctx=64, verbose=False)
    llm.eval(llm.tokenize(TEXT)[:16])
    assert np.isfinite(np.array(llm.scores[:16])).all()


def test_k_quant_that_does_not_fit_falls_back_with_a_warning(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "fallback.gguf"
    rc, stdout, err = run_cli(capsys, "synth", "--arch", "qwen3moe", "--type", "q4_k",
                              "--expert-ffn", "64", "-o", str(out))
    assert rc == 0, err
    assert "warning" in err and "ffn_down_exps (2 tensors) q4_k -> q5_0" in err
    assert len(err.strip().splitlines()) == 1
    assert stdout.startswith(f"wrote {out}")
    types = synth.describe_model(out)["tensor_types"]
    assert types["ffn_down_exps"] == {"q5_0": 2} and types["ffn_up_exps"] == {"q4_k": 2}


def test_122b_layer_expert_slab_is_5308416_bytes_at_q4_k(tmp_path):
    pytest.importorskip("llama_cpp")
    # the real per-expert shapes; 2 experts and a minimal vocabulary keep it to a few seconds
    path = synth.synth_model(tmp_path / "122b.gguf", "qwen2moe", "122b-layer", "q4_k",
                             experts=2, experts_used=1, vocab=258)
    info = synth.describe_model(path)
    assert (info["hidden"], info["expert_ffn"], info["layers"]) == (3072, 1024, 1)
    assert info["expert_slab_bytes"] == 5_308_416 == 3 * 1_769_472
    reader = open_gguf(path)
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = tensor_from_reader(reader, f"blk.0.{name}.weight")
        assert t.expert_bytes == 1_769_472 and t.ggml_type.name == "Q4_K"


# --- the CLI ----------------------------------------------------------------------------------

def test_synth_then_info_reports_the_model(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    rc, stdout, err = run_cli(capsys, "synth", "--arch", "mixtral", "--type", "q8_0", "--layers", "3",
                              "--experts", "4", "--experts-used", "2", "--seed", "7", "-o", str(out))
    assert rc == 0 and err == ""
    assert len(stdout.strip().splitlines()) == 1 and "mixtral" in stdout and "q8_0" in stdout

    rc, stdout, err = run_cli(capsys, "info", "--json", str(out))
    assert rc == 0, err
    info = json.loads(stdout)
    assert list(info) == ["architecture", "layers", "mtp_layers", "experts", "experts_used", "hidden", "expert_ffn",
                          "expert_slab_bytes", "expert_slab_bytes_max", "expert_share", "fingerprint",
                          "file_bytes", "tensor_types"]
    assert (info["architecture"], info["layers"], info["experts"], info["experts_used"]) == ("llama", 3, 4, 2)
    assert info["expert_slab_bytes"] == info["expert_slab_bytes_max"] == 3 * 32 * (64 // 32) * 34
    assert 0 < info["expert_share"] < 1
    assert "output" not in info["tensor_types"]  # tied: llama.cpp uses token_embd
    assert info["tensor_types"]["ffn_gate_inp"] == {"f32": 3}

    rc, stdout, err = run_cli(capsys, "info", str(out))
    assert rc == 0 and f"fingerprint   {info['fingerprint']}" in stdout
    assert "ffn_down_exps: q8_0 (3 tensors)" in stdout


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "huge"], "invalid choice"),
    (["--arch", "gpt2"], "invalid choice"),
    (["--type", "q3_k"], "invalid choice"),
    (["--hidden", "0"], "--hidden must be a positive integer"),
    (["--layers", "-1"], "--layers must be a positive integer"),
    (["--heads", "5"], "does not divide --hidden"),
    (["--kv-heads", "3"], "does not divide --heads"),
    (["--experts-used", "9"], "more than --experts 8"),
    (["--vocab", "257"], "--vocab 257 is too small"),
    (["--arch", "qwen3moe", "--shared-expert-ffn", "64"], "no shared expert"),
    (["--seed", "-1"], "--seed"),
])
def test_bad_synth_arguments_give_one_line_errors(tmp_path, capsys, argv, needle):
    rc, _, err = run_cli(capsys, "synth", *argv, "-o", str(tmp_path / "x.gguf"))
    assert_one_line_error(rc, err, needle)
    assert not list(tmp_path.iterdir())


def test_output_in_a_missing_directory_is_a_one_line_error(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "synth", "-o", str(tmp_path / "nope" / "x.gguf"))
    assert_one_line_error(rc, err, "does not exist")


def test_info_rejects_bad_files_with_one_line(tmp_path, capsys, tiny_models):
    import gguf

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(tiny_models["qwen2moe"], "rb").read()[:50_000])
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"hello, this is not a model")
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(dense, "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    for path, needle in ((tmp_path / "missing.gguf", "no such file"), (truncated, "truncated"),
                         (not_gguf, "not a GGUF file"), (dense, "not a Mixture-of-Experts model")):
        rc, _, err = run_cli(capsys, "info", str(path))
        assert_one_line_error(rc, err, needle)
