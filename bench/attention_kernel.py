"""The attention kernel alone (`cascadia.engine.paged_kernel.span`): is it at memory speed, or bound by its own work?

Scenario: specs/mid's attention shapes (4 K/V heads of 64 dims, 16 query heads: 4 query rows per K/V head and decode
row), K/V stored as f32 or bf16 in blocks of --kv-block positions (default 64, runtime.kv_block's; specs/mid-long.yaml
takes 256) laid out as a stage's pool lays them (each layer's keys and values strided views of its blocks), one
thread (a pinned node's), decode rows:
  global    one global layer, G streams at context N each, their blocks scattered over the pool as a long-running
            node's are (a random permutation of twice as many blocks)
  ring      one sliding layer's ring of 256 entries (window 128), G streams each at position 100,000
  cached    the same kernel on a context that fits the CPU's caches (1k positions of one stream, called again and
            again): the time per key and head that its own work takes, memory aside
Printed per case: median ms per call (of REPEATS, after a warm-up), the K/V bytes it reads over that time, ns per
key and K/V head, and the bytes' share of a streaming read's bandwidth on one thread (the sum of a 1 GiB array,
best of 3). A memory-bound kernel would read at about that bandwidth and take the same ns per key-head whether its
keys are cached or not. Then its arithmetic: a key and K/V head costs 4 rows x 64 dims multiply-adds to score and as
many to sum its value (1,024 flops), printed as GFLOP/s and as a share of what this CPU's best dense arithmetic does
on one thread (numpy's BLAS multiplying two 512 x 512 f32 matrices, held in the caches: best of 5). Last, what
the long-context target asks of that arithmetic: attention reading K/V at half the streaming read of every core needs
(bandwidth / 2) / (bytes per key-head) x 1,024 flops, shared among the cores; a kernel whose arithmetic must run
near the BLAS's rate to keep up is bound by the CPU, not the memory. Not a test: it prints tables and writes them to
bench/results/attention_kernel.json.

    python bench/attention_kernel.py [--contexts 4096,16384,65536] [--streams 1,8,32] [--repeats 15] [--kv-block 64]
"""

from __future__ import annotations

import cascadia  # noqa: F401  # isort: skip  first: numpy's BLAS reads its thread count (one) when it loads

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
from engine import memory_bandwidth, wall_seconds
from record import Table, now, spread, write

from cascadia.engine import paged_kernel

KV_HEADS, HEAD_DIM, GROUP = 4, 64, 4  # specs/mid's K/V heads and dims, query heads per K/V head
FLOPS_PER_KEY_HEAD = 2 * 2 * GROUP * HEAD_DIM  # a multiply-add per row and dim, to score a key and to sum its value
GEMM_SIZE = 512  # the BLAS reference's square matrices: 3 MiB of f32, in the caches
RING, WINDOW = 256, 128  # a sliding layer's ring of entries, its window
STORED = {"f32": np.float32, "bf16": np.uint16}  # bf16 K/V are kept as their bit patterns


class Case:
    """G streams' decode rows over their blocks: the kernel's arguments, built once."""

    def __init__(self, stored: type, streams: int, block: int, blocks_each: int, ring: int, position: int,
                 rng: np.random.Generator):
        pool = rng.standard_normal((2 * streams * blocks_each, 2, KV_HEADS, block, HEAD_DIM), dtype=np.float32)
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
        self.keys_read = streams * min(blocks_each * block, position + 1)
        self.bytes_read = 2 * self.keys_read * KV_HEADS * HEAD_DIM * pool.itemsize

    def call(self) -> float:
        start = time.perf_counter()
        paged_kernel.span(self.q, self.keys, self.values, self.table, 0, self.ring, self.window, self.positions,
                          self.rel, np.float32(1 / HEAD_DIM), self.top, self.total, self.out)
        return time.perf_counter() - start


def gemm_flops() -> float:
    """Flops/s of this CPU's best dense arithmetic on one thread: numpy's BLAS (one thread: see the import) multiplying
    two GEMM_SIZE-square f32 matrices that stay in the caches, best of 5 rounds of 10."""
    a, b = np.random.default_rng(1).standard_normal((2, GEMM_SIZE, GEMM_SIZE), dtype=np.float32)
    a @ b
    best = min(wall_seconds(lambda: [a @ b for _ in range(10)]) for _ in range(5)) / 10
    return 2 * GEMM_SIZE**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,16384,65536")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kv-block", type=int, default=64, help="positions per K/V block (runtime.kv_block)")
    parser.add_argument("--out", type=Path, help="default bench/results/attention_kernel.json")
    args = parser.parse_args()
    started = now()
    if args.kv_block < 1 or RING % args.kv_block:
        parser.error(f"--kv-block must divide the ring's {RING} entries")
    contexts = [int(n) for n in args.contexts.split(",")]
    counts = [int(g) for g in args.streams.split(",")]
    rng = np.random.default_rng(0)
    for stored in STORED.values():
        paged_kernel.warm_up(stored)
    data = np.ones(2**30 // 8)
    bandwidth, every_core = memory_bandwidth(data, every_core=False), memory_bandwidth(data)
    cores = len(os.sched_getaffinity(0))
    gemm = gemm_flops()
    setting = (f"streaming read {bandwidth / 1e9:.1f} GB/s on one thread, {every_core / 1e9:.1f} on {cores} cores; "
               f"BLAS {gemm / 1e9:.1f} GFLOP/s on one thread; blocks of {args.kv_block}; medians of {args.repeats} "
               "calls")
    print(setting)
    cases = [("cached", 1, 1024), *(("global", 1, n) for n in contexts),
             *(("global", g, contexts[0]) for g in counts if g > 1), *(("ring", g, RING) for g in counts)]
    kernel = Table("The attention kernel alone, one thread",
                   ["layer", "K/V", "streams", "keys each", "ms", "GB/s", "ns per key-head", "of streaming read %",
                    "GFLOP/s", "of BLAS %"], note=setting + ".")
    for name, stored in STORED.items():
        for kind, streams, keys in cases:
            ring = RING if kind == "ring" else 0
            case = Case(stored, streams, args.kv_block, keys // args.kv_block, ring, 100_000 if ring else keys - 1,
                        rng)
            case.call()
            times = [case.call() for _ in range(args.repeats)]
            seconds = statistics.median(times)
            rate = case.bytes_read / seconds
            flops = case.keys_read * KV_HEADS * FLOPS_PER_KEY_HEAD / seconds
            kernel.add(kind, name, streams, keys, spread(t * 1e3 for t in times), rate / 1e9,
                       seconds * 1e9 / (case.keys_read * KV_HEADS), 100 * rate / bandwidth, flops / 1e9,
                       100 * flops / gemm)
    demand = Table(f"What attention at half the streaming read of {cores} cores ({every_core / 2e9:.1f} GB/s) "
                   "asks of each core", ["K/V", "GFLOP/s", "of BLAS %"])
    for name, stored in STORED.items():
        key_heads = every_core / 2 / (2 * HEAD_DIM * np.dtype(stored).itemsize)  # a key and a value of one head
        need = key_heads * FLOPS_PER_KEY_HEAD / cores
        demand.add(name, need / 1e9, 100 * need / gemm)
    print(kernel.text() + "\n\n" + demand.text())
    write("attention_kernel", "The attention kernel alone: at memory speed, or bound by its own work?", started,
          [kernel, demand], args.out)


if __name__ == "__main__":
    main()
