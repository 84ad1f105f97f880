"""Where a stage keeps its streams' keys and values, in the runtime's `kv_precision` (`StateFormat`): blocks of one
pool per stage (`BlockPool`, cut as `cascadia.graph.costs.PoolLayout` says), lent to the streams that need them, so
that memory goes to the streams that are live and long, not to a preallocated context per slot.

A global layer needs every key of its stream: a stream takes a block as it passes each `kv_block` positions
(`PagedKV`). A sliding layer needs only its window's last keys: a stream takes a ring of a few blocks when it starts,
whatever its length (`PagedRing`). A block is either, and each layer's keys and values are a view of its own bytes
of every block. Both give back their blocks when the stream is released. The pool is zero-filled: pages are
committed as they are written.

A stream can start as a copy of another as it stands (`BlockPool.fork`: the choices of one prompt): the blocks its
positions fill are shared, counted by the streams that hold them, since neither stream writes below the point where
they parted; the block still filling and the rings, which both go on writing, are copied.

Both give the attention kernel a stream's entries start..stop-1 where they lie (`blocks`), entry e holding some
position p, e = p % span (span: the ring's length; a paged stream never wraps); a global layer's can also be
gathered into f32 arrays (`PagedKV.read`, for OpenVINO's fused attention).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from cascadia.engine import scratch
from cascadia.engine.rows import BatchError
from cascadia.engine.state_format import StateFormat
from cascadia.graph.costs import PoolLayout


class BlockPool:
    """`blocks` blocks of `layout.block_bytes` bytes for the attention layers of one stage, lent to `slots` streams.
    A slot's global table serves every global layer (its i-th block holds its positions i * block ..
    (i + 1) * block - 1 in each); its ring table every sliding layer."""

    def __init__(self, blocks: int, layout: PoolLayout, slots: int):
        if blocks < 1:
            raise ValueError(f"a K/V pool needs at least one block, got {blocks}")
        self.blocks, self.layout, self.block = blocks, layout, layout.kv_block
        self.arena = np.zeros((blocks, layout.block_bytes), np.uint8)
        self._taken = 0  # bytes of each block given to the global layers' views
        self._ring_views: tuple[np.ndarray, np.ndarray] | None = None
        self._free = list(range(blocks))  # a heap: the lowest free block goes first, so runs are reproducible
        self._holders = np.zeros(blocks, np.int64)  # streams holding each block (a fork shares its source's)
        self._tables: list[list[int]] = [[] for _ in range(slots)]
        self._rings = np.full((slots, layout.ring_blocks), -1, np.int64)  # each slot's ring blocks (-1: none yet)

    @property
    def free(self) -> int:
        return len(self._free)

    def held(self, slot: int) -> int:
        return len(self._tables[slot]) + len(self._ring_blocks(slot))

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block)

    def _view(self, start: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """[blocks, *shape] of `dtype` from byte `start` of every block: a view of the pool."""
        size = math.prod(shape) * np.dtype(dtype).itemsize
        if start + size > self.layout.block_bytes:
            raise ValueError(f"{size} bytes from byte {start} of a block do not fit the pool's blocks of "
                             f"{self.layout.block_bytes}")
        return self.arena[:, start:start + size].view(dtype).reshape(self.blocks, *shape, copy=False)

    def global_view(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """A global layer's keys or values: the bytes of every block no global layer has yet, and their place in
        `parts`."""
        out = self._view(self._taken, dtype, shape)
        size = out[0].nbytes
        if self._taken % size or self.layout.block_bytes % size:
            raise ValueError(f"a global layer's {size} bytes a block do not divide the pool's blocks of "
                             f"{self.layout.block_bytes} from byte {self._taken}")
        self._taken += size
        return out, (self._taken - size) // size

    def parts(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The pool as [blocks x n, *shape]: block b's part p at b * n + p, one contiguous array (np.take copies a
        strided source whole before it gathers)."""
        return self.arena.view(dtype).reshape(-1, *shape)

    def ring_views(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of a block lent to a ring, the same for every sliding layer (a block serves one)."""
        if self._ring_views is None:
            keys = self._view(0, dtype, shape)
            self._ring_views = keys, self._view(keys[0].nbytes, dtype, shape)
        return self._ring_views

    def grow(self, ends: dict[int, int]) -> None:
        """Give each slot its rings' blocks and the blocks for its positions 0..end-1; BatchError, before any
        change, when the pool has too few free blocks for all of them."""
        layout = self.layout
        rings = {slot: 0 if self._ring_blocks(slot) else layout.ring_blocks for slot in ends}
        wanted = {slot: self.blocks_for(end) - len(self._tables[slot]) if layout.paged else 0
                  for slot, end in ends.items()}
        needed = sum(max(0, n) for n in wanted.values()) + sum(rings.values())
        if needed > self.free:
            raise BatchError(f"the K/V pool has {self.free} free blocks of {self.block} positions, these rows need "
                             f"{needed} more")
        for slot, n in wanted.items():
            self._tables[slot] += self._take(n)
            if rings[slot]:
                self._rings[slot] = self._take(rings[slot])

    def _take(self, n: int) -> list[int]:
        taken = [heapq.heappop(self._free) for _ in range(n)]
        self._holders[taken] = 1
        return taken

    def fork(self, source: int, target: int, length: int) -> None:
        """Give `target` (holding nothing) `source`'s state for its positions 0..length-1: the blocks they fill
        shared, the block holding position `length` (partly filled) and the rings copied, since both streams write
        from `length` on. BatchError, before any change, when the pool has too few free blocks for the copies."""
        full = length // self.block if self.layout.paged else 0
        shared = self._tables[source][:full]
        copied = self._tables[source][full:self.blocks_for(length)] if self.layout.paged else []
        rings = self._ring_blocks(source)
        if len(copied) + len(rings) > self.free:
            raise BatchError(f"the K/V pool has {self.free} free blocks of {self.block} positions, a fork of slot "
                             f"{source} needs {len(copied) + len(rings)}")
        new = self._take(len(copied) + len(rings))
        self.arena[new] = self.arena[copied + rings]
        self._holders[shared] += 1
        self._tables[target] = shared + new[:len(copied)]
        if rings:
            self._rings[target] = new[len(copied):]

    def _ring_blocks(self, slot: int) -> list[int]:
        """The blocks the slot holds for its rings: all of them, or none."""
        return [block for block in self._rings[slot].tolist() if block >= 0]

    def release(self, slot: int) -> None:
        for block in self._tables[slot] + self._ring_blocks(slot):
            self._holders[block] -= 1
            if not self._holders[block]:
                heapq.heappush(self._free, block)
        self._tables[slot] = []
        self._rings[slot] = -1

    def table(self, slots: np.ndarray, n: int) -> np.ndarray:
        """[G, n] the first n blocks of each slot's table (0 past a slot's own: entries its stream never reads)."""
        out = np.zeros((len(slots), n), np.int64)
        for g, slot in enumerate(slots.tolist()):
            own = self._tables[slot][:n]
            out[g, : len(own)] = own
        return out

    def ring_table(self, slots: np.ndarray) -> np.ndarray:
        """[G, ring blocks] each slot's ring blocks, in ring order."""
        return self._rings[slots]


class PagedRing:
    """The keys and values of a stage's `index`-th sliding layer in its pool: each stream's ring of `span` entries
    (entry p % span holds position p) in its ring blocks for the layer, `per_block` entries of [kv, d] a block."""

    def __init__(self, pool: BlockPool, index: int, kv_heads: int, head_dim: int, fmt: StateFormat):
        self.pool, self.fmt = pool, fmt
        layout = pool.layout
        self.per_block, blocks = layout.ring_entries_per_block, layout.ring_layer_blocks
        self.span, self._blocks = self.per_block * blocks, slice(index * blocks, (index + 1) * blocks)
        self.k, self.v = pool.ring_views(fmt.dtype, (kv_heads, self.per_block, head_dim))

    def _table(self, slots: np.ndarray) -> np.ndarray:
        return self.pool.ring_table(slots)[:, self._blocks]

    def write(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [G, n, kv, d] of stream g at positions[g] [G, n]; the pool has already given the slots their rings."""
        entries = positions % self.span
        ids = np.take_along_axis(self._table(slots), entries // self.per_block, 1)
        self.k[ids, :, entries % self.per_block] = self.fmt.encode(k)
        self.v[ids, :, entries % self.per_block] = self.fmt.encode(v)

    def blocks(self, slots: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As `PagedKV.blocks`, for entries start..stop-1 of each stream's ring (start a multiple of `per_block`):
        [blocks, kv, per_block, d] views and [G, b] the ring's blocks holding them."""
        return self.k, self.v, self._table(slots)[:, start // self.per_block:-(-stop // self.per_block)]


class PagedKV:
    """A global layer's keys and values in its stage's pool: blocks [blocks, kv, block, d]; entry p is position p.
    A stream's call of at least `fused_from` rows (a prompt's chunk) reads its far keys gathered, through OpenVINO's
    fused attention (`cascadia.engine.attention`); None: never, every row through the spans a decode step reads.
    With `values_are_keys` (a latent attention's store: DeepSeek-V3 attends over one latent per position, which is
    its key and, in part, its value), the values are the keys themselves, kept once."""

    span = None  # never wraps

    def __init__(self, pool: BlockPool, kv_heads: int, head_dim: int, fmt: StateFormat, fused_from: int | None = None,
                 values_are_keys: bool = False):
        self.pool, self.fmt, self.fused_from = pool, fmt, fused_from
        shape = (kv_heads, pool.block, head_dim)
        self.k, self._k_part = pool.global_view(fmt.dtype, shape)
        self.v, self._v_part = (self.k, self._k_part) if values_are_keys else pool.global_view(fmt.dtype, shape)
        self._parts = pool.parts(fmt.dtype, shape)

    @classmethod
    def alone(cls, blocks: int, block: int, slots: int, kv_heads: int, head_dim: int, fmt: StateFormat,
              fused_from: int | None = None) -> PagedKV:
        """One global layer in a pool of its own (attention timed or checked by itself)."""
        layout = PoolLayout.of(2 * kv_heads * head_dim * fmt.dtype.itemsize, 0, 0, 0, block)
        return cls(BlockPool(blocks, layout, slots), kv_heads, head_dim, fmt, fused_from)

    @property
    def places(self) -> tuple[int, int]:
        """Where the layer's keys and values lie among each block's parts (`BlockPool.parts`)."""
        return self._k_part, self._v_part

    def write(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """As `PagedRing.write`; the pool has already given the slots blocks for these positions."""
        block = self.pool.block
        ids = np.take_along_axis(self.pool.table(slots, int(positions.max()) // block + 1), positions // block, 1)
        self.k[ids, :, positions % block] = self.fmt.encode(k)
        if self.v is not self.k:
            self.v[ids, :, positions % block] = self.fmt.encode(v)

    def blocks(self, slots: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keys and values where they lie, [blocks, kv, block, d] views of the pool in the stored format, and
        [G, b] the blocks holding positions start..stop-1 of each stream (start a multiple of the block)."""
        return self.k, self.v, self.pool.table(slots, self.pool.blocks_for(stop))[:, start // self.pool.block:]

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
            shape, n = table.shape + self.k.shape[1:], len(self._parts) // self.pool.blocks
            keys, values = (np.take(self._parts, table * n + part, axis=0,
                                    out=scratch.array(f"gathered {name}", shape, self.k.dtype))
                            for name, part in (("keys", self._k_part), ("values", self._v_part)))
        return self.fmt.decode(keys, "keys"), self.fmt.decode(values, "values")
