"""Weight quantisation in numpy, into the layouts OpenVINO's plugins decompress on the fly.

A matrix `[..., out, in]` is cut along its input dimension into groups; each group keeps one f16 scale (and, when
asymmetric, one zero point). The plugins recognise the NNCF decompression pattern built from these arrays
(`cascadia.engine.ov_ops.weight`) and keep the weights compressed in memory. 4-bit integers are packed two per byte,
as OpenVINO stores them (`Nibbles`), as soon as they are rounded.

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
class Nibbles:
    """4-bit integers of shape `shape` held two per byte, low nibble first, over the flattened array (an odd count
    ends with a zero nibble): the byte layout of OpenVINO's i4/u4 constants, at half the bytes of one per byte.
    Packed here because OpenVINO's own packing (`ops.constant(values, ov.Type.u4)`) goes through Python lists:
    seconds per layer."""

    data: np.ndarray  # uint8 [ceil(size / 2)]
    shape: tuple[int, ...]
    signed: bool

    @classmethod
    def zeros(cls, shape: tuple[int, ...], signed: bool) -> Nibbles:
        return cls(np.zeros((math.prod(shape) + 1) // 2, np.uint8), tuple(shape), signed)

    def put(self, first: int, values: np.ndarray) -> None:
        """Store int8 (signed) or uint8 `values` in the 4-bit range as entries first, first + 1, ... along axis 0.
        Each entry is stored once into zeros, so a byte that two puts share gets its low nibble from one and its high
        nibble from the other."""
        start = first * math.prod(self.shape[1:])  # flat position of the first value
        flat = values.reshape(-1).view(np.uint8)
        if start % 2 and flat.size:
            self.data[start // 2] |= (flat[0] & 0x0F) << 4
            flat, start = flat[1:], start + 1
        low = flat[0::2] & 0x0F
        self.data[start // 2: start // 2 + low.size] = low
        self.data[start // 2: start // 2 + flat.size // 2] |= flat[1::2] << 4

    def unpack(self) -> np.ndarray:
        """The values one per byte: int8 (sign-extended) or uint8."""
        return self._values(0, math.prod(self.shape)).reshape(self.shape)

    def entry(self, index: int) -> Nibbles:
        """Entry `index` along axis 0, packed on its own."""
        size = math.prod(self.shape[1:])
        return Nibbles.of(self._values(index * size, (index + 1) * size).reshape(self.shape[1:]), self.signed)

    @classmethod
    def of(cls, values: np.ndarray, signed: bool) -> Nibbles:
        """int8 (signed) or uint8 `values` in the 4-bit range, packed."""
        packed = cls.zeros(values.shape, signed)
        packed.put(0, values)
        return packed

    def _values(self, start: int, stop: int) -> np.ndarray:
        """Flat values start..stop-1, one per byte."""
        data = self.data[start // 2: (stop + 1) // 2]
        nibbles = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(-1)[start % 2: start % 2 + stop - start]
        return ((nibbles ^ 8).astype(np.int8) - 8) if self.signed else nibbles  # 8..15 -> -8..-1


Ints = np.ndarray | Nibbles


@attrs.frozen(eq=False)
class Quantized:
    """`values` [..., out, groups, group], signed for symmetric formats, unsigned with `zero_point` [..., out, groups,
    1] for asymmetric ones; `scale` float16 [..., out, groups, 1]. 8-bit integers are int8/uint8 arrays, 4-bit ones
    `Nibbles`."""

    values: Ints
    scale: np.ndarray
    zero_point: Ints | None
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the matrix it stands for."""
        *lead, groups, group = self.values.shape
        return (*lead, groups * group)

    def entry(self, index: int) -> Quantized:
        """The matrix at `index` along axis 0 of a stack (an expert)."""
        return Quantized(_entry(self.values, index), self.scale[index], _entry(self.zero_point, index), self.bits)

    @classmethod
    def concat(cls, parts: Sequence[Quantized]) -> Quantized:
        """Matrices of the same input width and format stacked along their output rows (gate over up)."""
        first = parts[0]

        def joined(arrays: list[Ints]) -> Ints:
            if isinstance(arrays[0], Nibbles):
                return Nibbles.of(np.concatenate([a.unpack() for a in arrays]), arrays[0].signed)
            return np.concatenate(arrays)

        zero_point = None if first.zero_point is None else joined([p.zero_point for p in parts])
        return cls(joined([p.values for p in parts]), np.concatenate([p.scale for p in parts]), zero_point,
                   first.bits)

    def dequantize(self) -> np.ndarray:
        """The float32 matrix the plugins compute with: (values - zero point) * scale."""
        centred = _one_per_byte(self.values).astype(np.float32)
        if self.zero_point is not None:
            centred -= _one_per_byte(self.zero_point)
        return (centred * self.scale.astype(np.float32)).reshape(self.shape)


def group_size(fmt: WeightFormat, width: int) -> int:
    """Input columns per scale for a matrix of `width` input columns."""
    return width if fmt.group_size is None else math.gcd(fmt.group_size, width)


def quantize(w: np.ndarray, fmt: WeightFormat) -> Quantized:
    """Round-to-nearest integer quantisation of a float matrix (last axis = input) in an integer `fmt`."""
    return quantize_stacks([(w,)], len(w), fmt)[0]


def quantize_stacks(chunks: Iterable[Sequence[np.ndarray]], count: int, fmt: WeightFormat) -> list[Quantized]:
    """`quantize` of several arrays [count, ...] (stacks of experts, or the rows of one matrix) that arrive together
    a few entries along axis 0 at a time (each chunk: one [n, ...] slice of every array), into arrays allocated
    once: only one chunk is ever held in float32, and 4-bit values are packed chunk by chunk. Groups never span
    entries, so the result is exactly that of quantising each whole array."""
    if not fmt.is_integer:
        raise ValueError(f"quantize: {fmt} is not an integer format")
    stacks: list[Quantized] = []
    start = 0
    for chunk in chunks:
        parts = [_round(w, fmt) for w in chunk]  # (values, scale, zero point) of each array
        if not stacks:
            stacks = [Quantized(*(_empty(a, count, fmt.bits) for a in part), fmt.bits) for part in parts]
        for stack, part in zip(stacks, parts, strict=True):
            for into, a in zip((stack.values, stack.scale, stack.zero_point), part, strict=True):
                if a is not None:
                    _put(into, start, a)
        start += len(chunk[0])
    if start != count:
        raise ValueError(f"quantize_stacks: the chunks held {start} entries along axis 0, expected {count}")
    return stacks


def _round(w: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Values (int8, or uint8 with zero points), f16 scales and uint8 zero points (asymmetric formats) of `w`."""
    *lead, rows, width = w.shape
    g = group_size(fmt, width)
    grouped = w.astype(np.float32, copy=False).reshape(*lead, rows, width // g, g)
    if fmt.symmetric:
        top = 2 ** (fmt.bits - 1) - 1  # symmetric range [-top, top]: no clipping of the largest weight
        scale = _f16_scale(np.abs(grouped).max(axis=-1, keepdims=True) / top)
        return np.clip(np.rint(grouped / scale), -top, top).astype(np.int8), scale, None
    top = 2 ** fmt.bits - 1
    low = np.minimum(grouped.min(axis=-1, keepdims=True), 0)
    high = np.maximum(grouped.max(axis=-1, keepdims=True), 0)
    scale = _f16_scale((high - low) / top)
    zero_point = np.clip(np.rint(-low / scale), 0, top)
    values = np.clip(np.rint(grouped / scale) + zero_point, 0, top).astype(np.uint8)
    return values, scale, zero_point.astype(np.uint8)


def _empty(part: np.ndarray | None, count: int, bits: int) -> Ints | None:
    """Room for `count` entries along axis 0 like those of `part`: 4-bit integers as `Nibbles` (zeros, as `put`
    needs), f16 scales and 8-bit integers as arrays."""
    if part is None:
        return None
    shape = (count, *part.shape[1:])
    if bits == 4 and part.dtype.kind in "iu":
        return Nibbles.zeros(shape, part.dtype == np.int8)
    return np.empty(shape, part.dtype)


def _put(into: Ints, first: int, part: np.ndarray) -> None:
    if isinstance(into, Nibbles):
        into.put(first, part)
    else:
        into[first: first + len(part)] = part


def _entry(ints: Ints | None, index: int) -> Ints | None:
    if ints is None:
        return None
    return ints.entry(index) if isinstance(ints, Nibbles) else ints[index]


def _one_per_byte(ints: Ints) -> np.ndarray:
    return ints.unpack() if isinstance(ints, Nibbles) else ints


def _f16_scale(scale: np.ndarray) -> np.ndarray:
    """Scales as stored (f16); an all-zero (or f16-underflowing) group gets scale 1 so it stays exactly zero."""
    half = scale.astype(np.float16)
    return np.where(half == 0, np.float16(1), half)


def round_to_bf16(w: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of a float32 array, rounded to nearest even as torch does (OpenVINO's own
    cast truncates)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (into `out`, float32 of their shape, if given): a bfloat16 is the top
    half of a float32. One pass, widening as it shifts (a cast then a shift takes ten times as long on 4 MiB of keys:
    two fresh arrays to fault in)."""
    return np.left_shift(bits, 16, dtype=np.uint32, out=None if out is None else out.view(np.uint32)).view(np.float32)
