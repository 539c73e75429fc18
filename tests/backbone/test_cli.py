"""Bad input on the command line: one clear line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFWriter

from kvasir_bus.cli import main

pytest.importorskip("llama_cpp", reason="the backbone commands need llama.cpp's vocabulary")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from synth.model import synth_model

    return synth_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", arch="mixtral", preset="tiny", qtype="q8_0", seed=4)


def dense_gguf(path, arch="llama"):
    """A GGUF without experts (a dense model) or of an architecture we do not run."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_context_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("command", ["generate", "verify"])
def test_missing_truncated_and_corrupt_files(capsys, tmp_path, tiny, command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    code, _, err = run(capsys, command, "--model", tmp_path / "nope.gguf", *extra)
    assert code == 2
    one_error_line(err, "no such file")

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    code, _, err = run(capsys, command, "--model", truncated, *extra)
    assert code == 2
    one_error_line(err, "truncated")

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    code, _, err = run(capsys, command, "--model", corrupt, *extra)
    assert code == 2
    one_error_line(err, "corrupt.gguf")

    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    code, _, err = run(capsys, command, "--model", not_gguf, *extra)
    assert code == 2
    one_error_line(err, "not a GGUF file")


def test_dense_and_unsupported_models_are_refused(capsys, tmp_path):
    code, _, err = run(capsys, "info", dense_gguf(tmp_path / "dense.gguf"))
    assert code == 2
    one_error_line(err, "not a Mixture-of-Experts")
    code, _, err = run(capsys, "generate", "--model", dense_gguf(tmp_path / "dense2.gguf"), "--prompt", "x")
    assert code == 2
    one_error_line(err, "Mixture-of-Experts")
    code, _, err = run(capsys, "generate", "--model", dense_gguf(tmp_path / "gpt2.gguf", "gpt2"), "--prompt", "x")
    assert code == 2
    one_error_line(err)


@pytest.mark.parametrize("flags, needle", [
    (["-n", "-1"], "-n"),
    (["--temperature", "-0.5"], "temperature"),
    (["--temperature", "0.8", "--top-p", "1.5"], "top-p"),
    (["-n", "many"], "invalid int value"),
    (["--wire-dtype", "int8"], "invalid choice"),
    (["--timeout-ms", "0", "--nats", "nats://127.0.0.1:1"], "timeout"),
    (["--reply-secret", "/no/such/reply.key", "--nats", "nats://127.0.0.1:1"], "--reply-secret"),
])
def test_bad_flag_values(capsys, tiny, flags, needle):
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "hello", *flags)
    assert code == 2
    one_error_line(err, needle)


def test_a_reply_secret_that_is_not_hex_is_one_line(capsys, tiny, tmp_path):
    bad = tmp_path / "reply.key"
    bad.write_text("not hex\n")
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "hello", "--reply-secret", str(bad),
                       "--nats", "nats://127.0.0.1:1")
    assert code == 2
    one_error_line(err, "not a hex secret")


def test_prompt_longer_than_the_context(capsys, tiny):
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "word " * 400, "-n", "4")
    assert code == 2
    one_error_line(err, "context")
    code, _, err = run(capsys, "verify", "--model", tiny, "--prompt", "word " * 400)
    assert code == 2
    one_error_line(err, "context")


def test_unreachable_bus_is_one_line(capsys, tiny):
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "hi", "-n", "2", "--nats", "nats://127.0.0.1:1")
    assert code == 2
    assert "cannot reach NATS" in err and "Traceback" not in err


def test_generate_json_and_logits_dump(capsys, tiny, tmp_path):
    dump = tmp_path / "logits.npy"
    code, out, _ = run(capsys, "generate", "--model", tiny, "--prompt", "Hello swarm", "-n", "5",
                       "--json", "--dump-logits", dump, "--no-stop")
    assert code == 0
    result = json.loads(out)
    assert len(result["tokens"]) == 5 and isinstance(result["text"], str)
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape[0] == len(result["prompt_tokens"]) + 5


def test_sampling_is_reproducible_by_seed(capsys, tiny):
    def sample(seed):
        code, out, _ = run(capsys, "generate", "--model", tiny, "--prompt", "Hello", "-n", "8", "--json",
                           "--temperature", "3.0", "--top-p", "1.0", "--seed", str(seed), "--no-stop")
        assert code == 0
        return json.loads(out)["tokens"]

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in (1, 2, 3)}) > 1


def test_verify_json_has_exactly_the_four_keys(capsys, tiny):
    code, out, _ = run(capsys, "verify", "--model", tiny, "--decode", "4", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"positions", "max_abs_diff", "min_cosine", "argmax_agreement", "settings"}
    assert report["argmax_agreement"] == 1.0 and report["max_abs_diff"] <= 1e-3


def test_verify_in_the_default_fast_mode_repacks_both_sides_and_is_exact(tmp_path):
    """``kvasir verify`` as a user runs it (the fast mode, the suite's mode aside): llama.cpp
    with our kernel switches (repacking included; verify runs the routed experts repacked at
    every row count, llama.cpp's layout, unless ``--expert-layout`` says otherwise), its tokens
    evaluated as our generation evaluated them (the prompt at once, then each token alone),
    gives our logits to the bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from synth.model import synth_model

    from kernels import ggml

    if not ggml.available():
        pytest.skip("ggml not available")
    path = synth_model(tmp_path / "tiny-q4k.gguf", arch="qwen3moe", preset="tiny", qtype="q4_k", seed=1)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("KVASIR_KERNEL_MODE", "GGML_CPU_TILED_MM", "KVASIR_REPACK")}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-m", "kvasir_bus.cli", "verify", "--model", str(path), "--prompt",
                           "Hello world, this is", "--decode", "16", "--json"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    ours, theirs = report["settings"]["ours"], report["settings"]["llama_cpp"]
    assert ours["mode"] == "fast" and theirs["eval"] == "prompt, then one token at a time"
    assert theirs["repack"] == ours["repack"] and theirs["tiled_mm"] == ours["tiled_mm"]
    if ours["repack"]:  # the routed experts repacked at every row count, as llama.cpp's default
        assert ours["label"].endswith("-repack-xall") and ours["expert_layout"] == "repacked"
        assert theirs["expert_layout"] == "repacked"
    assert report["max_abs_diff"] == 0.0 and report["argmax_agreement"] == 1.0
