"""One span of a layer's attention, computed block by block straight from the K/V pool by a compiled kernel.

A decode row reads every key and value of its stream once and does four multiply-adds with each (four query heads
share a K/V head), so its attention should run at the memory's speed. numpy cannot: a span of 4,096 keys is 256
matmuls of 4 x 64 by 64 x 64 (one per block and K/V head), each paying a call's fixed cost, and bf16 keys are widened
into a copy before they are multiplied. This kernel (numba, compiled when an engine warms up and cached on disk)
walks a span's blocks where they lie in the pool: for each block and K/V head it scores the keys against four
query rows at a time (each key and value loaded serves four rows), folds each row's scores into its running softmax
(the flash-attention rescaling) and accumulates the values into the outputs, widening each stored element to f32 in
a register as it multiplies it (a block widened into a buffer first cost a quarter more), so each stored byte is read
from memory once. It releases the GIL, so the spans run on the attention thread pool.

A global layer's entry e is position e, so a row at position p sees a prefix of each block, and most blocks whole
and beyond the relative bias's bank; a sliding layer's ring holds the latest position with each entry's remainder,
and a row sees those within its window. Masked keys score -inf, whose exponential is 0. Every block is walked
whole, a global layer's entries past its stream's last row masked too (unwritten, or another stream's old finite
values: their weight is 0), so a row's sums take the same steps whether the call ends at its own position (a decode
step) or further on (a prompt's chunk, a replay), and a replayed stream gets its decode steps' results bit for bit.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

_HALF_REBIAS = np.float32(2.0 ** 112)  # 2^(127 - 15): a half's exponent bits, shifted, as a float32's

# Reassociation lets the compiler vectorise the sums; no "fast" flag that assumes finite values, as a row's running
# maximum starts at -inf.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@intrinsic
def _f32_of_bits(typingctx, bits):
    """The float32 whose bit pattern is `bits` (a uint32)."""
    return types.float32(types.uint32), lambda context, builder, signature, args: builder.bitcast(
        args[0], ir.FloatType())


def _widen(stored):
    """One stored key or value element as f32."""
    raise NotImplementedError("compiled only: see the overload below")


@overload(_widen, inline="always")
def _widen_of(stored):
    if stored == types.float32:
        return lambda stored: stored
    if stored == types.uint16:  # bf16 bit patterns: the top half of a float32
        return lambda stored: _f32_of_bits(np.uint32(stored) << np.uint32(16))
    if stored == types.int16:  # IEEE half bit patterns (numba has no float16 on the CPU); finite ones exactly
        def widen_f16(stored):
            # exponent and mantissa moved into a float32's place, rebiased (15 -> 127) by a product, which
            # normalises subnormals; then the sign, copied (a branch here made numba warn when it compiled)
            magnitude = _f32_of_bits(np.uint32(stored & np.int16(0x7FFF)) << np.uint32(13)) * _HALF_REBIAS
            return np.copysign(magnitude, np.float32(stored))
        return widen_f16
    raise TypeError(f"no widening of {stored} keys to f32")


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _score(q0: np.ndarray, q1: np.ndarray, q2: np.ndarray, q3: np.ndarray, keys: np.ndarray, count: int,
           scale: np.float32, s0: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray) -> None:
    """s_r[:count] = (keys[:count] . q_r) * scale for four query rows, two keys at a time: each key load serves four
    rows, each query load two keys, and the eight sums stay in registers even on AVX2's sixteen (four keys' sixteen
    sums spilled to the stack there: 1.4-1.5x the time; one row at a time cost a quarter more)."""
    d = q0.shape[0]
    whole = count - count % 2
    for j in range(0, whole, 2):
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = np.float32(0)
        for t in range(d):
            k0, k1 = _widen(keys[j, t]), _widen(keys[j + 1, t])
            a00 += q0[t] * k0
            a01 += q0[t] * k1
            a10 += q1[t] * k0
            a11 += q1[t] * k1
            a20 += q2[t] * k0
            a21 += q2[t] * k1
            a30 += q3[t] * k0
            a31 += q3[t] * k1
        s0[j], s0[j + 1] = a00 * scale, a01 * scale
        s1[j], s1[j + 1] = a10 * scale, a11 * scale
        s2[j], s2[j + 1] = a20 * scale, a21 * scale
        s3[j], s3[j + 1] = a30 * scale, a31 * scale
    for j in range(whole, count):
        a0 = a1 = a2 = a3 = np.float32(0)
        for t in range(d):
            k = _widen(keys[j, t])
            a0 += q0[t] * k
            a1 += q1[t] * k
            a2 += q2[t] * k
            a3 += q3[t] * k
        s0[j], s1[j], s2[j], s3[j] = a0 * scale, a1 * scale, a2 * scale, a3 * scale


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _accumulate(w0: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, values: np.ndarray, count: int,
                o0: np.ndarray, o1: np.ndarray, o2: np.ndarray, o3: np.ndarray) -> None:
    """o_r += w_r[:count] @ values[:count] for four rows, two values at a time: each value load serves four rows,
    each load and store of an output two values."""
    d = o0.shape[0]
    whole = count - count % 2
    for j in range(0, whole, 2):
        w00, w01, w10, w11 = w0[j], w0[j + 1], w1[j], w1[j + 1]
        w20, w21, w30, w31 = w2[j], w2[j + 1], w3[j], w3[j + 1]
        for t in range(d):
            v0, v1 = _widen(values[j, t]), _widen(values[j + 1, t])
            o0[t] += w00 * v0 + w01 * v1
            o1[t] += w10 * v0 + w11 * v1
            o2[t] += w20 * v0 + w21 * v1
            o3[t] += w30 * v0 + w31 * v1
    for j in range(whole, count):
        for t in range(d):
            v = _widen(values[j, t])
            o0[t] += w0[j] * v
            o1[t] += w1[j] * v
            o2[t] += w2[j] * v
            o3[t] += w3[j] * v


_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH, _LN2_LOW = np.float32(0.693145751953125), np.float32(1.428606765330187e-06)  # ln 2 = high + low, high exact
_FLUSHED = np.int32(-(2**31))  # in place of 2^k: the result is 0
_EXP = tuple(np.float32(1 / math.factorial(i)) for i in range(8))  # e^r, Taylor to degree 7


@numba.njit(nogil=True, fastmath=_FAST - {"reassoc"}, cache=True)  # reassociating would undo the split of ln 2
def _exp_shifted(scores: np.ndarray, count: int, shift: np.float32, powers: np.ndarray) -> None:
    """scores[:count] = exp(scores[:count] - shift) (scores <= shift, -inf for a masked key), in loops the compiler
    vectorises (a call to the C library's expf per score cost as much as the rest of a block): e^x = 2^k e^r, k the
    nearest integer to x log2(e), r = x - k ln 2 (|r| <= ln(2) / 2, with ln 2 in two parts so that r keeps its bits),
    e^r a polynomial of degree 7 (within 1e-8 of it), 2^k added to the result's exponent bits. Below e^-87 (about a
    float32's least normal) the result is 0, as it is for a masked key."""
    for j in range(count):
        x = scores[j] - shift
        kept = x > np.float32(-87)
        x = max(x, np.float32(-87))
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = (x - k * _LN2_HIGH) - k * _LN2_LOW
        c = _EXP
        scores[j] = c[0] + r * (c[1] + r * (c[2] + r * (c[3] + r * (c[4] + r * (c[5] + r * (c[6] + r * c[7]))))))
        powers[j] = np.int32(k) << 23 if kept else _FLUSHED
    bits = scores.view(np.int32)
    for j in range(count):
        bits[j] = bits[j] + powers[j] if powers[j] != _FLUSHED else 0


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _mask_and_bias(scores: np.ndarray, key_positions: np.ndarray, count: int, position: int, reach: int,
                   bias: np.ndarray) -> bool:
    """For a row at `position`: -inf where a key is not seen (unwritten, after the row, or `reach` or more before
    it), the bias per distance added where it is within the bank; whether the row sees any of the keys."""
    seen = False
    for j in range(count):
        distance = position - key_positions[j]
        if key_positions[j] < 0 or distance < 0 or distance >= reach:
            scores[j] = -np.inf
        else:
            seen = True
            if distance < bias.shape[0]:
                scores[j] += bias[distance]
    return seen


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _fold(scores: np.ndarray, count: int, r: int, top: np.ndarray, total: np.ndarray, out: np.ndarray,
          powers: np.ndarray) -> None:
    """Fold row r's scores[:count] of a block into its running softmax (top[r], total[r], out[r]): rescale what it
    has to a new maximum, and leave exp(score - max) in scores, the weights of the block's values."""
    best = top[r]
    for j in range(count):
        best = max(best, scores[j])
    if best > top[r]:
        shrink = np.exp(top[r] - best)
        total[r] *= shrink
        out[r] *= shrink
        top[r] = best
    _exp_shifted(scores, count, best, powers)
    added = np.float32(0)
    for j in range(count):
        added += scores[j]
    total[r] += added


def span(q: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray, first_entry: int, ring: int,
         window: int, positions: np.ndarray, rel: np.ndarray, scale: np.float32, top: np.ndarray, total: np.ndarray,
         out: np.ndarray) -> None:
    """`_span` (below) on keys and values stored as f32, bf16 bits (uint16) or f16, the last passed as their bits;
    the small arrays made contiguous, as the kernel is compiled (at warm-up) for them."""
    if keys.dtype == np.float16:
        keys, values = keys.view(np.int16), values.view(np.int16)
    _span(np.ascontiguousarray(q), keys, values, np.ascontiguousarray(table, np.int64), first_entry, ring, window,
          np.ascontiguousarray(positions, np.int64), np.ascontiguousarray(rel), scale, top, total, out)


@numba.njit(nogil=True, fastmath=_FAST, cache=True)
def _span(q: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray, first_entry: int, ring: int,
          window: int, positions: np.ndarray, rel: np.ndarray, scale: np.float32, top: np.ndarray, total: np.ndarray,
          out: np.ndarray) -> None:
    """Attention of G streams' rows over their blocks `table` [G, b] of one layer, block i of stream g holding its
    entries first_entry + i B ..: q [G, kv, (h/kv) n, d] (query head j of K/V head k's rows at j n ..), keys and
    values [blocks, kv, B, d] (f32, bf16 bits in uint16, f16 bits in int16), rows' positions [G, n], rel
    [G, n, h, X] (bias per distance, already log-scaled). A global layer's entry e holds position e (`ring` 0); a
    sliding layer's ring of `ring` entries holds at entry e the latest position p <= the stream's last row's with
    p % ring = e (none yet where p < 0). A row at position p sees keys at p - window < k <= p (`window` 0: k <= p).
    Writes the scores' max per row [G, kv, (h/kv) n] (-inf where a row sees none of these keys), the sum of
    exp(score - max) and the unnormalised output [G, kv, (h/kv) n, d]."""
    streams, kv_heads, rows = q.shape[:3]
    block = keys.shape[2]
    n = positions.shape[1]
    group, extent = rows // n, rel.shape[3]
    # rows go through a block in fours; where the last four are short, the last row stands in for the missing ones
    # with its weights zeroed, so they add nothing to it
    scores = np.zeros((rows + 3 - (rows + 3) % 4, block), np.float32)
    powers, key_positions = np.empty(block, np.int32), np.empty(block, np.int64)
    top[:] = -np.inf
    total[:] = 0
    out[:] = 0
    for g in range(streams):
        last = positions[g, n - 1]
        reach = window if window > 0 else last + 1
        for i in range(table.shape[1]):
            base = first_entry + i * block
            if not ring and base > last:
                break
            # every entry of a block, those past `last` (unwritten) masked: a row's sums then take the same steps
            # whatever the last row of its stream in the call, so a replayed chunk computes a row as its decode step
            count = block
            for j in range(count):
                key_positions[j] = last - (last - base - j) % ring if ring else base + j
            for h in range(kv_heads):
                block_keys = np.ascontiguousarray(keys[table[g, i], h])
                block_values = np.ascontiguousarray(values[table[g, i], h])
                qs, outs = q[g, h], out[g, h]
                for c in range(0, rows, 4):
                    r1, r2, r3 = min(c + 1, rows - 1), min(c + 2, rows - 1), min(c + 3, rows - 1)
                    _score(qs[c], qs[r1], qs[r2], qs[r3], block_keys, count, scale, scores[c], scores[c + 1],
                           scores[c + 2], scores[c + 3])
                    seeing = 0
                    for r in range(c, min(c + 4, rows)):
                        row = r % n
                        position = positions[g, row]
                        # a global layer's block that the row sees whole and beyond the bias bank needs neither
                        if (ring or position - (base + count - 1) < extent) and not _mask_and_bias(
                                scores[r], key_positions, count, position, reach, rel[g, row, h * group + r // n]):
                            scores[r, :count] = 0
                            continue
                        seeing += 1
                        _fold(scores[r], count, r, top[g, h], total[g, h], outs, powers)
                    if seeing:
                        scores[rows:c + 4, :count] = 0
                        _accumulate(scores[c], scores[c + 1], scores[c + 2], scores[c + 3], block_values, count,
                                    outs[c], outs[r1], outs[r2], outs[r3])


def warm_up(stored: np.dtype) -> None:
    """Compile (or load from the disk cache) the kernel for keys and values stored as `stored`, now: a first
    compile takes seconds, and holds the GIL, so that a node would not answer its heartbeats mid-request."""
    q = np.zeros((1, 1, 1, 8), np.float32)
    keys = np.zeros((2, 2, 1, 4, 8), stored)[:, 0]  # strided over two blocks, as a pool's layer views are
    top, total, out = np.empty((1, 1, 1), np.float32), np.empty((1, 1, 1), np.float32), np.empty_like(q)
    span(q, keys, keys, np.zeros((1, 1), np.int64), 0, 0, 0, np.zeros((1, 1), np.int64),
         np.zeros((1, 1, 1, 1), np.float32), np.float32(1), top, total, out)
