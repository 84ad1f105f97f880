"""OpenVINO graph builders, one per kind of weight-heavy block of a layer (everything between them runs in FP32 on
the host: see `cascadia.engine.families`). Each returns an `ov.Model` whose inputs all have a dynamic row axis.

Weights arrive as float32 arrays in checkpoint layout ([out, in], experts [E, out, in]) and are stored in the graph
in their `WeightFormat`; expert stacks in an integer format may also arrive already quantised (`Quantized`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine.ov_ops import (all_experts_index, const, ints, linear, rms_norm, swiglu, swish, tiled_experts,
                                    weight)
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


def attention_input(projections: Sequence[np.ndarray], fmt: WeightFormat, norm: np.ndarray,
                    q_norm: np.ndarray | None, eps: float) -> ov.Model:
    """A decoder layer's rows up to its attention's host part: x [T, H] -> q [T, h d] and the other projections'
    columns (Inkling's k|v|r [T, 2 kv d + h r], a Llama's k|v), from the input RMSNorm and the projections as one
    matmul, q first; with `q_norm`, each head of q RMS-normalised (Inkling's k is normalised on the host, after its
    short convolution)."""
    w = np.concatenate(projections)
    x = _rows(w.shape[1])
    projected = linear(rms_norm(x.output(0), norm, eps), weight(w, fmt))
    q_width = projections[0].shape[0]
    q, rest = ops.variadic_split(projected, const(np.int64(-1)), ints(q_width, -1)).outputs()
    if q_norm is not None:
        heads = rms_norm(ops.reshape(q, ints(0, -1, q_norm.shape[0]), True).output(0), q_norm, eps)
        q = ops.reshape(heads, ints(0, q_width), True).output(0)
    return ov.Model([q, rest], [x], "attention_input")


def _per_head(x: ov.Output, heads: int, w: np.ndarray, fmt: WeightFormat) -> ov.Output:
    """x [T, h in] -> [T, h out]: each head's columns through its own matrix of w [h, out, in], as one product of a
    row and a matrix for each row and head (batched over rows, a product's kernel would depend on their count)."""
    rows = ops.reshape(x, ints(0, heads, 1, -1), True)  # [T, h, 1, in]
    return ops.reshape(linear(rows.output(0), weight(w, fmt)), ints(0, -1), True).output(0)


def latent_query(q_b: np.ndarray | None, w_uk: np.ndarray, rope: int, fmt: WeightFormat) -> ov.Model:
    """DeepSeek-V3's queries in the latent (the absorbed form): x [T, in], the normed q latent through `q_b`
    [h (N + R), in] (or, with None, the queries themselves) -> each head's non-rotated part through its key rows of
    kv_b_proj, w_uk [h, L, N] -> [T, h L], and the rotated parts, before RoPE, [T, h R]."""
    heads, _, nope = w_uk.shape
    x = _rows(q_b.shape[1] if q_b is not None else heads * (nope + rope))
    q = x.output(0) if q_b is None else linear(x.output(0), weight(q_b, fmt))
    by_head = ops.reshape(q, ints(0, heads, nope + rope), True)
    q_nope, q_rot = ops.variadic_split(by_head, const(np.int64(-1)), ints(nope, rope)).outputs()
    latent = _per_head(ops.reshape(q_nope, ints(0, -1), True).output(0), heads, w_uk, fmt)
    return ov.Model([latent, ops.reshape(q_rot, ints(0, -1), True).output(0)], [x], "latent_query")


def latent_output(w_uv: np.ndarray, o_proj: np.ndarray, fmt: WeightFormat) -> ov.Model:
    """DeepSeek-V3's attention output from the latent: x [T, h L], each head's attention over the latents, through its
    value rows of kv_b_proj, w_uv [h, V, L], then o_proj [H, h V] -> [T, H]."""
    heads, _, latent = w_uv.shape
    x = _rows(heads * latent)
    return ov.Model([linear(_per_head(x.output(0), heads, w_uv, fmt), weight(o_proj, fmt))], [x], "latent_output")


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
        shared: tuple[Stack, Stack, Stack] | None, shared_fmt: WeightFormat, top_k: int) -> ov.Model:
    """Routed experts ([E, ...] gate, up, down) chosen per row plus always-active shared experts ([S, ...], where the
    family has them): x [T, H], index [T, k] int32, weights [T, k], shared_weights [T, S] -> [T, H]."""
    x = _rows(routed[0].shape[2])
    index, w = _rows(top_k, "index", ov.Type.i32), _rows(top_k, "weights")
    out = _experts(x.output(0), *routed, routed_fmt, index.output(0), w.output(0))
    if shared is None:
        return ov.Model([out], [x, index, w], "moe")
    n_shared = shared[0].shape[0]
    shared_w = _rows(n_shared, "shared_weights")
    shared_out = _experts(x.output(0), *shared, shared_fmt, all_experts_index(shared_w.output(0), n_shared),
                          shared_w.output(0))
    return ov.Model([ops.add(out, shared_out).output(0)], [x, index, w, shared_w], "moe")


def moe_grouped(routed: tuple[Stack, Stack, Stack], routed_fmt: WeightFormat,
                shared: tuple[Stack, Stack, Stack] | None, shared_fmt: WeightFormat, top_k: int) -> ov.Model:
    """The experts of `moe`, each its own branch over the rows that chose it. The CPU plugin makes each branch a
    FullyConnected on compressed weights, which reads its expert once for all those rows (the fused GatherMatmul
    reads it again for every row) and quantises the activations dynamically where the precision allows. The host
    (`cascadia.engine.grouped_moe`) sorts the rows' choices by expert:
    x [T, H], shared_weights [T, S] (where the family has shared experts); sorted [N, H], the row of each of the
    N = T k choices in expert order; lengths [E] int64, choices per expert (0: untouched); sorted_weights [N, 1];
    unsort [T, k] int32, the place in sorted of each row's choices -> [T, H]."""
    n_experts, _, hidden = routed[0].shape
    x = _rows(hidden)
    sorted_rows, sorted_w = _rows(hidden, "sorted"), _rows(1, "sorted_weights")
    lengths = ops.parameter([n_experts], ov.Type.i64, name="lengths")
    unsort = _rows(top_k, "unsort", ov.Type.i32)
    parts = ops.variadic_split(sorted_rows, const(np.int64(0)), lengths).outputs()
    expert_out = ops.concat([_expert(part, routed, e, routed_fmt) for e, part in enumerate(parts)], 0)  # [N, H]
    weighted = ops.gather(ops.multiply(expert_out, sorted_w), unsort, const(np.int64(0)))  # [T, k, H]
    out = ops.reduce_sum(weighted, ints(1), False)
    if shared is None:
        return ov.Model([out.output(0)], [x, sorted_rows, lengths, sorted_w, unsort], "moe_grouped")
    shared_w = _rows(shared[0].shape[0], "shared_weights")
    for e in range(shared[0].shape[0]):
        column = ops.gather(shared_w, ints(e), const(np.int64(1)))  # [T, 1]
        out = ops.add(out, ops.multiply(_expert(x.output(0), shared, e, shared_fmt), column))
    return ov.Model([out.output(0)], [x, shared_w, sorted_rows, lengths, sorted_w, unsort], "moe_grouped")


def _expert(x: ov.Output, stacks: tuple[Stack, Stack, Stack], e: int, fmt: WeightFormat) -> ov.Output:
    """Expert e's SwiGLU of rows x, gate and up as one matmul [2I, H]."""
    gate, up, down = (s.entry(e) if isinstance(s, Quantized) else s[e] for s in stacks)
    gate_up = Quantized.concat([gate, up]) if isinstance(gate, Quantized) else np.concatenate([gate, up])
    g, u = ops.split(linear(x, weight(gate_up, fmt)), const(np.int64(-1)), 2).outputs()
    return linear(ops.multiply(swish(g), u).output(0), weight(down, fmt))


def embedding(table: np.ndarray | Quantized, fmt: WeightFormat) -> ov.Model:
    """ids [T] int64 -> rows of the table [T, H] (the plugins gather straight from compressed tables)."""
    ids = ops.parameter([-1], ov.Type.i64, name="ids")
    return ov.Model([ops.gather(weight(table, fmt), ids, const(np.int64(0))).output(0)], [ids], "embedding")
