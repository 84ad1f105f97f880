"""Small OpenVINO graph pieces: weights in the compressed layouts the plugins fuse, SwiGLU, and the tiled MoE block.

Shapes: T rows, H hidden, I expert width, E experts, k experts per row.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from openvino.utils.node_factory import NodeFactory

from cascadia.engine.quantize import Ints, Nibbles, Quantized, quantize, round_to_bf16
from cascadia.spec.types import WeightFormat

_NIBBLE_TYPES = {True: ov.Type.i4, False: ov.Type.u4}  # by `Nibbles.signed`


def const(values) -> ov.Output:
    return ops.constant(np.asarray(values)).output(0)


def ints(*values: int) -> ov.Output:
    """An i64 vector constant (shapes, axes, repeats)."""
    return const(np.array(values, np.int64))


def weight(w: np.ndarray | Quantized, fmt: WeightFormat) -> ov.Output:
    """A float32 `[..., out, in]` weight stored in `fmt`, as the decompression subgraph the plugins recognise:
    `Constant(int) -> Convert(f16) -> [Subtract(zero point)] -> Multiply(scale) -> [Reshape] -> Convert(f32)`, or
    `Constant(f16|bf16) -> Convert(f32)`, or a plain f32 constant. An integer `fmt` also takes `w` already
    quantised in it (`cascadia.engine.quantize.quantize_stacks`)."""
    if isinstance(w, Quantized) and not fmt.is_integer:
        raise ValueError(f"weight: a quantised matrix cannot be stored as {fmt}")
    if fmt.dtype == "f32":
        return ops.constant(np.ascontiguousarray(w, dtype=np.float32), shared_memory=True).output(0)
    if fmt.dtype == "f16":
        return ops.convert(ops.constant(w.astype(np.float16), shared_memory=True), ov.Type.f32).output(0)
    if fmt.dtype == "bf16":
        # The constant must own a copy: a Tensor over a temporary uint16 array does not keep the array alive.
        packed = ov.op.Constant(ov.Tensor(round_to_bf16(w), list(w.shape), ov.Type.bf16), shared_memory=False)
        return ops.convert(packed, ov.Type.f32).output(0)
    q = w if isinstance(w, Quantized) else quantize(w, fmt)
    *lead, out, groups, group = q.values.shape
    grouped = groups > 1
    # Per-row scales need no group axis: [..., out, in] * [..., out, 1].
    shape = q.values.shape if grouped else (*lead, out, group)
    scale_shape = q.scale.shape if grouped else (*lead, out, 1)
    decompressed = ops.convert(_int_constant(q.values, shape), ov.Type.f16)
    if q.zero_point is not None:
        decompressed = ops.subtract(decompressed, ops.convert(_int_constant(q.zero_point, scale_shape), ov.Type.f16))
    decompressed = ops.multiply(decompressed, ops.constant(q.scale.reshape(scale_shape), shared_memory=True))
    if grouped:
        decompressed = ops.reshape(decompressed, ints(*q.shape), False)
    return ops.convert(decompressed, ov.Type.f32).output(0)


def _int_constant(values: Ints, shape: tuple[int, ...]) -> ov.Node:
    """An i8/u8 constant sharing the memory of int8/uint8 `values` (the constant keeps the array alive), or an
    i4/u4 constant of packed `Nibbles`, of `shape` (the same number of values). A Tensor over a numpy array of
    another element type does not keep the array alive: a 4-bit constant takes a copy."""
    if isinstance(values, Nibbles):
        tensor = ov.Tensor(values.data, list(shape), _NIBBLE_TYPES[values.signed])
        return ov.op.Constant(tensor, shared_memory=False)
    return ops.constant(values.reshape(shape), shared_memory=True)


def linear(x: ov.Output, w: ov.Output) -> ov.Output:
    """x @ w.T for a weight stored [out, in] (batched: [E, T, in] x [E, out, in])."""
    return ops.matmul(x, w, False, True).output(0)


def rms_norm(x: ov.Output, weight: np.ndarray, eps: float) -> ov.Output:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, as `cascadia.engine.layers.rms_norm` computes it on
    the host (within f32 rounding), in the form the CPU plugin fuses into one RMS kernel."""
    mean = ops.reduce_mean(ops.multiply(x, x), ints(-1), True)
    inverse = ops.divide(const(np.float32(1)), ops.sqrt(ops.add(mean, const(np.float32(eps)))))
    return ops.multiply(ops.multiply(x, inverse), const(np.asarray(weight, np.float32))).output(0)


def swish(x: ov.Output) -> ov.Output:
    """SiLU as a one-input Swish. `opset4.swish(x)` from Python adds a `beta` input, which the MoE matcher rejects."""
    return NodeFactory("opset4").create("Swish", [x]).output(0)


def swiglu(x: ov.Output, gate: ov.Output, up: ov.Output, down: ov.Output) -> ov.Output:
    """down(silu(gate(x)) * up(x)); batched over experts when the weights are [E, ...] and x is [E, T, H]."""
    return linear(ops.multiply(swish(linear(x, gate)), linear(x, up)).output(0), down)


def tiled_experts(x: ov.Output, gate: ov.Output, up: ov.Output, down: ov.Output, n_experts: int, hidden: int,
                  index: ov.Output, weights: ov.Output) -> ov.Output:
    """Sum over each row's experts of weight * SwiGLU_expert(row), in the expert-major "tiled" form that the CPU
    plugin rewrites into GatherMatmul ops (only the selected experts are computed; weights stay compressed):
    x [T, H] tiled to [E, T, H] -> 3 batched matmuls -> [E, T, 1, H] times the dense routing matrix [E, T, 1, 1]
    made by scattering `weights` [T, k] at `index` [T, k] -> ReduceSum over E -> Reshape [T, H]."""
    tiled = ops.reshape(ops.tile(x, ints(n_experts, 1)), ints(n_experts, -1, hidden), False)
    expert_out = ops.reshape(swiglu(tiled.output(0), gate, up, down), ints(n_experts, -1, 1, hidden), False)
    rows = ops.gather(ops.shape_of(index), ints(0), const(np.int64(0)))
    zeros = ops.broadcast(const(np.zeros(1, np.float32)), ops.concat([rows, ints(n_experts)], 0))
    routing = ops.scatter_elements_update(zeros, index, weights, ints(1))  # [T, E]
    routing = ops.reshape(ops.transpose(routing, ints(1, 0)), ops.concat([ints(n_experts), rows, ints(-1)], 0), True)
    routing = ops.unsqueeze(routing, ints(-1))  # [E, T, 1, 1]
    summed = ops.reduce_sum(ops.multiply(expert_out, routing), ints(0), False)
    return ops.reshape(summed, ints(-1, hidden), False).output(0)


def all_experts_index(weights: ov.Output, n_experts: int) -> ov.Output:
    """[T, n] index selecting every expert on every row (shared experts, dense slices), shaped like `weights`."""
    return ops.broadcast(const(np.arange(n_experts, dtype=np.int32)[None]), ops.shape_of(weights)).output(0)
