"""Our engine against llama.cpp, and against itself (decode vs recompute, batch vs alone)."""

import numpy as np
import pytest

from backbone.model import Engine
from tests.parity import PROMPT, assert_logits_match_llama_cpp

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")


ARCHES = ["qwen3moe", "qwen2moe", "mixtral"]
TYPES = ["f32", "f16", "q8_0", "q4_k"]
# Reached on x86 (AVX2) with llama-cpp-python 0.3.36: max |logit difference| = 0 for all 12
# models (bit-identical; the engine computes attention, RoPE and the router's softmax with
# ggml's own kernels and keeps every product batch-invariant). The bound asserted is the
# issue's 1e-3, so a CPU whose kernels round differently still passes on real agreement.
MAX_ABS_DIFF = 1e-3


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_llama_cpp_over_prompt_and_greedy_steps(models, arch, qtype):
    assert_logits_match_llama_cpp(models(arch, qtype), PROMPT, min_prompt=32, max_abs_diff=MAX_ABS_DIFF)


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0"), ("mixtral", "f16")])
def test_prefill_then_decode_equals_full_recompute(models, arch, qtype):
    engine = Engine(models(arch, qtype))
    tokens = np.random.default_rng(0).integers(0, engine.cfg.n_vocab, 40)
    seq = engine.new_sequence()
    steps = [engine.forward([(seq, tokens[:30])])[0]]
    for t in tokens[30:]:
        steps.append(engine.forward([(seq, np.array([t]))])[0])
    incremental = np.concatenate(steps)
    (full,) = engine.forward([(engine.new_sequence(), tokens)])
    # Same rows, same kernels; only the batch size of each matmul differs, and every product
    # is batch-invariant: bit-identical.
    assert np.array_equal(incremental, full)
    assert (incremental.argmax(1) == full.argmax(1)).all()


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "f32"), ("mixtral", "q8_0")])
def test_batch_of_three_sequences_gives_each_its_logits_alone(models, arch, qtype):
    engine = Engine(models(arch, qtype))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (5, 17, 33)]
    alone = [engine.forward([(engine.new_sequence(), p)])[0] for p in prompts]
    seqs = [engine.new_sequence() for _ in prompts]
    together = engine.forward(list(zip(seqs, prompts)))
    for a, b in zip(alone, together):  # bit-identical: every product is batch-invariant
        assert np.array_equal(b, a)
    # A mixed step: one sequence decodes a token while another prefills a chunk.
    nxt = [np.array([int(together[0][-1].argmax())]), rng.integers(0, engine.cfg.n_vocab, 7)]
    mixed = engine.forward([(seqs[0], nxt[0]), (seqs[1], nxt[1])])
    ref0 = engine.forward([(seq0 := engine.new_sequence(), np.concatenate([prompts[0], nxt[0]]))])[0][-1:]
    ref1 = engine.forward([(engine.new_sequence(), np.concatenate([prompts[1], nxt[1]]))])[0][-7:]
    assert np.array_equal(mixed[0], ref0)
    assert np.array_equal(mixed[1], ref1)
    assert seq0.n_past == len(prompts[0]) + 1


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0"), ("mixtral", "f16")])
def test_fused_graphs_give_the_bits_of_the_op_by_op_path(models, arch, qtype):
    """One graph per step (one sequence), two per layer (a batch) and one call per op (the
    reference path, ``fused`` off) compute the same ops: identical logits."""
    engine = Engine(models(arch, qtype))
    assert engine.fused and engine.step_graphs
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, engine.cfg.n_vocab, n) for n in (9, 4)]
    nxt = rng.integers(0, engine.cfg.n_vocab, 3)

    def run() -> list[np.ndarray]:
        a, b = engine.new_sequence(), engine.new_sequence()
        out = engine.forward([(a, prompts[0])])  # one sequence: one graph per step
        out += engine.forward([(a, nxt[:1])]) + engine.forward([(a, nxt[1:])], all_logits=False)
        out += engine.forward([(b, prompts[1]), (a, nxt[:1])])  # a batch: two graphs per layer
        return out

    fused = run()
    engine.fused = engine.step_graphs = False
    reference = run()
    for got, want in zip(fused, reference):
        assert np.array_equal(got, want)


# The fast mode (the default outside this suite) against llama.cpp with the same kernel settings,
# its tokens evaluated as our generation evaluated them: every architecture, each with the types
# whose kernels differ most (repacked Q4_0/Q4_K, tiled F16/Q8_0, gpt-oss's MXFP4). Bit-identical:
# a decode step's attention runs its one query row alone there (ggml's vec_dot, as llama.cpp
# decodes a token); as two rows (tinyBLAS, the deterministic mode's batch invariance) it moved
# the logits by up to 9e-2 (tiny qwen2moe Q4_K). Attention is flash attention on both sides, the
# fast mode's default (``kernels.dense.flash_attn``), with gpt-oss's sinks and sliding window.
FAST_MATRIX = [(arch, qtype) for arch in ("qwen3moe", "qwen2moe", "mixtral", "qwen35moe", "qwen3next")
               for qtype in ("f16", "q8_0", "q4_0", "q4_k")] + [("gpt-oss", "mxfp4"), ("gpt-oss", "q4_k")]

_FAST_VERIFY = """
import contextlib, io, json, sys
from kvasir_bus.cli import main
for path in sys.argv[1:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["verify", "--model", path, "--decode", "16", "--json"])
    print(json.dumps({"path": path, "code": code, "report": json.loads(out.getvalue()) if code == 0 else None}))
"""


@pytest.mark.parametrize("layout,flash", [("repacked", "1"), ("plain", "1"), ("repacked", "0")])
def test_fast_mode_is_bit_identical_to_llama_cpp_with_the_same_kernels_on_every_architecture(models, layout, flash):
    """One child process in the fast mode (ggml fixes its mode when it loads) runs ``kvasir
    verify`` on every model of the matrix: max |diff| 0 and the settings both sides ran. Each
    of the two routed-expert layouts serving chooses between by the rows of a call
    (``kernels.ggml.expert_layout``) against llama.cpp with its experts in that layout: its
    default (repacked where ggml has the kernel) and its experts kept plain. Attention: flash
    attention on both sides (the fast mode's default), and off (KVASIR_FLASH_ATTN=0)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    matrix = FAST_MATRIX if layout == "repacked" else [(a, q) for a, q in FAST_MATRIX if q in ("q4_0", "q4_k")]
    paths = [str(models(arch, qtype)) for arch, qtype in matrix]
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVASIR_KERNEL_MODE", "GGML_CPU_TILED_MM", "KVASIR_REPACK", "KVASIR_EXPERT_LAYOUT",
                        "KVASIR_FLASH_ATTN")}
    env["PYTHONPATH"] = str(root)
    env["KVASIR_EXPERT_LAYOUT"] = layout
    if flash == "0":
        env["KVASIR_FLASH_ATTN"] = "0"
    done = subprocess.run([sys.executable, "-c", _FAST_VERIFY, *paths], env=env, capture_output=True, text=True,
                          timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["path"] for r in results] == paths
    for (arch, qtype), r in zip(matrix, results):
        assert r["code"] == 0, (arch, qtype, done.stderr[-2000:])
        report = r["report"]
        ours, theirs = report["settings"]["ours"], report["settings"]["llama_cpp"]
        assert ours["mode"] == "fast" and not ours["one_row_as_two"] and ours["expert_layout"] == layout
        assert theirs["eval"] == "prompt, then one token at a time" and theirs["repack"] == ours["repack"]
        assert not ours["repack"] or theirs["expert_layout"] == layout
        assert ours["flash_attn"] == theirs["flash_attn"] == (flash == "1")  # default on, as llama-server's
        assert (arch, qtype, report["max_abs_diff"], report["argmax_agreement"]) == (arch, qtype, 0.0, 1.0)
