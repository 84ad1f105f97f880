"""Rotary position embeddings as transformers computes them (`modeling_rope_utils`, `LlamaRotaryEmbedding`), in
FP32: inverse frequencies theta^(-2i/d), stretched by the config's scaling (linear: all divided by the factor;
llama3: the low frequencies divided, the high ones kept, a blend between), and each row's q and k rotated by its own
position, rotate_half style (the halves of a head, not interleaved pairs).

Shapes: T rows, h heads, d head dim.
"""

from __future__ import annotations

import math

import numpy as np

from cascadia.models.rope import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[d/2] float32, as transformers' rope init functions compute them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if scaling is None:
        return inv
    factor = np.float32(scaling.factor)
    if scaling.rope_type == "linear":
        return inv / factor
    # llama3: by wavelength against the trained context
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelength > context / low, inv / factor, inv)
    smooth = (np.float32(context) / wavelength - np.float32(low)) / np.float32(high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~(wavelength > context / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x [T, h, d] rotated by each row's position [T]: x cos + rotate_half(x) sin, with cos and sin of
    cat(f, f), f = position * inv_freq."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq  # [T, d/2]
    angles = np.concatenate([freqs, freqs], axis=1)[:, None, :]  # [T, 1, d]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)
