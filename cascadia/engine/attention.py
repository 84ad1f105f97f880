"""Attention over a stream's keys and values, in spans of keys on a thread pool, with the relative-position bias
only where it is non-zero; where the runtime asks, a prompt's chunk reads its far keys through OpenVINO's fused
attention.

A long context is read once per row of a call: at 64k positions the keys and values of one global layer are
megabytes, so attention is memory-bound. A stream's entries are cut into spans at every SPAN_KEYS-th entry, the same
cuts whatever else its call holds, so that its rows' sums take the same steps alone or beside other streams (at bf16
a different cut would round differently, and a request's tokens would depend on the server's load). A call's spans,
each over a part of its streams (as many parts as keep every thread busy), are computed apart on as many threads as
this process may use, and each stream's spans are combined, in order, as the softmax of their union (the
flash-attention rescaling: each span's sum and output times exp(its max - the max); a span the stream does not
reach adds exact zeros). A span is computed by a compiled kernel (`paged_kernel`) straight from the pool's blocks, a
global layer's or a sliding layer's ring's, and releases the GIL. The bias bank covers distances 0..X-1 only: the
kernel adds it to a row's last X keys alone. Log-scaling multiplies the queries and the bank at each row's own
position.

A chunk of a long prompt is compute-bound: its scores are rows x keys, which the kernel computes a row at a time.
Where the runtime asks for it (`fused_attention_from`: a stream's chunk of that many rows or more, on a global
layer; off by default, as it makes a row's result depend on where its prompt was cut into chunks, which a server's
load decides), the keys that every row of the chunk sees whole, beyond the bias bank (all but the last few
hundred), need neither mask nor bias, and OpenVINO's ScaledDotProductAttention computes them as blocked matrix
products, without writing the scores out. It returns a normalised output, not the softmax's sum, so the spans' part
(the nearest keys) enters it as one more key, a sink: its score is their log-sum-exp (a column the queries gain,
against the sink key's 1 there; the other keys' 0) and its value is 1 in a column of its own (the other values' 0).
That column of the output is the near part's share of the whole softmax, and the other columns are the far keys'
part already weighted by theirs: output = far part + share x near output, exact to f32 rounding (about 1e-6 of the
output against the spans alone). Far keys go in pieces of FUSED_KEYS (bounding the copies into that layout), each
folding the ones before into its sink.

Shapes: G streams of n rows each, h query heads, kv key/value heads, d head dim, X bias extent, m keys, s a span's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import attrs
import numpy as np
import openvino as ov
import openvino.opset13 as ops

from cascadia.engine import paged_kernel, scratch
from cascadia.engine.device import compile_options, core
from cascadia.engine.kv_store import PagedKV, PagedRing
from cascadia.engine.rows import Rows
from cascadia.host_cpus import available

KeyStore = PagedRing | PagedKV
SPAN_KEYS = 4096  # entries per span of a stream: a few MiB of keys and values
TASK_KEYS = 1024  # a call's streams are split among tasks only where each part still reads this many entries: below,
# a task's fixed cost (its Python call, its share of the merge) outweighs what a second thread saves
FUSED_KEYS = 32768  # far keys per fused call


@attrs.frozen
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # keys at distance >= window are masked (sliding layers); None = causal only
    bias_extent: int  # the relative-bias bank covers distances 0 .. bias_extent-1; zero beyond (0: no bank)
    log_scaling: tuple[int, float] | None  # (n_floor, alpha) on global layers that scale queries and bias
    scale: float  # of the scores q.k (Inkling's q and k are RMS-normalised: 1/d; Llama's d^-0.5)
    values_are_keys: bool = False  # a latent's store: each position's value is its key (`PagedKV`)


def log_scale(positions: np.ndarray, n_floor: int, alpha: float) -> np.ndarray:
    """tau(p) = 1 + alpha * log(max((p + 1) / n_floor, 1)), in FP32 as the reference."""
    ratio = (positions + 1).astype(np.float32) / np.float32(n_floor)
    return np.float32(1) + np.float32(alpha) * np.log(np.maximum(ratio, np.float32(1)))


@cache
def _width() -> int:
    """How many CPUs this process may run on (a pinned node's, on a fleet)."""
    return len(available())


@cache
def _threads() -> ThreadPoolExecutor:
    """One pool for every layer, as wide as the CPUs this process may run on."""
    return ThreadPoolExecutor(_width(), thread_name_prefix="attention")


def attend_rows(shape: AttentionShape, q: np.ndarray, k: np.ndarray, v: np.ndarray, rel: np.ndarray,
                store: KeyStore, rows: Rows) -> np.ndarray:
    """The rows of one call, q [T, h, d], k and v [T, kv, d], rel [T, h, X] -> attention output [T, h d]: streams
    with as many rows in the call go to `attend` together (all decode rows at once)."""
    out = np.empty((len(q), shape.heads * shape.head_dim), np.float32)
    for count in np.unique(rows.counts).tolist():
        groups = np.flatnonzero(rows.counts == count)
        part = rows.starts[groups][:, None] + np.arange(count)  # [G, n] rows of these streams
        out[part] = attend(shape, q[part], k[part], v[part], rel[part], store, rows.group_slots[groups],
                           rows.positions[rows.starts[groups]])
    return out


def attend(shape: AttentionShape, q: np.ndarray, k: np.ndarray, v: np.ndarray, rel: np.ndarray, store: KeyStore,
           slots: np.ndarray, first: np.ndarray) -> np.ndarray:
    """G streams' n rows each (all decode rows of a call at once, n = 1, or a prefill chunk), stream g's at
    positions first[g]..: q [G, n, h, d], k/v [G, n, kv, d], rel [G, n, h, X] (bias per distance) -> attention
    output [G, n, h * d]. Writes the new keys and values into the layer's `store` first (stream g's at `slots[g]`).

    A sliding layer's ring keeps window - 1 + (most rows per call) entries, so that writing a chunk never overwrites
    a key an earlier row of the same chunk still sees; a global layer's paged store never wraps. Keys are attended
    in entry order (softmax does not care); each key's position, for the mask and the bias, follows from its entry.
    A stream reads the first m entries, m the most any of the G has filled, and masks the entries it has not filled
    itself. A prompt's chunk of the store's `fused_from` rows or more (a global layer's) reads its far keys fused
    (see the module's text), one stream at a time."""
    streams, n = q.shape[:2]
    positions = first[:, None] + np.arange(n)  # [G, n]
    store.write(slots, positions, k, v)
    if shape.log_scaling is not None:
        tau = log_scale(positions, *shape.log_scaling)[:, :, None, None]  # [G, n, 1, 1]
        q, rel = q * tau, rel * tau
    # Query head i reads kv head i // (h / kv): group the queries of one kv head as rows of one matmul.
    grouped_q = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(streams, shape.kv_heads, -1, shape.head_dim))
    rel = np.ascontiguousarray(rel)  # both as the kernel is compiled for: [G, kv, (h/kv) n, d] and [G, n, h, X]
    far = _far_keys(shape, store, first, n)
    if not far.any():
        top, total, out = _spans(shape, grouped_q, rel, store, slots, positions, 0)
        out /= total[..., None]
    else:
        out = np.concatenate([_fused(shape, grouped_q[g], store, int(slots[g]), int(far[g]),
                                     *_spans(shape, grouped_q[g, None], rel[g, None], store, slots[g, None],
                                             positions[g, None], int(far[g])))
                              for g in range(streams)])
    return out.reshape(streams, shape.heads, n, shape.head_dim).transpose(0, 2, 1, 3).reshape(streams, n, -1)


def _spans(shape: AttentionShape, grouped_q: np.ndarray, rel: np.ndarray, store: KeyStore, slots: np.ndarray,
           positions: np.ndarray, begin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries begin..(each stream's last)-1 in spans on the thread pool, each stream's combined: the scores' max
    per row [G, kv, h/kv, n], the sum of exp(score - max) and the unnormalised output [G, kv, h/kv, n, d]."""
    ends = positions[:, -1] + 1 if store.span is None else np.minimum(store.span, positions[:, -1] + 1)
    block = store.pool.block if store.span is None else store.per_block
    step = max(1, SPAN_KEYS // block) * block
    cuts = range(begin - begin % step, int(ends.max()), step)
    spans = [(max(cut, begin), min(cut + step, int(ends.max()))) for cut in cuts]
    parts = _stream_parts(np.minimum(ends - begin, step), sum(stop - start == step for start, stop in spans))
    tasks = [(span, part) for span in spans for part in parts]

    def task(bounds: tuple[int, int], part: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # arrays of its own: a running max and sum that threads update in one cache line would slow both
        top, total = np.empty((2, *grouped_q[part].shape[:3]), np.float32)
        out = np.empty(grouped_q[part].shape, np.float32)
        paged_kernel.span(grouped_q[part], *store.blocks(slots[part], *bounds), bounds[0], store.span or 0,
                          shape.window or 0, positions[part], rel[part], np.float32(shape.scale), top, total, out)
        return top, total, out
    done = [task(*tasks[0])] if len(tasks) == 1 else list(_threads().map(lambda args: task(*args), tasks))
    if len(parts) > 1:  # each span's parts joined, its streams in order
        done = [tuple(map(np.concatenate, zip(*done[k:k + len(parts)]))) for k in range(0, len(done), len(parts))]
    top, total, out = done[0]
    if len(done) > 1:  # the spans combined in order, as a stream's spans are the same in every call
        top = np.maximum.reduce([span[0] for span in done])  # a span a row does not reach: max -inf, sum 0
        top[np.isneginf(top)] = 0  # a row that sees no key at all: weights 0, not exp(-inf + inf)
        total, out = np.zeros_like(total), np.zeros_like(out)
        for span_top, span_total, span_out in done:
            weight = np.exp(span_top - top)
            total += weight * span_total
            out += weight[..., None] * span_out
    group = (*grouped_q.shape[:2], shape.heads // shape.kv_heads, -1)
    return top.reshape(group), total.reshape(group), out.reshape(*group, shape.head_dim)


def _stream_parts(entries: np.ndarray, whole_spans: int) -> list[slice]:
    """The streams of a call in consecutive parts, each a task of every span: as many as give every thread a whole
    span's task (a call's last span may be a few entries) where each part still reads TASK_KEYS entries a span
    (`entries`: each stream's per span)."""
    streams = len(entries)
    wanted = -(-_width() // max(1, whole_spans))
    count = max(1, min(streams, wanted, int(entries.sum()) // TASK_KEYS))
    return [slice(streams * part // count, streams * (part + 1) // count) for part in range(count)]


def _far_keys(shape: AttentionShape, store: KeyStore, first: np.ndarray, rows: int) -> np.ndarray:
    """[G] entries 0..far-1 of each stream that every one of its `rows` rows sees whole, beyond the bias bank (a
    global layer's positions up to first - bias_extent), in whole blocks, where the store reads them fused; else 0."""
    if store.span is not None or store.fused_from is None or rows < store.fused_from:
        return np.zeros(len(first), np.int64)
    block = store.pool.block
    return np.maximum(first - shape.bias_extent + 1, 0) // block * block


def _fused(shape: AttentionShape, grouped_q: np.ndarray, store: PagedKV, slot: int, far: int, top: np.ndarray,
           total: np.ndarray, near: np.ndarray) -> np.ndarray:
    """One stream's attention [1, kv, h/kv, n, d] from the spans' part over its entries far.. (`top`, `total`,
    `near`: `_spans`' for this stream) and its entries 0..far-1 through the fused attention, a piece at a time
    (see the module's text)."""
    kv, d = shape.kv_heads, shape.head_dim
    queries = grouped_q.shape[1]  # (h/kv) n
    out = (near / total[..., None]).reshape(kv, queries, d)
    lse = (top + np.log(total)).reshape(kv, queries)
    q = np.zeros((1, kv, queries, d + 1), np.float32)
    q[0, :, :, :d] = grouped_q
    step = max(1, FUSED_KEYS // store.pool.block) * store.pool.block
    for start in range(0, far, step):
        keys, values = store.read(np.array([slot]), start, min(start + step, far))  # [1, b, kv, B, d]
        blocks, block = keys.shape[1], keys.shape[3]
        k, v = (scratch.array(f"fused {name}", (1, kv, blocks * block + 1, d + 1), np.float32) for name in "kv")
        for padded, stored in ((k, keys), (v, values)):
            padded[0, :, :-1, :d].reshape(kv, blocks, block, d)[...] = stored[0].transpose(1, 0, 2, 3)
            padded[0, :, :-1, d] = 0
            padded[0, :, -1] = 0
            padded[0, :, -1, d] = 1  # the sink: key 1 against the queries' log-sum-exp; value 1 in its own column
        q[0, :, :, d] = lse * np.float32(1 / shape.scale)  # the attention scales the scores
        piece = _fused_attention(kv, d + 1, shape.scale)(q, k, v)  # [1, kv, (h/kv) n, d + 1]
        share = piece[0, :, :, d]  # of the keys before this piece
        out = piece[0, :, :, :d] + share[..., None] * out
        lse -= np.log(share)
    return out.reshape(1, kv, shape.heads // kv, -1, d)


@cache
def _fused_attention(kv_heads: int, width: int, scale: float):
    """OpenVINO's ScaledDotProductAttention in f32 for q [1, kv, rows, width], k and v [1, kv, keys, width], scores
    scaled by `scale`, on this process's CPUs; a callable of the three arrays returning its output, valid until the
    next call."""
    params = [ops.parameter([1, kv_heads, -1, width], ov.Type.f32, name=name) for name in "qkv"]
    scale = ops.constant(np.float32(scale))
    model = ov.Model([ops.scaled_dot_product_attention(*params, scale=scale)], params, "attention")
    request = core().compile_model(model, "CPU", compile_options("f32", _width())
                                   ).create_infer_request()

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        request.infer({"q": q, "k": k, "v": v}, share_inputs=True)
        return request.get_output_tensor(0).data
    return run
