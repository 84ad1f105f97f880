"""How a stage keeps per-stream state (K/V rings, short-convolution histories): in f32, f16, or bf16 (the runtime's
`kv_precision`). Stored compactly, read back as f32: all arithmetic on state stays in f32, as in the reference.
numpy has no bfloat16, so bf16 state is held as its bit patterns in uint16 (rounded to nearest even)."""

from __future__ import annotations

import attrs
import numpy as np

from cascadia.engine import scratch
from cascadia.engine.quantize import bf16_to_f32, round_to_bf16

_STORED = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


@attrs.frozen
class StateFormat:
    precision: str = attrs.field(default="f32", validator=attrs.validators.in_(tuple(_STORED)))

    @property
    def dtype(self) -> np.dtype:
        """How values are stored."""
        return np.dtype(_STORED[self.precision])

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, self.dtype)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """f32 values as stored (f32: the same array)."""
        if self.precision == "f32":
            return x
        return round_to_bf16(x) if self.precision == "bf16" else x.astype(np.float16)

    def decode(self, stored: np.ndarray, scratch_role: str | None = None) -> np.ndarray:
        """Stored values as f32 (f32: the same array, never a copy), widened into this thread's `scratch` array for
        `scratch_role` if one is named (valid until the thread asks for that role again)."""
        if self.precision == "f32":
            return stored
        out = None if scratch_role is None else scratch.array(scratch_role, stored.shape, np.float32)
        if self.precision == "bf16":
            return bf16_to_f32(stored, out)
        if out is None:
            return stored.astype(np.float32)
        np.copyto(out, stored)
        return out
