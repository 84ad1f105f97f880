"""The host-side parts every family's layer shares, in FP32 as the references compute them: RMSNorm (whole rows and
per head), softmax and log-sigmoid, a router's logits (`router_logits`) and choice (`Routing`), and the per-row factor
of the FP32 restoration around compressed MLP blocks (`row_factor`; `cascadia.engine.families.inkling` says how the
restoration works). Each computes a row the same way whatever rows share its call, so that a stream's tokens do not
depend on what the engine computes beside it.

Shapes: T rows of one call, H hidden, k routed experts per row, S shared experts.
"""

from __future__ import annotations

import attrs
import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (the mean as np.mean takes it, sum / n, without its
    per-call overhead: a decode step makes dozens of these calls on single rows)."""
    variance = np.square(x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def head_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm of rows [T, heads * d] -> [T, heads, d]."""
    return rms_norm(x.reshape(x.shape[0], -1, weight.shape[0]), weight, eps)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def router_logits(h: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """h [T, H] against a router's weight [E, H] -> [T, E], each row as a product of its own: one BLAS call over all
    the rows picks its kernel, and so its rounding, by their count, and a row's experts and weights would then
    depend on the rows beside it (by a few units in the last place, enough to flip a near tie)."""
    return np.matmul(h[:, None, :], weight.T)[:, 0]


@attrs.frozen
class Routing:
    """A router's choice for each row of a call."""

    index: np.ndarray  # [T, k] int32 routed experts of each row
    weights: np.ndarray  # [T, k] their weights
    shared_weights: np.ndarray  # [T, S] weights of the shared experts


def row_factor(*weights: np.ndarray) -> np.ndarray:
    """F [T, 1] = 2^ceil(log2 max(1, sum |w|)) over all of a row's routing weights: dividing them by F keeps the
    weighted sum of expert outputs no larger than the largest expert output (the FP32 restoration multiplies
    it back on the host)."""
    total = sum(np.abs(w).sum(axis=1, keepdims=True) for w in weights)
    return np.exp2(np.ceil(np.log2(np.maximum(total, 1)))).astype(np.float32)
