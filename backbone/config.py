"""The model config: everything the forward pass needs to know, read once from GGUF metadata.

Every difference between the supported architectures is a field here (RoPE style, Q/K norm,
QKV bias, shared expert and its gate, renormalised top-k, tied output, gated delta-net layers),
filled from the :data:`ARCHES` table, so the forward pass in :mod:`backbone.model` has no
``if arch == ...``: where an architecture adds structure (qwen35moe's delta-net layers), the
engine asks a trait or the per-layer ``recurrent`` list.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gguf import GGUFReader, GGUFValueType

from kvasir_bus.errors import ModelFileError


@dataclass(frozen=True)
class ArchTraits:
    """How one llama.cpp architecture computes (see DESIGN.md section 8)."""

    rope_style: Literal["neox", "norm", "imrope"]  # NEOX pairs (i, i+n_rot/2); NORM pairs (2i, 2i+1);
    # IMROPE: NEOX pairs, angles from 4 interleaved position sections (ggml_rope_multi)
    qk_norm: bool  # RMS norm per head on Q and K before RoPE (qwen3moe)
    qkv_bias: bool  # Q/K/V projections carry biases (qwen2moe)
    norm_topk: bool  # top-k weights divided by their sum (qwen3moe, Mixtral)
    shared_expert: bool  # a shared expert gated by silu(g)/g, g = cur . gate_inp_shexp (qwen2moe)
    expert_ffn_key: str  # metadata key (after "<arch>.") holding the routed expert FFN width
    shexp_gate: Literal["silu_div", "sigmoid"] = "silu_div"  # same function, rounded differently
    ffn_norm: str = "ffn_norm"  # tensor name of the norm before the MoE (qwen35moe: post_attention_norm)
    delta_net: bool = False  # gated delta-net layers (ssm_*), full attention every few layers
    attn_q_gate: bool = False  # attn_q yields (q, gate) per head; attention out * sigmoid(gate)
    ssm_ba: bool = False  # qwen3next: beta and alpha from one ssm_ba, interleaved per Q/K head, and Q/K
    # heads repeated interleaved (V head h reads Q/K head h // (Hv/Hk); qwen35moe: h % Hk)
    # gpt-oss (llama.cpp's openai-moe):
    attn_sinks: bool = False  # a learned per-head logit in every softmax (attn_sinks), an output bias
    # (attn_output.bias), and sliding-window attention on the layers the pattern names
    router: Literal["softmax", "softmax_weight"] = "softmax"  # softmax over all experts then top-k, or
    # top-k on the (biased) logits then softmax over the k chosen (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
    router_bias: bool = False  # ffn_gate_inp.bias added to the router logits
    expert_glu: Literal["swiglu", "swiglu_oai"] = "swiglu"  # the routed experts' activation; swiglu_oai
    # experts carry biases on gate, up and down (ffn_*_exps.bias)


ARCHES: dict[str, ArchTraits] = {
    "qwen2moe": ArchTraits("neox", qk_norm=False, qkv_bias=True, norm_topk=False,
                           shared_expert=True, expert_ffn_key="expert_feed_forward_length"),
    "qwen3moe": ArchTraits("neox", qk_norm=True, qkv_bias=False, norm_topk=True,
                           shared_expert=False, expert_ffn_key="expert_feed_forward_length"),
    # Mixtral is llama.cpp's "llama" architecture with experts.
    "llama": ArchTraits("norm", qk_norm=False, qkv_bias=False, norm_topk=True,
                        shared_expert=False, expert_ffn_key="feed_forward_length"),
    # Qwen3.5 MoE (the 122B-A10B): 3 of 4 layers gated delta-net, the rest gated attention.
    "qwen35moe": ArchTraits("imrope", qk_norm=True, qkv_bias=False, norm_topk=True, shared_expert=True,
                            expert_ffn_key="expert_feed_forward_length", shexp_gate="sigmoid",
                            ffn_norm="post_attention_norm", delta_net=True, attn_q_gate=True),
    # Qwen3-Next: the same family with NEOX RoPE and beta/alpha in one interleaved ssm_ba.
    "qwen3next": ArchTraits("neox", qk_norm=True, qkv_bias=False, norm_topk=True, shared_expert=True,
                            expert_ffn_key="expert_feed_forward_length", shexp_gate="sigmoid",
                            ffn_norm="post_attention_norm", delta_net=True, attn_q_gate=True, ssm_ba=True),
    # gpt-oss (20b, 120b): sinks, sliding window on alternate layers, biases everywhere, swiglu_oai.
    "gpt-oss": ArchTraits("neox", qk_norm=False, qkv_bias=True, norm_topk=False, shared_expert=False,
                          expert_ffn_key="expert_feed_forward_length", ffn_norm="post_attention_norm",
                          attn_sinks=True, router="softmax_weight", router_bias=True, expert_glu="swiglu_oai"),
}


@dataclass(frozen=True)
class RopeScaling:
    """The ``ggml_rope_ext`` parameters past the base, as llama.cpp derives them for a context
    (llama_context's constructor, from the ``rope.scaling.*`` keys): no scaling is freq_scale 1
    and ext_factor 0. YaRN (``rope.scaling.type`` yarn, ``factor`` F, ``original_context_length``
    N) is freq_scale 1/F, ext_factor 1, beta_fast 32, beta_slow 1, ``n_ctx_orig`` N and an
    attn_factor that cancels ggml's own YaRN magnitude scaling (see :func:`yarn`)."""

    n_ctx_orig: int  # the context the ramp between interpolation and extrapolation is set for
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def ggml_args(self) -> dict:
        """Keyword arguments of :func:`kernels.dense.rope_qk` after the base."""
        return dict(n_ctx_orig=self.n_ctx_orig, freq_scale=self.freq_scale, ext_factor=self.ext_factor,
                    attn_factor=self.attn_factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)


def _logf(x: float) -> np.float32:
    """The C library's ``logf``, the one llama.cpp calls (numpy's float32 log may round otherwise)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.float32(libm.logf(np.float32(x)))


def yarn(factor: float, n_ctx_orig: int, attn_factor: float = 1.0) -> RopeScaling:
    """YaRN as llama_context sets it up when the file asks for it and the caller overrides
    nothing (ext_factor 1, no ``yarn_log_multiplier``: gpt-oss does not read one), in float32
    like the C++: ``attn_factor = mscale(F) / (1 + 0.1 ln F) * rope.scaling.attn_factor``, where
    ``mscale(F) = 0.1 ln F + 1``: about 1, and exactly what ggml's kernel multiplies back."""
    f32 = np.float32
    freq_scale = f32(1.0) / f32(factor)  # hparams.rope_freq_scale_train
    scale = f32(1.0) / freq_scale  # cparams: factor = 1.0f / rope_freq_scale
    mscale = f32(0.1) * f32(1.0) * _logf(scale) + f32(1.0) if scale > 1 else f32(1.0)
    mscale *= f32(1.0) / (f32(1.0) + f32(0.1) * _logf(scale))
    mscale *= f32(attn_factor)
    return RopeScaling(n_ctx_orig, float(freq_scale), 1.0, float(mscale), 32.0, 1.0)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    traits: ArchTraits
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # 0: no shared expert
    rms_eps: float
    rope_base: float
    tied_output: bool  # no output.weight: the head reuses token_embd
    bos_id: int | None
    eos_id: int | None
    # Gated delta-net (traits.delta_net): which layers are recurrent, and their sizes.
    recurrent: tuple[bool, ...] = ()  # per layer; empty: none
    ssm_conv_kernel: int = 0  # causal conv width; the conv state keeps kernel - 1 columns
    ssm_k_heads: int = 0  # Q/K heads (ssm.group_count)
    ssm_v_heads: int = 0  # V heads (ssm.time_step_rank)
    ssm_head_dim: int = 0  # S: head size of Q, K and V (ssm.state_size)
    rope_sections: tuple[int, ...] = ()  # IMROPE: 4 section sizes, in rotated pairs
    n_layer_nextn: int = 0  # multi-token-prediction blocks past n_layer: loaded, never executed
    # Sliding-window attention (gpt-oss): which layers see only the last n_swa positions, and
    # the RoPE base those layers use.
    swa: tuple[bool, ...] = ()  # per layer; empty: none
    n_swa: int = 0
    rope_base_swa: float = 0.0
    rope_scaling: RopeScaling | None = None  # None: none (freq_scale 1, n_ctx_orig = n_ctx_train)

    @property
    def rope(self) -> RopeScaling:
        """The RoPE parameters past the base (the same on every layer: gpt-oss' sliding-window
        layers scale like the others)."""
        return self.rope_scaling or RopeScaling(self.n_ctx_train)

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of the delta-net conv: Q, K and V side by side."""
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent) and self.recurrent[layer]

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa) and self.swa[layer]

    def layer_rope_base(self, layer: int) -> float:
        """llama_model::get_rope_freq_base: sliding-window layers have a base of their own."""
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    def layer_window(self, layer: int) -> int:
        """Positions a query of ``layer`` sees (itself included); 0: all before it."""
        return self.n_swa if self.is_swa(layer) else 0


def read_config(reader: GGUFReader, path: str = "model") -> ModelConfig:
    """Parse the GGUF metadata into a :class:`ModelConfig`; errors name the file and the key."""
    meta = _Meta(reader, path)
    arch = meta.str("general.architecture")
    if arch not in ARCHES:
        supported = ", ".join(sorted(ARCHES))
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported (supported: {supported})")
    traits = ARCHES[arch]
    n_expert = meta.int(f"{arch}.expert_count", 0)
    if n_expert == 0:
        raise ModelFileError(f"{path}: not a Mixture-of-Experts model ({arch}.expert_count is missing or 0)")
    n_embd = meta.int(f"{arch}.embedding_length")
    n_head = meta.int(f"{arch}.attention.head_count")
    n_head_kv = meta.int(f"{arch}.attention.head_count_kv", n_head)
    head_dim = meta.int(f"{arch}.attention.key_length", n_embd // n_head)
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
        raise ModelFileError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    names = {t.name for t in reader.tensors}
    n_expert_used = meta.int(f"{arch}.expert_used_count")
    if not 0 < n_expert_used <= n_expert:
        raise ModelFileError(f"{path}: expert_used_count {n_expert_used} is not in 1..{n_expert}")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelFileError(f"{path}: no token_embd.weight tensor")
    n_ff_shexp = meta.int(f"{arch}.expert_shared_feed_forward_length", 0) if traits.shared_expert else 0
    if traits.shared_expert and n_ff_shexp == 0 and "blk.0.ffn_gate_shexp.weight" in names:
        n_ff_shexp = meta.int(f"{arch}.feed_forward_length")
    n_ff_exp = meta.int(f"{arch}.{traits.expert_ffn_key}", 0) or meta.int(f"{arch}.feed_forward_length") // n_expert_used
    n_layer_all = meta.int(f"{arch}.block_count")
    n_layer_nextn = meta.int(f"{arch}.nextn_predict_layers", 0)
    if not 0 <= n_layer_nextn < n_layer_all:
        raise ModelFileError(f"{path}: nextn_predict_layers {n_layer_nextn} is not in 0..{n_layer_all - 1}")
    n_layer = n_layer_all - n_layer_nextn
    ssm = _delta_net_config(meta, arch, n_layer, path) if traits.delta_net else {}
    swa = _swa_config(meta, arch, n_layer, path) if traits.attn_sinks else {}
    sections = ()
    if traits.rope_style == "imrope":
        sections = tuple(meta.int_array(f"{arch}.rope.dimension_sections"))
        if len(sections) != 4 or min(sections) < 0 or sum(sections) == 0:
            raise ModelFileError(f"{path}: rope.dimension_sections {list(sections)} must be 4 sizes, not all 0")
    return ModelConfig(
        arch=arch,
        traits=traits,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=meta.int(f"{arch}.rope.dimension_count", head_dim),
        n_vocab=int(embd.shape[1]),
        n_ctx_train=meta.int(f"{arch}.context_length"),
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        rms_eps=meta.float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_base=meta.float(f"{arch}.rope.freq_base", 10000.0),
        tied_output="output.weight" not in names,
        bos_id=meta.int("tokenizer.ggml.bos_token_id", -1) if "tokenizer.ggml.bos_token_id" in reader.fields else None,
        eos_id=meta.int("tokenizer.ggml.eos_token_id", -1) if "tokenizer.ggml.eos_token_id" in reader.fields else None,
        rope_sections=sections,
        n_layer_nextn=n_layer_nextn,
        rope_scaling=_rope_scaling(meta, arch, traits, path),
        **ssm,
        **swa,
    )


def _rope_scaling(meta: "_Meta", arch: str, traits: ArchTraits, path: str) -> RopeScaling | None:
    """``rope.scaling.*`` as llama.cpp reads them (llama_model::load_hparams): type (default
    linear), factor (0 or absent: 1), original_context_length (default the training context),
    attn_factor (default 1). Linear scaling with factor 1 is no scaling. YaRN is computed on the
    ggml attention path (gpt-oss); anything else is refused in one line rather than ignored."""
    kind = meta.str(f"{arch}.rope.scaling.type", "linear")
    factor = meta.float(f"{arch}.rope.scaling.factor", 0.0) or meta.float(f"{arch}.rope.scale_linear", 0.0)
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):  # "none" never scales
        return None
    if kind != "yarn" or not traits.attn_sinks:
        raise ModelFileError(f"{path}: RoPE scaling {kind!r} (factor {factor:g}) is not supported by the engine "
                             f"for {arch} (YaRN is, for gpt-oss)")
    if factor <= 1.0:
        raise ModelFileError(f"{path}: {arch}.rope.scaling.factor {factor:g} must be above 1 for YaRN")
    n_ctx_orig = meta.int(f"{arch}.rope.scaling.original_context_length", 0) or meta.int(f"{arch}.context_length")
    return yarn(factor, n_ctx_orig, meta.float(f"{arch}.rope.scaling.attn_factor", 1.0))


def _swa_config(meta: "_Meta", arch: str, n_layer: int, path: str) -> dict:
    """The sliding-window keys llama.cpp reads for gpt-oss (llama_model_openai_moe::load_arch_hparams):
    ``attention.sliding_window``; the pattern (an array of per-layer flags, or a period n whose
    layers il with il % n < n - 1 slide; default 2: the even layers); ``rope.freq_base_swa``,
    default the model's base."""
    n_swa = meta.int(f"{arch}.attention.sliding_window")
    if n_swa <= 0:
        raise ModelFileError(f"{path}: attention.sliding_window {n_swa} must be positive")
    key = f"{arch}.attention.sliding_window_pattern"
    field = meta.reader.fields.get(key)
    if field is not None and field.types and field.types[0] == GGUFValueType.ARRAY:
        flags = meta.int_array(key)
        if len(flags) < n_layer:
            raise ModelFileError(f"{path}: {key} has {len(flags)} entries for {n_layer} layers")
        swa = tuple(bool(f) for f in flags[:n_layer])
    else:
        period = meta.int(key, 2)
        if period < 0:
            raise ModelFileError(f"{path}: {key} {period} must not be negative")
        swa = tuple(period == 0 or il % period < period - 1 for il in range(n_layer))
    base = meta.float(f"{arch}.rope.freq_base", 10000.0)
    return dict(swa=swa, n_swa=n_swa, rope_base_swa=meta.float(f"{arch}.rope.freq_base_swa", base))


def _delta_net_config(meta: "_Meta", arch: str, n_layer: int, path: str) -> dict:
    """The delta-net keys llama.cpp reads (llama_model_qwen35moe::load_arch_hparams): which layers
    are recurrent (``attention.recurrent_layers``, else all but every ``full_attention_interval``-th,
    default 4) and the head sizes; S = ssm.state_size must equal inner_size / time_step_rank."""
    if f"{arch}.attention.recurrent_layers" in meta.reader.fields:
        flags = meta.int_array(f"{arch}.attention.recurrent_layers")
        if len(flags) < n_layer:
            raise ModelFileError(f"{path}: attention.recurrent_layers has {len(flags)} entries for {n_layer} layers")
        recurrent = tuple(bool(f) for f in flags[:n_layer])
    else:
        interval = meta.int(f"{arch}.full_attention_interval", 4)
        if interval <= 0:
            raise ModelFileError(f"{path}: full_attention_interval {interval} must be positive")
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    kernel = meta.int(f"{arch}.ssm.conv_kernel")
    inner = meta.int(f"{arch}.ssm.inner_size")
    state = meta.int(f"{arch}.ssm.state_size")
    v_heads = meta.int(f"{arch}.ssm.time_step_rank")
    k_heads = meta.int(f"{arch}.ssm.group_count")
    if min(kernel, inner, state, v_heads, k_heads) <= 0 or v_heads % k_heads or inner != v_heads * state:
        raise ModelFileError(f"{path}: delta-net sizes do not fit: conv_kernel {kernel}, inner_size {inner}, "
                             f"state_size {state}, time_step_rank {v_heads}, group_count {k_heads} "
                             "(need inner_size = time_step_rank * state_size, group_count | time_step_rank)")
    return dict(recurrent=recurrent, ssm_conv_kernel=kernel, ssm_k_heads=k_heads, ssm_v_heads=v_heads,
                ssm_head_dim=state)


class _Meta:
    """Typed access to GGUF key/values with errors that name the file and the key."""

    _MISSING = object()

    def __init__(self, reader: GGUFReader, path: str):
        self.reader, self.path = reader, path

    def _scalar(self, key: str, default):
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
            return default
        if field.types and field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is an array, expected a scalar")
        return field.parts[field.data[0]][0].item()

    def str(self, key: str, default=_MISSING) -> str:
        value = self._scalar(key, default)
        if not isinstance(value, str):
            raise ModelFileError(f"{self.path}: metadata key {key!r} = {value!r} is not a string")
        return value

    def int(self, key: str, default=_MISSING) -> int:
        value = self._scalar(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(f"{self.path}: metadata key {key!r} = {value!r} is not an integer")
        return value

    def int_array(self, key: str) -> list[int]:
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        if not field.types or field.types[0] != GGUFValueType.ARRAY or len(field.types) < 2 \
                or field.types[1] in (GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            raise ModelFileError(f"{self.path}: metadata key {key!r} is not an array of integers")
        return [int(field.parts[i][0]) for i in field.data]

    def float(self, key: str, default=_MISSING) -> float:
        value = self._scalar(key, default)
        if isinstance(value, str):
            raise ModelFileError(f"{self.path}: metadata key {key!r} = {value!r} is not a number")
        return float(value)
