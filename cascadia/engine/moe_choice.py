"""Which MoE path a stage runs at each call size, measured where it runs.

The fused graph (GatherMatmul) costs about the same per row at any row count: on a CPU without AMX it reads an
expert's weights again for every row that chose it. The expert-grouped graph reads each touched expert once for all
its rows, but pays for a branch per expert even when few are touched. So fused wins small calls and grouped large
ones; where they cross depends on the machine, the weight format and the precision, and is measured on the stage's
own first MoE layer when the engine starts (`runtime.moe_grouped_from: auto`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from cascadia.engine.device import CompiledBlock
from cascadia.engine.grouped_moe import GroupedBlock

ROUNDS = 5  # timed calls of each path at each bucket; the medians decide
MARGIN = 0.1  # grouped must be this much faster, so that noise does not flip a near tie from one start to the next


class MoeLayer(Protocol):
    """What the choice reads of a MoE layer of any family: its two paths and the inputs its router gives them."""

    post_norm: np.ndarray  # [H]
    mlp: CompiledBlock  # fused
    grouped: GroupedBlock

    def expert_inputs(self, h: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]: ...


def measured_grouped_from(layer: MoeLayer, buckets: Sequence[int], rounds: int = ROUNDS) -> int | None:
    """`crossover` of the two paths of `layer` timed at every bucket on rows of unit RMS routed by the layer's
    router, the paths called in turn."""
    return crossover({bucket: _median_seconds(layer, bucket, rounds) for bucket in buckets})


def paths_text(grouped_from: int | None, buckets: Sequence[int]) -> str:
    """Which path runs which calls, in words."""
    if grouped_from is None:
        return "fused at every call size"
    if grouped_from <= min(buckets):
        return "expert-grouped at every call size"
    return f"fused below {grouped_from} rows, expert-grouped from {grouped_from}"


def crossover(seconds: dict[int, tuple[float, float]]) -> int | None:
    """The smallest bucket from which the grouped path is faster than the fused one by MARGIN at that bucket and
    every larger one (None: not at the largest), from (fused, grouped) seconds per call by bucket."""
    grouped_from = None
    for bucket in sorted(seconds, reverse=True):
        fused, grouped = seconds[bucket]
        if grouped > (1 - MARGIN) * fused:
            break
        grouped_from = bucket
    return grouped_from


def _median_seconds(layer: MoeLayer, rows: int, rounds: int) -> tuple[float, float]:
    """Median seconds per call of the fused and the grouped path on `rows` rows, new rows (so a new routing) in
    every round, as in decoding: the grouped graph's shapes follow the routing, and a change of shapes costs it
    time (measured up to 1.8x its time on repeated inputs, on bench/engine.py's model). One untimed call each
    first."""
    rng = np.random.default_rng(rows)
    samples: list[list[float]] = [[], []]
    for round_ in range(rounds + 1):
        inputs, _ = layer.expert_inputs(rng.standard_normal((rows, layer.post_norm.shape[0]), dtype=np.float32))
        paths = (lambda: layer.mlp(*inputs, bucket=rows), lambda: layer.grouped(*inputs))
        for times, path in zip(samples, paths):
            start = time.perf_counter()
            path()
            if round_:
                times.append(time.perf_counter() - start)
    fused, grouped = (statistics.median(times) for times in samples)
    return fused, grouped
