"""Small OpenVINO graph pieces: weights in the compressed layouts the plugins fuse, SwiGLU, and the tiled MoE block.

Shapes: T rows, H hidden, I expert width, E experts, k experts per row.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from openvino.utils.node_factory import NodeFactory

from cascadia.exec.quantize import Quantized, quantize, round_to_bf16
from cascadia.spec.types import WeightFormat

_INT_TYPES = {(4, True): ov.Type.i4, (8, True): ov.Type.i8, (4, False): ov.Type.u4, (8, False): ov.Type.u8}


def const(values) -> ov.Output:
    return ops.constant(np.asarray(values)).output(0)


def ints(*values: int) -> ov.Output:
    """An i64 vector constant (shapes, axes, repeats)."""
    return const(np.array(values, np.int64))


def weight(w: np.ndarray | Quantized, fmt: WeightFormat) -> ov.Output:
    """A float32 `[..., out, in]` weight stored in `fmt`, as the decompression subgraph the plugins recognise:
    `Constant(int) -> Convert(f16) -> [Subtract(zero point)] -> Multiply(scale) -> [Reshape] -> Convert(f32)`, or
    `Constant(f16|bf16) -> Convert(f32)`, or a plain f32 constant. An integer `fmt` also takes `w` already
    quantised in it (`cascadia.exec.quantize.quantize_stacks`)."""
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
    grouped = q.values.shape[-2] > 1
    # Per-row scales need no group axis: [..., out, in] * [..., out, 1].
    values = q.values if grouped else q.values[..., 0, :]
    scale = q.scale if grouped else q.scale[..., 0, :]
    decompressed = ops.convert(_int_constant(values, q.bits), ov.Type.f16)
    if q.zero_point is not None:
        zero_point = q.zero_point if grouped else q.zero_point[..., 0, :]
        zero = ops.convert(_int_constant(zero_point, q.bits), ov.Type.f16)
        decompressed = ops.subtract(decompressed, zero)
    decompressed = ops.multiply(decompressed, ops.constant(scale))
    if grouped:
        decompressed = ops.reshape(decompressed, ints(*w.shape), False)
    return ops.convert(decompressed, ov.Type.f32).output(0)


def _int_constant(values: np.ndarray, bits: int) -> ov.Node:
    """An i8/u8/i4/u4 constant from int8 (signed) or uint8 values. 4-bit values are packed here, two per byte, low
    nibble first, over the flattened array (OpenVINO's own packing goes through Python lists: seconds per layer)."""
    signed = values.dtype == np.int8
    if bits == 8:
        return ops.constant(values)
    nibbles = np.append(values.reshape(-1).view(np.uint8) & 0x0F, np.zeros(values.size % 2, np.uint8))
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    # A Tensor over a temporary array does not keep it alive: the constant takes a copy.
    return ov.op.Constant(ov.Tensor(packed, list(values.shape), _INT_TYPES[4, signed]), shared_memory=False)


def linear(x: ov.Output, w: ov.Output) -> ov.Output:
    """x @ w.T for a weight stored [out, in] (batched: [E, T, in] x [E, out, in])."""
    return ops.matmul(x, w, False, True).output(0)


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
