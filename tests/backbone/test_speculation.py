"""A step of 8 rows or more in the fast mode (``Engine._run_step_graphs``, ``backbone.model.
Speculation``): each routed expert takes its layout by the rows it gets, which only the router
knows. A decode step of several sequences runs in one graph with every expert repacked, kept where no expert got 8 rows
(the layout rule's own choice then), and runs again the rule's way (a graph per layer, the
experts split by their rows) where one did. Either way the logits, the KV cache and the local
experts' statistics are those of the step that never speculated, bit for bit.

ggml fixes its mode as it loads: the fast mode runs in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from backbone.model import Speculation

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
import numpy as np
from backbone.model import Engine

def run(spec):
    engine = Engine(sys.argv[1], n_ctx=1024)
    engine.speculation.enabled = spec
    rng = np.random.default_rng(4)
    V = engine.cfg.n_vocab
    seqs = [engine.new_sequence() for _ in range(12)]
    out = []
    for j, s in enumerate(seqs):  # prompts of 9..20 tokens: never tried
        out += engine.forward([(s, rng.integers(0, V, 9 + j))], all_logits=j % 2 == 0)
    tried_prompts = engine.speculation.tries
    for i in range(8):  # decode steps of 8 and 12 streams: rarely 8 rows on one expert
        out += engine.forward([(s, rng.integers(0, V, 1)) for s in seqs[:8 if i < 4 else 12]], all_logits=False)
    # and steps whose streams all took one token, the same (8 rows on one expert: the same token)
    same = rng.integers(0, V, 1)
    for i in range(2):
        out += engine.forward([(s, same) for s in seqs], all_logits=False)
    caches = [np.concatenate([k[:s.n_past].ravel() for k in s.k]) for s in seqs]
    engine.tried_prompts = tried_prompts
    return out, caches, engine

a, ca, ea = run(False)
b, cb, eb = run(True)
print(json.dumps({
    "same_logits": len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)),
    "same_caches": all(np.array_equal(x, y) for x, y in zip(ca, cb)),
    "same_stats": (dict(ea.local_experts.calls), dict(ea.local_experts.rows))
                  == (dict(eb.local_experts.calls), dict(eb.local_experts.rows)),
    "tries": eb.speculation.tries, "misses": eb.speculation.misses, "untried": ea.speculation.tries,
    "tried_prompts": eb.tried_prompts,
}))
"""


def test_a_step_speculated_in_one_graph_keeps_every_bit_whether_kept_or_run_again(models):
    path = models("qwen3moe", "q4_k", ctx=1024)
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same_logits"] and got["same_caches"] and got["same_stats"], got
    assert got["untried"] == 0 and got["tried_prompts"] == 0
    assert 0 < got["misses"] < got["tries"], got  # some kept, some run again: both ways covered


def test_a_kind_of_step_that_keeps_missing_is_tried_only_now_and_then():
    spec = Speculation()
    prompt, decode = (16, 0), (16, 16)
    allowed = int(Speculation.MAX_MISS * Speculation.WINDOW)  # misses a young kind may have
    for _ in range(allowed + 1):
        assert spec.worth(prompt)
        spec.record(prompt, False)
    tried = sum(spec.worth(prompt) for _ in range(3 * Speculation.PROBE_EVERY))
    assert tried == 3  # one probe in PROBE_EVERY
    young = Speculation()  # one early miss among kept tries does not stop them
    for kept in (True, False, True):
        assert young.worth(decode)
        young.record(decode, kept)
    assert young.worth(decode)
    for _ in range(20):  # decode steps that keep: always tried
        assert spec.worth(decode)
        spec.record(decode, True)
    assert not spec.worth((Speculation.MAX_ROWS + 1, 0))
    assert not Speculation(enabled=False).worth(decode)
