"""The model config: everything the forward pass needs to know, read once from GGUF metadata.

Every difference between the supported architectures is a field here (RoPE style, Q/K norm,
QKV bias, shared expert and its gate, renormalised top-k, tied output), filled from the
:data:`ARCHES` table, so the forward pass in :mod:`backbone.model` has no ``if arch == ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gguf import GGUFReader, GGUFValueType

from kvasir_bus.errors import ModelFileError


@dataclass(frozen=True)
class ArchTraits:
    """How one llama.cpp architecture computes (see DESIGN.md section 8)."""

    rope_style: Literal["neox", "norm"]  # NEOX pairs (i, i+n_rot/2); NORM pairs (2i, 2i+1)
    qk_norm: bool  # RMS norm per head on Q and K before RoPE (qwen3moe)
    qkv_bias: bool  # Q/K/V projections carry biases (qwen2moe)
    norm_topk: bool  # top-k weights divided by their sum (qwen3moe, Mixtral)
    shared_expert: bool  # a shared expert gated by silu(g)/g, g = cur . gate_inp_shexp (qwen2moe)
    expert_ffn_key: str  # metadata key (after "<arch>.") holding the routed expert FFN width


ARCHES: dict[str, ArchTraits] = {
    "qwen2moe": ArchTraits("neox", qk_norm=False, qkv_bias=True, norm_topk=False,
                           shared_expert=True, expert_ffn_key="expert_feed_forward_length"),
    "qwen3moe": ArchTraits("neox", qk_norm=True, qkv_bias=False, norm_topk=True,
                           shared_expert=False, expert_ffn_key="expert_feed_forward_length"),
    # Mixtral is llama.cpp's "llama" architecture with experts.
    "llama": ArchTraits("norm", qk_norm=False, qkv_bias=False, norm_topk=True,
                        shared_expert=False, expert_ffn_key="feed_forward_length"),
}


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

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv


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
    return ModelConfig(
        arch=arch,
        traits=traits,
        n_layer=meta.int(f"{arch}.block_count"),
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
    )


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

    def float(self, key: str, default=_MISSING) -> float:
        value = self._scalar(key, default)
        if isinstance(value, str):
            raise ModelFileError(f"{self.path}: metadata key {key!r} = {value!r} is not a number")
        return float(value)
