"""The FP32 vector operations of an Inkling layer, in numpy, in the reference's order of operations."""

from __future__ import annotations

import numpy as np

from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (the mean as np.mean takes it, sum / n, without its
    per-call overhead: a decode step makes dozens of these calls on single rows)."""
    variance = np.square(x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def head_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm of rows [T, heads * head_dim] -> [T, heads, head_dim]."""
    return rms_norm(x.reshape(x.shape[0], -1, weight.shape[0]), weight, eps)


def short_conv(y: np.ndarray, taps: np.ndarray, states: np.ndarray, rows: Rows,
               fmt: StateFormat = StateFormat()) -> np.ndarray:
    """Depthwise causal convolution over each slot's history plus the residual: y + conv(y), y [T, C].
    `taps` [K, C], the convolution's weight transposed (tap K-1 meets the current row); `states` [slots, K-1, C],
    the slots' last K-1 inputs stored in `fmt`, is updated in place."""
    group_slots = rows.group_slots
    history = np.concatenate([fmt.decode(states[group_slots]).reshape(-1, y.shape[1]), y])
    conv = (history[rows.conv_taps] * taps).sum(axis=1)
    states[group_slots] = fmt.encode(history[rows.conv_keep])
    return conv + y


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
