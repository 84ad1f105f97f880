"""Per-thread reusable arrays (`cascadia.engine.scratch`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cascadia.engine import scratch


def test_a_role_reuses_its_memory_and_roles_and_threads_do_not_share():
    first = scratch.array("test keys", (4, 8), np.float32)
    first[...] = 1
    other = scratch.array("test values", (4, 8), np.float32)
    other[...] = 2
    again = scratch.array("test keys", (2, 8), np.uint16)  # smaller, another dtype: the same memory
    assert np.shares_memory(first, again) and not np.shares_memory(first, other)
    assert (first == 1).all()
    grown = scratch.array("test keys", (64, 64), np.float32)  # larger: a new buffer
    assert grown.shape == (64, 64) and grown.dtype == np.float32
    with ThreadPoolExecutor(1) as pool:
        elsewhere = pool.submit(scratch.array, "test keys", (64, 64), np.float32).result()
    assert not np.shares_memory(grown, elsewhere)
