"""Weight quantisation in numpy, into the layouts OpenVINO's plugins decompress on the fly.

A matrix `[..., out, in]` is cut along its input dimension into groups; each group keeps one f16 scale (and, when
asymmetric, one zero point). The plugins recognise the NNCF decompression pattern built from these arrays
(`cascadia.exec.ov_ops.weight`) and keep the weights compressed in memory.

A group size that does not divide the input width is replaced by their greatest common divisor (finer groups, never
coarser): tiny test models have widths such as 48 that a group of 32 does not divide; real widths are multiples of
128.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from cascadia.spec.types import WeightFormat


@attrs.frozen(eq=False)
class Quantized:
    """`values` [..., out, groups, group] (int8 for symmetric, uint8 with `zero_point` for asymmetric formats),
    `scale` float16 [..., out, groups, 1]."""

    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the matrix it stands for."""
        *lead, groups, group = self.values.shape
        return (*lead, groups * group)

    def dequantize(self) -> np.ndarray:
        """The float32 matrix the plugins compute with: (values - zero point) * scale."""
        centred = self.values.astype(np.float32)
        if self.zero_point is not None:
            centred -= self.zero_point
        return (centred * self.scale.astype(np.float32)).reshape(self.shape)


def group_size(fmt: WeightFormat, width: int) -> int:
    """Input columns per scale for a matrix of `width` input columns."""
    return width if fmt.group_size is None else math.gcd(fmt.group_size, width)


def quantize(w: np.ndarray, fmt: WeightFormat) -> Quantized:
    """Round-to-nearest integer quantisation of a float matrix (last axis = input) in an integer `fmt`."""
    if not fmt.is_integer:
        raise ValueError(f"quantize: {fmt} is not an integer format")
    *lead, rows, width = w.shape
    g = group_size(fmt, width)
    grouped = w.astype(np.float32, copy=False).reshape(*lead, rows, width // g, g)
    if fmt.symmetric:
        top = 2 ** (fmt.bits - 1) - 1  # symmetric range [-top, top]: no clipping of the largest weight
        scale = _f16_scale(np.abs(grouped).max(axis=-1, keepdims=True) / top)
        values = np.clip(np.rint(grouped / scale), -top, top).astype(np.int8)
        return Quantized(values, scale, None, fmt.bits)
    top = 2 ** fmt.bits - 1
    low = np.minimum(grouped.min(axis=-1, keepdims=True), 0)
    high = np.maximum(grouped.max(axis=-1, keepdims=True), 0)
    scale = _f16_scale((high - low) / top)
    zero_point = np.clip(np.rint(-low / scale), 0, top)
    values = np.clip(np.rint(grouped / scale) + zero_point, 0, top).astype(np.uint8)
    return Quantized(values, scale, zero_point.astype(np.uint8), fmt.bits)


def quantize_stacks(chunks: Iterable[Sequence[np.ndarray]], count: int, fmt: WeightFormat) -> list[Quantized]:
    """`quantize` of several stacks [count, out, in] that arrive together a few experts at a time (each chunk: one
    [n, out, in] slice of every stack), into arrays allocated once: only one chunk is ever held in float32. Groups
    never span experts, so the result is exactly that of quantising each whole stack."""
    stacks: list[Quantized] = []
    start = 0
    for chunk in chunks:
        parts = [quantize(w, fmt) for w in chunk]
        if not stacks:
            stacks = [Quantized(_empty_stack(p.values, count), _empty_stack(p.scale, count),
                                None if p.zero_point is None else _empty_stack(p.zero_point, count), p.bits)
                      for p in parts]
        end = start + len(chunk[0])
        for stack, part in zip(stacks, parts, strict=True):
            stack.values[start:end], stack.scale[start:end] = part.values, part.scale
            if part.zero_point is not None:
                stack.zero_point[start:end] = part.zero_point
        start = end
    if start != count:
        raise ValueError(f"quantize_stacks: the chunks held {start} experts, expected {count}")
    return stacks


def _empty_stack(part: np.ndarray, count: int) -> np.ndarray:
    return np.empty((count, *part.shape[1:]), part.dtype)


def _f16_scale(scale: np.ndarray) -> np.ndarray:
    """Scales as stored (f16); an all-zero (or f16-underflowing) group gets scale 1 so it stays exactly zero."""
    half = scale.astype(np.float16)
    return np.where(half == 0, np.float16(1), half)


def round_to_bf16(w: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of a float32 array, rounded to nearest even as torch does (OpenVINO's own
    cast truncates)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns: a bfloat16 is the top half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
