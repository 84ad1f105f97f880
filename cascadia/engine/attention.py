"""Inkling attention over per-slot K/V rings, on the host in FP32.

Why the host: each stream has its own context length, sliding and global layers keep different spans, and the
relative-position bias is a gather by distance; per stream, numpy does this exactly with no padding to the longest
context and no recompilation, while the weight-heavy projections around it run in OpenVINO. Decode attention is a
small part of a step's work next to reading the layer's weights.

K/V ring of a slot: R entries [kv_heads, R, head_dim]; position p lives at entry p % R. A global layer's ring is
the whole context budget (it never wraps). A sliding layer keeps window - 1 + (most rows per call) entries: enough
that writing a chunk never overwrites a key an earlier row of the same chunk still sees. Attention runs over the
ring's filled entries in ring order (softmax does not care about key order); each key's position, needed for the
mask and the bias, follows from its entry.
"""

from __future__ import annotations

import attrs
import numpy as np

from cascadia.engine.host_ops import softmax
from cascadia.engine.state_format import StateFormat


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


def attend(shape: AttentionShape, q: np.ndarray, k: np.ndarray, v: np.ndarray, rel: np.ndarray,
           ring_k: np.ndarray, ring_v: np.ndarray, first: int, fmt: StateFormat = StateFormat()) -> np.ndarray:
    """Rows of one slot at positions first.. (n rows): q [n, H, d], k/v [n, KV, d], rel [n, H, extent] (bias per
    distance) -> attention output [n, H * d]. Writes the new keys and values into the slot's ring (stored in `fmt`)
    first."""
    n, ring = q.shape[0], ring_k.shape[1]
    positions = first + np.arange(n)
    ring_k[:, positions % ring] = fmt.encode(k.transpose(1, 0, 2))
    ring_v[:, positions % ring] = fmt.encode(v.transpose(1, 0, 2))
    last = first + n - 1
    filled = min(ring, last + 1)
    key_positions = last - (last - np.arange(filled)) % ring
    distance = positions[:, None] - key_positions[None, :]  # [n, m]

    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    in_bank = (distance >= 0) & (distance < shape.bias_extent)
    bias = rel.transpose(1, 0, 2)[:, np.arange(n)[:, None], np.clip(distance, 0, shape.bias_extent - 1)]
    bias = np.where(in_bank, bias, np.float32(0))  # [H, n, m]
    if shape.log_scaling is not None:
        tau = log_scale(positions, *shape.log_scaling)
        q = q * tau[:, None, None]
        bias = bias * tau[None, :, None]

    # Query head h reads kv head h // (H / KV): group the queries of one kv head as rows of one matmul.
    grouped_q = q.transpose(1, 0, 2).reshape(kv_heads, -1, head_dim)  # [KV, rep * n, d]
    scores = (grouped_q @ fmt.decode(ring_k[:, :filled]).transpose(0, 2, 1)).reshape(heads, n, filled)
    scores = scores * np.float32(1 / head_dim) + bias  # q and k are RMS-normalised: 1/d, not 1/sqrt(d)
    allowed = distance >= 0
    if shape.window is not None:
        allowed &= distance < shape.window
    probs = softmax(np.where(allowed, scores, -np.inf)).reshape(kv_heads, -1, filled)
    out = (probs @ fmt.decode(ring_v[:, :filled])).reshape(heads, n, head_dim)
    return out.transpose(1, 0, 2).reshape(n, heads * head_dim)
