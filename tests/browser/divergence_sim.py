"""Why a generation with browser tabs under the default audit may differ from the monolithic run,
reproduced without a browser: ``python tests/browser/divergence_sim.py [--runs 30]``.

The tab's kernel gives the numpy worker's bits (tests/browser/test_kernel_node.py), up to ~5e-7
relative from ggml's, the backbone's kernel. In tests/browser/test_browser_worker.py the two tabs
hold all of layer 0, and after probation about 9 in 10 of their replies are used unaudited. Here
the same model, prompt and kernel mode (deterministic, as tests/conftest.py sets) run 64 greedy
tokens with each layer-0 expert call computed by numpy with probability ``--unaudited`` (else by
ggml), and each run prints where its tokens first differ from the monolithic run's and the
largest logit change. The same question with real tabs, saved and rendered in the README:
``bench/browser_audit.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

os.environ.setdefault("KVASIR_KERNEL_MODE", "deterministic")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from backbone.experts import LocalExperts  # noqa: E402
from backbone.generate import generate  # noqa: E402
from backbone.model import Engine  # noqa: E402
from backbone.sampling import Sampler, SamplerConfig  # noqa: E402


class TabsOnLayer0(LocalExperts):
    """Every expert here; a layer-0 call answered with numpy's bits (a tab's) with probability p."""

    def __init__(self, weights, p: float, rng: random.Random):
        super().__init__(weights)
        self.p, self.rng = p, rng

    def run_layer(self, layer, calls):
        return [self.compute(layer, e, rows, backend="numpy" if layer == 0 and self.rng.random() < self.p else None)
                for e, rows in calls]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--unaudited", type=float, default=0.9, help="share of layer-0 calls with the tab's bits")
    args = p.parse_args()
    from synth.model import synth_model

    with tempfile.TemporaryDirectory() as d:
        path = synth_model(os.path.join(d, "tiny-q4k.gguf"), arch="qwen3moe", preset="tiny", qtype="q4_k", seed=7)
        mono = Engine(path)
        prompt = np.random.default_rng(3).integers(0, mono.cfg.n_vocab, 16).tolist()
        ref = generate(mono, prompt, 64, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
        differ = 0
        for run in range(args.runs):
            eng = Engine(path)
            eng.experts = TabsOnLayer0(eng.local_experts.weights, args.unaudited, random.Random(run))
            g = generate(eng, prompt, 64, Sampler(SamplerConfig()), stop_on_eos=False, keep_logits=True)
            same = next((i for i, (a, b) in enumerate(zip(g.tokens, ref.tokens)) if a != b), 64)
            differ += same < 64
            delta = np.abs(g.logits_array() - ref.logits_array()).max()
            print(f"run {run}: tokens equal for {same} of 64; max |logit delta| {delta:.3g}", flush=True)
        print(f"{differ} of {args.runs} runs differ from the monolithic run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
