"""The compiled kernel that attends a global layer's blocks where they lie in the pool
(cascadia/engine/paged_kernel.py), against a dense softmax in float64 over the same stored keys, and its parts: the
vectorised exponential and the widening of 16-bit keys."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from cascadia.engine import attention, paged_kernel
from cascadia.engine.attention import AttentionShape, log_scale
from cascadia.engine.kv_store import BlockPool, PagedKV, PagedRing
from cascadia.engine.state_format import StateFormat
from cascadia.graph.costs import PoolLayout

SHAPE = AttentionShape(8, 2, 24, None, 40, (64, 0.4), 1 / 24)  # 4 query heads a K/V head, head dim not a power of two
# 3 rows a K/V head and decode row; dim not 8's multiple
THREE_A_HEAD = AttentionShape(6, 2, 12, None, 40, (64, 0.4), 1 / 12)
WIDE = AttentionShape(8, 2, 64, None, 40, (64, 0.4), 1 / 64)  # specs/mid's head dim: whole vectors, no remainder
LLAMA = AttentionShape(6, 2, 16, None, 0, None, 16 ** -0.5)  # no bias bank, no log scaling, scores by d^-0.5
BLOCK = 16


def dense_attention(shape: AttentionShape, q: np.ndarray, rel: np.ndarray, keys: np.ndarray, values: np.ndarray,
                    first: int) -> np.ndarray:
    """One stream's n rows at first.. over its keys and values [positions, kv, d] (the rows' own included), in
    float64, a sliding layer's window applied: q [n, h, d], rel [n, h, X] -> [n, h d]."""
    n, heads, d = q.shape
    positions = first + np.arange(n)
    scaling = shape.log_scaling
    tau = (log_scale(positions, *scaling) if scaling else np.ones(n)).astype(np.float64)[:, None, None]
    group = heads // shape.kv_heads
    k, v = (np.repeat(x.astype(np.float64), group, axis=1) for x in (keys, values))  # [m, h, d]
    scores = np.einsum("nhd,mhd->nhm", q * tau, k) * shape.scale
    distance = positions[:, None] - np.arange(len(keys))[None, :]  # [n, m]
    if shape.bias_extent:
        bias = np.take_along_axis(rel * tau, np.clip(distance, 0, shape.bias_extent - 1)[:, None, :], axis=2)
        scores += np.where((distance >= 0) & (distance < shape.bias_extent), 1.0, 0.0)[:, None, :] * bias
    seen = (distance >= 0) & (distance < (shape.window or len(keys)))
    scores = np.where(seen[:, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("nhm,mhd->nhd", weights, v).reshape(n, -1)


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("shape", [SHAPE, THREE_A_HEAD, WIDE, LLAMA],
                         ids=["4 a K/V head", "3 a K/V head", "head dim 64", "llama"])
def test_streams_on_scattered_blocks_match_a_dense_softmax(precision, rows, shape, monkeypatch):
    """Three streams at 37, 300 and 1,000 positions (their last blocks partly filled), blocks interleaved as streams
    that grow together take them, in spans of 3 blocks on the thread pool: decode rows, and 5 rows of a chunk (each
    row sees a different prefix of the last block); 4 and 3 query heads a K/V head (the kernel takes query rows in
    fours: 3 leaves the last four short). Within 2e-6 of the largest output (f32 rounding)."""
    monkeypatch.setattr(attention, "SPAN_KEYS", 3 * BLOCK)
    first, slots = np.array([37, 300, 1000]), np.array([2, 0, 1])
    fmt = StateFormat(precision)
    store = PagedKV.alone(3 * (1000 + rows) // BLOCK + 6, BLOCK, 3, shape.kv_heads, shape.head_dim, fmt)
    rng = np.random.default_rng(1)
    history = rng.standard_normal((3, 1000, shape.kv_heads, shape.head_dim), np.float32)
    for start in range(0, 1000, 50):
        for g, slot in enumerate(slots):
            at = np.arange(start, min(start + 50, first[g]))[None]
            if at.size:
                store.pool.grow({int(slot): int(at.max()) + 1})
                keys = history[g][at[0]][None]
                store.write(np.array([slot]), at, keys, keys * 0.5 - 1)
    store.pool.grow({int(slot): int(first[g]) + rows for g, slot in enumerate(slots)})
    table = store.pool.table(slots[2:], 1000 // BLOCK)[0]
    assert not np.array_equal(table, table[0] + np.arange(len(table)))  # not in a row
    q = rng.standard_normal((3, rows, shape.heads, shape.head_dim), np.float32) * 3
    k, v = rng.standard_normal((2, 3, rows, shape.kv_heads, shape.head_dim), np.float32)
    rel = rng.standard_normal((3, rows, shape.heads, shape.bias_extent), np.float32)
    out = attention.attend(shape, q, k, v, rel, store, slots, first)
    for g, slot in enumerate(slots):
        keys, values = store.read(slots[g:g + 1], 0, int(first[g]) + rows)  # as stored: [1, b, kv, B, d]
        keys, values = (x[0].transpose(0, 2, 1, 3).reshape(-1, shape.kv_heads, shape.head_dim) for x in (keys, values))
        expected = dense_attention(shape, q[g], rel[g], keys[:first[g] + rows], values[:first[g] + rows], int(first[g]))
        assert np.abs(out[g] - expected).max() <= 2e-6 * np.abs(expected).max()


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_sliding_layers_wrapped_rings_match_a_dense_softmax_in_its_window(precision, rows):
    """Three streams' rings of 32 entries (blocks of 8; window 24, bias bank 40) at 10, 31 and 300 positions: one
    not yet full, one about to wrap, one wrapped nine times; decode rows and 5-row chunks."""
    shape = AttentionShape(8, 2, 24, 24, 40, None, 1 / 24)
    fmt = StateFormat(precision)
    entry_bytes = 2 * shape.kv_heads * shape.head_dim * fmt.dtype.itemsize
    layout = PoolLayout.of(0, entry_bytes, 1, shape.window - 1 + rows, 8)
    ring = PagedRing(BlockPool(3 * layout.ring_blocks, layout, 3), 0, shape.kv_heads, shape.head_dim, fmt)
    first, slots = np.array([10, 31, 300]), np.array([1, 2, 0])
    ring.pool.grow({int(slot): 1 for slot in slots})
    rng = np.random.default_rng(2)
    history = rng.standard_normal((2, 3, 300 + rows, shape.kv_heads, shape.head_dim), np.float32)
    for g, slot in enumerate(slots):
        for start in range(0, int(first[g]), 7):
            at = np.arange(start, min(start + 7, first[g]))[None]
            ring.write(np.array([slot]), at, history[0, g][at[0]][None], history[1, g][at[0]][None])
    q = rng.standard_normal((3, rows, shape.heads, shape.head_dim), np.float32) * 3
    rel = rng.standard_normal((3, rows, shape.heads, shape.bias_extent), np.float32)
    new = np.stack([history[:, g, first[g]:first[g] + rows] for g in range(3)], axis=1)  # [2, G, n, kv, d]
    out = attention.attend(shape, q, new[0], new[1], rel, ring, slots, first)
    stored = fmt.decode(fmt.encode(history))  # what the ring holds: rounded to its format
    for g in range(3):
        end = int(first[g]) + rows
        expected = dense_attention(shape, q[g], rel[g], stored[0, g, :end], stored[1, g, :end], int(first[g]))
        assert np.abs(out[g] - expected).max() <= 2e-6 * np.abs(expected).max()


def test_a_row_that_sees_none_of_a_spans_keys_gets_nothing_from_it():
    """Rows at positions 3 and 4 against a span of entries 16..31: the scores' max -inf, the sum 0, the output 0."""
    q = np.ones((1, 1, 2, 8), np.float32)
    keys = np.ones((4, 1, 16, 8), np.float32)
    top, total = np.full((2, 1, 1, 2), 7, np.float32)
    out = np.full(q.shape, 7, np.float32)
    paged_kernel.span(q, keys, keys, np.array([[1]]), 16, 0, 0, np.array([[3, 4]]), np.zeros((1, 2, 1, 4), np.float32),
                      np.float32(1), top, total, out)
    assert np.isneginf(top).all() and not total.any() and not out.any()


def test_the_exponential_is_within_float32_rounding_of_numpys():
    """e^(x - max) for x from 120 below the max to the max itself: within 1.5e-7 relative (numpy's own float32
    exponential is within 1 ulp); below e^-87, and for a masked key's -inf, 0."""
    x = np.r_[np.linspace(-120, 0, 100_000, dtype=np.float32), np.float32(-np.inf)]
    scores = x.copy()
    paged_kernel._exp_shifted(scores, len(x), np.float32(0), np.empty(len(x), np.int32))
    kept = x > -87
    expected = np.exp(x[kept].astype(np.float64))
    assert np.abs(scores[kept] / expected - 1).max() <= 1.5e-7  # 7e-8 measured; numpy's float32 exp 1.9e-7
    assert not scores[~kept].any()


@pytest.mark.parametrize("stored", ["f16", "bf16"])
def test_every_finite_16_bit_value_widens_exactly(stored):
    """Every finite f16 bit pattern (subnormals and both zeros included), and every finite bf16 one, widens to the
    f32 numpy gives."""
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    if stored == "f16":
        exact = bits.view(np.float16).astype(np.float32)
        bits = bits.view(np.int16)  # as `paged_kernel.span` passes f16 keys
    else:
        exact = StateFormat("bf16").decode(bits)
    finite = np.isfinite(exact)

    @numba.njit
    def widen(stored: np.ndarray) -> np.ndarray:
        out = np.empty(stored.shape, np.float32)
        for i in range(len(stored)):
            out[i] = paged_kernel._widen(stored[i])
        return out
    np.testing.assert_array_equal(widen(bits[finite]), exact[finite])


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_warm_up_compiles_the_kernel_a_pools_views_call(precision):
    """After `warm_up`, attention over a pool's strided layer views finds its compiled kernel: no compile (seconds,
    holding the GIL) on a node's first request."""
    fmt = StateFormat(precision)
    paged_kernel.warm_up(fmt.dtype)
    compiled = len(paged_kernel._span.signatures)
    store = PagedKV.alone(4, BLOCK, 1, SHAPE.kv_heads, SHAPE.head_dim, fmt)
    store.pool.grow({0: 3})
    q = np.ones((1, 1, SHAPE.heads, SHAPE.head_dim), np.float32)
    k = np.ones((1, 1, SHAPE.kv_heads, SHAPE.head_dim), np.float32)
    rel = np.zeros((1, 1, SHAPE.heads, SHAPE.bias_extent), np.float32)
    attention.attend(SHAPE, q, k, k, rel, store, np.array([0]), np.array([2]))
    assert len(paged_kernel._span.signatures) == compiled
