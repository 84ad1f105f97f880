"""A layer's MLP on the host, as every family runs it: a dense SwiGLU block, or a router and the experts' blocks
(fused, or expert-grouped for calls of many rows), the output restored to full scale in FP32.

FP32 restoration (the paper's scheme for FP16 expert arithmetic; FP16 overflows above 65504): the build divides the
up projections by A = 2^n (`layer_build.up_divisor`), which divides silu(gate) * up, the down projection and the
MLP's output by A; per row, the routing weights are divided by F = 2^ceil(log2 max(1, sum |w|))
(`layers.row_factor`), so the weighted sum of expert outputs is no larger than the largest expert output. The host
multiplies by A * F in FP32: exact in every precision, short of underflow.

Shapes: T rows of one call, H hidden, k routed experts per row, S shared experts (none in some families).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from cascadia.engine.device import CompiledBlock
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.layers import Routing, row_factor
from cascadia.policy import padded_size


@attrs.define(eq=False, slots=False, kw_only=True)  # no slots: calibration times a layer's methods by wrapping them
class Mlp:
    """What a layer's MLP holds: a family's decoder layer is one (its attention beside)."""

    post_norm: np.ndarray  # [H]: the norm whose output feeds the MLP (A was chosen for its weight)
    mlp: CompiledBlock | None  # dense: [T, H] -> [T, H]; MoE: (x, index, weights[, shared weights]) -> [T, H]
    # (None: a MoE layer whose every call runs `grouped`)
    up_divisor: float  # A of the FP32 restoration
    router: Callable[[np.ndarray], Routing] | None = None  # MoE layers
    output_scale: np.ndarray | None = None  # dense layers that scale their output (Inkling's global_scale [1])
    dense_slices: int | None = None  # dense layers run as this many all-active expert slices
    grouped: GroupedBlock | None = None  # MoE layers: the same experts, expert-grouped (`graphs.moe_grouped`)
    grouped_from: int | None = None  # calls of at least this many rows (their bucket) run `grouped`, not `mlp`

    def runs_grouped(self, bucket: int) -> bool:
        """Whether a call of `bucket` rows runs the expert-grouped MoE."""
        return self.grouped is not None and self.grouped_from is not None and bucket >= self.grouped_from

    def expert_inputs(self, h: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """A MoE layer's block inputs for rows h [T, H] (h, index, weights / F, and shared weights / F where the
        family has shared experts), and F [T, 1]."""
        routing = self.router(h)
        factor = row_factor(routing.weights, routing.shared_weights)
        shared = (routing.shared_weights / factor,) if routing.shared_weights.shape[1] else ()
        return (h, routing.index, routing.weights / factor, *shared), factor

    def feed_forward(self, h: np.ndarray, bucket: int | None = None) -> np.ndarray:
        """The MLP of the rows h [T, H] (normed), restored to full scale in FP32; the blocks run at `bucket` rows
        (None: the smallest bucket that holds them)."""
        if self.router is None:
            if self.dense_slices:
                out = self.mlp(h, np.ones((len(h), self.dense_slices), np.float32), bucket=bucket)[0]
            else:
                out = self.mlp(h, bucket=bucket)[0]
            out = out * np.float32(self.up_divisor)
            return out if self.output_scale is None else out * self.output_scale
        inputs, factor = self.expert_inputs(h)
        if self.mlp is None or self.runs_grouped(padded_size(len(h), self.mlp.buckets) if bucket is None else bucket):
            out = self.grouped(*inputs)
        else:
            out = self.mlp(*inputs, bucket=bucket)[0]
        return out * (np.float32(self.up_divisor) * factor)
