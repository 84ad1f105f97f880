"""Building the compiled blocks of a layer's MLP from a checkpoint's tensors, as every family's layer does (its
build is its family's: `cascadia.engine.families`): a dense SwiGLU, or the routed and shared experts as the fused
and the expert-grouped block, with the divisor A of their FP32 restoration (`cascadia.engine.mlp`).

Expert stacks in an integer format are read and quantised one expert at a time (`Checkpoint.layer` streams them),
never held whole in float32: a full-size Inkling MoE layer is 4.6 GB in float32.

A is chosen from the weights alone: the typical magnitude of up, silu(gate) * up and down for an input of unit RMS
(before the norm's weight) is estimated from row norms, and A brings the largest of them down to at most 2^7,
which leaves 2^9 of headroom for outliers below FP16's limit and 2^21 above its smallest normal number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import openvino as ov

from cascadia.engine import graphs
from cascadia.engine.checkpoint import LayerTensors
from cascadia.engine.device import CompiledBlock
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.quantize import quantize_stacks
from cascadia.spec.types import WeightFormat, WeightFormats

Compile = Callable[[ov.Model], CompiledBlock]
CompileGrouped = Callable[[ov.Model], GroupedBlock]
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down of a few experts
Chunks = Callable[[int | None], Iterator[Chunk]]  # a stack's chunks of that many experts (None: whole)
TYPICAL_CEILING_LOG2 = 7


def swiglu_block(gate: np.ndarray, up: np.ndarray, down: np.ndarray, norm_weight: np.ndarray, fmt: WeightFormat,
                 compile: Compile, dense_slices: int | None = None) -> tuple[CompiledBlock, float]:
    """A dense SwiGLU fed by an RMSNorm of weight `norm_weight`, compiled with its up projection divided by A, and
    A. `dense_slices`: as that many all-active expert slices through the fused MoE graph."""
    divisor = up_divisor(gate, up, down, norm_weight)
    up = up / np.float32(divisor)
    model = graphs.expert_slices(*_slices(gate, up, down, dense_slices), fmt) if dense_slices else \
        graphs.swiglu_mlp(gate, up, down, fmt)
    return compile(model), divisor


def moe_blocks(routed: Chunks, n_routed: int, shared: Chunks | None, n_shared: int, top_k: int,
               formats: WeightFormats, norm_weight: np.ndarray, compile: Compile | None,
               compile_grouped: CompileGrouped | None) -> tuple[CompiledBlock | None, GroupedBlock | None, float]:
    """The routed and shared experts (`shared` None: a family without) as the fused block (with `compile`) and the
    expert-grouped one (with `compile_grouped`, for the engine to choose between the two by rows), and their divisor
    A. Integer formats stream the stacks one expert at a time, twice: A must be known before quantising up / A. Each
    graph is built and compiled in turn, so that only one holds copies of the weights."""
    routed_fmt, shared_fmt = formats.routed_experts, formats.shared_experts
    divisor = up_divisor(*_peak_rows(routed(_per(routed_fmt))), norm_weight)
    if shared is not None:
        divisor = max(divisor, up_divisor(*_peak_rows(shared(_per(shared_fmt))), norm_weight))
    routed_weights = expert_weights(routed(_per(routed_fmt)), n_routed, routed_fmt, divisor)
    shared_weights = None if shared is None else expert_weights(shared(_per(shared_fmt)), n_shared, shared_fmt,
                                                                  divisor)
    fused = grouped = None
    if compile is not None:
        model = graphs.moe(routed_weights, routed_fmt, shared_weights, shared_fmt, top_k)
        if compile_grouped is None:
            del routed_weights, shared_weights  # the graph holds copies of 4-bit stacks: not twice while it compiles
        fused = compile(model)
        del model
    if compile_grouped is not None:
        model = graphs.moe_grouped(routed_weights, routed_fmt, shared_weights, shared_fmt, top_k)
        del routed_weights, shared_weights
        grouped = compile_grouped(model)
    return fused, grouped, divisor


def up_divisor(gate: np.ndarray, up: np.ndarray, down: np.ndarray, norm_weight: np.ndarray) -> float:
    """A = 2^n >= 1 for a SwiGLU (or experts [E, ...]) fed by an RMSNorm with weight `norm_weight`."""
    gain = float(np.abs(norm_weight).max())
    gate_size, up_size = _largest_row_norm(gate) * gain, _largest_row_norm(up) * gain
    product = gate_size * up_size  # |silu(g)| <= |g|
    largest = max(up_size, product, _largest_row_norm(down) * product)
    return float(2.0 ** max(0, math.ceil(math.log2(max(largest, 1.0))) - TYPICAL_CEILING_LOG2))


def _largest_row_norm(w: np.ndarray) -> float:
    """Largest L2 norm of a row of [..., out, in] (no temporary the size of w)."""
    return math.sqrt(float(np.einsum("...i,...i->...", w, w).max()))


def _slices(gate: np.ndarray, up: np.ndarray, down: np.ndarray, n: int):
    """A dense SwiGLU [I, H] / [H, I] as n experts of width I/n: [n, I/n, H] gate and up, [n, H, I/n] down."""
    width, hidden = gate.shape
    if width % n:
        raise ValueError(f"dense_slices={n} does not divide the dense MLP width {width}")
    return (gate.reshape(n, width // n, hidden), up.reshape(n, width // n, hidden),
            np.ascontiguousarray(down.reshape(hidden, n, width // n).transpose(1, 0, 2)))


def _per(fmt: WeightFormat) -> int | None:
    """Experts per chunk: one for integer formats (quantised into preallocated arrays), else the whole stack."""
    return 1 if fmt.is_integer else None


def stack_chunks(t: Mapping[str, np.ndarray], name: str, per: int | None) -> Iterator[np.ndarray]:
    """A stack whole (`per` None) or `per` experts at a time, read expert by expert from a checkpoint's layer."""
    if per is None:
        return iter([t[name]])
    if isinstance(t, LayerTensors):
        return t.slices(name, per)
    stack = t[name]
    return (stack[first: first + per] for first in range(0, len(stack), per))


def _peak_rows(chunks: Iterator[Chunk]) -> list[np.ndarray]:
    """For each of gate, up and down, the row of largest norm of every chunk: `up_divisor` depends only on the
    largest row norms, so it gives the same A for these rows as for the whole stacks."""
    peaks: list[list[np.ndarray]] = [[], [], []]
    for chunk in chunks:
        for rows, w in zip(peaks, chunk):
            norms = np.einsum("...i,...i->...", w, w)
            rows.append(w[np.unravel_index(norms.argmax(), norms.shape)].copy())  # a view would keep w alive
    return [np.stack(rows) for rows in peaks]


def expert_weights(chunks: Iterator[Chunk], count: int, fmt: WeightFormat, divisor: float = 1.0):
    """Gate, up / A and down of `count` experts: quantised chunk by chunk for an integer `fmt`, else the float32
    stacks (one chunk)."""
    scaled = ((gate, up / np.float32(divisor), down) for gate, up, down in chunks)
    if fmt.is_integer:
        return tuple(quantize_stacks(scaled, count, fmt))
    (whole,) = scaled
    return whole
