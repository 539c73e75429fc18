"""Audit policy and comparison (backbone/audit.py): which replies are checked, what passes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backbone.audit import (AuditConfig, Auditor, kernel_label, relative_error, replies_agree,
                            rerun_backend, tolerance)


def test_probation_audits_every_first_reply_of_a_node():
    auditor = Auditor(AuditConfig(rate=0.01, probation=5, seed=1))
    ref = np.ones((1, 4), np.float32)
    assert all(auditor.should_audit("new", layer=0) for _ in range(5))
    assert all(auditor.should_audit("new", layer=0) for _ in range(7))  # none passed yet: still on probation
    for _ in range(5):
        assert auditor.judge("new", ref, ref, exact=True, weight_type=T.F32)
    later = [auditor.should_audit("new", layer=0) for _ in range(100)]
    assert 1 <= sum(later) <= 2  # one audit per window of 100 (the 5 of probation started it)


@pytest.mark.parametrize("rate", [0.5, 0.1, 0.03])
def test_one_reply_in_every_window_is_audited_per_layer(rate):
    cfg = AuditConfig(rate=rate, probation=0, seed=7)
    auditor = Auditor(cfg)
    for layer in (0, 3):
        picks = [auditor.should_audit("w", layer) for _ in range(cfg.window * 20)]
        for start in range(0, len(picks), cfg.window):
            assert sum(picks[start:start + cfg.window]) == 1


def test_a_liar_on_every_reply_is_caught_within_two_windows_less_one_after_any_honest_stretch():
    cfg = AuditConfig(rate=0.1, probation=16, seed=3)
    assert cfg.max_replies_to_catch == 19
    worst = 0
    for seed in range(200):
        for honest in (0, 16, 100, 137):
            auditor = Auditor(AuditConfig(rate=0.1, probation=16, seed=seed))
            ref = np.ones((1, 4), np.float32)
            for _ in range(honest):
                if auditor.should_audit("liar", 2):
                    auditor.judge("liar", ref, ref, exact=True, weight_type=T.F32)
            lies = 1
            while not auditor.should_audit("liar", 2):
                lies += 1
            worst = max(worst, lies)
            assert lies <= cfg.max_replies_to_catch
    assert worst > cfg.window  # the bound is not loose for nothing: starting mid-window costs more


def test_rate_zero_audits_nothing_and_rate_one_audits_everything():
    none, every = Auditor(AuditConfig(rate=0.0)), Auditor(AuditConfig(rate=1.0, probation=0))
    assert not any(none.should_audit("n", 0) for _ in range(50))
    assert all(every.should_audit("n", 0) for _ in range(50))


def test_bad_rates_are_refused():
    for rate in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="audit rate"):
            AuditConfig(rate=rate)


def test_same_kernel_demands_identical_bits():
    ref = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    assert replies_agree(ref.copy(), ref, same_kernel=True, weight_type=T.Q4_K)
    nudged = ref.copy()
    nudged[0, 0] = np.nextafter(nudged[0, 0], np.float32(2))
    assert not replies_agree(nudged, ref, same_kernel=True, weight_type=T.Q4_K)
    assert replies_agree(nudged, ref, same_kernel=False, weight_type=T.Q4_K)  # one ulp is noise


def test_a_failed_audit_quarantines_the_node_once():
    auditor = Auditor(AuditConfig(rate=1.0))
    ref = np.ones((1, 8), np.float32)
    assert auditor.judge("a", ref.copy(), ref, exact=True, weight_type=T.F32)
    assert not auditor.judge("b", ref * 0, ref, exact=True, weight_type=T.F32)
    assert not auditor.judge("b", ref * 0, ref, exact=True, weight_type=T.F32)
    assert auditor.quarantined == {"b"} and auditor.is_quarantined("b") and not auditor.is_quarantined("a")
    assert auditor.stats.to_dict() == {"audits": 3, "audit_failures": 2, "quarantined": ["b"]}


def test_non_finite_or_misshaped_replies_fail():
    ref = np.ones((2, 4), np.float32)
    assert relative_error(np.full_like(ref, np.nan), ref) == math.inf
    assert not replies_agree(np.ones((1, 4), np.float32), ref, same_kernel=False, weight_type=T.F32)


def test_the_backbone_reruns_a_kernel_it_has_on_the_same_cpu_and_demands_identical_bits():
    assert rerun_backend(kernel_label("ggml", "x86_64"), "ggml", machine="x86_64") == ("ggml", True)
    assert rerun_backend(kernel_label("numpy", "x86_64"), "ggml", machine="x86_64") == ("numpy", True)
    assert rerun_backend(kernel_label("ggml", "aarch64"), "ggml", machine="x86_64") == ("ggml", False)
    assert rerun_backend("cuda-sm90", "numpy", machine="x86_64") == ("numpy", False)


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_k"])
def test_honest_kernels_pass_their_audit_and_a_scaled_liar_does_not(models, qtype):
    pytest.importorskip("llama_cpp", reason="the backbone's reference kernel is ggml (llama-cpp-python)")
    from kernels.expert import expert_ffn
    from kernels.tensors import open_gguf, tensors_from_reader

    t = tensors_from_reader(open_gguf(models("qwen3moe", qtype)))
    rng = np.random.default_rng(0)
    worst = 0.0
    for layer in range(2):
        g, u, d = (t[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        for e in range(g.n_expert):
            x = (rng.standard_normal((3, g.ne[0])) * rng.uniform(0.05, 2)).astype(np.float32)
            w = (g.expert(e), u.expert(e), d.expert(e))
            ggml = expert_ffn(*w, x, routed=True, backend="ggml")
            numpy = expert_ffn(*w, x, routed=True, backend="numpy")
            # Same kernel on the same CPU: identical bits, so the bar is equality.
            assert replies_agree(numpy, expert_ffn(*w, x, routed=True, backend="numpy"), same_kernel=True,
                                 weight_type=d.ggml_type)
            # A kernel the backbone cannot rerun is held to the loose cross-kernel bound.
            worst = max(worst, relative_error(numpy, ggml))
            assert replies_agree(numpy, ggml, same_kernel=False, weight_type=d.ggml_type)
            liar = (numpy * np.float32(1 + 1e-3)).astype(np.float32)
            assert not replies_agree(liar, numpy, same_kernel=True, weight_type=d.ggml_type)
            noise = numpy + rng.standard_normal(numpy.shape).astype(np.float32) * np.abs(numpy).max()
            assert not replies_agree(noise, ggml, same_kernel=False, weight_type=d.ggml_type)
    assert worst <= tolerance(d.ggml_type)
