"""The shapes the planner needs of a model, from a GGUF's header or from a published config.

Only the header is read (a few MB at most, :func:`modelfile.gguf_header.parse_header` with its
lower bound on how much more it needs), so a 77 GB file's shapes come in a fraction of a second.
Byte counts are the tensors' own (quantized) sizes: a dense layer's weights are what a decode
step streams from memory, an expert's three slabs are what a worker streams per call.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from kvasir_bus.errors import ModelFileError, UsageError

# Q4_K: 144 bytes per 256 weights (4.5 bits); Q8_0: 34 per 32 (8.5 bits); MXFP4: 17 per 32.
Q4_K_BYTES_PER_WEIGHT = 144 / 256
Q8_0_BYTES_PER_WEIGHT = 34 / 32
MXFP4_BYTES_PER_WEIGHT = 17 / 32


@dataclass(frozen=True)
class Shapes:
    """What the cost model scales with. Layer counts are MoE layers; ``dense_ffn_layers`` are
    layers whose FFN is dense (DeepSeek-V3's first three), which dispatch nothing."""

    name: str
    arch: str
    fingerprint: str  # the model fingerprint of the file; "" for a published shape
    n_layer: int  # layers run per step (MTP blocks excluded)
    n_moe_layers: int
    n_attention_layers: int  # full-attention layers (the KV cache grows with context)
    n_embd: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    expert_bytes: int  # gate + up + down of one routed expert
    dense_bytes_attention: int  # one full-attention layer's non-expert weights (router, shared expert)
    dense_bytes_recurrent: int  # one delta-net (or other linear-attention) layer's; 0 when none
    head_bytes: int  # output projection
    source: str = ""  # the file, or the config it was taken from
    notes: tuple[str, ...] = field(default=())

    @property
    def n_recurrent_layers(self) -> int:
        return self.n_layer - self.n_attention_layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Shapes":
        try:
            return cls(**{**d, "notes": tuple(d.get("notes", ()))})
        except TypeError as exc:
            raise UsageError(f"profile: the model shapes are malformed ({exc})") from None


HEADER_FIRST = 4 << 20


def read_header(path: str):
    """The GGUF header of ``path``, reading only as much of the file as it takes."""
    from modelfile.gguf_header import NeedMore, parse_header

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            want = min(HEADER_FIRST, size)
            buf = f.read(want)
            while True:
                try:
                    return parse_header(buf, os.path.basename(path))
                except NeedMore as more:
                    if more.end > size or len(buf) >= size:
                        raise ModelFileError(f"{path}: truncated GGUF header (needs {more.end} bytes, "
                                             f"the file has {size})") from None
                    f.seek(len(buf))
                    buf += f.read(min(size, max(more.end, 2 * len(buf))) - len(buf))
    except OSError as exc:
        raise UsageError(f"--model {path}: {exc.strerror or exc}") from None


def from_gguf(path: str) -> Shapes:
    """Shapes from a GGUF's header alone (the MTP blocks past ``block_count - nextn`` left out)."""
    h = read_header(path)
    meta = h.metadata
    arch = meta.get("general.architecture")

    def key(name: str, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelFileError(f"{path}: no {arch}.{name} in the header")
        return v

    n_expert = int(key("expert_count", 0))
    if not n_expert:
        raise ModelFileError(f"{path}: not a Mixture-of-Experts model ({arch}.expert_count is missing or 0)")
    n_layer = int(key("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0))
    by_name = {t.name: t for t in h.tensors}
    n_embd = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // max(1, n_head)))

    def layer_bytes(il: int) -> tuple[int, int, bool, bool]:
        prefix = f"blk.{il}."
        dense = expert = 0
        for name, t in by_name.items():
            if name.startswith(prefix):
                if "_exps" in name:
                    expert += t.nbytes
                else:
                    dense += t.nbytes
        recurrent = f"{prefix}ssm_out.weight" in by_name
        return dense, expert, recurrent, expert > 0

    attn, rec, moe, exp_bytes = [], [], 0, 0
    for il in range(n_layer):
        dense, expert, recurrent, is_moe = layer_bytes(il)
        (rec if recurrent else attn).append(dense)
        if is_moe:
            moe += 1
            exp_bytes = expert // n_expert
    if moe == 0:
        raise ModelFileError(f"{path}: no routed expert tensors (blk.N.ffn_*_exps) in the header")
    out = by_name.get("output.weight") or by_name.get("token_embd.weight")
    embd = by_name.get("token_embd.weight")
    gate = next((t for n, t in by_name.items() if n.endswith("ffn_gate_exps.weight")), None)
    n_ff_exp = int(gate.ne[1]) if gate is not None else int(meta.get(f"{arch}.expert_feed_forward_length", 0))
    return Shapes(
        name=os.path.basename(path), arch=str(arch), fingerprint=h.fingerprint, n_layer=n_layer,
        n_moe_layers=moe, n_attention_layers=len(attn), n_embd=n_embd, n_expert=n_expert,
        n_expert_used=int(key("expert_used_count")), n_ff_exp=n_ff_exp, n_head=n_head,
        n_head_kv=int(meta.get(f"{arch}.attention.head_count_kv", n_head)), head_dim=head_dim,
        n_vocab=int(embd.ne[1]) if embd is not None else 0, expert_bytes=exp_bytes,
        dense_bytes_attention=round(sum(attn) / len(attn)) if attn else 0,
        dense_bytes_recurrent=round(sum(rec) / len(rec)) if rec else 0,
        head_bytes=out.nbytes if out is not None else 0, source=os.path.abspath(path))


# -- published shapes ----------------------------------------------------------------------------

def _attn_bytes(n_embd: int, q_width: int, kv_width: int, bpw: float) -> int:
    """Q, K, V, O projections at ``bpw`` bytes per weight."""
    return int((n_embd * q_width * 2 + 2 * n_embd * kv_width) * bpw)


def _qwen35moe_122b() -> Shapes:
    # Qwen3.5-122B-A10B (qwen35moe). From the seeds (shared/DESIGN.md section 1, the GGUF they
    # ran): hidden 3072, 256 routed experts per layer, top-8, expert FFN 1024, Q4_K experts of
    # 3 x 1,769,472 bytes, 12,544 experts = 49 blocks x 256 (48 layers run, 1 MTP block), a
    # 77.6 GB file. From the published config.json (Qwen/Qwen3.5-122B-A10B): every 4th layer
    # full attention (full_attention_interval 4, gated query: q_proj twice the width), the
    # others gated delta-net; 32 query heads, 2 KV heads, head_dim 256; delta-net 16 key heads
    # and 64 value heads of 128; shared expert FFN 1024; vocabulary 248,320. Dense weights are
    # counted at Q8_0 (8.5 bits), the usual type of attention tensors in a Q4_K_M file.
    n_embd, bpw = 3072, Q8_0_BYTES_PER_WEIGHT
    shared_router = int(3 * n_embd * 1024 * bpw) + n_embd * 256 * 4  # shared expert + f32 router
    attention = int((n_embd * 32 * 256 * 2 + 2 * n_embd * 2 * 256 + 32 * 256 * n_embd) * bpw) + shared_router
    delta = int((n_embd * (2 * 16 * 128 + 2 * 64 * 128) + 64 * 128 * n_embd) * bpw) + shared_router
    return Shapes(
        name="qwen35moe-122b-a10b", arch="qwen35moe", fingerprint="", n_layer=48, n_moe_layers=48,
        n_attention_layers=12, n_embd=n_embd, n_expert=256, n_expert_used=8, n_ff_exp=1024, n_head=32,
        n_head_kv=2, head_dim=256, n_vocab=248320, expert_bytes=3 * 1769472,
        dense_bytes_attention=attention, dense_bytes_recurrent=delta,
        head_bytes=int(n_embd * 248320 * Q4_K_BYTES_PER_WEIGHT * 1.5),  # Q6_K head
        source="published: Qwen3.5-122B-A10B config.json + the seeds' GGUF (DESIGN.md section 1)",
        notes=("dense weights assumed Q8_0, experts Q4_K",))


def _gpt_oss_120b() -> Shapes:
    # gpt-oss-120b, published config.json (openai/gpt-oss-120b): 36 layers, hidden 2880, 128
    # experts per layer, top-4, expert intermediate 2880 (gate and up each 2880 x 2880), 64 query
    # heads and 8 KV heads of 64, sliding window 128 on every other layer (modelled as full:
    # the window only bounds the context term), vocabulary 201,088; experts in MXFP4.
    n_embd = 2880
    expert = int(3 * n_embd * 2880 * MXFP4_BYTES_PER_WEIGHT)
    attention = _attn_bytes(n_embd, 64 * 64, 8 * 64, 2.0) // 2 + int(64 * 64 * n_embd) + n_embd * 128 * 4
    return Shapes(
        name="gpt-oss-120b", arch="gpt-oss", fingerprint="", n_layer=36, n_moe_layers=36,
        n_attention_layers=36, n_embd=n_embd, n_expert=128, n_expert_used=4, n_ff_exp=2880, n_head=64,
        n_head_kv=8, head_dim=64, n_vocab=201088, expert_bytes=expert,
        dense_bytes_attention=attention, dense_bytes_recurrent=0, head_bytes=int(n_embd * 201088 * 2),
        source="published: openai/gpt-oss-120b config.json",
        notes=("attention weights bf16, experts MXFP4", "sliding-window layers counted as full attention"))


def _deepseek_v3() -> Shapes:
    # DeepSeek-V3 (671B total, 37B active), published config.json (deepseek-ai/DeepSeek-V3):
    # 61 layers, the first 3 with a dense FFN (first_k_dense_replace 3), 58 MoE layers of 256
    # routed experts, top-8, moe_intermediate_size 2048, one shared expert of 2048, hidden 7168,
    # 128 heads with MLA (q_lora_rank 1536, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128),
    # vocabulary 129,280. Experts at Q4_K; the MLA projections at Q8_0.
    n_embd, bpw = 7168, Q8_0_BYTES_PER_WEIGHT
    mla = int((n_embd * 1536 + 1536 * 128 * 192 + n_embd * (512 + 64) + 512 * 128 * 256 + 128 * 128 * n_embd) * bpw)
    shared = int(3 * n_embd * 2048 * bpw) + n_embd * 256 * 4
    return Shapes(
        name="deepseek-v3", arch="deepseek2", fingerprint="", n_layer=61, n_moe_layers=58,
        n_attention_layers=61, n_embd=n_embd, n_expert=256, n_expert_used=8, n_ff_exp=2048, n_head=128,
        n_head_kv=1, head_dim=576, n_vocab=129280, expert_bytes=int(3 * n_embd * 2048 * Q4_K_BYTES_PER_WEIGHT),
        dense_bytes_attention=mla + shared, dense_bytes_recurrent=0, head_bytes=int(n_embd * 129280 * bpw),
        source="published: deepseek-ai/DeepSeek-V3 config.json",
        notes=("MLA's compressed KV cache (512 + 64 per token) counted as one KV head of 576",
               "the 3 dense-FFN layers run on the backbone and dispatch nothing"))


PUBLISHED = {"qwen35moe-122b-a10b": _qwen35moe_122b, "gpt-oss-120b": _gpt_oss_120b, "deepseek-v3": _deepseek_v3}


def published(name: str) -> Shapes:
    try:
        return PUBLISHED[name]()
    except KeyError:
        raise UsageError(f"--shape {name!r}: unknown (known: {', '.join(PUBLISHED)})") from None
