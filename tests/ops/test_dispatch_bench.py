"""bench/dispatch.py's ``cores_busy``: every process's CPU of a round over its wall time times the
cores, the median of the rounds. It says whether the machine's cores or the decode's serial waits
bound a sharded decode, so its arithmetic is pinned here."""

from __future__ import annotations

from tests.bench_script import load


def test_cores_busy_is_every_process_cpu_over_wall_times_cores():
    bench = load("dispatch")
    # 10 tokens at 20 tok/s: 0.5 s of wall on 2 cores. Round 1: 0.5 + 0.3 + 0.1 s of CPU (the
    # engine-thread figures after the first three are parts of the backbone's, not added).
    rounds = [(0.5, 0.3, 0.1, 0.45, 0.2), (0.25, 0.2, 0.05, 0.2, 0.1), (1.0, 0.8, 0.2, 0.9, 0.4)]
    assert bench.cores_busy(rounds[:1], [20.0], 10, cores=2) == 0.9
    # on 4 cores the rounds keep 0.9 / 2, 0.5 / 2 and 2.0 / 2 of them busy: the median is 0.45
    assert bench.cores_busy(rounds, [20.0, 20.0, 20.0], 10, cores=4) == 0.45
    # each round its own wall time: 0.9 s of CPU in 0.5 s, 0.5 s in 1 s on one core: 1.8 and 0.5
    assert bench.cores_busy(rounds[:2], [20.0, 10.0], 10, cores=1) == 1.15
