"""The llama.cpp parity check every architecture's tests run (shared by tests/backbone and tests/arch)."""

from __future__ import annotations

from backbone.generate import generate
from backbone.model import Engine
from backbone.sampling import Sampler, SamplerConfig

# The prompt every parity test runs (36+ tokens with the synthetic byte-level vocabulary).
PROMPT = ("Experts are cut out of the model one by one, so a small phone can hold a real share "
          "of it while the backbone keeps them all.")


def assert_logits_match_llama_cpp(path, prompt_text: str, *, min_prompt: int, n_decode: int = 16,
                                  max_abs_diff: float = 1e-3) -> dict:
    """Our engine's logits over the prompt and ``n_decode`` greedy steps against llama.cpp's on the
    same tokens: argmax agreement 1.0 and max |diff| within ``max_abs_diff``. Returns the report."""
    from backbone.reference import Reference, compare
    from backbone.tokenizer import Tokenizer

    prompt = Tokenizer(path).encode(prompt_text)
    assert len(prompt) >= min_prompt
    gen = generate(Engine(path), prompt, n_decode, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
    assert len(gen.tokens) == n_decode
    ref = Reference(path, n_ctx=len(gen.all_tokens) + 8, n_batch=64).logits(gen.all_tokens)
    report = compare(gen.logits_array(), ref)
    assert report["positions"] == len(prompt) + n_decode
    assert report["argmax_agreement"] == 1.0, report
    assert report["max_abs_diff"] <= max_abs_diff, report
    return report
