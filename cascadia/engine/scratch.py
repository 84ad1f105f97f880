"""Per-thread arrays reused call after call, for temporaries of megabytes that a call fills whole and drops.

A fresh array of megabytes faults its pages in on every call (the allocator hands large blocks back to the system
when they are freed), and in this project's VM that costs more than filling them: one global layer's decode row at
64k positions with bf16 keys and values, widened to f32 into fresh arrays, took 46 ms against 21 ms widened into
reused ones (the same process, alternating). Each role keeps one buffer per thread, grown to the largest size asked
for; an array from `array` is valid until the same thread asks for the same role again.
"""

from __future__ import annotations

import math
import threading

import numpy as np


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.by_role: dict[str, np.ndarray] = {}


_buffers = _Buffers()


def array(role: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array of `shape` and `dtype`, this thread's for `role` until it asks for `role` again."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = _buffers.by_role.get(role)
    if buffer is None or buffer.size < size:
        buffer = _buffers.by_role[role] = np.empty(size, np.uint8)
    return buffer[:size].view(dtype).reshape(shape)
