"""The backbone engine: one readable forward pass for every supported MoE architecture.

    x = token_embd[ids]
    for each layer:
        x = x + attn(rms_norm(x) * attn_norm)          # RoPE, GQA, per-sequence KV cache
                                                        # (qwen35moe: Q-gated attention, or a gated
                                                        #  delta-net with per-sequence conv + state)
        (last layer, only each sequence's last logits wanted: keep only those rows of x and
         of attn's output, as llama.cpp's inp_out_ids does; the FFN and head see those alone)
        h = rms_norm(x) * ffn_norm                      # (qwen35moe: post_attention_norm)
        ids, w = route(h @ ffn_gate_inp, k)             # the router runs once, here
        x = x + combine(experts(h rows by expert), w) + shared_expert(h)
    logits = (rms_norm(x) * output_norm) @ output

A step runs a *batch* of independent sequences (each with its own KV cache and position;
prefill chunks and single decode tokens mixed): every dense matmul runs on all rows at once,
and the router groups the rows of the whole batch by expert, so each selected expert is asked
once per layer with every row that chose it. Who computes an expert is the business of the
:class:`~backbone.experts.ExpertBackend` (all local here; remote workers in the sharded setup).

How it runs on ggml (the same ops, so the same bits, whichever way):

- one sequence, every expert local: one graph from the token ids to the logits, the router's
  top-k included (a long chunk: a few layers per graph; ``_step_graphs``,
  ``kernels.fused.step_graph``);
- several sequences, decode tokens and prompt chunks mixed: the same, one graph per step, every
  dense op on all rows at once and each sequence's attention against its own KV cache in a
  sub-graph of its own, or, for the decode streams whose caches share a block
  (``backbone.kvslots``), once for all of them (``_batch_graphs``; ``StepShape.streams`` and
  ``groups``; a wide batch: a few layers per graph); in the fast mode a decode step of 8
  streams or more is tried with every expert in the graph (``Speculation``);
- either, remote experts: the same ops split at the experts, one graph per layer from
  the previous layer's combine (the remote outputs an input) to this layer's router; the
  shared expert, which needs no routed expert, runs while their replies travel
  (``_step_graphs_remote``);
- what those do not cover (``_one_graph_per_step``: attention sinks and sliding windows,
  softmax-weight routers, expert biases, rounded wire rows; a chunk whose attention runs in
  pieces): per layer, two graphs around the per-sequence attention graphs
  (``_attention_fused``; the second ends with the router's top-k, the same ops), the experts
  as one ``mul_mat_id`` graph or remote calls (the shared expert then in a graph of its own,
  while they are away: ``_shared_fused``);
- delta-net and gated-query attention layers (qwen35moe, qwen3next): in the step graphs above
  too, one sequence at a time (``fused._delta_net_part``: each layer's conv and recurrent
  state bound by address and updated in place by the graph); a batch of several sequences,
  and what step graphs do not cover, one call per op, below (a one-sequence delta-net mixer:
  one graph).

``forward`` below is the order of operations of every architecture, op by op; the graph
builders of ``kernels/fused.py`` follow it line for line (tests/backbone/test_parity.py,
test_step_graph.py and test_batch_graph.py check that the paths give identical logits).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels import deltanet, dense, fused, ops
from backbone.config import ModelConfig, read_config
from backbone.experts import ExpertBackend, LocalExperts
from backbone.kvslots import KvSlots, Lease
from kvasir_bus.errors import ModelFileError, UsageError
from kernels.expert import expert_ffn, prepare
from kernels.backend import backend_name, matmul
from kernels.ggml import deterministic as ggml_deterministic, get_rows as ggml_get_rows, repack_below as ggml_repack_below
from kernels.tensors import QTensor, open_gguf, tensors_from_reader

WIRE_DTYPES = {"float32": np.float32, "float16": np.float16}
# A one-sequence step's graph holds as many layers as keep its intermediates under this many
# bytes (a decode step: all of them), so that the graph cache keeps it for the next step.
STEP_GRAPH_BYTES = 8 << 20
# A batch's step graph may hold more: 16 decoding sequences of the small model ran at the same CPU
# time per step with 8 MB (4 layers per graph) and 64 MB (all 8; KVASIR_THREADS=1, fast mode).
BATCH_GRAPH_BYTES = 64 << 20
# A batch's decode graph holds at most this many (sequence, layer) attention sub-graphs. A new
# batch shape costs a build (Python, ~20 ggml calls per sequence and layer, and cold scratch:
# measured ~0.2 ms per sequence and layer, about what computing it takes), and a decode batch's
# shape changes whenever a sequence crosses a multiple of 64 cells (every 64 / S steps; a group
# of streams in one KV block, only its longest one) or one joins or
# leaves; one graph serves every group of layers of the same shapes, so smaller groups build
# less: the amortised cost stays under ~6% of a step at any S. A step with prompt chunks (a
# shape that seldom recurs) runs one layer per graph: a build of one layer.
MAX_STREAM_LAYERS = 128
# A delta-net layer's graph holds every sequence's new recurrent state in its scratch (the fused
# op's packed result, copied into the sequence's state after): 4 MB per sequence at the 122B's
# shapes (64 heads of 128 x 128). A batch whose states take more runs the per-layer path (each
# sequence's delta-net graph of its own, its scratch freed after it), so that a wide batch never
# holds a graph of gigabytes: 16 sequences at the 122B's shapes, any at the tiny test models'.
MAX_STATE_BYTES = 64 << 20


@functools.lru_cache(maxsize=None)
def _kq_scale(head_dim: int) -> float:
    return float(dense.kq_scale(head_dim))  # asked every step: numpy scalars cost microseconds


@dataclass(frozen=True)
class Layer:
    """One transformer block; attribute names are the GGUF tensor names. An attention layer
    has ``attn_q``..``attn_output``; a gated delta-net layer (qwen35moe) has ``attn_qkv``,
    ``attn_gate`` and the ``ssm_*`` tensors instead."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray  # the GGUF's ffn_norm, or post_attention_norm (traits.ffn_norm)
    ffn_gate_inp: QTensor  # router, (D -> E), never quantized
    ffn_gate_exps: QTensor  # (D, F, E)
    ffn_up_exps: QTensor  # (D, F, E)
    ffn_down_exps: QTensor  # (F, D, E)
    attn_q: QTensor | None = None  # (D -> H*Dh), or H*2*Dh with the per-head gate (attn_q_gate)
    attn_k: QTensor | None = None
    attn_v: QTensor | None = None
    attn_output: QTensor | None = None
    attn_qkv: QTensor | None = None  # delta-net: (D -> C), Q, K and V of the conv
    attn_gate: QTensor | None = None  # delta-net: (D -> Hv*S), z of the gated output norm
    ssm_conv1d: np.ndarray | None = None  # (C, W) float32
    ssm_dt: np.ndarray | None = None  # (Hv,) bias of alpha
    ssm_a: np.ndarray | None = None  # (Hv,) -exp(A_log)
    ssm_beta: QTensor | None = None  # (D -> Hv)
    ssm_alpha: QTensor | None = None  # (D -> Hv)
    ssm_ba: QTensor | None = None  # qwen3next: (D -> 2*Hv), per Q/K head [beta x Hv/Hk, alpha x Hv/Hk]
    ssm_norm: np.ndarray | None = None  # (S,)
    ssm_out: QTensor | None = None  # (Hv*S -> D)
    attn_q_bias: np.ndarray | None = None
    attn_k_bias: np.ndarray | None = None
    attn_v_bias: np.ndarray | None = None
    attn_q_norm: np.ndarray | None = None
    attn_k_norm: np.ndarray | None = None
    ffn_gate_inp_shexp: np.ndarray | None = None  # (D,)
    ffn_gate_shexp: QTensor | None = None
    ffn_up_shexp: QTensor | None = None
    ffn_down_shexp: QTensor | None = None
    # gpt-oss
    attn_output_bias: np.ndarray | None = None  # (D,)
    attn_sinks: np.ndarray | None = None  # (H,) one extra logit per head in every softmax row
    ffn_gate_inp_bias: np.ndarray | None = None  # (E,) router bias
    ffn_gate_exps_bias: np.ndarray | None = None  # (E, F) one bias row per expert
    ffn_up_exps_bias: np.ndarray | None = None  # (E, F)
    ffn_down_exps_bias: np.ndarray | None = None  # (E, D)


@dataclass(frozen=True)
class Weights:
    token_embd: QTensor
    output_norm: np.ndarray
    output: QTensor  # token_embd when the output head is tied
    layers: tuple[Layer, ...]
    expert_glu: str = "swiglu"  # the routed experts' activation (ArchTraits.expert_glu)

    _experts: dict = field(default_factory=dict, compare=False, repr=False)  # (layer, e) -> views

    def expert(self, layer: int, e: int) -> tuple[QTensor, QTensor, QTensor]:
        """Expert ``e`` of ``layer``: 2-D views of its gate/up/down slabs, with their bias rows
        and the activation where the architecture has them (made once, then kept)."""
        views = self._experts.get((layer, e))
        if views is None:
            blk = self.layers[layer]
            views = (blk.ffn_gate_exps.expert(e, blk.ffn_gate_exps_bias, self.expert_glu),
                     blk.ffn_up_exps.expert(e, blk.ffn_up_exps_bias),
                     blk.ffn_down_exps.expert(e, blk.ffn_down_exps_bias))
            self._experts[(layer, e)] = views
        return views


def load_weights(tensors: dict[str, QTensor], cfg: ModelConfig, path: str) -> Weights:
    def get(name: str, optional: bool = False) -> QTensor | None:
        t = tensors.get(name)
        if t is None and not optional:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        return t

    def vec(name: str, optional: bool = False) -> np.ndarray | None:
        t = get(name, optional)
        return None if t is None else t.f32().reshape(-1)

    def shaped(name: str, ne: tuple[int, ...]) -> QTensor:
        t = get(name)
        if tuple(t.ne) != ne:
            raise ModelFileError(f"{path}: {name} has shape {tuple(t.ne)}, expected {ne}")
        return t

    layers = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        if cfg.is_recurrent(i):
            D, C, W = cfg.n_embd, cfg.ssm_conv_channels, cfg.ssm_conv_kernel
            Hv, S = cfg.ssm_v_heads, cfg.ssm_head_dim
            mixer = dict(
                attn_qkv=shaped(b + "attn_qkv.weight", (D, C)),
                attn_gate=shaped(b + "attn_gate.weight", (D, Hv * S)),
                ssm_conv1d=shaped(b + "ssm_conv1d.weight", (W, C)).f32().reshape(C, W),
                ssm_dt=shaped(b + "ssm_dt.bias", (Hv,)).f32().reshape(-1),
                ssm_a=shaped(b + "ssm_a", (Hv,)).f32().reshape(-1),
                **(dict(ssm_ba=shaped(b + "ssm_ba.weight", (D, 2 * Hv))) if cfg.traits.ssm_ba else
                   dict(ssm_beta=shaped(b + "ssm_beta.weight", (D, Hv)),
                        ssm_alpha=shaped(b + "ssm_alpha.weight", (D, Hv)))),
                ssm_norm=shaped(b + "ssm_norm.weight", (S,)).f32().reshape(-1),
                ssm_out=shaped(b + "ssm_out.weight", (Hv * S, D)),
            )
        else:
            mixer = dict(
                attn_q=get(b + "attn_q.weight"),
                attn_k=get(b + "attn_k.weight"),
                attn_v=get(b + "attn_v.weight"),
                attn_output=get(b + "attn_output.weight"),
                attn_q_bias=vec(b + "attn_q.bias", optional=not cfg.traits.qkv_bias),
                attn_k_bias=vec(b + "attn_k.bias", optional=not cfg.traits.qkv_bias),
                attn_v_bias=vec(b + "attn_v.bias", optional=not cfg.traits.qkv_bias),
                attn_q_norm=vec(b + "attn_q_norm.weight", optional=not cfg.traits.qk_norm),
                attn_k_norm=vec(b + "attn_k_norm.weight", optional=not cfg.traits.qk_norm),
            )
            if cfg.traits.attn_sinks:
                mixer.update(attn_output_bias=shaped(b + "attn_output.bias", (cfg.n_embd,)).f32(),
                             attn_sinks=shaped(b + "attn_sinks.weight", (cfg.n_head,)).f32())
        moe_bias = {}
        if cfg.traits.router_bias:
            moe_bias["ffn_gate_inp_bias"] = shaped(b + "ffn_gate_inp.bias", (cfg.n_expert,)).f32()
        if cfg.traits.expert_glu == "swiglu_oai":  # bias rows, (E, rows) float32 contiguous
            E, F, D = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
            for kind, rows in (("gate", F), ("up", F), ("down", D)):
                moe_bias[f"ffn_{kind}_exps_bias"] = shaped(b + f"ffn_{kind}_exps.bias", (rows, E)).f32()
        layers.append(Layer(
            attn_norm=vec(b + "attn_norm.weight"),
            ffn_norm=vec(b + cfg.traits.ffn_norm + ".weight"),
            ffn_gate_inp=get(b + "ffn_gate_inp.weight"),
            ffn_gate_exps=get(b + "ffn_gate_exps.weight"),
            ffn_up_exps=get(b + "ffn_up_exps.weight"),
            ffn_down_exps=get(b + "ffn_down_exps.weight"),
            **mixer,
            ffn_gate_inp_shexp=vec(b + "ffn_gate_inp_shexp.weight", optional=True),
            ffn_gate_shexp=get(b + "ffn_gate_shexp.weight", optional=not cfg.n_ff_shexp),
            ffn_up_shexp=get(b + "ffn_up_shexp.weight", optional=not cfg.n_ff_shexp),
            ffn_down_shexp=get(b + "ffn_down_shexp.weight", optional=not cfg.n_ff_shexp),
            **moe_bias,
        ))
        _check_experts(layers[-1], cfg, i, path)
        if cfg.traits.attn_q_gate and layers[-1].attn_q is not None:
            want = (cfg.n_embd, 2 * cfg.n_head * cfg.head_dim)
            if tuple(layers[-1].attn_q.ne) != want:
                raise ModelFileError(f"{path}: {b}attn_q.weight has shape {tuple(layers[-1].attn_q.ne)}, "
                                     f"expected {want} (query and gate per head)")
    token_embd = get("token_embd.weight")
    return Weights(
        token_embd=token_embd,
        output_norm=vec("output_norm.weight"),
        output=get("output.weight", optional=True) or token_embd,
        layers=tuple(layers),
        expert_glu=cfg.traits.expert_glu,
    )


def _check_experts(blk: Layer, cfg: ModelConfig, i: int, path: str) -> None:
    want = {
        "ffn_gate_exps": (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert),
        "ffn_up_exps": (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert),
        "ffn_down_exps": (cfg.n_ff_exp, cfg.n_embd, cfg.n_expert),
        "ffn_gate_inp": (cfg.n_embd, cfg.n_expert),
    }
    for name, shape in want.items():
        got = getattr(blk, name).ne
        if tuple(got) != shape:
            raise ModelFileError(f"{path}: blk.{i}.{name}.weight has shape {got}, expected {shape}")


@dataclass
class Sequence:
    """One sequence's KV cache, laid out as llama.cpp's: per layer K of shape (capacity,
    Hkv*Dh), one row per cell, and V transposed, (Hkv*Dh, capacity) (``v_trans``: flash
    attention off), or as K (flash attention: ``kernels.dense.flash_attn``), both float16 and
    zero in the cells not yet written. The capacity grows in whole chunks of 256
    cells (llama.cpp pads its context the same way), up to the context size rounded up."""

    n_ctx: int
    n_past: int = 0
    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)
    # Delta-net layers (None elsewhere): the last W-1 conv inputs (C, W-1) and the recurrent
    # state (Hv, S, S), float32 as in llama.cpp's recurrent memory; both start at zero.
    conv: list[np.ndarray | None] = field(default_factory=list)
    ssm: list[np.ndarray | None] = field(default_factory=list)
    # Where the caches live: a slot of a block shared with other sequences of the same capacity
    # (backbone.kvslots: a decode step attends for all of them at once), its row per layer
    # (-1: a delta-net layer); or, without ``slots`` or for a capacity too big to share a
    # block, arrays of its own.
    slots: KvSlots | None = None
    rows: tuple[int, ...] = ()
    lease: Lease | None = None
    _finalizer: object = None
    # what Engine._caches last bound: (cells every attention layer's cache holds, the per-layer
    # list, the first attention layer, the first delta-net layer), reused while a step fits
    # those cells and the arrays are still the sequence's
    bound: tuple | None = field(default=None, repr=False)
    v_trans: bool = True  # V (Hkv*Dh, capacity); False: (capacity, Hkv*Dh), as K

    def reserve(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Make the layer's cache hold cells 0..end-1; returns (K, V)."""
        cache_k, cache_v = self.k[layer], self.v[layer]
        if end > cache_k.shape[0]:  # grow geometrically, in chunks of 256 cells
            cap = dense.cache_cells_for(max(end, 2 * cache_k.shape[0]), self.n_ctx)
            if not self._move_to_slot(cap):
                grown_k = np.zeros((cap, cache_k.shape[1]), dtype=np.float16)
                grown_k[:cache_k.shape[0]] = cache_k
                if self.v_trans:
                    grown_v = np.zeros((cache_v.shape[0], cap), dtype=np.float16)
                    grown_v[:, :cache_v.shape[1]] = cache_v
                else:
                    grown_v = np.zeros((cap, cache_v.shape[1]), dtype=np.float16)
                    grown_v[:cache_v.shape[0]] = cache_v
                self.k[layer], self.v[layer] = grown_k, grown_v
            cache_k, cache_v = self.k[layer], self.v[layer]
        if self.lease is not None and end > self.lease.high:
            self.lease.high = end  # cells to zero when the slot comes back
        return cache_k, cache_v

    def _move_to_slot(self, cells: int) -> bool:
        """Move every attention layer's cache into a slot of ``cells`` cells (copying what it
        holds), letting go of the slot it had. False where no slot is had: the caller grows
        the layer's own arrays (first letting go of a slot it held, if any: a cache then has
        arrays of its own for every layer)."""
        lease = self.slots.lease(cells) if self.slots is not None else None
        if lease is None:
            if self.lease is not None:  # out of the blocks: every layer gets arrays of its own
                for il, row in enumerate(self.rows):
                    if row >= 0:
                        self.k[il], self.v[il] = self.k[il].copy(), self.v[il].copy()
                self.close()
            return False
        lease.high = self.n_past
        for il, row in enumerate(self.rows):
            if row < 0:
                continue
            k, v, old_k, old_v = lease.k(row), lease.v(row), self.k[il], self.v[il]
            k[:old_k.shape[0]] = old_k
            if self.v_trans:
                v[:, :old_v.shape[1]] = old_v
            else:
                v[:old_v.shape[0]] = old_v
            self.k[il], self.v[il] = k, v
        self.close()
        self.lease = lease
        self._finalizer = weakref.finalize(self, self.slots.release, lease)
        return True

    def close(self) -> None:
        """Give back the cache's slot, if it has one (the engine's blocks keep no sequence
        alive: a sequence dropped gives it back too). The sequence must not run again."""
        if self.lease is not None:
            self._finalizer.detach()
            self.slots.release(self.lease)
            self.lease, self._finalizer = None, None

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store this chunk's keys and values (L, Hkv, Dh) at positions n_past.."""
        L = k.shape[0]
        end = self.n_past + L
        cache_k, cache_v = self.reserve(layer, end)
        cache_k[self.n_past:end] = k.reshape(L, -1)
        if self.v_trans:
            cache_v[:, self.n_past:end] = v.reshape(L, -1).T
        else:
            cache_v[self.n_past:end] = v.reshape(L, -1)

    def kv_heads(self, layer: int, end: int, n_head_kv: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of cells 0..end-1 as (Hkv, end, Dh) keys and values (for ``ops.attention``)."""
        cache_k, cache_v = self.k[layer], self.v[layer]
        k = cache_k[:end].reshape(end, n_head_kv, -1).transpose(1, 0, 2)
        if self.v_trans:
            v = cache_v[:, :end].reshape(n_head_kv, -1, end).transpose(0, 2, 1)
        else:
            v = cache_v[:end].reshape(end, n_head_kv, -1).transpose(1, 0, 2)
        return k, v


class Speculation:
    """When a step of ``repack_below`` rows or more is worth running in one graph with every
    expert repacked (``Engine._run_step_graphs``): kept where no expert got that many rows, run
    again the rule's way where one did. A kept step saves a graph launch and a Python round per
    layer (8% of a 16-stream decode step of the small model); a step run twice costs about one
    more. Only decode steps are tried: their streams are separate texts and rarely pile onto
    one expert, where a prompt's tokens often do (the small synthetic model's prompts of 9-24
    tokens: every one missed, and a missed prompt is a first token twice as late). Per kind of
    step (its rows and sequences) the outcomes of its recent tries decide: tried while at most
    :data:`MAX_MISS` of them missed, and once in :data:`PROBE_EVERY` steps anyway (routing
    changes with the text). A kind that has had fewer than :data:`WINDOW` tries is judged as
    if the rest had been kept."""

    MAX_ROWS = 64  # more rows than this: some expert gets the threshold's rows nearly always
    MAX_MISS = 0.1
    PROBE_EVERY = 32
    WINDOW = 32  # outcomes remembered per kind of step
    MIN_TRIES = 2  # tries before a kind's outcomes decide

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._seen: dict[tuple, list[bool]] = {}
        self._skipped: dict[tuple, int] = {}
        self.tries = self.misses = 0

    def worth(self, kind: tuple[int, int]) -> bool:
        """``kind``: (rows, sequences) of a step."""
        if not self.enabled or kind[0] > self.MAX_ROWS:
            return False
        seen = self._seen.get(kind, [])
        # the misses among the last WINDOW tries, those not yet made counted as kept: one early
        # miss (a 16-stream decode step of the small model misses about one in 60) does not
        # stop the tries for the WINDOW probes it would take to outweigh it
        if len(seen) < self.MIN_TRIES or seen.count(False) <= self.MAX_MISS * max(len(seen), self.WINDOW):
            return True
        skipped = self._skipped.get(kind, 0) + 1
        self._skipped[kind] = 0 if skipped >= self.PROBE_EVERY else skipped
        return skipped >= self.PROBE_EVERY

    def record(self, kind: tuple[int, int], kept: bool) -> None:
        if len(self._seen) > 4 * self.MAX_ROWS and kind not in self._seen:  # bounded: kinds are few
            self._seen.clear()
            self._skipped.clear()
        seen = self._seen.setdefault(kind, [])
        seen.append(kept)
        del seen[:-self.WINDOW]
        self.tries += 1
        self.misses += not kept


class Engine:
    """A whole MoE model on one node. ``experts`` decides who computes each routed expert."""

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int | None = None,
                 experts: ExpertBackend | None = None, wire_dtype: str = "float32"):
        self.path = os.fspath(model_path)
        self.reader = open_gguf(self.path)
        cfg = read_config(self.reader, self.path)
        self._setup(cfg, load_weights(tensors_from_reader(self.reader), cfg, self.path), n_ctx, experts, wire_dtype)

    @classmethod
    def from_weights(cls, tensors: dict[str, np.ndarray | QTensor], cfg: ModelConfig, *, n_ctx: int | None = None,
                     experts: ExpertBackend | None = None, wire_dtype: str = "float32") -> "Engine":
        """An engine on tensors held in memory, named as in GGUF (``blk.0.attn_q.weight``...).

        numpy arrays are in numpy order (``ne`` reversed: a (D -> F) projection is (F, D), the
        expert stacks (E, F, D)) and become float32 tensors; :class:`QTensor` values are used
        as they are. No file, so no ``path``/``reader``: such an engine cannot be served.
        """
        engine = cls.__new__(cls)
        engine.path, engine.reader = None, None
        qt = {name: t if isinstance(t, QTensor) else _f32_tensor(name, t) for name, t in tensors.items()}
        engine._setup(cfg, load_weights(qt, cfg, "weights"), n_ctx, experts, wire_dtype)
        return engine

    def _setup(self, cfg: ModelConfig, weights: Weights, n_ctx: int | None, experts: ExpertBackend | None,
               wire_dtype: str) -> None:
        self.cfg, self.weights = cfg, weights
        self.n_ctx = min(n_ctx or self.cfg.n_ctx_train, self.cfg.n_ctx_train)
        if self.n_ctx <= 0:
            raise UsageError(f"context size must be positive, got {n_ctx}")
        if wire_dtype not in WIRE_DTYPES:
            raise UsageError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.local_experts = LocalExperts(self.weights)
        self.experts: ExpertBackend = experts or self.local_experts
        # Attention (RoPE, QK, softmax, PV) through ggml, bit-identical to llama.cpp, when the
        # kernels are ggml's; the numpy version of the same math otherwise.
        self.ggml_attention = backend_name() == "ggml" and dense.available()
        if (cfg.traits.delta_net or cfg.traits.rope_style == "imrope" or cfg.traits.attn_sinks) \
                and not self.ggml_attention:
            raise UsageError(f"architecture {cfg.arch} runs on ggml's kernels only (its delta-net, "
                             "multi-section RoPE and attention sinks have no numpy path in the engine); "
                             "unset KVASIR_KERNEL")
        # Attention layers as two graphs each (kernels/fused.py) where ggml computes them; the
        # gated-query (IMROPE) attention of qwen35moe/qwen3next keeps the op-by-op path there.
        self.fused = self.ggml_attention and not cfg.traits.attn_q_gate and cfg.traits.rope_style != "imrope"
        # qwen35moe/qwen3next: their delta-net and gated-attention layers in the step graphs
        # below (kernels/fused.py: _delta_net_part, the gated part of _attention_part), with
        # at least one attention layer (the step's KV shapes come from one).
        recurrent_graphs = self.ggml_attention and cfg.traits.delta_net \
            and not all(cfg.is_recurrent(il) for il in range(cfg.n_layer))
        graphs = self.fused or recurrent_graphs
        self.one_row_as_two = graphs and ggml_deterministic()
        self._shapes: tuple[ModelConfig, list[fused.AttentionShape]] | None = None
        self._step_plans: dict = {}  # fused.step_graph's memo: what its calls on these layers share
        # One graph per step for one sequence where nothing needs Python between the layers:
        # no delta-net layers, no attention sinks or windows, no expert biases, the
        # softmax-then-top-k router, rows sent to the experts unrounded.
        t = cfg.traits
        self.step_graphs = graphs and not t.attn_sinks and t.router != "softmax_weight" \
            and weights.layers[0].ffn_gate_exps_bias is None and self.wire_dtype == np.float32
        # The same for a batch of several sequences (``_batch_graphs``); off: the per-layer path
        # (three graphs per layer and one attention graph per sequence), which gives the same bits.
        self.batch_graphs = self.step_graphs
        # Decode streams' caches side by side (backbone.kvslots), attended for all at once in
        # a batch step's graph (fused.KvGroup); env KVASIR_KV_GROUPS=0: each its own, the same bits.
        self.kv_groups = self.batch_graphs and os.environ.get("KVASIR_KV_GROUPS", "1") != "0"
        n_attn = sum(not cfg.is_recurrent(il) for il in range(cfg.n_layer))
        self.kv_slots = KvSlots(n_attn, cfg.n_head_kv * cfg.head_dim, v_trans=not dense.flash_attn()) \
            if self.kv_groups else None
        # per lane thread: the last batch step's blocks (_step_blocks), KV groups' fixed inputs (_kv_groups)
        self._thread = threading.local()
        self.speculation = Speculation(enabled=os.environ.get("KVASIR_SPECULATE", "1") != "0")
        # Repacked now (fast mode), not in the middle of the first request; what it took is
        # reported by whoever logs (the backbone service), not here: a library prints nothing.
        t0 = time.perf_counter()
        self.prepared_bytes = prepare(fused.repackable_weights(weights.layers, weights.output)) if graphs else 0
        self.prepared_s = time.perf_counter() - t0

    def _attention_shape(self, il: int) -> fused.AttentionShape | fused.DeltaNetShape:
        """Layer ``il``'s attention shape and RoPE parameters, or its delta-net shape, made once
        per config."""
        c = self.cfg
        if self._shapes is None or self._shapes[0] is not c:
            shapes = [self._layer_shape(i) for i in range(c.n_layer)]
            # the first layer of each distinct shape: what sizes a step's graphs (_layers_per_graph)
            self._shape_kinds = sorted({s: i for i, s in reversed(list(enumerate(shapes)))}.values())
            self._shapes = (c, shapes)
        return self._shapes[1][il]

    def _layer_shape(self, il: int) -> fused.AttentionShape | fused.DeltaNetShape:
        c = self.cfg
        if c.is_recurrent(il):
            return fused.DeltaNetShape(c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_dim, c.ssm_conv_kernel, c.rms_eps,
                                       ba=c.traits.ssm_ba)
        gate = c.traits.attn_q_gate
        if c.traits.rope_style == "imrope":  # as _attention's deltanet.rope_multi_qk: YaRN off
            rope = (int(c.n_rot), deltanet.ROPE_TYPE_IMROPE, int(c.n_ctx_train), float(c.rope_base),
                    1.0, 0.0, 1.0, 32.0, 1.0)
            return fused.AttentionShape(c.n_head, c.n_head_kv, c.head_dim, c.rms_eps, rope, q_gate=gate,
                                        sections=tuple(int(s) for s in c.rope_sections))
        return fused.AttentionShape(c.n_head, c.n_head_kv, c.head_dim, c.rms_eps, dense.rope_params(
            c.n_rot, c.traits.rope_style, c.layer_rope_base(il), **c.rope.ggml_args()), q_gate=gate)

    def use_experts(self, experts: ExpertBackend | None) -> None:
        """From the next step on, ``experts`` computes the routed experts (None: this node)."""
        self.experts = experts or self.local_experts

    def new_sequence(self) -> Sequence:
        c = self.cfg
        gqa = c.n_head_kv * c.head_dim
        rec = [c.is_recurrent(il) for il in range(c.n_layer)]
        conv = (c.ssm_conv_channels, c.ssm_conv_kernel - 1)
        ssm = (c.ssm_v_heads, c.ssm_head_dim, c.ssm_head_dim)
        rows = tuple(np.cumsum([not r for r in rec]) - 1)
        return Sequence(self.n_ctx, k=[np.zeros((0, gqa), dtype=np.float16) for _ in range(c.n_layer)],
                        v=[np.zeros(dense.v_cache_shape(0, gqa) if self.ggml_attention else (gqa, 0),
                                    dtype=np.float16) for _ in range(c.n_layer)],
                        v_trans=not (self.ggml_attention and dense.flash_attn()),
                        conv=[np.zeros(conv, dtype=np.float32) if r else None for r in rec],
                        ssm=[np.zeros(ssm, dtype=np.float32) if r else None for r in rec],
                        slots=self.kv_slots, rows=tuple(-1 if r else int(i) for r, i in zip(rec, rows)))

    # -- the forward pass -------------------------------------------------------------------

    def forward(self, batch: list[tuple[Sequence, np.ndarray]], *, all_logits: bool = True) -> list[np.ndarray]:
        """Run one step for a batch of (sequence, new token ids) and advance each sequence.

        Returns per entry the logits (L_i, n_vocab) of every new token, or only of its last
        token (1, n_vocab) when ``all_logits`` is false.
        """
        c, w = self.cfg, self.weights
        lengths = [len(ids) for _, ids in batch]
        for (seq, ids), L in zip(batch, lengths):
            if L == 0:
                raise UsageError("a batch entry has no tokens")
            if seq.n_past + L > seq.n_ctx:
                raise UsageError(f"sequence needs {seq.n_past + L} positions; the context is {seq.n_ctx}")
            if not 0 <= ids[0] < c.n_vocab if L == 1 else np.any((ids < 0) | (ids >= c.n_vocab)):
                raise UsageError(f"token id out of range 0..{c.n_vocab - 1}")
        # Where only each sequence's last logits are wanted, the last layer's FFN and the head run
        # on those rows alone: after the layer's attention (or delta-net) output projection, the
        # other rows are dropped, as llama.cpp's ``inp_out_ids`` does.
        starts = np.cumsum([0] + lengths)
        keep = None if all_logits or len(batch) == starts[-1] else starts[1:] - 1
        if self._one_graph_per_step(batch):
            if len(batch) == 1:
                return self._step_graphs(batch[0][0], np.asarray(batch[0][1], dtype=np.int64), keep)
            return self._batch_graphs(batch, lengths, keep)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in batch])
        positions = np.concatenate([seq.n_past + np.arange(L) for (seq, _), L in zip(batch, lengths)])
        rope = positions if self.ggml_attention else ops.rope_cache(positions, c.n_rot, c.rope_base)

        x = ggml_get_rows(w.token_embd, ids) if self.ggml_attention else embed(w.token_embd, ids)  # (T, D)
        for il, blk in enumerate(w.layers):
            rows = keep if il == c.n_layer - 1 else None  # the rows that go on after the mixer
            if self.fused and blk.attn_q is not None:  # the same math in two ggml graphs
                remote = self.experts is not self.local_experts
                f = self._attention_fused(il, blk, x, positions, batch, starts, keep=rows, with_shared=not remote)
                shared = f.shared
                if remote and blk.ffn_gate_shexp is not None:  # needs no routed expert: runs while they are away
                    shared = functools.partial(self._shared_fused, blk, f.h)
                x = f.x + self._moe(il, blk, f.h, routed=(f.ids, f.weights), shared=shared)
                continue
            h = ops.rms_norm(x, blk.attn_norm, c.rms_eps)
            if blk.ssm_out is not None:
                mixed = self._delta_net(il, blk, h, batch, starts)
            else:
                mixed = self._attention(il, blk, h, rope, batch, starts)
            x = x + mixed if rows is None else x[rows] + mixed[rows]
            h = ops.rms_norm(x, blk.ffn_norm, c.rms_eps)
            x = x + self._moe(il, blk, h)
        for seq, L in zip((s for s, _ in batch), lengths):
            seq.n_past += L

        if not all_logits:  # x holds each sequence's last row only
            starts = np.arange(len(batch) + 1)
        out = ops.rms_norm(x, w.output_norm, c.rms_eps)
        logits = matmul(w.output, out)  # (T, V)
        return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def _attention(self, il: int, blk: Layer, h: np.ndarray, rope, batch, starts) -> np.ndarray:
        """``rope``: the positions (T,) on the ggml path, (cos, sin) from ``ops.rope_cache`` on numpy's."""
        c = self.cfg
        T = h.shape[0]
        q, k, v = matmul(blk.attn_q, h), matmul(blk.attn_k, h), matmul(blk.attn_v, h)
        if blk.attn_q_bias is not None:
            q, k, v = q + blk.attn_q_bias, k + blk.attn_k_bias, v + blk.attn_v_bias
        gate = None
        if c.traits.attn_q_gate:  # per head: Dh query values, then Dh gate values
            qg = q.reshape(T, c.n_head, 2, c.head_dim)
            q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, c.n_head * c.head_dim)
        q = q.reshape(T, c.n_head, c.head_dim)  # (T, H, Dh)
        k = k.reshape(T, c.n_head_kv, c.head_dim)  # (T, Hkv, Dh)
        v = v.reshape(T, c.n_head_kv, c.head_dim)
        if blk.attn_q_norm is not None:  # per-head RMS norm before RoPE (qwen3moe)
            q = ops.rms_norm(q, blk.attn_q_norm, c.rms_eps)
            k = ops.rms_norm(k, blk.attn_k_norm, c.rms_eps)
        if c.traits.rope_style == "imrope":
            q, k = deltanet.rope_multi_qk(q, k, rope, c.n_rot, c.rope_sections, c.rope_base, c.n_ctx_train)
        elif self.ggml_attention:
            q, k = dense.rope_qk(q, k, rope, c.n_rot, c.traits.rope_style, c.layer_rope_base(il), **c.rope.ggml_args())
        else:
            q = ops.rope(q, *rope, c.traits.rope_style)
            k = ops.rope(k, *rope, c.traits.rope_style)
        k16, v16 = k.astype(np.float16), v.astype(np.float16)  # the KV cache is f16
        out = np.empty((T, c.n_head * c.head_dim), dtype=np.float32)
        # gpt-oss: sinks, a sliding window on some layers, and the scale 1/sqrt(n_rot)
        extra = dict(sinks=blk.attn_sinks, window=c.layer_window(il), scale=dense.kq_scale(c.n_rot)) \
            if blk.attn_sinks is not None else {}
        for (seq, _), a, b in zip(batch, starts[:-1], starts[1:]):
            seq.append(il, k16[a:b], v16[a:b])
            if self.ggml_attention:
                out[a:b] = dense.attention(q[a:b], seq.k[il], seq.v[il], seq.n_past, **extra)
            else:
                end = seq.n_past + (b - a)
                out[a:b] = ops.attention(q[a:b], *seq.kv_heads(il, end, c.n_head_kv), seq.n_past)
        if gate is not None:
            out = deltanet.sigmoid_gate(out, gate)
        out = matmul(blk.attn_output, out)
        return out if blk.attn_output_bias is None else out + blk.attn_output_bias

    def _one_graph_per_step(self, batch) -> bool:
        """Whether this step can run as one graph (``_step_graphs`` for one sequence,
        ``_batch_graphs`` for several; one per layer with remote experts): rows sent to the
        experts unrounded, standard attention and routing (``self.step_graphs``), and chunks
        that need no splitting of their attention (``kernels.dense.attention`` runs a long one
        in pieces), and for delta-net layers a batch whose recurrent states fit a graph's scratch
        (``MAX_STATE_BYTES``). Otherwise the per-layer path of ``forward``."""
        if not self.step_graphs or (len(batch) > 1 and not self.batch_graphs):
            return False
        c = self.cfg
        if c.traits.delta_net and len(batch) * c.ssm_v_heads * c.ssm_head_dim ** 2 * 4 > MAX_STATE_BYTES:
            return False
        for seq, ids in batch if not dense.flash_attn() else ():  # (flash attention: never split)
            end = seq.n_past + len(ids)
            n_kv = dense.n_kv_for(end, dense.cache_cells_for(end, seq.n_ctx))
            if len(ids) > max(2, dense.MAX_KQ_BYTES // (8 * n_kv * self.cfg.n_head)):
                return False
        return True

    def _step_graphs(self, seq: Sequence, ids: np.ndarray, keep: np.ndarray | None) -> list[np.ndarray]:
        """One sequence's step as one ggml graph from the embedding to the logits, routing
        included (``kernels.fused.step_graph``), or a few layers per graph for a long chunk: the
        forward pass above, with the same ops and bits. ``keep``: the one row whose logits are
        wanted, or None for every row."""
        c, w = self.cfg, self.weights
        T = len(ids)
        R = 2 if T == 1 and self.one_row_as_two else T
        end = seq.n_past + T
        caches = self._caches(seq, end)
        kv_size = next(kc.shape[0] for (kc, _), il in zip(caches, range(c.n_layer)) if not c.is_recurrent(il))
        n_kv = dense.n_kv_for(end, kv_size)
        step = fused.StepShape(R, T, kv_size, n_kv, _kq_scale(c.head_dim), c.n_expert_used,
                               w.expert_glu, c.traits.shexp_gate, c.traits.norm_topk)
        blocks = [fused.Block(w.layers[il], self._attention_shape(il), caches[il]) for il in range(c.n_layer)]
        per_graph = _layers_per_graph(step, [blocks[i] for i in self._shape_kinds], STEP_GRAPH_BYTES)
        positions = np.arange(seq.n_past, end, dtype=np.int32)
        if R != T:  # one row as two
            positions, ids = np.repeat(positions, 2), np.repeat(ids, 2)
        at = dict(n_past=seq.n_past, positions=positions, mask=dense.causal_mask(seq.n_past, T, n_kv, R))
        tokens = (w.token_embd, ids.astype(np.int32))  # embedded in the graph: (R, D)
        n_out = T if keep is None else len(keep)  # the rows whose logits are wanted
        head_rows = np.arange(n_out, dtype=np.int32) if keep is None else np.zeros(n_out, dtype=np.int32)
        if n_out == 1 and self.one_row_as_two:  # the head's one row as two, as matmul does
            head_rows = np.zeros(2, dtype=np.int32)
        head = (w.output_norm, w.output, head_rows, c.rms_eps)
        logits = self._run_step_graphs(step, blocks, per_graph, tokens, at, keep, head, n_out)
        seq.n_past = end
        return [logits[:n_out]]

    def _caches(self, seq: Sequence, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer what the step graphs bind of ``seq``: its KV cache grown to hold cells
        0..end-1, or for a delta-net layer its conv and recurrent states (updated in place).
        The list is kept on the sequence (read-only) until a step needs more cells than its
        caches hold: a decode step's sequences then cost a comparison each, not a call per
        layer (their Python, after a graph has evicted the CPU's caches, is several times
        slower than a warm benchmark of it shows)."""
        bound = seq.bound
        # still the sequence's arrays: its first attention layer's K (a slot move replaces every
        # layer's) and its first delta-net layer's states (the per-layer path replaces them all)
        if bound is not None and end <= bound[0] and (bound[2] is None or seq.k[bound[2]] is bound[1][bound[2]][0]) \
                and (bound[3] is None or seq.conv[bound[3]] is bound[1][bound[3]][0]
                     and seq.ssm[bound[3]] is bound[1][bound[3]][1]):
            if seq.lease is not None and end > seq.lease.high:
                seq.lease.high = end  # cells to zero when the slot comes back, as reserve() notes them
            return bound[1]
        c = self.cfg
        out = [(seq.conv[il], seq.ssm[il]) if c.is_recurrent(il) else seq.reserve(il, end) for il in range(c.n_layer)]
        attn = [il for il in range(c.n_layer) if not c.is_recurrent(il)]
        recurrent = next((il for il in range(c.n_layer) if c.is_recurrent(il)), None)
        seq.bound = (min(out[il][0].shape[0] for il in attn) if attn else end, out, attn[0] if attn else None, recurrent)
        return out

    def _batch_graphs(self, batch, lengths: list[int], keep: np.ndarray | None) -> list[np.ndarray]:
        """A step of several sequences (decode tokens and prompt chunks mixed) as one ggml graph
        from the embedding to the logits (``kernels.fused.step_graph`` with ``StepShape.
        streams``): every dense op, the router and the experts on all rows at once, each
        sequence's attention against its own KV cache in its own sub-graph, the ops
        ``kernels.dense.attention`` runs on it alone (its token's row twice in deterministic
        mode): each sequence gets the bits it gets alone, or in the per-layer path. The graph
        is cached by the sequences' row counts and cache shapes (n_kv padded to 64 cells; a
        group of decode streams in one KV block, ``_kv_groups``: the longest one's), so a decode
        step reuses it until a sequence crosses such a multiple or the batch changes;
        positions, masks and the cache cells written are bound per call. A decode step of many
        sequences runs a few layers per graph, and a step with prompt chunks one layer per
        graph (``MAX_STREAM_LAYERS``): a new shape's graph stays cheap to build. ``keep``: each
        sequence's last row (its logits only), or None for every row."""
        c, w = self.cfg, self.weights
        T = sum(lengths)
        min_rows = 2 if ggml_deterministic() else 1  # kernels.dense.attention's
        streams, caches, masks = [], [], []
        start = 0
        for (seq, _), L in zip(batch, lengths):
            end = seq.n_past + L
            mine = self._caches(seq, end)
            kv_size = mine[seq.bound[2]][0].shape[0]  # the first attention layer's cells
            n_kv = dense.n_kv_for(end, kv_size)
            rows = max(L, min_rows)
            streams.append(fused.Stream(start, L, rows, kv_size, n_kv))
            caches.append(mine)
            masks.append(dense.causal_mask(seq.n_past, L, n_kv, rows))
            start += L
        groups, group_at, spans = self._kv_groups(batch, streams, min_rows)
        for i, s in enumerate(streams):  # a group's member has its group's cells (its own mask unread)
            if s.group >= 0:
                masks[i] = dense.causal_mask(batch[i][0].n_past, 1, s.n_kv, s.rows)
        step = fused.StepShape(T, T, 0, 0, _kq_scale(c.head_dim), c.n_expert_used, w.expert_glu,
                               c.traits.shexp_gate, c.traits.norm_topk, streams=tuple(streams), groups=groups)
        blocks = self._step_blocks([seq for seq, _ in batch], caches, spans)
        per_graph = 1 if T > len(batch) else min(  # chunks: one layer per graph (see MAX_STREAM_LAYERS)
            _layers_per_graph(step, [blocks[i] for i in self._shape_kinds], BATCH_GRAPH_BYTES),
            max(1, MAX_STREAM_LAYERS // len(batch)))
        n_pasts = tuple(seq.n_past for seq, _ in batch)
        positions = np.concatenate([np.arange(p, p + L, dtype=np.int32) for p, L in zip(n_pasts, lengths)])
        at = dict(n_pasts=n_pasts, positions=positions, masks=tuple(masks), groups=group_at)
        tokens = (w.token_embd, np.concatenate([np.asarray(t, dtype=np.int32) for _, t in batch]))
        n_out = T if keep is None else len(keep)  # the rows whose logits are wanted (two at least)
        head = (w.output_norm, w.output, np.arange(n_out, dtype=np.int32), c.rms_eps)
        logits = self._run_step_graphs(step, blocks, per_graph, tokens, at, keep, head, n_out)
        for (seq, _), L in zip(batch, lengths):
            seq.n_past += L
        if keep is not None:  # one row per sequence
            return [logits[i:i + 1] for i in range(len(batch))]
        starts = np.cumsum([0] + lengths)
        return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def _step_blocks(self, seqs: list, caches: list, spans: list) -> fused.Blocks:
        """A batch step's :class:`fused.Block` per layer: each sequence's caches of the layer
        (``caches``: :meth:`_caches`' lists), and per KV group its span's views of the layer's
        block. The last step's, on this thread, where its caches and spans were these (a decode
        step of the same streams: the sequences' lists are the same objects while their caches
        hold), so that ``step_graph`` checks them once. Kept only while every one of those
        sequences lives: one that is dropped lets go of them (its caches are not held past it)."""
        last = getattr(self._thread, "blocks", None)
        if last is not None:
            caches0, spans0, blocks0 = last[0], last[1], last[2]
            if blocks0 is not None and len(caches0) == len(caches) and all(a is b for a, b in zip(caches0, caches)) \
                    and len(spans0) == len(spans) and all(a[0] is b[0] and a[1:] == b[1:] for a, b in zip(spans0, spans)):
                return blocks0
        w, rows = self.weights, seqs[0].rows
        blocks = fused.Blocks(
            fused.Block(w.layers[il], self._attention_shape(il), None, tuple(m[il] for m in caches),
                        spans=tuple((blk.k[row, lo:lo + n], blk.v[row, lo:lo + n]) for blk, lo, n in spans)
                        if (row := rows[il]) >= 0 else ())
            for il in range(self.cfg.n_layer))
        entry = [caches, spans, blocks, None]

        def let_go(_, entry=entry) -> None:  # a sequence of the step was dropped
            entry[0] = entry[1] = entry[2] = None

        entry[3] = [weakref.ref(seq, let_go) for seq in seqs]
        self._thread.blocks = entry
        return blocks

    def _kv_groups(self, batch, streams: list, rows: int) -> tuple[tuple, tuple, list]:
        """The decode streams of a batch step whose caches share a block (``backbone.kvslots``),
        two or more to a block: their :class:`fused.KvGroup` (each marked in ``streams``), its
        per-call inputs, and per group (its block, first slot, span). Nothing without
        ``kv_groups``."""
        if not self.kv_groups:
            return (), (), []
        by_block: dict[int, list[int]] = {}
        for i, ((seq, _), s) in enumerate(zip(batch, streams)):
            if s.n_new == 1 and seq.lease is not None:
                by_block.setdefault(id(seq.lease.block), []).append(i)
        groups, inputs, spans = [], [], []
        gqa = self.cfg.n_head_kv * self.cfg.head_dim
        flash = dense.flash_attn()  # (V stored as K: a group's V cells are its K cells, kidx)
        mask_dtype = np.float16 if flash else np.float32  # dense.mask_dtype
        known = getattr(self._thread, "groups", None)  # a group's fixed inputs, by its members' places
        if known is None or len(known) > 64:
            known = self._thread.groups = {}
        for members in by_block.values():
            if len(members) < 2:
                continue
            block = batch[members[0]][0].lease.block
            slots = tuple(batch[i][0].lease.slot for i in members)
            starts = tuple(streams[i].start for i in members)
            n_kv = max(streams[i].n_kv for i in members)
            fixed = known.get((slots, starts, rows))
            if fixed is None or fixed[0]() is not block:  # (a weak reference: an emptied block is let go)
                fixed = known[(slots, starts, rows)] = (weakref.ref(block),
                                                        *self._group_fixed(block, slots, starts, rows, gqa))
            _, lo, span, offs, places, qidx, sel, pick, dst, vbase = fixed
            g = len(groups)
            for i in members:
                # the step's shape names the group's cells, not each member's: a member crossing
                # 64 cells changes it only where it was the group's longest
                st = streams[i]
                streams[i] = fused.Stream(st.start, st.n_new, st.rows, st.kv_size, n_kv, g)  # (replace(): 5x the time)
            past = [batch[i][0].n_past for i in members]
            n_pasts = np.array(past, dtype=np.int64)
            mask = np.full((span, rows, n_kv), -np.inf, dtype=mask_dtype)
            mask[:, :, 0] = 0  # a slot of no member: one cell seen, its output dropped
            for o, p in zip(places, past):
                mask[o, :, :p + 1] = 0  # dense.causal_mask's rows: cells 0..n_past seen
            inputs.append(fused.GroupInputs(qidx=qidx, sel=sel, kidx=offs * block.cells + n_pasts,
                                            vidx=vbase.ravel() if flash else (vbase + n_pasts[:, None]).ravel(), mask=mask, pick=pick, dst=dst))
            groups.append(fused.KvGroup(block.cells, span, n_kv, rows, len(members)))
            spans.append((block, lo, span))
        return tuple(groups), tuple(inputs), spans

    @staticmethod
    def _group_fixed(block, slots: tuple, starts: tuple, rows: int, gqa: int) -> tuple:
        """What a KV group's inputs keep while its members keep their slots and rows: its first
        slot and span, each member's slot offset (an array and a list), the query row of each
        slot's rows (``qidx``), each member's row of the step (``sel``, ``dst``), its first row
        in the group's output (``pick``), and where its value elements sit less its cell
        (``vidx`` less ``n_past``)."""
        lo = min(slots)
        span = max(slots) - lo + 1
        offs = np.array(slots, dtype=np.int64) - lo
        qidx = np.full((span, rows), starts[0], dtype=np.int32)
        qidx[offs] = np.array(starts, dtype=np.int32)[:, None]
        dst = np.array(starts, dtype=np.int64)
        vbase = (offs * gqa * block.cells)[:, None] + np.arange(gqa, dtype=np.int64)[None, :] * block.cells
        return (lo, span, offs, offs.tolist(), qidx.ravel(), dst.astype(np.int32), (offs * rows).astype(np.int32),
                dst, vbase)

    def _run_step_graphs(self, step: fused.StepShape, blocks: list, per_graph: int, tokens: tuple, at: dict,
                         keep: np.ndarray | None, head: tuple, n_out: int) -> np.ndarray:
        """The step graphs of ``_step_graphs`` or ``_batch_graphs`` from the step's ``tokens``
        (the embedding and the ids, embedded in the first graph): ``per_graph`` layers per
        graph with every expert local, or one per layer with remote experts. Returns the logits."""
        if self.experts is not self.local_experts:  # one graph per layer, the experts remote
            return self._step_graphs_remote(step, blocks, tokens, at, keep, head)
        if not all(fused.experts_in_graph(step.n_new, b.layer) for b in blocks):
            # each expert's layout by its rows (kernels.ggml.expert_layout), which only the
            # router knows: the whole step's graphs with every expert repacked, kept where no
            # expert got the repacked layout's threshold of rows (the rule's own layout then);
            # else one graph per layer up to its router, its experts split by their rows in
            # kernels.ggml.moe_ffn
            kind = (step.n_new, len(step.streams))
            decode = step.n_new == len(step.streams)  # one token from each of several sequences
            if decode and self.speculation.worth(kind) and not any(b.recurrent for b in blocks):
                logits, chosen = self._local_graphs(step, blocks, per_graph, tokens, at, keep, head, n_out, True)
                below = ggml_repack_below()
                kept = all(np.bincount(c.ravel()).max(initial=0) < below for c in chosen)
                self.speculation.record(kind, kept)
                if kept:
                    self._count_local(chosen)
                    return logits
            return self._step_graphs_remote(step, blocks, tokens, at, keep, head)
        logits, chosen = self._local_graphs(step, blocks, per_graph, tokens, at, keep, head, n_out)
        self._count_local(chosen)
        return logits

    def _local_graphs(self, step: fused.StepShape, blocks: list, per_graph: int, tokens: tuple, at: dict,
                      keep: np.ndarray | None, head: tuple, n_out: int, speculate: bool = False):
        """The step's graphs with every expert local, ``per_graph`` layers each: the logits and
        per layer the experts chosen (n, K)."""
        n_layer, x, chosen = len(blocks), None, []
        for first in range(0, n_layer, per_graph):
            # (the list itself where it is one part: step_graph checks it once)
            part = blocks if per_graph >= n_layer else blocks[first:first + per_graph]
            last = first + len(part) == n_layer
            out = fused.step_graph(step, part, x=x, tokens=tokens if x is None else None, **at,
                                   head=head if last else None, memo=self._step_plans, speculate=speculate,
                                   keep=self._dense_rows(keep) if last else None, n_kept=n_out)
            chosen += out.ids
            x = out.x
        return out.logits, chosen

    def _count_local(self, chosen: list[np.ndarray]) -> None:
        """The local experts' statistics (the market's demand) of a step's layers."""
        for il, c in enumerate(chosen):
            self.local_experts.calls[il] += len(set(c.ravel().tolist()))  # (np.unique: 10x slower)
            self.local_experts.rows[il] += c.size

    def _step_graphs_remote(self, step: fused.StepShape, blocks: list, tokens: tuple, at: dict,
                            keep: np.ndarray | None, head: tuple) -> np.ndarray:
        """``_step_graphs`` with the routed experts computed by ``self.experts``: one graph per
        layer, from the previous layer's combine (its experts' outputs an input) to this
        layer's router; then the last combine and the head. The same ops as the one graph of
        an all-local step, so the same bits whoever computed the experts. With every expert
        local (a step of more rows than one graph can hold the experts' layouts for,
        ``fused.experts_in_graph``) each layer's experts are one :meth:`LocalExperts.run_ids`."""
        n_layer, n_kept = len(blocks), 0 if keep is None else len(keep)
        prev = None
        for il, blk in enumerate(blocks):
            last = il == n_layer - 1
            out = fused.step_graph(step, [blk], tokens=tokens if prev is None else None, prev=prev, **at, remote=True,
                                   memo=self._step_plans,
                                   keep=self._dense_rows(keep) if last else None, n_kept=n_kept)
            r = out.routed
            if last and keep is not None:  # the kept rows only, from here on
                step = replace(step, rows=len(self._dense_rows(keep)), n_new=len(keep))
            shared = functools.partial(self._shared_remote, step, blk.layer, r) \
                if blk.layer.ffn_gate_shexp is not None else None
            if self.experts is self.local_experts:  # the layer's experts here, in one call
                if shared is not None:
                    shared()
                prev = (r, self.local_experts.run_ids(il, r.h, r.ids))
                continue
            prev = (r, self._expert_outputs(il, r.h, r.ids, while_waiting=shared))
        return fused.step_graph(step, [], prev=prev, head=head, memo=self._step_plans).logits

    def _shared_remote(self, step: fused.StepShape, layer: Layer, r: fused.Routed) -> None:
        """The shared expert of a layer stopped at its remote experts, into ``r.shared``: it
        needs none of them, so it runs while their replies travel."""
        r.shared = fused.shared_expert(layer, r.h, step.rows, step.shexp_gate, tokens=step.n_new,
                                       memo=self._step_plans)

    def _dense_rows(self, keep: np.ndarray | None) -> np.ndarray | None:
        """The rows the dense ops of the last layer keep: ``keep``, one row as two in
        deterministic mode (as every dense product runs it there)."""
        if keep is None or len(keep) > 1 or not self.one_row_as_two:
            return keep
        return np.repeat(keep, 2)

    def _attention_fused(self, il: int, blk: Layer, x: np.ndarray, positions: np.ndarray, batch,
                         starts, keep: np.ndarray | None = None, with_shared: bool = True) -> fused.FfnIn:
        """An attention layer up to the routed experts, as ``_attention`` then the FFN norm,
        router and shared expert of ``_moe`` compute it, in two ggml graphs around the KV cache
        (``kernels/fused.py``); after the output projection only the rows ``keep`` go on.
        Deterministic mode runs a one-row step as two rows, as every dense product does there
        (``kernels.ggml.matmul``). ``with_shared`` false: without the shared expert (``FfnIn.
        shared`` None; :meth:`_shared_fused` computes it while remote experts are away)."""
        c = self.cfg
        T = x.shape[0]
        pad = T == 1 and self.one_row_as_two
        xs, pos = (np.repeat(x, 2, axis=0), np.repeat(positions, 2)) if pad else (x, positions)
        q, k, v = fused.attention_in(xs, pos, self._attention_shape(il), attn_norm=blk.attn_norm, wq=blk.attn_q,
                                     wk=blk.attn_k, wv=blk.attn_v, bq=blk.attn_q_bias, bk=blk.attn_k_bias,
                                     bv=blk.attn_v_bias, q_norm=blk.attn_q_norm, k_norm=blk.attn_k_norm)
        k16, v16 = k[:T].astype(np.float16), v[:T].astype(np.float16)  # the KV cache is f16
        out = np.empty((len(xs), c.n_head * c.head_dim), dtype=np.float32)
        extra = dict(sinks=blk.attn_sinks, window=c.layer_window(il), scale=dense.kq_scale(c.n_rot)) \
            if blk.attn_sinks is not None else {}
        for (seq, _), a, b in zip(batch, starts[:-1], starts[1:]):
            seq.append(il, k16[a:b], v16[a:b])
            out[a:b] = dense.attention(q[a:b], seq.k[il], seq.v[il], seq.n_past, **extra)
        if pad:
            out[1] = out[0]
        rows = self._dense_rows(keep)
        shexp = (blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp) \
            if blk.ffn_gate_shexp is not None and with_shared else None
        f = fused.attention_out(out, xs, eps=c.rms_eps, wo=blk.attn_output, bo=blk.attn_output_bias,
                                ffn_norm=blk.ffn_norm, router=blk.ffn_gate_inp, router_bias=blk.ffn_gate_inp_bias,
                                router_softmax=c.traits.router != "softmax_weight", n_expert_used=c.n_expert_used,
                                norm_topk=c.traits.norm_topk, shexp=shexp,
                                shexp_gate=blk.ffn_gate_inp_shexp, shexp_gate_kind=c.traits.shexp_gate, keep=rows)
        if pad or (rows is not None and len(rows) > len(keep)):  # the first of two equal rows
            f = fused.FfnIn(f.x[:1], f.h[:1], f.ids[:1], f.weights[:1], None if f.shared is None else f.shared[:1])
        return f

    def _shared_fused(self, blk: Layer, h: np.ndarray) -> np.ndarray:
        """The gated shared expert of the FFN input ``h`` (n, D) as ``_attention_fused``'s graph
        computes it, on the rows it runs (a one-row step as two in deterministic mode)."""
        rows = 2 if len(h) == 1 and self.one_row_as_two else len(h)
        return fused.shared_expert(blk, h, rows, self.cfg.traits.shexp_gate, tokens=len(h), memo=self._step_plans)

    def _delta_net(self, il: int, blk: Layer, h: np.ndarray, batch, starts) -> np.ndarray:
        """A gated delta-net layer: the projections on all rows at once, then each sequence's
        chunk through ``kernels.deltanet.delta_net`` with its own conv and recurrent state."""
        c = self.cfg
        if self._delta_net_graph(batch, h):  # one sequence: the whole mixer in one graph
            seq = batch[0][0]
            out, seq.conv[il], seq.ssm[il] = deltanet.delta_net_layer(
                h, seq.conv[il], seq.ssm[il], wqkv=blk.attn_qkv, wz=blk.attn_gate, wbeta=blk.ssm_beta,
                walpha=blk.ssm_alpha, wout=blk.ssm_out, conv_w=blk.ssm_conv1d, dt_bias=blk.ssm_dt, ssm_a=blk.ssm_a,
                norm_w=blk.ssm_norm, k_heads=c.ssm_k_heads, eps=c.rms_eps)
            return out
        qkv, z = matmul(blk.attn_qkv, h), matmul(blk.attn_gate, h)
        if blk.ssm_ba is not None:  # qwen3next: split as llama.cpp's views do (copies, no rounding)
            T, Hk, Hv = h.shape[0], c.ssm_k_heads, c.ssm_v_heads
            ba = matmul(blk.ssm_ba, h).reshape(T, Hk, 2, Hv // Hk)
            beta, alpha = ba[:, :, 0].reshape(T, Hv), ba[:, :, 1].reshape(T, Hv)
        else:
            beta, alpha = matmul(blk.ssm_beta, h), matmul(blk.ssm_alpha, h)
        out = np.empty((h.shape[0], c.ssm_v_heads * c.ssm_head_dim), dtype=np.float32)
        for (seq, _), a, b in zip(batch, starts[:-1], starts[1:]):
            out[a:b], seq.conv[il], seq.ssm[il] = deltanet.delta_net(
                qkv[a:b], z[a:b], beta[a:b], alpha[a:b], seq.conv[il], seq.ssm[il], blk.ssm_conv1d, blk.ssm_dt,
                blk.ssm_a, blk.ssm_norm, k_heads=c.ssm_k_heads, eps=c.rms_eps, interleave=c.traits.ssm_ba)
        return matmul(blk.ssm_out, out)

    def _delta_net_graph(self, batch, h: np.ndarray) -> bool:
        """Whether a delta-net layer runs as one graph (``kernels.deltanet.delta_net_layer``): one
        sequence (its products on the same rows as the op-by-op path's), qwen35moe's separate
        beta and alpha projections, and not a one-row step in deterministic mode (there every
        dense product runs one row as two, ``kernels.ggml.matmul``; the op-by-op path does)."""
        return self.ggml_attention and len(batch) == 1 and not self.cfg.traits.ssm_ba \
            and not (len(h) == 1 and ggml_deterministic())

    def _moe(self, il: int, blk: Layer, h: np.ndarray, *, routed: tuple[np.ndarray, np.ndarray] | None = None,
             shared: np.ndarray | Callable[[], np.ndarray] | None = None) -> np.ndarray:
        """The MoE FFN of rows ``h``. ``routed``/``shared``: the router's choice (ids, weights)
        (T, K) and the gated shared expert, when the fused graph has computed them already;
        ``shared`` a function: what computes it, run while the routed experts are away."""
        c = self.cfg
        if routed is not None:
            ids, weights = routed
        else:
            softmax = dense.softmax if self.ggml_attention else ops.softmax
            router = matmul(blk.ffn_gate_inp, h)  # (T, E)
            if blk.ffn_gate_inp_bias is not None:
                router = router + blk.ffn_gate_inp_bias
            if c.traits.router == "softmax_weight":
                ids, weights = ops.route_softmax_weight(router, c.n_expert_used, softmax)  # (T, K)
            else:
                ids, weights = ops.route(router, c.n_expert_used, c.traits.norm_topk, softmax)  # (T, K)
        # Whatever rounding the wire applies to the rows, the local path applies too.
        rows = h.astype(self.wire_dtype).astype(np.float32)
        if self.experts is self.local_experts and self.ggml_attention:  # llama.cpp's layout, one graph
            expert_out = self.local_experts.run_ids(il, rows, ids)  # (T, K, D)
            moe = ops.combine(expert_out, weights)
            return moe + shared if shared is not None else self._shared(blk, h, moe)
        if callable(shared):
            done = []
            moe = ops.combine(self._expert_outputs(il, rows, ids, while_waiting=lambda: done.append(shared())),
                              weights)
            return moe + done[0]
        moe = ops.combine(self._expert_outputs(il, rows, ids), weights)
        return moe + shared if shared is not None else self._shared(blk, h, moe)

    def _expert_outputs(self, il: int, rows: np.ndarray, ids: np.ndarray,
                        while_waiting: Callable[[], None] | None = None) -> np.ndarray:
        """Every chosen expert of layer ``il`` on its rows, through ``self.experts`` (each
        expert asked once, with every row that chose it): rows (T, D), ids (T, K) -> (T, K, D).
        ``while_waiting``: work that needs none of them, done once they are asked for (before,
        with a backend that cannot overlap it: the same result, later)."""
        chosen = ids[0].tolist() if len(ids) == 1 else None
        if chosen is not None and len(set(chosen)) == len(chosen):  # a decode row: K experts, each on it
            slots = sorted(range(len(chosen)), key=chosen.__getitem__)  # in expert order, as below
            row = rows.copy()
            calls = [(chosen[k], row) for k in slots]
            places = None
        else:
            groups = [(int(e), np.nonzero(ids == e)) for e in np.unique(ids)]  # (row idx, slot idx) per expert
            calls = [(e, np.ascontiguousarray(rows[r])) for e, (r, _) in groups]
            places = [where for _, where in groups]
        if while_waiting is not None and _overlaps(type(self.experts)):
            outs = self.experts.run_layer(il, calls, while_waiting=while_waiting)
        else:
            if while_waiting is not None:
                while_waiting()
            outs = self.experts.run_layer(il, calls)
        if places is None:  # the decode row's outputs put in slot order, then one copy
            in_slots = [None] * len(outs)
            for k, out in zip(slots, outs):
                in_slots[k] = out
            return np.concatenate(in_slots, dtype=np.float32).reshape(ids.shape + rows.shape[1:])  # (1, K, D)
        expert_out = np.empty((*ids.shape, rows.shape[1]), dtype=np.float32)  # (T, K, D)
        for (r, slot), out in zip(places, outs):
            expert_out[r, slot] = out
        return expert_out

    def _shared(self, blk: Layer, h: np.ndarray, moe: np.ndarray) -> np.ndarray:
        """``moe`` plus the (gated) shared expert of rows ``h``, where the layer has one."""
        c = self.cfg
        if blk.ffn_gate_shexp is not None:
            shared = expert_ffn(blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp, h, routed=False)
            if blk.ffn_gate_inp_shexp is not None:
                if self.ggml_attention:
                    gate = dense.shared_expert_gate(h, blk.ffn_gate_inp_shexp, c.traits.shexp_gate)  # (T, 1)
                else:
                    gate = ops.silu_gate((h @ blk.ffn_gate_inp_shexp)[:, None].astype(np.float32))
                shared = shared * gate
            moe = moe + shared
        return moe


def _layers_per_graph(step: fused.StepShape, kinds: list, budget: int) -> int:
    """How many layers one step graph holds (``fused.layers_per_graph``) for the costliest of
    ``kinds``, one block of each distinct layer shape (qwen35moe: delta-net, gated attention)."""
    return min(fused.layers_per_graph(step, b.layer, b.shape, budget) for b in kinds)


@functools.lru_cache(maxsize=None)
def _overlaps(backend: type) -> bool:
    """Whether an expert backend's ``run_layer`` takes ``while_waiting`` (work of the caller's
    to do once the experts are asked for: :meth:`backbone.dispatch.RemoteExperts.run_layer`)."""
    return "while_waiting" in inspect.signature(backend.run_layer).parameters


def _f32_tensor(name: str, array: np.ndarray) -> QTensor:
    """A numpy array (numpy order) as a float32 :class:`QTensor` (ggml order)."""
    a = np.ascontiguousarray(array, dtype=np.float32)
    return QTensor(name, GGMLQuantizationType.F32, tuple(reversed(a.shape)), a.reshape(-1).view(np.uint8))


def embed(token_embd: QTensor, ids: np.ndarray) -> np.ndarray:
    """Rows of the token embedding, dequantised exactly: (T,) -> (T, D) float32."""
    t = token_embd
    if t.ggml_type == GGMLQuantizationType.F32:
        return t.data.view(np.float32).reshape(-1, t.ne[0])[ids].copy()
    if t.ggml_type == GGMLQuantizationType.F16:
        return t.data.view(np.float16).reshape(-1, t.ne[0])[ids].astype(np.float32)
    from gguf.quants import dequantize

    rows = t.data.reshape(-1, t.row_bytes)[ids]
    return dequantize(rows, t.ggml_type).reshape(len(ids), t.ne[0]).astype(np.float32, copy=False)


def type_name(t: GGMLQuantizationType) -> str:
    return GGMLQuantizationType(t).name.lower()


__all__ = ["Engine", "Sequence", "Weights", "Layer", "embed", "GGML_QUANT_SIZES"]
