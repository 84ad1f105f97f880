"""Where a layer keeps its streams' keys and values, in the runtime's `kv_precision` (`StateFormat`).

A sliding layer needs only its window's last keys: each slot has a ring of them (`SlotRing`), a fixed size whatever
the context. A global layer needs every key of its stream: those live in fixed-size blocks of positions taken from
the stage's `BlockPool` as the stream grows and given back when it is released (`PagedKV`), so that memory goes to
the streams that are long, not to a preallocated context per slot. Arrays are zero-filled: pages are committed as
they are written.

Both read a stream's entries start..stop-1 back as keys and values [kv, stop - start, d], entry e holding some
position p, e = p % span (span: the ring's length; a paged stream never wraps).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from cascadia.engine import scratch
from cascadia.engine.rows import BatchError
from cascadia.engine.state_format import StateFormat


class BlockPool:
    """`blocks` blocks of `block` positions for the global layers of one stage, lent to `slots` streams. One table
    serves every global layer: a slot's i-th block holds its positions i * block .. (i + 1) * block - 1 in each."""

    def __init__(self, blocks: int, block: int, slots: int):
        if blocks < 1 or block < 1:
            raise ValueError(f"a K/V pool needs at least one block of at least one position, got {blocks} x {block}")
        self.blocks, self.block = blocks, block
        self._free = list(range(blocks))  # a heap: the lowest free block goes first, so runs are reproducible
        self._tables: list[list[int]] = [[] for _ in range(slots)]

    @property
    def free(self) -> int:
        return len(self._free)

    def held(self, slot: int) -> int:
        return len(self._tables[slot])

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block)

    def grow(self, ends: dict[int, int]) -> None:
        """Give each slot the blocks for its positions 0..end-1; BatchError, before any change, when the pool has
        too few free blocks for all of them."""
        wanted = {slot: self.blocks_for(end) - self.held(slot) for slot, end in ends.items()}
        needed = sum(max(0, n) for n in wanted.values())
        if needed > self.free:
            raise BatchError(f"the K/V pool has {self.free} free blocks of {self.block} positions, these rows need "
                             f"{needed} more")
        for slot, n in wanted.items():
            self._tables[slot] += [heapq.heappop(self._free) for _ in range(n)]

    def release(self, slot: int) -> None:
        for block in self._tables[slot]:
            heapq.heappush(self._free, block)
        self._tables[slot] = []

    def table(self, slots: np.ndarray, n: int) -> np.ndarray:
        """[G, n] the first n blocks of each slot's table (0 past a slot's own: entries its stream never reads)."""
        out = np.zeros((len(slots), n), np.int64)
        for g, slot in enumerate(slots.tolist()):
            own = self._tables[slot][:n]
            out[g, : len(own)] = own
        return out


class SlotRing:
    """A sliding layer's keys and values: per slot a ring [kv, span, d] (entry p % span holds position p)."""

    def __init__(self, slots: int, kv_heads: int, span: int, head_dim: int, fmt: StateFormat):
        self.fmt, self.span = fmt, span
        self.k, self.v = fmt.zeros((slots, kv_heads, span, head_dim)), fmt.zeros((slots, kv_heads, span, head_dim))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [G, n, kv, d] of stream g at positions[g] [G, n]."""
        self.k[slots[:, None], :, positions % self.span] = self.fmt.encode(k)
        self.v[slots[:, None], :, positions % self.span] = self.fmt.encode(v)

    def read(self, slots: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Entries start..stop-1 of each stream's ring, keys and values [G, 1, kv, stop - start, d] in f32."""
        return (self.fmt.decode(self.k[slots, None, :, start:stop]),
                self.fmt.decode(self.v[slots, None, :, start:stop]))


class PagedKV:
    """A global layer's keys and values in its stage's pool: blocks [blocks, kv, block, d]; entry p is position p."""

    span = None  # never wraps

    def __init__(self, pool: BlockPool, kv_heads: int, head_dim: int, fmt: StateFormat):
        self.pool, self.fmt = pool, fmt
        shape = (pool.blocks, kv_heads, pool.block, head_dim)
        self.k, self.v = fmt.zeros(shape), fmt.zeros(shape)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """As `SlotRing.write`; the pool has already given the slots blocks for these positions."""
        block = self.pool.block
        ids = np.take_along_axis(self.pool.table(slots, int(positions.max()) // block + 1), positions // block, 1)
        self.k[ids, :, positions % block] = self.fmt.encode(k)
        self.v[ids, :, positions % block] = self.fmt.encode(v)

    def read(self, slots: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The blocks holding positions start..stop-1 of each stream (start a multiple of the block), keys and
        values [G, blocks, kv, block, d] in f32: views of the store, or this thread's `scratch` arrays, valid until
        its next read."""
        table = self.pool.table(slots, self.pool.blocks_for(stop))[:, start // self.pool.block:]
        first, count = int(table[0, 0]), table.shape[1]
        if len(slots) == 1 and np.array_equal(table[0], np.arange(first, first + count)):
            at = slice(first, first + count)  # one stream's blocks in a row (as one stream alone takes them): views
            keys, values = self.k[None, at], self.v[None, at]
        else:
            shape = table.shape + self.k.shape[1:]
            keys, values = (np.take(stored, table, axis=0, out=scratch.array(f"gathered {name}", shape, stored.dtype))
                            for name, stored in (("keys", self.k), ("values", self.v)))
        return self.fmt.decode(keys, "keys"), self.fmt.decode(values, "values")
