"""Rotary position embeddings as transformers computes them (`modeling_rope_utils`, `LlamaRotaryEmbedding`), in
FP32: inverse frequencies theta^(-2i/d), stretched by the config's scaling (linear: all divided by the factor;
llama3: the low frequencies divided, the high ones kept, a blend between; yarn: a ramp between the frequencies
divided and kept, by dimension, with cos and sin scaled by its attention factor), and each row's q and k rotated by
its own position, rotate_half style (the halves of a head), or in interleaved pairs (DeepSeek-V3's `rope_interleave`:
pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written out evens first as transformers does).

Shapes: T rows, h heads, d head dim.
"""

from __future__ import annotations

import math

import numpy as np

from cascadia.models.rope import YARN, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[d/2] float32, as transformers' rope init functions compute them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if scaling is None:
        return inv
    factor = np.float32(scaling.factor)
    if scaling.rope_type == "linear":
        return inv / factor
    if scaling.rope_type == YARN:
        return _yarn(head_dim, theta, scaling)
    # llama3: by wavelength against the trained context
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelength > context / low, inv / factor, inv)
    smooth = (np.float32(context) / wavelength - np.float32(low)) / np.float32(high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~(wavelength > context / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies (`_compute_yarn_parameters`): the extrapolated theta^(-2i/d) for the fast dimensions, the
    interpolated ones (divided by the factor) for the slow, a linear ramp between the dimensions that turn
    `beta_fast` and `beta_slow` times over the trained context."""
    positions = np.power(np.float32(theta), np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    extrapolated, interpolated = np.float32(1) / positions, np.float32(1) / (np.float32(scaling.factor) * positions)

    def dimension(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(theta))
    low, high = dimension(scaling.beta_fast or 32), dimension(scaling.beta_slow or 1)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = np.float32(1) - ramp.astype(np.float32)
    return (interpolated * (np.float32(1) - kept) + extrapolated * kept).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 mscale ln(factor) + 1 (1 for a factor of at most 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or from its mscales), else 1."""
    if scaling is None or scaling.rope_type != YARN:
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0,
           interleaved: bool = False) -> np.ndarray:
    """x [T, h, d] rotated by each row's position [T], with cos and sin of f = position * inv_freq times `factor`:
    x cos + rotate_half(x) sin over cat(f, f), or each pair (x[2i], x[2i+1]) by f[i], the rotated evens then odds
    (`interleaved`)."""
    freqs = positions.astype(np.float32)[:, None, None] * inv_freq  # [T, 1, d/2]
    cos, sin = np.float32(factor) * np.cos(freqs), np.float32(factor) * np.sin(freqs)
    if interleaved:
        evens, odds = x[..., 0::2], x[..., 1::2]
        return np.concatenate([evens * cos - odds * sin, odds * cos + evens * sin], axis=-1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.concatenate([cos, cos], axis=-1) + rotated * np.concatenate([sin, sin], axis=-1)
