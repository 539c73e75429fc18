"""gpt-oss with YaRN RoPE scaling, as the published files have it (rope.scaling.type yarn,
factor 32, original context 4096), against llama.cpp.

llama.cpp derives the ``ggml_rope_ext`` parameters in llama_context's constructor: freq_scale
1/factor, ext_factor 1, beta_fast 32, beta_slow 1, n_ctx_orig the original context, and an
attn_factor that cancels ggml's own YaRN magnitude factor (about 1, in float32). The engine
reads the same keys into ModelConfig.rope_scaling (backbone.config.yarn) and hands them to the
RoPE graph. YaRN moves every position but 0 (its low-frequency dimensions are interpolated);
the second file also runs the 52 positions past a 16-position original context.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backbone.config import read_config, yarn
from backbone.model import Engine
from kernels.tensors import open_gguf
from kvasir_bus.cli import main
from kvasir_bus.errors import UsageError
from synth.model import make_config
from tests.parity import PROMPT, assert_logits_match_llama_cpp

pytest.importorskip("llama_cpp", reason="llama.cpp is the reference engine")

ARCH = "gpt-oss"
MAX_ABS_DIFF = 1e-3  # the bound; the target (and what is measured) is 0


def test_the_published_yarn_keys_become_the_rope_parameters(models):
    path = models(ARCH, "f32", rope_scaling="yarn")
    r = open_gguf(path)
    assert r.fields["gpt-oss.rope.scaling.type"].contents() == "yarn"
    assert r.fields["gpt-oss.rope.scaling.factor"].contents() == 32.0
    assert r.fields["gpt-oss.rope.scaling.original_context_length"].contents() == 4096
    rope = read_config(r, str(path)).rope
    assert (rope.n_ctx_orig, rope.freq_scale, rope.ext_factor, rope.beta_fast, rope.beta_slow) == \
        (4096, np.float32(1 / 32), 1.0, 32.0, 1.0)
    assert abs(rope.attn_factor - 1.0) < 1e-6  # mscale(32) / (1 + 0.1 ln 32): 1 up to float32 rounding
    assert read_config(open_gguf(models(ARCH, "f32")), "plain").rope == dataclasses.replace(
        rope, n_ctx_orig=read_config(open_gguf(models(ARCH, "f32")), "plain").n_ctx_train, freq_scale=1.0,
        ext_factor=0.0, attn_factor=1.0)


@pytest.mark.parametrize("qtype,scaling", [
    ("f32", {}),  # as published: factor 32, original context 4096
    ("mxfp4", {}),
    ("f32", dict(rope_scaling_factor=4.0, rope_original_context=16)),  # positions past the original context
])
def test_yarn_logits_match_llama_cpp(models, qtype, scaling):
    path = models(ARCH, qtype, rope_scaling="yarn", **scaling)
    report = assert_logits_match_llama_cpp(path, PROMPT, min_prompt=36, n_decode=16, max_abs_diff=MAX_ABS_DIFF)
    assert report["max_abs_diff"] == 0.0, report  # bit-identical, as for the unscaled files


def test_yarn_moves_the_logits(models):
    """The scaling is live: the same weights without it give other logits."""
    engine = Engine(models(ARCH, "f32", rope_scaling="yarn"))
    tokens = np.random.default_rng(3).integers(0, engine.cfg.n_vocab, 40)
    (scaled,) = engine.forward([(engine.new_sequence(), tokens)])
    engine.cfg = dataclasses.replace(engine.cfg, rope_scaling=None)
    (plain,) = engine.forward([(engine.new_sequence(), tokens)])
    assert not np.allclose(scaled, plain, atol=1e-3)
    assert scaled.shape == plain.shape


def test_yarn_attn_factor_is_float32_like_llama_cpp():
    f32 = np.float32
    for factor in (4.0, 32.0, 40.0):
        want = (f32(0.1) * np.log(f32(factor)) + f32(1)) * (f32(1) / (f32(1) + f32(0.1) * np.log(f32(factor))))
        assert abs(yarn(factor, 4096).attn_factor - float(want)) <= 2 * np.finfo(np.float32).eps


def test_synth_rope_scaling_flags_and_their_refusals(tmp_path, capsys):
    assert make_config(ARCH, rope_scaling="yarn", rope_scaling_factor=8, rope_original_context=64).rope_scaling_factor == 8.0
    for args, why in ((dict(arch="qwen3moe", rope_scaling="yarn"), "only for gpt-oss"),
                      (dict(arch=ARCH, rope_scaling_factor=4.0), "need --rope-scaling yarn"),
                      (dict(arch=ARCH, rope_scaling="yarn", rope_scaling_factor=1.0), "in \\(1, 1024\\]"),
                      (dict(arch=ARCH, rope_scaling="yarn", rope_original_context=0), "positive integer")):
        with pytest.raises(UsageError, match=why):
            make_config(**args)
    out = tmp_path / "m.gguf"
    assert main(["synth", "--arch", "qwen3moe", "--rope-scaling", "yarn", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only for gpt-oss" in err
    assert main(["synth", "--arch", ARCH, "--rope-scaling", "yarn", "--rope-scaling-factor", "8",
                 "--rope-original-context", "64", "-o", str(out)]) == 0
    cfg = read_config(open_gguf(out), str(out))
    assert (cfg.rope.freq_scale, cfg.rope.n_ctx_orig) == (0.125, 64)
