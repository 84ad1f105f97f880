"""FP32 output restoration for low-precision expert arithmetic (the paper's FP16 scheme).

FP16 overflows above 65504. Before the low-precision part, large values are scaled down by powers of two, and the
FP32 host multiplies the result back, which is exact in every precision (short of underflow):
- per layer, the up projections are divided by A = 2^n, which divides silu(gate) * up, the down projection and the
  layer's output by A;
- per row, the routing weights are divided by F = 2^ceil(log2 max(1, sum |w|)), so the weighted sum of expert
  outputs is no larger than the largest expert output.

A is chosen from the weights alone: the typical magnitude of up, silu(gate) * up and down for an input of unit RMS
(before the norm's weight) is estimated from row norms, and A brings the largest of them down to at most 2^7,
which leaves 2^9 of headroom for outliers below FP16's limit and 2^21 above its smallest normal number.
"""

from __future__ import annotations

import math

import numpy as np

TYPICAL_CEILING_LOG2 = 7


def _largest_row_norm(w: np.ndarray) -> float:
    """Largest L2 norm of a row of [..., out, in] (no temporary the size of w)."""
    return math.sqrt(float(np.einsum("...i,...i->...", w, w).max()))


def up_divisor(gate: np.ndarray, up: np.ndarray, down: np.ndarray, norm_weight: np.ndarray) -> float:
    """A = 2^n >= 1 for a SwiGLU (or experts [E, ...]) fed by an RMSNorm with weight `norm_weight`."""
    gain = float(np.abs(norm_weight).max())
    gate_size, up_size = _largest_row_norm(gate) * gain, _largest_row_norm(up) * gain
    product = gate_size * up_size  # |silu(g)| <= |g|
    largest = max(up_size, product, _largest_row_norm(down) * product)
    return float(2.0 ** max(0, math.ceil(math.log2(max(largest, 1.0))) - TYPICAL_CEILING_LOG2))


def row_factor(*weights: np.ndarray) -> np.ndarray:
    """F [T, 1] = 2^ceil(log2 max(1, sum |w|)) over all of a row's routing weights."""
    total = sum(np.abs(w).sum(axis=1, keepdims=True) for w in weights)
    return np.exp2(np.ceil(np.log2(np.maximum(total, 1)))).astype(np.float32)
