"""What a cached ggml graph call may skip, and what it must still do every time.

A call binds its arrays' addresses read from numpy's struct (not ``__array_interface__``),
checks an expert's weights once per triple (a plan) and keys its graph by a few ints. These
tests pin down that none of that changes a result or lets bad input through: addresses equal
numpy's own, every call returns a fresh array, a plan is never reused for other tensors,
rows that are not float32 C-contiguous are still converted, out-of-range expert ids are still
refused, and experts sharing a graph each get their own bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import kernels  # noqa: F401  (thread settings before numpy work)
from kernels.tensors import QTensor


def _weight(ggml, name: str, out: int, inp: int, seed: int, qtype=T.Q8_0) -> QTensor:
    w = (np.random.default_rng(seed).standard_normal((out, inp)) / math.sqrt(inp)).astype(np.float32)
    return QTensor(name, qtype, (inp, out), ggml.quantize(w, qtype))


def _expert(ggml, seed: int, d: int = 64, f: int = 32, qtype=T.Q8_0):
    return (_weight(ggml, "gate", f, d, seed, qtype), _weight(ggml, "up", f, d, seed + 1, qtype),
            _weight(ggml, "down", d, f, seed + 2, qtype))


def _slabs(ggml, E: int, d: int = 64, f: int = 32, seed: int = 0):
    """Three 3-D expert slabs (E experts) and the 2-D views of each expert."""
    experts = [_expert(ggml, seed + 3 * e, d, f) for e in range(E)]
    slab = [QTensor(f"blk.0.ffn_{n}_exps.weight", T.Q8_0, (*experts[0][i].ne, E),
                    np.concatenate([ex[i].data for ex in experts]))
            for i, n in enumerate(("gate", "up", "down"))]
    return slab, experts


def test_addresses_are_numpys_own(ggml, tmp_path):
    base = np.arange(96, dtype=np.float32)
    mm = np.memmap(tmp_path / "m.bin", dtype=np.uint8, mode="w+", shape=(64,))
    arrays = [base, base[5:], base.reshape(12, 8)[3:], base.reshape(12, 8)[:, 2:],
              np.frombuffer(bytes(40), dtype=np.float32, offset=8), mm, mm[7:]]
    for a in arrays:
        assert ggml.address(a) == a.__array_interface__["data"][0]
    assert ggml.address(12345) == 12345


def test_a_non_array_is_refused_not_read(ggml):
    for bad in (b"abcd", [1.0, 2.0], 1.5, None):
        with pytest.raises(TypeError, match="numpy array"):
            ggml.address(bad)


def test_every_call_returns_a_fresh_array(ggml):
    gate, up, down = _expert(ggml, 0)
    rng = np.random.default_rng(1)
    x1, x2 = rng.standard_normal((2, 1, 64)).astype(np.float32)
    y1 = ggml.expert_ffn(gate, up, down, x1, routed=True)
    kept = y1.copy()
    y2 = ggml.expert_ffn(gate, up, down, x2, routed=True)
    assert not np.shares_memory(y1, y2)
    assert np.array_equal(y1, kept)  # the second call did not write into the first result
    assert not np.array_equal(y1, y2)


def test_experts_sharing_a_graph_each_get_their_own_bits(ggml):
    a, b = _expert(ggml, 0), _expert(ggml, 10)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    ya = ggml.expert_ffn(*a, x, routed=True)
    yb = ggml.expert_ffn(*b, x, routed=True)  # same shapes: the same cached graph, rebound
    ggml.graph_cache().entries.clear()
    assert np.array_equal(ggml.expert_ffn(*b, x, routed=True), yb)  # a graph built for b alone
    assert np.array_equal(ggml.expert_ffn(*a, x, routed=True), ya)
    assert not np.array_equal(ya, yb)


def test_a_checked_gate_with_other_tensors_is_checked_again(ggml):
    gate, up, down = _expert(ggml, 0)
    x = np.zeros((1, 64), np.float32)
    ggml.expert_ffn(gate, up, down, x, routed=True)  # gate's plan now holds (up, down)
    with pytest.raises(ValueError, match=r"expected ne=\(32, 64\)"):
        ggml.expert_ffn(gate, up, gate, x, routed=True)
    wide = _weight(ggml, "wide_up", 64, 64, 5)
    with pytest.raises(ValueError, match="same shape"):
        ggml.expert_ffn(gate, wide, down, x, routed=True)
    assert ggml.expert_ffn(gate, up, down, x, routed=True).shape == (1, 64)  # the plan still serves


def test_rows_in_any_layout_are_converted_and_bad_rows_refused(ggml):
    gate, up, down = _expert(ggml, 0)
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    want = ggml.expert_ffn(gate, up, down, x, routed=True)
    for same in (x.astype(np.float64), np.asfortranarray(x), np.repeat(x, 2, axis=0)[::2],
                 x.astype(">f4")):
        assert np.array_equal(ggml.expert_ffn(gate, up, down, same, routed=True), want)
    for bad, match in ((x[:, :32], r"shape \(n>=1, 64\)"), (x[:0], r"shape \(n>=1, 64\)"),
                       (x[0], r"shape \(n>=1, 64\)"), (x.astype(np.int32), "floating-point")):
        with pytest.raises(ValueError, match=match):
            ggml.expert_ffn(gate, up, down, bad, routed=True)


@pytest.mark.parametrize("T_rows", [1, 40])  # few ids (checked as Python ints) and many (numpy)
def test_moe_ffn_refuses_out_of_range_ids(ggml, T_rows):
    (gate, up, down), _ = _slabs(ggml, E=4)
    x = np.zeros((T_rows, 64), np.float32)
    ids = np.zeros((T_rows, 2), np.int32)
    assert ggml.moe_ffn(gate, up, down, x, ids).shape == (T_rows, 2, 64)
    for bad in (-1, 4, 2**31 - 1):
        wrong = ids.copy()
        wrong[-1, 1] = bad
        with pytest.raises(ValueError, match=r"out of range 0\.\.3"):
            ggml.moe_ffn(gate, up, down, x, wrong)
    with pytest.raises(ValueError, match="ids: expected shape"):
        ggml.moe_ffn(gate, up, down, x, ids[:, 0])


def test_moe_ffn_rows_match_each_expert_alone(ggml):
    (gate, up, down), experts = _slabs(ggml, E=4)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ids = rng.integers(0, 4, (5, 2)).astype(np.int64)  # converted to int32 on the way in
    y = ggml.moe_ffn(gate, up, down, x, ids)
    for t in range(5):
        for k in range(2):
            alone = ggml.expert_ffn(*experts[ids[t, k]], x[t:t + 1], routed=True)
            assert np.array_equal(y[t, k], alone[0])


def test_moe_ffn_checks_biases_given_after_a_plan_was_made(ggml):
    (gate, up, down), _ = _slabs(ggml, E=4)
    x, ids = np.zeros((1, 64), np.float32), np.zeros((1, 2), np.int32)
    ggml.moe_ffn(gate, up, down, x, ids)  # the plan without biases
    with pytest.raises(ValueError, match="expert bias"):
        ggml.moe_ffn(gate, up, down, x, ids, biases=(np.zeros((4, 31), np.float32), None, None))
    biased = ggml.moe_ffn(gate, up, down, x, ids, biases=(None, None, np.ones((4, 64), np.float32)))
    assert np.array_equal(biased, ggml.moe_ffn(gate, up, down, x, ids) + 1)


def test_a_bigger_work_buffer_is_taken_when_a_graph_needs_one(ggml):
    small, big = _expert(ggml, 0, d=64, f=32), _expert(ggml, 20, d=256, f=256, qtype=T.Q4_K)
    x_small = np.ones((1, 64), np.float32)
    x_big = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    want = ggml.expert_ffn(*big, x_big, routed=True)
    for _ in range(2):  # alternate: the second big call reuses the grown buffer
        ggml.expert_ffn(*small, x_small, routed=True)
        assert np.array_equal(ggml.expert_ffn(*big, x_big, routed=True), want)


def test_shapes_numbered_from_many_threads_never_share_an_id(ggml):
    import threading

    shapes = [("test-shape", i) for i in range(200)]
    got: dict = {}
    barrier = threading.Barrier(4)

    def number(part):
        barrier.wait()
        for s in part:
            got[s] = ggml.shape_id(s)

    threads = [threading.Thread(target=number, args=(shapes[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got.values())) == len(shapes)


@pytest.mark.parametrize("n", [3, 100])  # few ids (checked as Python ints) and many (numpy)
def test_get_rows_refuses_out_of_range_rows(ggml, n):
    w = _weight(ggml, "token_embd", 16, 64, 0)  # 16 rows of 64
    ids = np.arange(n, dtype=np.int64) % 16
    assert np.array_equal(ggml.get_rows(w, ids), w.f32()[ids])
    for bad in (-1, 16, -2**31):
        wrong = ids.astype(np.int32)
        wrong[-1] = bad
        with pytest.raises(ValueError, match=r"0\.\.15"):
            ggml.get_rows(w, wrong)


def test_one_thread_keeps_this_threads_calls_off_an_openmp_team_and_no_other_threads():
    """kernels.ggml.one_thread: inside, every thread policy answers one (on this thread only),
    so a caller computing small products inline never leads a team of its own (libgomp
    throttles every team's barriers once its teams' threads outnumber the CPUs)."""
    import threading

    from kernels import ggml

    big = 1 << 30
    outside = (ggml.n_threads(), ggml.decode_threads(), ggml.threads_for(big), ggml.expert_threads(big))
    other = []
    with ggml.one_thread():
        assert (ggml.n_threads(), ggml.decode_threads(), ggml.threads_for(big, 1), ggml.expert_threads(big)) \
            == (1, 1, 1, 1)
        t = threading.Thread(target=lambda: other.append(ggml.n_threads()))
        t.start()
        t.join()
        with ggml.one_thread():  # nested: still one, and the outer one still holds after
            pass
        assert ggml.n_threads() == 1
    assert other == [outside[0]]  # another thread keeps its own policy
    assert (ggml.n_threads(), ggml.decode_threads(), ggml.threads_for(big), ggml.expert_threads(big)) == outside
