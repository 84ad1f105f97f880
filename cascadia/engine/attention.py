"""Attention over a stream's keys and values, in spans of keys on a thread pool, with the relative-position bias
only where it is non-zero.

A long context is read once per row of a call: at 64k positions the keys and values of one global layer are
megabytes, so attention is memory-bound. The keys are cut into spans of SPAN_KEYS entries; each span's scores,
exponentials and partial output are computed apart (a span's keys stay in cache between the two matmuls), on as
many threads as this process may use (numpy releases the GIL in matmuls and ufuncs), and the spans are combined as
the softmax of their union (the flash-attention rescaling: each span's sum and output times exp(its max - the max)).
The bias bank covers distances 0..X-1 only: spans wholly farther from every row add none, so a stream at 64k
positions gathers the bias of its last X keys, not of all of them. Log-scaling multiplies the queries and the bank
at each row's own position.

Shapes: G streams of n rows each, h query heads, kv key/value heads, d head dim, X bias extent, m keys, s a span's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import attrs
import numpy as np

from cascadia.engine.kv_store import PagedKV, SlotRing

KeyStore = SlotRing | PagedKV
SPAN_KEYS = 4096  # keys per span: 4096 x 64 dims of f32 keys and values are 2 MiB, about a core's share of L3


@attrs.frozen
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # keys at distance >= window are masked (sliding layers); None = causal only
    bias_extent: int  # the relative-bias bank covers distances 0 .. bias_extent-1; zero beyond
    log_scaling: tuple[int, float] | None  # (n_floor, alpha) on global layers that scale queries and bias


def log_scale(positions: np.ndarray, n_floor: int, alpha: float) -> np.ndarray:
    """tau(p) = 1 + alpha * log(max((p + 1) / n_floor, 1)), in FP32 as the reference."""
    ratio = (positions + 1).astype(np.float32) / np.float32(n_floor)
    return np.float32(1) + np.float32(alpha) * np.log(np.maximum(ratio, np.float32(1)))


@cache
def _threads() -> ThreadPoolExecutor:
    """One pool for every layer, as wide as the CPUs this process may run on (a pinned node's, on a fleet)."""
    return ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="attention")


def attend(shape: AttentionShape, q: np.ndarray, k: np.ndarray, v: np.ndarray, rel: np.ndarray, store: KeyStore,
           slots: np.ndarray, first: np.ndarray) -> np.ndarray:
    """G streams' n rows each (all decode rows of a call at once, n = 1, or a prefill chunk), stream g's at
    positions first[g]..: q [G, n, h, d], k/v [G, n, kv, d], rel [G, n, h, X] (bias per distance) -> attention
    output [G, n, h * d]. Writes the new keys and values into the layer's `store` first (stream g's at `slots[g]`).

    A sliding layer's ring keeps window - 1 + (most rows per call) entries, so that writing a chunk never overwrites
    a key an earlier row of the same chunk still sees; a global layer's paged store never wraps. Keys are attended
    in entry order (softmax does not care); each key's position, for the mask and the bias, follows from its entry.
    A stream reads the first m entries, m the most any of the G has filled, and masks the entries it has not filled
    itself."""
    streams, n = q.shape[:2]
    positions = first[:, None] + np.arange(n)  # [G, n]
    store.write(slots, positions, k, v)
    last = first + n - 1
    ring = store.span or int(last.max()) + 1
    filled = np.minimum(ring, last + 1)
    if shape.log_scaling is not None:
        tau = log_scale(positions, *shape.log_scaling)[:, :, None, None]  # [G, n, 1, 1]
        q, rel = q * tau, rel * tau
    # Query head i reads kv head i // (h / kv): group the queries of one kv head as rows of one matmul.
    grouped_q = q.transpose(0, 2, 1, 3).reshape(streams, shape.kv_heads, -1, shape.head_dim)  # [G, kv, (h/kv) n, d]
    step = SPAN_KEYS if store.span is not None else max(1, SPAN_KEYS // store.pool.block) * store.pool.block
    spans = [(start, min(start + step, int(filled.max()))) for start in range(0, int(filled.max()), step)]

    def span(bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _span(shape, grouped_q, rel, store, slots, positions, last, ring, filled, *bounds)
    parts = [span(spans[0])] if len(spans) == 1 else list(_threads().map(span, spans))
    top = np.maximum.reduce([p[0] for p in parts])  # [G, kv, h/kv, n]
    weights = [np.exp(p[0] - top) for p in parts]
    total = sum(w * p[1] for w, p in zip(weights, parts))
    out = sum(w[..., None] * p[2] for w, p in zip(weights, parts)) / total[..., None]  # [G, kv, h/kv, n, d]
    return out.reshape(streams, shape.heads, n, shape.head_dim).transpose(0, 2, 1, 3).reshape(streams, n, -1)


def _span(shape: AttentionShape, grouped_q: np.ndarray, rel: np.ndarray, store: KeyStore, slots: np.ndarray,
          positions: np.ndarray, last: np.ndarray, ring: int, filled: np.ndarray, start: int, stop: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries start..stop-1 of every stream (and any more the store returns with them: past stop, they are past
    every stream's filled entries): the scores' max per row [G, kv, h/kv, n] (0 where a row sees none of them),
    the sum of exp(score - max) [G, kv, h/kv, n] and the unnormalised output [G, kv, h/kv, n, d].

    Keys come as b runs of B entries [G, b, kv, B, d] (a paged store's blocks, without copying them into one
    run), scores as [G, b, kv, h/kv, n, B]. A span that every row sees whole, beyond the bias bank (most of a long
    context), needs neither mask nor bias."""
    streams, n = positions.shape
    kv_heads, group = shape.kv_heads, shape.heads // shape.kv_heads
    keys, values = store.read(slots, start, stop)
    runs, run = keys.shape[1], keys.shape[3]
    scores = (grouped_q[:, None] @ keys.transpose(0, 1, 2, 4, 3)).reshape(streams, runs, kv_heads, group, n, run)
    scores *= np.float32(1 / shape.head_dim)  # q and k are RMS-normalised: 1/d, not 1/sqrt(d)
    # the least distance from a row to a key: a paged store's entries are positions, a ring's wrap (take 0)
    nearest = int(positions[:, 0].min()) - (start + runs * run - 1) if store.span is None else 0
    if shape.window is not None or nearest < shape.bias_extent:
        entries = start + np.arange(runs * run)
        key_positions = last[:, None] - (last[:, None] - entries) % ring  # [G, s]
        distance = positions[:, :, None] - key_positions[:, None, :]  # [G, n, s]

        def by_run(x: np.ndarray) -> np.ndarray:  # [G, n, ..., s] -> [G, b, ..., n, B]
            x = x.reshape(*x.shape[:-1], runs, run)
            return np.moveaxis(x, (1, -2), (-2, 1))
        if nearest < shape.bias_extent:
            in_bank = (distance >= 0) & (distance < shape.bias_extent)
            bias = np.take_along_axis(rel, np.clip(distance, 0, shape.bias_extent - 1)[:, :, None, :], axis=3)
            bias = np.where(in_bank[:, :, None], bias, np.float32(0))  # [G, n, h, s]
            scores += by_run(bias.reshape(streams, n, kv_heads, group, -1))
        allowed = (distance >= 0) & (entries < filled[:, None])[:, None, :]
        if shape.window is not None:
            allowed &= distance < shape.window
        scores = np.where(by_run(allowed[:, :, None, None]), scores, -np.inf)
    top = scores.max(axis=(1, 5), keepdims=True)
    top[np.isneginf(top)] = 0  # a row that sees none of these keys: every exponential below is 0
    exps = np.exp(scores - top)
    out = (exps.reshape(streams, runs, kv_heads, group * n, run) @ values).sum(axis=1)
    return top[:, 0, ..., 0], exps.sum(axis=(1, 5)), out.reshape(streams, kv_heads, group, n, shape.head_dim)
