"""Generation: prefill the prompt, then decode one token per step until N tokens or EOS."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from backbone.model import Engine
from backbone.sampling import Sampler
from kvasir_bus.errors import UsageError


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated
    logits: list[np.ndarray] = field(default_factory=list)  # one (V,) row per token of prompt + generated
    stop_reason: str = "length"  # "length" | "eos"
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    def logits_array(self) -> np.ndarray:
        return np.stack(self.logits).astype(np.float32)


def generate(engine: Engine, prompt: list[int], n: int, sampler: Sampler, *, stop_on_eos: bool = True,
             keep_logits: bool = False, on_token: Callable[[int], None] | None = None) -> Generation:
    """Greedy or sampled generation of up to ``n`` tokens after ``prompt``.

    With ``keep_logits`` the logits of every token of the final sequence are kept (the last
    generated token is run through the model too, so there is one row per token).
    """
    if not prompt:
        raise UsageError("the prompt is empty")
    if n < 0:
        raise UsageError(f"-n must be >= 0, got {n}")
    if len(prompt) + n > engine.n_ctx:
        raise UsageError(f"prompt ({len(prompt)} tokens) plus {n} new tokens exceeds the context of {engine.n_ctx}")
    gen = Generation(prompt=list(prompt))
    seq = engine.new_sequence()
    t0 = time.perf_counter()
    (logits,) = engine.forward([(seq, np.asarray(prompt))], all_logits=keep_logits)
    gen.prefill_s = time.perf_counter() - t0
    if keep_logits:
        gen.logits.extend(logits)
    t0 = time.perf_counter()
    eos = engine.cfg.eos_id
    for i in range(n):
        token = sampler(logits[-1])
        gen.tokens.append(token)
        if on_token:
            on_token(token)
        at_eos = stop_on_eos and token == eos
        if at_eos:
            gen.stop_reason = "eos"
        done = at_eos or i == n - 1
        if done and not keep_logits:
            break
        (logits,) = engine.forward([(seq, np.asarray([token]))], all_logits=keep_logits)
        if keep_logits:
            gen.logits.extend(logits)
        if done:
            break
    gen.decode_s = time.perf_counter() - t0
    return gen
