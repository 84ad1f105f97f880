"""OpenVINO graph builders, one per kind of weight-heavy block of an Inkling layer (everything between them runs in
FP32 on the host: see `cascadia.engine.decoder`). Each returns an `ov.Model` whose inputs all have a dynamic row axis.

Weights arrive as float32 arrays in checkpoint layout ([out, in], experts [E, out, in]) and are stored in the graph
in their `WeightFormat`; expert stacks in an integer format may also arrive already quantised (`Quantized`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine.ov_ops import all_experts_index, const, linear, swiglu, tiled_experts, weight
from cascadia.engine.quantize import Quantized
from cascadia.spec.types import WeightFormat


def _rows(width: int, name: str = "x", dtype=ov.Type.f32) -> ov.Output:
    return ops.parameter([-1, width], dtype, name=name)


def projection(weights: Sequence[np.ndarray | Quantized], fmt: WeightFormat) -> ov.Model:
    """x [T, in] -> x @ concat(weights).T: several projections of the same input as one matmul (several only as
    float arrays)."""
    w = np.concatenate(weights) if len(weights) > 1 else weights[0]
    x = _rows(w.shape[1])
    return ov.Model([linear(x.output(0), weight(w, fmt))], [x], "projection")


def swiglu_mlp(gate: np.ndarray, up: np.ndarray, down: np.ndarray, fmt: WeightFormat) -> ov.Model:
    """x [T, H] -> down(silu(gate x) * up x) [T, H]."""
    x = _rows(gate.shape[1])
    return ov.Model([swiglu(x.output(0), weight(gate, fmt), weight(up, fmt), weight(down, fmt))], [x], "swiglu")


Stack = np.ndarray | Quantized


def _experts(x: ov.Output, gate: Stack, up: Stack, down: Stack, fmt: WeightFormat,
             index: ov.Output, weights: ov.Output) -> ov.Output:
    n_experts, _, hidden = gate.shape
    return tiled_experts(x, weight(gate, fmt), weight(up, fmt), weight(down, fmt), n_experts, hidden, index, weights)


def expert_slices(gate: np.ndarray, up: np.ndarray, down: np.ndarray, fmt: WeightFormat) -> ov.Model:
    """All-active experts [n, ...] (a dense MLP cut into slices): x [T, H], weights [T, n] -> sum of weighted
    slices [T, H], through the same fused graph as the MoE."""
    x, w = _rows(gate.shape[2]), _rows(gate.shape[0], "weights")
    out = _experts(x.output(0), gate, up, down, fmt, all_experts_index(w.output(0), gate.shape[0]), w.output(0))
    return ov.Model([out], [x, w], "expert_slices")


def moe(routed: tuple[Stack, Stack, Stack], routed_fmt: WeightFormat,
        shared: tuple[Stack, Stack, Stack], shared_fmt: WeightFormat, top_k: int) -> ov.Model:
    """Routed experts ([E, ...] gate, up, down) chosen per row plus always-active shared experts ([S, ...]):
    x [T, H], index [T, k] int32, weights [T, k], shared_weights [T, S] -> [T, H]."""
    hidden, n_shared = routed[0].shape[2], shared[0].shape[0]
    x = _rows(hidden)
    index, w = _rows(top_k, "index", ov.Type.i32), _rows(top_k, "weights")
    shared_w = _rows(n_shared, "shared_weights")
    routed_out = _experts(x.output(0), *routed, routed_fmt, index.output(0), w.output(0))
    shared_out = _experts(x.output(0), *shared, shared_fmt, all_experts_index(shared_w.output(0), n_shared),
                          shared_w.output(0))
    return ov.Model([ops.add(routed_out, shared_out).output(0)], [x, index, w, shared_w], "moe")


def embedding(table: np.ndarray | Quantized, fmt: WeightFormat) -> ov.Model:
    """ids [T] int64 -> rows of the table [T, H] (the plugins gather straight from compressed tables)."""
    ids = ops.parameter([-1], ov.Type.i64, name="ids")
    return ov.Model([ops.gather(weight(table, fmt), ids, const(np.int64(0))).output(0)], [ids], "embedding")
