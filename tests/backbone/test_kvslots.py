"""Sequences' KV caches as slots of shared blocks (backbone/kvslots.py), and the decode step that
attends for a block's sequences at once (``kernels.fused.KvGroup``): the same bits as each
sequence attending alone, in both kernel modes, with holes in the block, sequences growing
into a bigger block, and sequences dropped."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone import kvslots
from backbone.kvslots import KvSlots
from backbone.model import Engine
from kernels import fused, ggml

ROOT = Path(__file__).resolve().parents[2]


def test_slots_are_handed_out_lowest_first_and_come_back_zeroed():
    slots = KvSlots(rows=2, gqa=8)
    a, b, c = (slots.lease(256) for _ in range(3))
    assert [x.slot for x in (a, b, c)] == [0, 1, 2] and a.block is b.block is c.block
    b.k(1)[:10] = 1.5
    b.v(0)[:, :10] = -2
    b.high = 10
    slots.release(b)
    slots.release(b)  # a second release does nothing
    assert not b.block.k[:, 1].any() and not b.block.v[:, 1].any()
    assert slots.lease(256).slot == 1  # the hole is filled first
    assert slots.stats() == {256: [3]}


def test_a_full_block_opens_another_and_an_empty_extra_block_is_let_go(monkeypatch):
    monkeypatch.setattr(kvslots, "MAX_SLOTS", 2)
    slots = KvSlots(rows=1, gqa=4)
    leases = [slots.lease(256) for _ in range(3)]
    assert leases[2].block is not leases[0].block and slots.stats() == {256: [2, 1]}
    slots.release(leases[2])
    assert slots.stats() == {256: [2]}
    slots.release(leases[0])
    slots.release(leases[1])
    assert slots.stats() == {256: [0]}  # the first block of a size stays


def test_a_cache_too_big_to_share_a_block_gets_none(monkeypatch):
    monkeypatch.setattr(kvslots, "MAX_BLOCK_BYTES", 3 * 2 * 2 * 4 * 256 * 8)  # three 256-cell slots
    slots = KvSlots(rows=4, gqa=8)
    assert slots.slots_for(256) == 3 and slots.lease(256) is not None
    assert slots.slots_for(512) == 1 and slots.lease(512) is None
    assert KvSlots(rows=0, gqa=8).lease(256) is None  # a model without attention layers


def test_a_sequence_moves_to_a_bigger_slot_with_its_cells_and_gives_slots_back(models):
    engine = Engine(models("qwen3moe", "q4_k", ctx=1024))
    rng = np.random.default_rng(2)
    seq = engine.new_sequence()
    engine.forward([(seq, rng.integers(0, engine.cfg.n_vocab, 200))])
    first = seq.lease
    assert first.block.cells == 256 and seq.k[0].base is not None
    before = [k[:200].copy() for k in seq.k]
    engine.forward([(seq, rng.integers(0, engine.cfg.n_vocab, 100))])  # 300 cells: a 512-cell slot
    assert seq.lease.block.cells == 512 and first.released
    assert all(np.array_equal(k[:200], b) for k, b in zip(seq.k, before))
    assert not first.block.k[:, first.slot].any()  # the old slot came back zeroed
    block = seq.lease.block
    del seq
    gc.collect()
    assert block.used == 0  # a sequence dropped gives its slot back


def _run(engine: Engine, groups: bool) -> list[np.ndarray]:
    """Six sequences read their prompts, then decode together; one leaves after a few steps
    (a hole in the block), one's steps come as chunks of two now and then (it leaves the group
    for those steps), and one grows past 256 cells into another block."""
    engine.kv_groups = groups
    rng = np.random.default_rng(11)
    V = engine.cfg.n_vocab
    seqs = [engine.new_sequence() for _ in range(6)]
    if not groups:
        for s in seqs:  # caches of their own
            s.slots = None
    out = []
    for j, s in enumerate(seqs):
        out += engine.forward([(s, rng.integers(0, V, 240 if j == 4 else 5 + 7 * j))], all_logits=False)
    live = list(range(6))
    for i in range(24):
        if i == 6:
            live.remove(2)
        batch = [(seqs[j], rng.integers(0, V, 2 if (j == 1 and i % 5 == 0) else 1)) for j in live]
        out += engine.forward(batch, all_logits=False)
    return out


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "q4_k"), ("qwen2moe", "q8_0")])
def test_a_block_of_decode_streams_attends_at_once_with_each_ones_own_bits(models, arch, qtype, monkeypatch):
    engine = Engine(models(arch, qtype, ctx=1024))
    assert engine.kv_groups and engine.batch_graphs
    built = []
    real = fused._attend_group
    monkeypatch.setattr(fused, "_attend_group", lambda *a, **kw: built.append(a[6]) or real(*a, **kw))
    ggml.graph_cache().entries.clear()
    grouped = _run(engine, True)
    spans = {(g.cells, g.span, g.members) for g in built}
    assert any(m >= 4 for _, _, m in spans) and any(span > m for _, span, m in spans), spans  # holes too
    assert any(cells == 512 for cells, _, _ in spans) is False  # the grown one is alone in its block
    own = _run(engine, False)
    assert len(grouped) == len(own)
    assert all(np.array_equal(a, b) for a, b in zip(grouped, own))


@pytest.mark.parametrize("flash", ["1", "0"])  # flash attention, the fast mode's default, and off
def test_kv_groups_give_each_ones_own_bits_in_the_fast_mode_too(flash):
    env = dict(os.environ, KVASIR_KERNEL_MODE="fast", KVASIR_FLASH_ATTN=flash, PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "attends_at_once"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "2 passed" in out.stdout


def test_a_groups_graph_is_rebuilt_only_when_its_longest_stream_crosses_64_cells(models, monkeypatch):
    """The step's shape names a group's cells (its longest member's, padded to 64), not each
    member's: a shorter member crossing 64 cells builds no graph (with caches of their own, it
    would)."""
    engine = Engine(models("qwen3moe", "q4_k", ctx=1024))
    rng = np.random.default_rng(5)
    V = engine.cfg.n_vocab
    built = []
    real_put = ggml.GraphCache.put
    monkeypatch.setattr(ggml.GraphCache, "put", lambda self, key, g: built.append(key) or real_put(self, key, g))
    for groups in (True, False):
        engine.kv_groups = groups
        seqs = [engine.new_sequence() for _ in range(3)]
        for s, n in zip(seqs, (10, 40, 150)):
            if not groups:
                s.slots = None
            engine.forward([(s, rng.integers(0, V, n))])
        built.clear()
        for _ in range(30):  # the second crosses 64 cells; the longest stays within 192
            engine.forward([(s, rng.integers(0, V, 1)) for s in seqs], all_logits=False)
        assert len(built) == (1 if groups else 2), (groups, len(built))


def test_a_group_index_outside_its_span_is_refused_before_ggml_reads_it(models, monkeypatch):
    engine = Engine(models("qwen3moe", "q4_k"))
    seqs = [engine.new_sequence() for _ in range(3)]
    for s in seqs:
        engine.forward([(s, np.array([1, 2, 3]))])
    real = engine._kv_groups

    def corrupt(*a):
        groups, inputs, spans = real(*a)
        inputs[0].kidx[0] = groups[0].cells * groups[0].span  # one cell past the span
        return groups, inputs, spans

    monkeypatch.setattr(engine, "_kv_groups", corrupt)
    with pytest.raises(ValueError, match="out of range"):
        engine.forward([(s, np.array([4])) for s in seqs], all_logits=False)
