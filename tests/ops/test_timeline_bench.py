"""bench/timeline.py's ``timeline``: the stamped events of a decode -> each stage's milliseconds
per token. The decode it stamps begins with the prompt's step, whose first workers get their
multi-row bundles while the backbone's send of the others still runs: that step is no decode
token and is left out (its hop to the last worker would come out below 0)."""

from __future__ import annotations

from tests.bench_script import load

BACKBONE, WORKER = 100, 200
MS = 1_000_000  # ns


def _step(t0: int, hop_ms: float) -> list[tuple[int, int, int, str]]:
    """One one-layer step from ``t0`` (ns): the backbone's graph, plan and send, the worker's
    message ``hop_ms`` after the send returned, its kernel and reply, the backbone's books and
    its second graph; 1 ms between stamps otherwise."""
    b = [("graph0", 0), ("graph1", 1), ("plan0", 2), ("plan1", 3), ("send0", 4), ("published", 5)]
    w = [("w_msg", 5 + hop_ms), ("w_k0", 7), ("w_k1", 8), ("w_sent", 9)]
    after = [("reply0", 10), ("reply1", 11), ("wake0", 12), ("wake1", 13), ("layer1", 14), ("graph0", 15),
             ("graph1", 16)]
    return sorted([(t0 + int(ms * MS), BACKBONE, 1, e) for e, ms in b + after]
                  + [(t0 + int(ms * MS), WORKER, 2, e) for e, ms in w])


def test_the_prompt_step_is_left_out_of_the_decode_tokens():
    bench = load("timeline")
    # the prompt's step: its worker had its message 3 ms before the send returned; then 3 tokens
    events = _step(0, -3.0) + _step(20 * MS, 1.0) + _step(40 * MS, 1.5) + _step(60 * MS, 0.5) \
        + [(80 * MS, BACKBONE, 1, "graph0")]
    out = bench.timeline(events, BACKBONE)
    hop = out["F hop to the last worker"]
    assert hop["tokens"] == 3 and hop["min_ms"] == 0.5 and hop["median_ms"] == 1.0
    assert out["token"]["tokens"] == 3 and out["token"]["median_ms"] == 20.0
    assert out["H kernels"]["median_ms"] == 1.0
    with_prompt = bench.timeline(events, BACKBONE, skip=0)["F hop to the last worker"]
    assert with_prompt["tokens"] == 4 and with_prompt["min_ms"] == -3.0
