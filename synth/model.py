"""Synthetic Mixture-of-Experts GGUF models: random weights, real shapes, loadable by llama.cpp.

``synth_model(path, arch, preset, qtype, seed, **overrides)`` writes a model that llama.cpp
(llama-cpp-python) loads and runs, with a byte-level BPE tokenizer (:mod:`synth.vocab`), so
text prompts work end to end. Three architecture families:

- ``qwen3moe``: per-head RMS norm on Q and K (``attn_q_norm``/``attn_k_norm``), untied output.
- ``qwen2moe``: Q/K/V biases and a shared expert (``ffn_*_shexp`` gated by
  ``ffn_gate_inp_shexp``); llama.cpp requires ``output.weight``.
- ``mixtral``: llama.cpp's ``llama`` architecture with experts (NORM rope); the output is tied
  (no ``output.weight``: llama.cpp falls back to ``token_embd``).
- ``qwen35moe``: Qwen3.5 MoE (the 122B-A10B). Of every ``full_attention_interval`` layers all but
  the last are gated delta-net layers (``attn_qkv``, ``attn_gate``, ``ssm_*``), the last gated
  attention (``attn_q`` holds query and gate per head, Q/K norms, IMROPE); the FFN norm is
  ``post_attention_norm``; a shared expert gated by ``sigmoid(ffn_gate_inp_shexp . x)``.
- ``qwen3next``: the same family with NEOX RoPE and beta/alpha in one ``ssm_ba`` tensor.
- ``gpt-oss``: attention sinks (``attn_sinks``), sliding-window attention on the even layers
  with a RoPE base of their own (``rope.freq_base_swa``), biases on Q/K/V, the attention
  output, the router and every routed expert (``ffn_*_exps.bias``), experts with swiglu_oai.

The file is written streaming: the header, metadata and tensor table first, then every tensor's
data one chunk at a time (one expert of a 3-D ``*_exps`` tensor, or a block of rows), generated
and quantized on a few threads and written in order. Memory stays at a few chunks whatever the
model's size, which the ``122b-layer`` preset (256 experts of 3072 x 1024) needs.

Weights are normal with a per-chunk seed derived from (seed, tensor name, chunk index), so a
file is a pure function of its config: the same seed gives identical bytes.

Types: every weight matrix (token embedding, output, attention, experts, shared expert) gets
the requested type; norms, biases and routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) stay
F32. F16/Q8_0/Q4_0 are made by gguf-py, K-quants by ggml's own quantizer (``ggml_quantize_chunk``
from llama-cpp-python's bundled libggml-base, the function ``llama-quantize`` calls). A matrix
whose rows do not fit the type's block falls back like llama.cpp's quantizer does (Q4_K->Q5_0,
Q5_K->Q5_1, Q6_K->Q8_0, then F16) and is listed in :attr:`SynthReport.fallbacks`.
``mxfp4`` is llama.cpp's MXFP4_MOE mix, the way the published gpt-oss GGUFs store their
tensors: routed experts in MXFP4, the other matrices in Q8_0, norms, biases, sinks and routers F32.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import importlib.util
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, LlamaFileType

from backbone.config import ARCHES, ArchTraits
from kvasir_bus.errors import DependencyError, ModelFileError, UsageError
from synth import vocab as vocab_mod

SYNTH_VERSION = 2  # bump when the same config would produce different bytes
# A Zephyr-style chat template (tokenizer.chat_template), rendered by the server's chat API.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


# --- architectures: differences are data, not branches --------------------------------------

@dataclass(frozen=True)
class ArchSpec:
    """One synthetic family: a llama.cpp architecture, whose traits in the backbone's table
    (:data:`backbone.config.ARCHES`) decide which tensors and keys the file has, and the few
    choices only a synthetic file makes."""

    gguf_arch: str  # general.architecture, a key of backbone.config.ARCHES
    tied_output: bool  # no output.weight: llama.cpp uses token_embd (qwen2moe requires one)
    rms_eps: float
    rope_base: float
    rope_base_swa: float = 0.0  # sliding-window layers (traits.attn_sinks); 0: none written

    @property
    def traits(self) -> ArchTraits:
        return ARCHES[self.gguf_arch]


ARCHS: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec("qwen3moe", tied_output=False, rms_eps=1e-6, rope_base=1_000_000.0),
    "qwen2moe": ArchSpec("qwen2moe", tied_output=False, rms_eps=1e-6, rope_base=1_000_000.0),
    "mixtral": ArchSpec("llama", tied_output=True, rms_eps=1e-5, rope_base=1_000_000.0),
    "qwen35moe": ArchSpec("qwen35moe", tied_output=False, rms_eps=1e-6, rope_base=10_000_000.0),
    "qwen3next": ArchSpec("qwen3next", tied_output=False, rms_eps=1e-6, rope_base=10_000_000.0),
    # gpt-oss' own base is 150000 on every layer; a synthetic file gives the sliding-window
    # layers another (rope.freq_base_swa), so that using the wrong one shows.
    "gpt-oss": ArchSpec("gpt-oss", tied_output=False, rms_eps=1e-5, rope_base=150_000.0, rope_base_swa=10_000.0),
}

QTYPES: dict[str, QT] = {
    "f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0,
    "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K, "mxfp4": QT.MXFP4,
}
K_QUANTS = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})
GGML_QUANTIZED = K_QUANTS | {QT.MXFP4}  # made by ggml's own quantizer
# What llama.cpp's quantizer uses when a row does not fit a K-quant block (then F16).
_FALLBACK: dict[QT, QT] = {QT.MXFP4: QT.Q8_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
                          QT.Q5_0: QT.F16, QT.Q5_1: QT.F16, QT.Q8_0: QT.F16, QT.Q4_0: QT.F16}
# general.file_type: the files are uniform (every matrix one type), closest to llama.cpp's "S"
_FILE_TYPES: dict[QT, LlamaFileType] = {
    QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16,
    QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    QT.Q4_K: LlamaFileType.MOSTLY_Q4_K_S, QT.Q5_K: LlamaFileType.MOSTLY_Q5_K_S,
    QT.Q6_K: LlamaFileType.MOSTLY_Q6_K, QT.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}
MXFP4_OTHERS = QT.Q8_0  # llama-quantize's MXFP4_MOE: every matrix that is not a routed expert


# --- presets and the config -----------------------------------------------------------------

# shared_expert_ffn applies to qwen2moe only (the other two have no shared expert).
PRESETS: dict[str, dict[str, int]] = {
    # unit tests: builds and runs in well under a second
    "tiny": dict(layers=2, experts=8, experts_used=2, hidden=64, expert_ffn=32, heads=4,
                 kv_heads=2, vocab=320, ctx=256, shared_expert_ffn=64),
    # demo and benchmarks: ~200M parameters, ~113 MB at q4_k
    "small": dict(layers=8, experts=64, experts_used=8, hidden=512, expert_ffn=256, heads=8,
                  kv_heads=4, vocab=1024, ctx=2048, shared_expert_ffn=512),
    # the per-expert shapes of the 122B model; one Q4_K expert is 3 x 1,769,472 bytes
    "122b-layer": dict(layers=1, experts=256, experts_used=8, hidden=3072, expert_ffn=1024,
                       heads=32, kv_heads=2, vocab=1024, ctx=4096, shared_expert_ffn=1024),
}
# K-quant blocks hold 256 values of a row: tiny's rows are widened so the experts really are
# K-quants (explicit overrides win, and fall back with a warning if they do not fit).
_TINY_K_QUANT = dict(hidden=256, expert_ffn=256, shared_expert_ffn=256)

# Sizes only the delta-net family has (0 elsewhere). head_dim 0 = hidden / heads; rope_dims 0 =
# head_dim. The 122b-layer row is Qwen3.5-122B-A10B's config as we read it: 32 query heads and
# 2 KV heads of 256 (64 rotated, sections 11/11/10), 16 Q/K and 64 V delta-net heads of 128,
# conv width 4, full attention every 4th layer; one layer by default (a delta-net layer), pass
# --layers 4 for one full period with its attention layer.
DELTA_NET_FIELDS = ("head_dim", "rope_dims", "ssm_k_heads", "ssm_v_heads", "ssm_head_dim", "conv_kernel",
                    "full_attention_interval")
_DELTA_NET_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=4, head_dim=0, rope_dims=8, ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=16,
                 conv_kernel=4, full_attention_interval=4),
    "small": dict(head_dim=0, rope_dims=16, ssm_k_heads=4, ssm_v_heads=8, ssm_head_dim=64, conv_kernel=4,
                  full_attention_interval=4),
    "122b-layer": dict(head_dim=256, rope_dims=64, ssm_k_heads=16, ssm_v_heads=64, ssm_head_dim=128,
                       conv_kernel=4, full_attention_interval=4),
}
_DELTA_NET_TINY_K_QUANT = dict(ssm_head_dim=64)  # ssm_out rows (v heads x head size) of 256

# gpt-oss: head_dim is its own (64, not hidden / heads), and the sliding window. The 122b-layer
# row is gpt-oss-120b's layer (hidden 2880, 128 experts, top-4, expert FFN 2880, 64 query and
# 8 KV heads of 64, window 128); tiny's window of 8 is shorter than the test prompts, so the
# sliding-window layers really mask.
GPT_OSS_FIELDS = ("head_dim", "sliding_window")
_GPT_OSS_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, heads=8, kv_heads=2, head_dim=16, sliding_window=8),  # Q is 128 wide, hidden 64
    "small": dict(experts=32, experts_used=4, expert_ffn=512, heads=8, kv_heads=2, head_dim=64, sliding_window=128),
    "122b-layer": dict(experts=128, experts_used=4, hidden=2880, expert_ffn=2880, heads=64, kv_heads=8,
                       head_dim=64, sliding_window=128),
}

SIZE_FIELDS = ("layers", "experts", "experts_used", "hidden", "expert_ffn", "heads", "kv_heads",
               "vocab", "ctx", "shared_expert_ffn") + DELTA_NET_FIELDS + ("sliding_window",)


@dataclass(frozen=True)
class SynthConfig:
    """Everything a synthetic model is a function of. ``shared_expert_ffn`` is 0 = no shared
    expert."""

    arch: str
    preset: str
    qtype: str
    seed: int
    layers: int
    experts: int
    experts_used: int
    hidden: int
    expert_ffn: int
    heads: int
    kv_heads: int
    vocab: int
    ctx: int
    shared_expert_ffn: int
    # delta-net family only (0 elsewhere): see DELTA_NET_FIELDS
    head_dim: int = 0
    rope_dims: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    conv_kernel: int = 0
    full_attention_interval: int = 0
    sliding_window: int = 0  # gpt-oss only
    # RoPE scaling (gpt-oss): "none", or "yarn" as the published files have it
    rope_scaling: str = "none"
    rope_scaling_factor: float = 0.0  # yarn: context extension factor (published: 32)
    rope_original_context: int = 0  # yarn: the context trained before extension (published: 4096)
    # qwen35moe: one multi-token-prediction block (blk.<layers>.*, nextn_predict_layers 1) that
    # llama.cpp loads (and skips unless asked to load MTP) and the engine never executes
    mtp: bool = False

    def __post_init__(self):
        if not self.head_dim:  # the attention head size defaults to hidden / heads
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    @property
    def ggml_type(self) -> QT:
        return QTYPES[self.qtype]

    @property
    def n_rot(self) -> int:
        return self.rope_dims or self.head_dim

    @property
    def rope_sections(self) -> tuple[int, int, int, int]:
        """IMROPE sections over the n_rot/2 rotated pairs, split 11:11:10 like Qwen3.5's 32."""
        pairs = self.n_rot // 2
        t = h = (pairs * 11 + 16) // 32
        return (t, h, pairs - t - h, 0)

    @property
    def n_mtp(self) -> int:
        """Multi-token-prediction blocks after the ``layers`` trunk blocks (0 or 1)."""
        return int(self.mtp)

    def is_recurrent(self, layer: int) -> bool:
        """Delta-net trunk layers; the MTP block is full attention (llama.cpp: is_recr is false
        past n_layer)."""
        return (self.spec.traits.delta_net and layer < self.layers
                and (layer + 1) % self.full_attention_interval != 0)

    def matrix_type(self, expert: bool) -> QT:
        """The type asked for a weight matrix: ``mxfp4`` puts only routed experts in MXFP4."""
        if self.ggml_type == QT.MXFP4 and not expert:
            return MXFP4_OTHERS
        return self.ggml_type

    @property
    def ssm_conv_channels(self) -> int:
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim


MTP_ARCHS = ("qwen35moe",)  # where --mtp writes a nextn block as llama.cpp's loader expects it
YARN_DEFAULTS = dict(rope_scaling_factor=32.0, rope_original_context=4096)  # published gpt-oss


def make_config(arch: str = "qwen3moe", preset: str = "tiny", qtype: str = "f32", seed: int = 0, *,
                rope_scaling: str = "none", rope_scaling_factor: float | None = None,
                rope_original_context: int | None = None, mtp: bool = False,
                **overrides: int | None) -> SynthConfig:
    """The config for a preset with some sizes overridden (``None`` = keep the preset's).
    ``rope_scaling="yarn"`` (gpt-oss) writes YaRN RoPE scaling, by default as published
    (factor 32, original context 4096). ``mtp`` (qwen35moe) adds the multi-token-prediction
    block the published Qwen3.5 files have.

    Raises :class:`UsageError` for anything that could not make a valid model.
    """
    _check_choice("architecture", arch, ARCHS)
    _check_choice("preset", preset, PRESETS)
    _check_choice("type", qtype, QTYPES)
    unknown = set(overrides) - set(SIZE_FIELDS)
    if unknown:
        raise UsageError(f"unknown size override(s): {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(SIZE_FIELDS)})")
    if not isinstance(seed, int) or seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {seed!r}")
    given = {k: v for k, v in overrides.items() if v is not None}
    shared_expert = ARCHS[arch].traits.shared_expert
    delta_net = ARCHS[arch].traits.delta_net
    gpt_oss = ARCHS[arch].traits.attn_sinks
    own = set(DELTA_NET_FIELDS if delta_net else ()) | set(GPT_OSS_FIELDS if gpt_oss else ())
    if given.get("shared_expert_ffn") is not None and not shared_expert:
        having = ", ".join(a for a, spec in ARCHS.items() if spec.traits.shared_expert)
        raise UsageError(f"--shared-expert-ffn: architecture {arch} has no shared expert "
                         f"(only {having} has one)")
    for name in set(DELTA_NET_FIELDS + GPT_OSS_FIELDS) - own:
        if given.get(name) is not None:
            families = []
            if name in DELTA_NET_FIELDS:
                having = ", ".join(a for a, spec in ARCHS.items() if spec.traits.delta_net)
                families.append(f"delta-net architectures ({having})")
            if name in GPT_OSS_FIELDS:
                families.append(", ".join(a for a, spec in ARCHS.items() if spec.traits.attn_sinks))
            raise UsageError(f"--{name.replace('_', '-')}: only for {' and '.join(families)}")
    sizes = dict(PRESETS[preset])
    sizes.update(dict.fromkeys(DELTA_NET_FIELDS + GPT_OSS_FIELDS, 0))
    if delta_net:
        sizes.update(_DELTA_NET_PRESETS[preset])
    if gpt_oss:
        sizes.update(_GPT_OSS_PRESETS[preset])
    if preset == "tiny" and QTYPES[qtype] in K_QUANTS:
        sizes.update(_TINY_K_QUANT)
        if delta_net:
            sizes.update(_DELTA_NET_TINY_K_QUANT)
        if gpt_oss:
            sizes.update(head_dim=64)  # attn_output rows of heads x 64 = 256
    sizes.update(given)
    if not shared_expert:
        sizes["shared_expert_ffn"] = 0
    for name in SIZE_FIELDS:
        value = sizes[name]
        if name == "shared_expert_ffn" and not shared_expert:
            continue
        if name in DELTA_NET_FIELDS + GPT_OSS_FIELDS and (name not in own or name in ("head_dim", "rope_dims")) \
                and value == 0:
            continue  # not this family's, or "derive it"
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    sizes.update(_rope_scaling(arch, rope_scaling, rope_scaling_factor, rope_original_context))
    if mtp:
        if arch not in MTP_ARCHS:
            raise UsageError(f"--mtp: only for {', '.join(MTP_ARCHS)} (a multi-token-prediction block "
                             f"llama.cpp loads for it)")
        sizes["mtp"] = True
    cfg = SynthConfig(arch=arch, preset=preset, qtype=qtype, seed=seed, **sizes)
    _check_consistent(cfg)
    return cfg


def _rope_scaling(arch: str, kind: str, factor: float | None, original: int | None) -> dict:
    if kind not in ("none", "yarn"):
        raise UsageError(f"--rope-scaling {kind!r}: choose none or yarn")
    if kind == "none":
        if factor is not None or original is not None:
            raise UsageError("--rope-scaling-factor and --rope-original-context need --rope-scaling yarn")
        return {}
    if not ARCHS[arch].traits.attn_sinks:
        having = ", ".join(a for a, spec in ARCHS.items() if spec.traits.attn_sinks)
        raise UsageError(f"--rope-scaling yarn: only for {having} (the engine computes YaRN there)")
    factor = YARN_DEFAULTS["rope_scaling_factor"] if factor is None else factor
    original = YARN_DEFAULTS["rope_original_context"] if original is None else original
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 < float(factor) <= 1024.0:
        raise UsageError(f"--rope-scaling-factor must be a number in (1, 1024], got {factor!r}")
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise UsageError(f"--rope-original-context must be a positive integer, got {original!r}")
    return dict(rope_scaling="yarn", rope_scaling_factor=float(factor), rope_original_context=original)


def _check_choice(what: str, value: str, known: dict) -> None:
    if value not in known:
        raise UsageError(f"unknown {what} {value!r} (choose from {', '.join(known)})")


def _check_consistent(cfg: SynthConfig) -> None:
    if cfg.spec.traits.delta_net:
        _check_delta_net(cfg)
    elif cfg.spec.traits.attn_sinks:
        if cfg.head_dim < 2:
            raise UsageError(f"--head-dim {cfg.head_dim} must be at least 2")
    elif cfg.hidden % cfg.heads:
        raise UsageError(f"--heads {cfg.heads} does not divide --hidden {cfg.hidden}")
    if cfg.heads % cfg.kv_heads:
        raise UsageError(f"--kv-heads {cfg.kv_heads} does not divide --heads {cfg.heads}")
    if cfg.head_dim % 2:
        raise UsageError(f"head size {cfg.head_dim} (--hidden / --heads) must be even for RoPE")
    if cfg.experts_used > cfg.experts:
        raise UsageError(f"--experts-used {cfg.experts_used} is more than --experts {cfg.experts}")
    if cfg.experts > 1024:  # LLAMA_MAX_EXPERTS; llama.cpp aborts above it
        raise UsageError(f"--experts {cfg.experts}: llama.cpp supports at most 1024")
    if cfg.layers > 512:  # LLAMA_MAX_LAYERS
        raise UsageError(f"--layers {cfg.layers}: llama.cpp supports at most 512")
    if cfg.vocab < vocab_mod.MIN_VOCAB:
        raise UsageError(f"--vocab {cfg.vocab} is too small: the byte-level tokenizer needs at "
                         f"least {vocab_mod.MIN_VOCAB} (256 bytes, <|endoftext|>, one merge)")


def _check_delta_net(cfg: SynthConfig) -> None:
    if cfg.head_dim <= 0:
        raise UsageError(f"--heads {cfg.heads} is more than --hidden {cfg.hidden}; give --head-dim")
    if cfg.n_rot % 2 or cfg.n_rot > cfg.head_dim or cfg.n_rot < 8:
        raise UsageError(f"--rope-dims {cfg.n_rot} must be even and in 8..{cfg.head_dim} (the head size)")
    if cfg.ssm_v_heads % cfg.ssm_k_heads:
        raise UsageError(f"--ssm-k-heads {cfg.ssm_k_heads} does not divide --ssm-v-heads {cfg.ssm_v_heads}")
    if cfg.conv_kernel < 2:
        raise UsageError(f"--conv-kernel {cfg.conv_kernel} must be at least 2")


# --- the tensor plan --------------------------------------------------------------------------

_CHUNK_VALUES = 1 << 22  # part of the seed scheme: changing it changes the bytes


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its numpy-order shape, its type and how its values are drawn."""

    name: str
    shape: tuple[int, ...]  # numpy order (ne reversed): (n_expert, rows, cols) for *_exps
    ggml_type: QT
    requested: QT  # the type asked for; differs from ggml_type after a fallback
    std: float
    mean: float = 0.0

    @property
    def cols(self) -> int:  # ne[0]
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape[:-1]) * (self.cols // block) * type_size

    def chunks(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` over the flattened rows: one expert per chunk for the
        3-D expert tensors, about ``_CHUNK_VALUES`` values per chunk otherwise."""
        rows = math.prod(self.shape[:-1])
        step = self.shape[1] if len(self.shape) == 3 else max(1, _CHUNK_VALUES // self.cols)
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _matrix_type(requested: QT, cols: int) -> QT:
    """The type a matrix with rows of ``cols`` values gets: the requested one if its blocks fit."""
    qtype = requested
    while cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK[qtype]
    return qtype


def plan_tensors(cfg: SynthConfig) -> list[TensorPlan]:
    """Every tensor of the model, in file order, with the shapes llama.cpp expects."""
    spec, traits, want = cfg.spec, cfg.spec.traits, cfg.ggml_type
    d, hd, ff, E = cfg.hidden, cfg.head_dim, cfg.expert_ffn, cfg.experts
    q_dim, kv_dim = cfg.heads * hd, cfg.kv_heads * hd

    def matrix(name: str, shape: tuple[int, ...], std: float) -> TensorPlan:
        asked = cfg.matrix_type(expert=len(shape) == 3)
        return TensorPlan(name, shape, _matrix_type(asked, shape[-1]), asked, std)

    def f32(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> TensorPlan:
        return TensorPlan(name, shape, QT.F32, QT.F32, std, mean)

    # Scales: inputs to every projection are RMS-normalised (about unit per element), so
    # std 1/sqrt(fan_in) keeps activations near unit; logits come out with std ~2. A tied
    # output reuses the unit-std embedding, so its output_norm carries the 1/sqrt(d) instead.
    out_gain = 2.0 / math.sqrt(d) if spec.tied_output else 1.0
    plan = [matrix("token_embd.weight", (cfg.vocab, d), 1.0)]
    plan.append(f32("output_norm.weight", (d,), 0.1 * out_gain, out_gain))
    if not spec.tied_output:
        plan.append(matrix("output.weight", (cfg.vocab, d), 2.0 / math.sqrt(d)))
    for i in range(cfg.layers + cfg.n_mtp):
        b = f"blk.{i}."
        plan.append(f32(b + "attn_norm.weight", (d,), 0.1, 1.0))
        if cfg.is_recurrent(i):
            plan += _delta_net_tensors(cfg, b, matrix, f32)
            plan += _moe_tensors(cfg, b, matrix, f32)
            continue
        if traits.attn_q_gate:  # query and gate per head, interleaved by head
            q_dim *= 2
        plan.append(matrix(b + "attn_q.weight", (q_dim, d), d ** -0.5))
        if traits.attn_q_gate:
            q_dim //= 2
        plan.append(matrix(b + "attn_k.weight", (kv_dim, d), d ** -0.5))
        plan.append(matrix(b + "attn_v.weight", (kv_dim, d), d ** -0.5))
        if traits.qkv_bias:
            for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                plan.append(f32(b + f"attn_{x}.bias", (n,), 0.1))
        if traits.qk_norm:  # one RMS norm weight per head dimension, shared by all heads
            plan.append(f32(b + "attn_q_norm.weight", (hd,), 0.1, 1.0))
            plan.append(f32(b + "attn_k_norm.weight", (hd,), 0.1, 1.0))
        plan.append(matrix(b + "attn_output.weight", (d, q_dim), q_dim ** -0.5))
        if traits.attn_sinks:  # one logit per head; output bias
            plan.append(f32(b + "attn_output.bias", (d,), 0.1))
            plan.append(f32(b + "attn_sinks.weight", (cfg.heads,), 1.0))
        plan += _moe_tensors(cfg, b, matrix, f32)
        if i >= cfg.layers:  # the MTP block: a full-attention MoE block, plus what makes it NextN
            plan += [matrix(b + "nextn.eh_proj.weight", (d, 2 * d), (2 * d) ** -0.5),
                     f32(b + "nextn.enorm.weight", (d,), 0.1, 1.0),
                     f32(b + "nextn.hnorm.weight", (d,), 0.1, 1.0),
                     f32(b + "nextn.shared_head_norm.weight", (d,), 0.1 * out_gain, out_gain)]
    return plan


def _moe_tensors(cfg: SynthConfig, b: str, matrix, f32) -> list[TensorPlan]:
    traits, d, ff, E = cfg.spec.traits, cfg.hidden, cfg.expert_ffn, cfg.experts
    plan = [f32(b + traits.ffn_norm + ".weight", (d,), 0.1, 1.0),
            # router logits with std ~2: top-k differs from token to token, softmax not one-hot
            f32(b + "ffn_gate_inp.weight", (E, d), 2.0 / math.sqrt(d)),
            matrix(b + "ffn_gate_exps.weight", (E, ff, d), d ** -0.5),
            matrix(b + "ffn_up_exps.weight", (E, ff, d), d ** -0.5),
            matrix(b + "ffn_down_exps.weight", (E, d, ff), ff ** -0.5)]
    if traits.router_bias:
        plan.append(f32(b + "ffn_gate_inp.bias", (E,), 0.5))
    if traits.expert_glu == "swiglu_oai":  # one bias row per expert (ne = (rows, E))
        plan += [f32(b + "ffn_gate_exps.bias", (E, ff), 0.5), f32(b + "ffn_up_exps.bias", (E, ff), 0.5),
                 f32(b + "ffn_down_exps.bias", (E, d), 0.1)]
    if traits.shared_expert:
        sff = cfg.shared_expert_ffn
        plan.append(f32(b + "ffn_gate_inp_shexp.weight", (d,), d ** -0.5))
        plan.append(matrix(b + "ffn_gate_shexp.weight", (sff, d), d ** -0.5))
        plan.append(matrix(b + "ffn_up_shexp.weight", (sff, d), d ** -0.5))
        plan.append(matrix(b + "ffn_down_shexp.weight", (d, sff), sff ** -0.5))
    return plan


def _delta_net_tensors(cfg: SynthConfig, b: str, matrix, f32) -> list[TensorPlan]:
    """A gated delta-net layer's mixer, shaped as llama_model_qwen35moe::load_arch_tensors wants.
    ssm_a (= -exp(A_log)) is drawn around -1 with std 0.1, so it is always negative: every
    token's decay exp(softplus(.) * ssm_a) stays below 1 and the recurrent state bounded."""
    d, S, Hv, C, W = cfg.hidden, cfg.ssm_head_dim, cfg.ssm_v_heads, cfg.ssm_conv_channels, cfg.conv_kernel
    return [
        matrix(b + "attn_qkv.weight", (C, d), d ** -0.5),
        matrix(b + "attn_gate.weight", (Hv * S, d), d ** -0.5),
        f32(b + "ssm_conv1d.weight", (C, W), W ** -0.5),  # ggml_ssm_conv takes float32 only
        f32(b + "ssm_dt.bias", (Hv,), 0.5),
        f32(b + "ssm_a", (Hv,), 0.1, -1.0),
        *([matrix(b + "ssm_ba.weight", (2 * Hv, d), d ** -0.5)] if cfg.spec.traits.ssm_ba else
          [matrix(b + "ssm_beta.weight", (Hv, d), d ** -0.5), matrix(b + "ssm_alpha.weight", (Hv, d), d ** -0.5)]),
        f32(b + "ssm_norm.weight", (S,), 0.1, 1.0),
        matrix(b + "ssm_out.weight", (d, Hv * S), (Hv * S) ** -0.5),
    ]


# --- metadata ----------------------------------------------------------------------------------

def _add_metadata(w: gguf.GGUFWriter, cfg: SynthConfig) -> None:
    spec, traits = cfg.spec, cfg.spec.traits
    w.add_name(f"kvasir-synth-{cfg.arch}-{cfg.preset}-{cfg.qtype}-seed{cfg.seed}")
    w.add_file_type(int(_FILE_TYPES[cfg.ggml_type]))
    if cfg.ggml_type not in (QT.F32, QT.F16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32("kvasir.synth.version", SYNTH_VERSION)
    w.add_uint64("kvasir.synth.seed", cfg.seed)
    w.add_string("kvasir.synth.preset", cfg.preset)

    w.add_vocab_size(cfg.vocab)
    w.add_context_length(cfg.ctx)
    w.add_embedding_length(cfg.hidden)
    w.add_block_count(cfg.layers + cfg.n_mtp)
    if cfg.mtp:
        w.add_uint32(f"{spec.gguf_arch}.nextn_predict_layers", cfg.n_mtp)
    w.add_feed_forward_length(cfg.expert_ffn)  # llama (mixtral) reads the expert size here
    if traits.expert_ffn_key == "expert_feed_forward_length":
        w.add_expert_feed_forward_length(cfg.expert_ffn)
    if traits.shared_expert:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.n_rot)
    if traits.rope_style == "imrope":
        w.add_array(f"{cfg.spec.gguf_arch}.rope.dimension_sections", list(cfg.rope_sections))
    if traits.delta_net:
        a = cfg.spec.gguf_arch
        w.add_uint32(f"{a}.ssm.conv_kernel", cfg.conv_kernel)
        w.add_uint32(f"{a}.ssm.inner_size", cfg.ssm_v_heads * cfg.ssm_head_dim)
        w.add_uint32(f"{a}.ssm.state_size", cfg.ssm_head_dim)
        w.add_uint32(f"{a}.ssm.time_step_rank", cfg.ssm_v_heads)
        w.add_uint32(f"{a}.ssm.group_count", cfg.ssm_k_heads)
        w.add_uint32(f"{a}.full_attention_interval", cfg.full_attention_interval)
    w.add_rope_freq_base(spec.rope_base)
    if traits.attn_sinks:
        w.add_sliding_window(cfg.sliding_window)
        w.add_float32(f"{spec.gguf_arch}.rope.freq_base_swa", spec.rope_base_swa)
    if cfg.rope_scaling == "yarn":  # the keys (and types) of the published gpt-oss GGUFs
        w.add_string(f"{spec.gguf_arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{spec.gguf_arch}.rope.scaling.factor", cfg.rope_scaling_factor)
        w.add_uint32(f"{spec.gguf_arch}.rope.scaling.original_context_length", cfg.rope_original_context)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)

    v = vocab_mod.build_vocab(cfg.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.token_types))
    w.add_token_merges(list(v.merges))
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(v.eos_id)
    w.add_add_bos_token(False)  # like Qwen: tokenize() adds nothing
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)  # not ChatML, so tests can tell the file's own is used


# --- values: generate and quantize one chunk ---------------------------------------------------

def _chunk_values(t: TensorPlan, seed: int, index: int, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``t`` in float32, shape (stop - start, cols)."""
    key = np.random.SeedSequence([seed, zlib.crc32(t.name.encode()), index])
    x = np.random.default_rng(key).standard_normal((stop - start, t.cols), dtype=np.float32)
    x *= np.float32(t.std)
    if t.mean:
        x += np.float32(t.mean)
    return x


def quantize_rows(x: np.ndarray, qtype: QT) -> np.ndarray:
    """Quantize float32 rows ``x`` (rows, cols) to ``qtype``: the raw bytes as a numpy array."""
    if qtype == QT.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype in GGML_QUANTIZED:
        return _ggml_quantize(x, qtype)
    return gguf.quants.quantize(x, qtype)


@functools.lru_cache(maxsize=1)
def _ggml_quantize_chunk():
    """``ggml_quantize_chunk`` from llama-cpp-python's bundled libggml-base (no llama import)."""
    spec = importlib.util.find_spec("llama_cpp")
    lib = Path(spec.origin).parent / "lib" / "libggml-base.so" if spec and spec.origin else None
    if lib is None or not lib.exists():
        raise DependencyError("K-quant types (q4_k, q5_k, q6_k) are made with llama.cpp's quantizer: "
                              "install llama-cpp-python (pip install 'kvasir-bus[backbone]')")
    fn = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL).ggml_quantize_chunk
    # size_t ggml_quantize_chunk(type, const float *src, void *dst, int64 start, int64 nrows,
    #                            int64 n_per_row, const float *imatrix)
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


def _ggml_quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    rows, cols = x.shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(rows * (cols // block) * type_size, dtype=np.uint8)
    written = _ggml_quantize_chunk()(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def _make_chunk(t: TensorPlan, seed: int, index: int, start: int, stop: int) -> np.ndarray:
    return quantize_rows(_chunk_values(t, seed, index, start, stop), t.ggml_type)


# --- writing -----------------------------------------------------------------------------------

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor being written)


@dataclass(frozen=True)
class SynthReport:
    path: Path
    config: SynthConfig
    file_bytes: int
    seconds: float
    fallbacks: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (asked, got)


def write_model(path: str | os.PathLike, cfg: SynthConfig, *, progress: Progress | None = None,
                threads: int | None = None) -> SynthReport:
    """Write the model ``cfg`` describes to ``path`` (atomically: a temp file, then a rename)."""
    t0 = time.perf_counter()
    path = Path(path)
    _check_output_path(path)
    if cfg.ggml_type in GGML_QUANTIZED:
        _ggml_quantize_chunk()  # fail before writing anything if llama-cpp-python is missing
    plan = plan_tensors(cfg)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        _write_header(tmp, cfg, plan)
        with open(tmp, "ab") as f:
            _write_data(f, cfg, plan, progress, threads or _default_threads())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fallbacks = {t.name: (t.requested.name.lower(), t.ggml_type.name.lower())
                 for t in plan if t.ggml_type != t.requested}
    return SynthReport(path, cfg, path.stat().st_size, time.perf_counter() - t0, fallbacks)


def synth_model(path: str | os.PathLike, arch: str = "qwen3moe", preset: str = "tiny",
                qtype: str = "f32", seed: int = 0, **overrides) -> Path:
    """Build a synthetic model and return its path (see :func:`make_config` for the knobs)."""
    return write_model(path, make_config(arch, preset, qtype, seed, **overrides)).path


def _check_output_path(path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give a file name, e.g. {path / 'model.gguf'}")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{path}: directory {parent} is not writable")


def _default_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def _write_header(path: Path, cfg: SynthConfig, plan: list[TensorPlan]) -> None:
    """Header, metadata and tensor table; the data section is appended by :func:`_write_data`."""
    w = gguf.GGUFWriter(path, cfg.spec.gguf_arch)
    _add_metadata(w, cfg)
    for t in plan:
        if t.ggml_type in (QT.F32, QT.F16):
            dtype = np.float32 if t.ggml_type == QT.F32 else np.float16
            w.add_tensor_info(t.name, t.shape, np.dtype(dtype), t.nbytes)
        else:  # quantized: byte shape (last axis in bytes) with the raw type
            byte_shape = gguf.quants.quant_shape_to_byte_shape(t.shape, t.ggml_type)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def _write_data(f, cfg: SynthConfig, plan: list[TensorPlan], progress: Progress | None,
                threads: int) -> None:
    """Every tensor's bytes in table order, each padded to the alignment, as GGUF requires."""
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    _pad(f, align)
    total = sum(_padded(t.nbytes, align) for t in plan)
    jobs = [(t, i, start, stop, i == len(chunks) - 1)
            for t in plan for chunks in [t.chunks()] for i, (start, stop) in enumerate(chunks)]
    written = tensor_start = 0  # bytes into the data section
    results = _ordered_map(lambda job: _make_chunk(job[0], cfg.seed, *job[1:4]), jobs, threads)
    for (t, _, _, _, last), data in zip(jobs, results):
        f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        written += data.nbytes
        if last:
            if written - tensor_start != t.nbytes:
                raise RuntimeError(f"{t.name}: wrote {written - tensor_start} bytes, expected {t.nbytes}")
            _pad(f, align)
            written = tensor_start = _padded(written, align)
        if progress is not None:
            progress(written, total, t.name)


def _padded(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _pad(f, align: int) -> None:
    f.write(b"\0" * (_padded(f.tell(), align) - f.tell()))


def _ordered_map(fn, items: list, threads: int) -> Iterator:
    """``map(fn, items)`` on ``threads`` threads, in order, with at most 2*threads results
    waiting, so memory stays bounded however many items there are."""
    if threads <= 1:
        yield from map(fn, items)
        return
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="synth") as pool:
        pending: collections.deque = collections.deque()
        it = iter(items)
        try:
            for item in it:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()


# --- inspection (kvasir info) ------------------------------------------------------------------

def describe_model(path: str | os.PathLike) -> dict:
    """What ``kvasir info`` shows, for any MoE GGUF (synthetic or not), as plain data.

    Keys: architecture, layers, experts, experts_used, hidden, expert_ffn, expert_slab_bytes
    (gate+up+down of one expert in the first MoE layer), expert_slab_bytes_max (the largest over
    layers: llama.cpp's mixes such as Q4_K_M give some layers bigger types), expert_share (routed
    expert bytes / file bytes), fingerprint, file_bytes, tensor_types ({group: {type: count}},
    where a group is the tensor name without ``blk.N.`` and ``.weight``). Raises :class:`ModelFileError` for a
    missing, truncated or corrupt file, or one without routed experts.
    """
    from kvasir_bus.fingerprint import model_fingerprint
    from kernels.tensors import open_gguf

    path = Path(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: no general.architecture key; not a model GGUF")
    exps = [t for t in reader.tensors if "_exps" in t.name]
    if not exps:
        raise ModelFileError(f"{path}: architecture {arch} has no routed expert tensors "
                             "(*_exps); not a Mixture-of-Experts model")
    n_expert = _field(reader, f"{arch}.expert_count") or int(exps[0].shape[-1])
    slabs: dict[int | None, int] = {}  # layer -> bytes of one expert's slab in that layer
    for t in exps:
        layer = _layer_of(t.name)
        slabs[layer] = slabs.get(layer, 0) + int(t.n_bytes) // n_expert
    down = next((t for t in exps if "ffn_down_exps" in t.name), None)
    expert_ffn = int(down.shape[0]) if down is not None else \
        _field(reader, f"{arch}.expert_feed_forward_length")
    file_bytes = sum(os.path.getsize(p) for p in getattr(reader, "paths", [path]))  # all parts of a split
    return {
        "architecture": arch,
        "layers": _field(reader, f"{arch}.block_count"),
        "mtp_layers": _field(reader, f"{arch}.nextn_predict_layers") or 0,  # of them: never executed
        "experts": int(n_expert),
        "experts_used": _field(reader, f"{arch}.expert_used_count"),
        "hidden": _field(reader, f"{arch}.embedding_length"),
        "expert_ffn": expert_ffn,
        "expert_slab_bytes": next(iter(slabs.values())),
        "expert_slab_bytes_max": max(slabs.values()),
        "expert_share": sum(int(t.n_bytes) for t in exps) / file_bytes,
        "fingerprint": model_fingerprint(reader),
        "file_bytes": file_bytes,
        "tensor_types": _tensor_types(reader),
    }


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return int(value) if isinstance(value, (np.integer,)) else value


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


def tensor_group(name: str) -> str:
    """``blk.3.ffn_down_exps.weight`` -> ``ffn_down_exps``; ``blk.0.attn_q.bias`` -> ``attn_q.bias``."""
    if _layer_of(name) is not None:
        name = name.split(".", 2)[2]
    return name.removesuffix(".weight")


def _tensor_types(reader) -> dict[str, dict[str, int]]:
    groups: dict[str, collections.Counter] = {}
    for t in reader.tensors:
        type_name = QT(int(t.tensor_type)).name.lower()
        groups.setdefault(tensor_group(t.name), collections.Counter())[type_name] += 1
    return {g: dict(c) for g, c in groups.items()}
