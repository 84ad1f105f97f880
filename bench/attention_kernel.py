"""The attention kernel alone (`cascadia.engine.paged_kernel.span`): is it at memory speed, or bound by its own work?

Scenario: specs/mid's attention shapes (4 K/V heads of 64 dims, 16 query heads: 4 query rows per K/V head and decode
row), K/V stored as f32 or bf16 in blocks of 64 positions laid out as a stage's pool lays them (each layer's keys
and values strided views of its blocks), one thread (a pinned node's), decode rows:
  global    one global layer, G streams at context N each, their blocks scattered over the pool as a long-running
            node's are (a random permutation of twice as many blocks)
  ring      one sliding layer's ring of 256 entries (window 128), G streams each at position 100,000
  cached    the same kernel on a context that fits the CPU's caches (1k positions of one stream, called again and
            again): the time per key and head that its own work takes, memory aside
Printed per case: median ms per call (of REPEATS, after a warm-up), the K/V bytes it reads over that time, ns per
key and K/V head, and the bytes' share of a streaming read's bandwidth on one thread (the sum of a 1 GiB array,
best of 3). A memory-bound kernel would read at about that bandwidth and take the same ns per key-head whether its
keys are cached or not. Not a test: it prints a table.

    python bench/attention_kernel.py [--contexts 4096,16384,65536] [--streams 1,8,32] [--repeats 15]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import statistics
import time

import numpy as np
from engine import memory_bandwidth

from cascadia.engine import paged_kernel
from cascadia.host_cpus import describe, identity
from cascadia.table import format_rows

KV_HEADS, HEAD_DIM, GROUP, BLOCK = 4, 64, 4, 64  # specs/mid's K/V heads and dims, query heads per K/V head
RING, WINDOW = 256, 128  # a sliding layer's ring of entries, its window
STORED = {"f32": np.float32, "bf16": np.uint16}  # bf16 K/V are kept as their bit patterns


class Case:
    """G streams' decode rows over their blocks: the kernel's arguments, built once."""

    def __init__(self, stored: type, streams: int, blocks_each: int, ring: int, position: int,
                 rng: np.random.Generator):
        pool = rng.standard_normal((2 * streams * blocks_each, 2, KV_HEADS, BLOCK, HEAD_DIM), dtype=np.float32)
        if stored is np.uint16:
            pool = (pool.view(np.uint32) >> 16).astype(np.uint16)
        self.keys, self.values = pool[:, 0], pool[:, 1]  # strided, as a pool's layer views are
        self.table = rng.permutation(len(pool))[:streams * blocks_each].reshape(streams, blocks_each)
        self.ring, self.window = ring, WINDOW if ring else 0
        self.q = rng.standard_normal((streams, KV_HEADS, GROUP, HEAD_DIM), dtype=np.float32)
        self.positions = np.full((streams, 1), position, np.int64)
        self.rel = np.zeros((streams, 1, KV_HEADS * GROUP, 256), np.float32)
        self.top, self.total = np.empty((2, streams, KV_HEADS, GROUP), np.float32)
        self.out = np.empty_like(self.q)
        self.keys_read = streams * min(blocks_each * BLOCK, position + 1)
        self.bytes_read = 2 * self.keys_read * KV_HEADS * HEAD_DIM * pool.itemsize

    def call(self) -> float:
        start = time.perf_counter()
        paged_kernel.span(self.q, self.keys, self.values, self.table, 0, self.ring, self.window, self.positions,
                          self.rel, np.float32(1 / HEAD_DIM), self.top, self.total, self.out)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,16384,65536")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    contexts = [int(n) for n in args.contexts.split(",")]
    counts = [int(g) for g in args.streams.split(",")]
    rng = np.random.default_rng(0)
    for stored in STORED.values():
        paged_kernel.warm_up(stored)
    bandwidth = memory_bandwidth(np.ones(2**30 // 8), every_core=False)
    print(f"{describe(identity())}; streaming read {bandwidth / 1e9:.1f} GB/s on one thread; "
          f"medians of {args.repeats} calls")
    cases = [("cached", 1, 1024), *(("global", 1, n) for n in contexts),
             *(("global", g, contexts[0]) for g in counts if g > 1), *(("ring", g, RING) for g in counts)]
    rows = [("layer", "K/V", "streams", "keys each", "ms", "GB/s", "ns per key-head", "of streaming read")]
    for name, stored in STORED.items():
        for kind, streams, keys in cases:
            ring = RING if kind == "ring" else 0
            case = Case(stored, streams, keys // BLOCK, ring, 100_000 if ring else keys - 1, rng)
            case.call()
            seconds = statistics.median(case.call() for _ in range(args.repeats))
            rate = case.bytes_read / seconds
            rows.append((kind, name, str(streams), str(keys), f"{seconds * 1e3:.2f}", f"{rate / 1e9:.1f}",
                         f"{seconds * 1e9 / (case.keys_read * KV_HEADS):.1f}", f"{rate / bandwidth:.0%}"))
    print(format_rows(rows, left={0, 1}))


if __name__ == "__main__":
    main()
