"""A whole :class:`Engine` on a hand-set one-layer model whose logits are worked out here.

The model (Mixtral-style "llama" traits: NORM RoPE, top-k renormalised, no shared expert) has
D=4, one head, 2 experts of width 2, top-1, a vocabulary of 3, every weight float32 and set by
hand so that each step can be followed on paper:

* Q and K are zero, so every score is 0 and causal attention is a plain mean of the values of
  positions 0..t (RoPE rotates zeros: it cannot matter); V is the identity, the output
  projection 0.5 x identity;
* the router looks at h[1] alone: negative -> expert 0, positive -> expert 1, weight 1 (top-1
  renormalised);
* the embeddings have mean square 1, so the first RMS norm (eps 0) leaves them unchanged.
"""

from __future__ import annotations

import numpy as np

from backbone.config import ARCHES, ModelConfig
from backbone.model import Engine

D, F, E, V = 4, 2, 2, 3
EPS = 0.0

CFG = ModelConfig(arch="llama", traits=ARCHES["llama"], n_layer=1, n_embd=D, n_head=1, n_head_kv=1,
                  head_dim=D, n_rot=D, n_vocab=V, n_ctx_train=16, n_expert=E, n_expert_used=1, n_ff_exp=F,
                  n_ff_shexp=0, rms_eps=EPS, rope_base=10000.0, tied_output=False, bos_id=None, eos_id=None)

EMBD = np.array([[1, -1, 1, -1],  # token 0
                 [1, 1, 1, 1],  # token 1
                 [0, 2, 0, 0]], dtype=np.float32)  # token 2; every row has mean square 1
GATE = np.array([[[1, 0, 0, 0], [0, 0, 1, 0]],  # (E, F, D)
                 [[0, 1, 0, 0], [0, 0, 0, 0]]], dtype=np.float32)
UP = np.array([[[1, 0, 0, 0], [0, 0, 0, 1]],
               [[0, 1, 0, 0], [0, 0, 0, 0]]], dtype=np.float32)
DOWN = np.array([[[1, 0], [0, 0], [0, 0], [0, 1]],  # (E, D, F)
                 [[0, 0], [2, 0], [0, 0], [0, 0]]], dtype=np.float32)
ROUTER = np.array([[0, -1, 0, 0], [0, 1, 0, 0]], dtype=np.float32)  # (E, D)
OUTPUT = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float32)  # (V, D)


def tensors() -> dict[str, np.ndarray]:
    zeros, eye, ones = np.zeros((D, D), np.float32), np.eye(D, dtype=np.float32), np.ones(D, np.float32)
    return {
        "token_embd.weight": EMBD,
        "blk.0.attn_norm.weight": ones,
        "blk.0.attn_q.weight": zeros,
        "blk.0.attn_k.weight": zeros,
        "blk.0.attn_v.weight": eye,
        "blk.0.attn_output.weight": 0.5 * eye,
        "blk.0.ffn_norm.weight": ones,
        "blk.0.ffn_gate_inp.weight": ROUTER,
        "blk.0.ffn_gate_exps.weight": GATE,
        "blk.0.ffn_up_exps.weight": UP,
        "blk.0.ffn_down_exps.weight": DOWN,
        "output_norm.weight": ones,
        "output.weight": OUTPUT,
    }


def rms(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)


def silu(x):
    return x / (1 + np.exp(-x))


def expected_logits(ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """The forward pass of this model, step by step: (T, V) logits and each token's expert."""
    x = EMBD[ids].astype(np.float64)  # (T, D)
    h = rms(x)  # == x: mean square 1
    assert np.array_equal(h, x)
    means = np.cumsum(h, axis=0) / np.arange(1, len(ids) + 1)[:, None]  # uniform causal attention over V=h
    x = x + 0.5 * means
    h = rms(x)
    chosen = [0 if row[1] < 0 else 1 for row in h]  # the router: sign of h[1]
    moe = np.stack([DOWN[e] @ (silu(GATE[e] @ row) * (UP[e] @ row)) for e, row in zip(chosen, h)])
    x = x + moe  # top-1, renormalised: weight 1
    return rms(x) @ OUTPUT.T, chosen


def test_expected_logits_by_hand_for_the_first_token():
    # Token 0 attends only to itself: x = [1,-1,1,-1] + 0.5 x [1,-1,1,-1] = 1.5 x [1,-1,1,-1];
    # its RMS norm is [1,-1,1,-1]; h[1] < 0 -> expert 0: gate [1, 1], up [1, -1],
    # silu(1) = 0.7310586, so the expert gives down @ [0.731, -0.731] = [0.731, 0, 0, -0.731].
    logits, chosen = expected_logits([0])
    s = 1 / (1 + np.exp(-1.0))
    x = np.array([1.5 + s, -1.5, 1.5, -1.5 - s])
    assert chosen == [0]
    np.testing.assert_allclose(logits[0], (x / np.sqrt((x * x).mean())) @ OUTPUT.T, rtol=1e-12)


class Recording:
    """An expert backend that notes who was asked for which rows, then computes locally."""

    def __init__(self, local):
        self.local, self.calls = local, []

    def run_layer(self, layer, calls):
        self.calls.append((layer, [(e, len(rows)) for e, rows in calls]))
        return self.local.run_layer(layer, calls)


def test_engine_on_hand_set_weights_computes_the_worked_out_logits():
    engine = Engine.from_weights(tensors(), CFG)
    assert engine.path is None and engine.n_ctx == 16
    backend = Recording(engine.local_experts)
    engine.use_experts(backend)
    want, chosen = expected_logits([0, 1, 2])
    assert chosen == [0, 1, 1]  # both experts are used: the routing is part of the check

    seq = engine.new_sequence()
    (prefill,) = engine.forward([(seq, np.array([0, 1]))])  # (2, V)
    (decode,) = engine.forward([(seq, np.array([2]))])  # (1, V), through the KV cache
    got = np.concatenate([prefill, decode])
    # llama.cpp's attention multiplies float16 probabilities (1/3 -> 0.33325) with the float16
    # cache: 1e-4 is that rounding; a wrong expert or a wrong mask is off by more than 0.1.
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    # Each selected expert was asked once per step, with every row that chose it.
    assert backend.calls == [(0, [(0, 1), (1, 1)]), (0, [(1, 1)])]
    assert seq.n_past == 3

    engine.use_experts(None)  # back to this node's experts: the same numbers
    (again,) = engine.forward([(engine.new_sequence(), np.array([0, 1, 2]))])
    np.testing.assert_allclose(again, want, rtol=1e-3, atol=1e-4)
    assert len(backend.calls) == 2
