"""Sequences' KV caches side by side, so that a decode step attends for all of them at once.

A sequence's cache of one layer is K (cells, Hkv*Dh) and V transposed (Hkv*Dh, cells), f16
(``backbone.model.Sequence``). Alone in its own arrays, each sequence of a step needs its own
attention ops: at 16 decode streams of the small model those sub-graphs were a third of the
step (5.5 of 16.9 ms, six ops per sequence and layer, each a barrier of the thread team).
llama-server keeps its slots' caches in one tensor per layer and attends for all of them in one
op. Here a *block* holds ``slots`` caches of the same capacity per attention layer, one after
the other at a fixed stride:

    K block: (layers, slots, cells, Hkv*Dh)     V block: (layers, slots, Hkv*Dh, cells)
                                                (flash attention: as K, llama.cpp's layout then)

so the caches of the sequences in slots lo..hi of one layer are one strided 4-D view
(``kernels.fused``'s grouped attention, ``StepShape.groups``) and the ops of one sequence alone
run once for the whole group, with the same bits (each sequence's row meets only its own cells:
its mask hides the rest, and the extra cells add exact zeros in the same SIMD lanes; see
``kernels.dense``).

A block is ``np.zeros``: the operating system commits its pages as cells are written, so a
block costs the memory of what its sequences hold, not of its size. A slot that comes back is
zeroed where it was written (cells not yet written must be zero: a masked cell's weight is an
exact 0, and 0 times a stale non-finite value would not be). Slots are handed out lowest
first, so the live sequences stay packed at the front of a block and a group's span has few
holes. A capacity whose block would hold fewer than two slots within :data:`MAX_BLOCK_BYTES`
gets no block (the caller keeps a cache of its own: per-sequence attention, as before).
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np

#: Address space one block may take (committed only as its cells are written).
MAX_BLOCK_BYTES = 1 << 30
#: Slots per block at most: a decode step's group is one block's sequences.
MAX_SLOTS = 64


@dataclass
class Lease:
    """One slot of a block: the sequence's caches are ``block.k[:, slot]`` and
    ``block.v[:, slot]``; ``high`` is how many cells it has written (zeroed when it comes back)."""

    block: "KvBlock"
    slot: int
    high: int = 0
    released: bool = False

    def k(self, row: int) -> np.ndarray:
        return self.block.k[row, self.slot]  # (cells, gqa), C-contiguous

    def v(self, row: int) -> np.ndarray:
        return self.block.v[row, self.slot]  # (gqa, cells), or (cells, gqa) as K; C-contiguous


class KvBlock:
    """``slots`` caches of ``cells`` cells for ``layers`` attention layers."""

    def __init__(self, layers: int, slots: int, cells: int, gqa: int, v_trans: bool = True):
        self.cells, self.slots, self.v_trans = cells, slots, v_trans
        self.k = np.zeros((layers, slots, cells, gqa), dtype=np.float16)
        self.v = np.zeros((layers, slots, gqa, cells) if v_trans else (layers, slots, cells, gqa), dtype=np.float16)
        self._free = list(range(slots))  # a heap: lowest slot first
        self.used = 0

    def take(self) -> int | None:
        if not self._free:
            return None
        self.used += 1
        return heapq.heappop(self._free)

    def give(self, slot: int, high: int) -> None:
        if high:
            self.k[:, slot, :high] = 0
            if self.v_trans:
                self.v[:, slot, :, :high] = 0
            else:
                self.v[:, slot, :high] = 0
        heapq.heappush(self._free, slot)
        self.used -= 1


class KvSlots:
    """The blocks of one engine, per capacity. ``rows``: the model's attention layers (a
    delta-net layer has no KV cache); ``gqa``: Hkv*Dh; ``v_trans``: V transposed (False: laid
    out as K, for flash attention). Thread-safe: a sequence may be dropped (and its slot come
    back) on any thread."""

    def __init__(self, rows: int, gqa: int, v_trans: bool = True):
        self.rows, self.gqa, self.v_trans = rows, gqa, v_trans
        self._blocks: dict[int, list[KvBlock]] = {}
        self._lock = threading.Lock()

    def slots_for(self, cells: int) -> int:
        """Slots of a block of ``cells``-cell caches (0: none, too big to share a block)."""
        per_slot = 2 * 2 * self.rows * cells * self.gqa  # K and V, f16
        return min(MAX_SLOTS, MAX_BLOCK_BYTES // max(1, per_slot)) if self.rows else 0

    def lease(self, cells: int) -> Lease | None:
        """A free slot of ``cells`` cells (a new block where every one is taken), or None where
        caches of this size get no block."""
        slots = self.slots_for(cells)
        if slots < 2:
            return None
        with self._lock:
            blocks = self._blocks.setdefault(cells, [])
            for block in blocks:
                slot = block.take()
                if slot is not None:
                    return Lease(block, slot)
            block = KvBlock(self.rows, slots, cells, self.gqa, self.v_trans)
            blocks.append(block)
            return Lease(block, block.take())

    def release(self, lease: Lease) -> None:
        """Give a slot back (once; later calls do nothing). An empty block other than the
        first of its size is let go."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            block = lease.block
            block.give(lease.slot, lease.high)
            blocks = self._blocks.get(block.cells, [])
            if block.used == 0 and blocks and blocks[0] is not block and block in blocks:
                blocks.remove(block)

    def stats(self) -> dict:
        with self._lock:
            return {cells: [b.used for b in blocks] for cells, blocks in self._blocks.items()}
