"""Building a `DecoderLayer` from a checkpoint's tensors: the host weights it keeps in FP32, the blocks it compiles,
and the divisor A of its FP32 restoration (`cascadia.engine.inkling`).

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

from cascadia.models import inkling as names
from cascadia.engine import graphs
from cascadia.engine.attention import AttentionShape
from cascadia.engine.checkpoint import LayerTensors
from cascadia.engine.device import CompiledBlock
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.inkling import DecoderLayer, Router, conv_taps
from cascadia.engine.quantize import quantize_stacks
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import WeightFormat, WeightFormats

Compile = Callable[[ov.Model], CompiledBlock]
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down of a few experts
TYPICAL_CEILING_LOG2 = 7


def build_layer(cfg: InklingConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                compile: Compile, dense_slices: int | None = None,
                compile_grouped: Callable[[ov.Model], GroupedBlock] | None = None, fused: bool = True) -> DecoderLayer:
    """Layer `layer` from its float32 tensors `t` by name relative to its prefix (`Checkpoint.layer`).
    `dense_slices`: run a dense MLP as that many all-active expert slices through the fused MoE graph.
    `compile_grouped`: also compile a MoE layer's experts expert-grouped (`graphs.moe_grouped`), for the engine to
    choose between the two by rows (`DecoderLayer.grouped_from`, unset here); `fused=False` with it: the grouped
    graph alone (for an engine that runs it at every call size)."""
    heads, kv_heads, head_dim = cfg.heads(layer)
    log_scaling = None
    if not cfg.is_sliding(layer) and cfg.log_scaling_n_floor is not None:
        log_scaling = (cfg.log_scaling_n_floor, cfg.log_scaling_alpha)
    shape = AttentionShape(heads, kv_heads, head_dim, cfg.sliding_window_size if cfg.is_sliding(layer) else None,
                           cfg.layer_rel_extent(layer), log_scaling)
    qkvr = [t[name] for name in (names.Q_PROJ, names.K_PROJ, names.V_PROJ, names.R_PROJ)]
    post_norm = t[names.POST_NORM]
    common = dict(
        shape=shape, eps=cfg.rms_norm_eps, post_norm=post_norm, k_norm=t[names.K_NORM], rel_bank=t[names.REL_BANK],
        conv_kv=conv_taps(t[names.K_SCONV], t[names.V_SCONV]), conv_attn=conv_taps(t[names.ATTN_SCONV]),
        conv_mlp=conv_taps(t[names.MLP_SCONV]), kv_width=2 * qkvr[1].shape[0],
        qkvr=compile(graphs.attention_input(qkvr, formats.attention, t[names.INPUT_NORM], t[names.Q_NORM],
                                            cfg.rms_norm_eps)),
        o_proj=compile(graphs.projection([t[names.O_PROJ]], formats.attention)))
    if cfg.is_dense(layer):
        gate, up, down = t[names.DENSE_GATE], t[names.DENSE_UP], t[names.DENSE_DOWN]
        divisor = up_divisor(gate, up, down, post_norm)
        up = up / np.float32(divisor)
        fmt = formats.dense_mlp
        model = graphs.expert_slices(*_slices(gate, up, down, dense_slices), fmt) if dense_slices else \
            graphs.swiglu_mlp(gate, up, down, fmt)
        return DecoderLayer(**common, mlp=compile(model), up_divisor=divisor, output_scale=t[names.DENSE_SCALE],
                            dense_slices=dense_slices)
    router = Router(t[names.ROUTER], t[names.ROUTER_CORRECTION], cfg.route_scale, t[names.ROUTER_SCALE],
                    cfg.num_experts_per_tok)
    mlp, grouped, divisor = _moe_blocks(cfg, t, formats, post_norm, compile if fused else None, compile_grouped)
    return DecoderLayer(**common, mlp=mlp, up_divisor=divisor, router=router, grouped=grouped)


def _moe_blocks(cfg: InklingConfig, t: Mapping[str, np.ndarray], formats: WeightFormats, post_norm: np.ndarray,
                compile: Compile | None, compile_grouped: Callable[[ov.Model], GroupedBlock] | None
                ) -> tuple[CompiledBlock | None, GroupedBlock | None, float]:
    """The routed and shared experts as the fused block (with `compile`) and the expert-grouped one (with
    `compile_grouped`), and their divisor A. Integer formats stream the stacks one expert at a time, twice: A must
    be known before quantising up / A. Each graph is built and compiled in turn, so that only one holds copies of
    the weights."""
    width, routed_fmt, shared_fmt = cfg.moe_intermediate_size, formats.routed_experts, formats.shared_experts

    def routed() -> Iterator[Chunk]:
        return _routed_chunks(t, width, _per(routed_fmt))

    def shared() -> Iterator[Chunk]:
        return _shared_chunks(t, _per(shared_fmt))

    divisor = max(up_divisor(*_peak_rows(routed()), post_norm), up_divisor(*_peak_rows(shared()), post_norm))
    routed_weights = _expert_weights(routed(), cfg.n_routed_experts, routed_fmt, divisor)
    shared_weights = _expert_weights(shared(), cfg.n_shared_experts, shared_fmt, divisor)
    top_k, fused, grouped = cfg.num_experts_per_tok, None, None
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


def _stack_chunks(t: Mapping[str, np.ndarray], name: str, per: int | None) -> Iterator[np.ndarray]:
    """A stack whole (`per` None) or `per` experts at a time, read expert by expert from a checkpoint's layer."""
    if per is None:
        return iter([t[name]])
    if isinstance(t, LayerTensors):
        return t.slices(name, per)
    stack = t[name]
    return (stack[first: first + per] for first in range(0, len(stack), per))


def _routed_chunks(t: Mapping[str, np.ndarray], width: int, per: int | None) -> Iterator[Chunk]:
    for gate_up, down in zip(_stack_chunks(t, names.EXPERTS_GATE_UP, per), _stack_chunks(t, names.EXPERTS_DOWN, per),
                             strict=True):
        yield gate_up[:, :width], gate_up[:, width:], down


def _shared_chunks(t: Mapping[str, np.ndarray], per: int | None) -> Iterator[Chunk]:
    return zip(*(_stack_chunks(t, name, per) for name in (names.SHARED_GATE, names.SHARED_UP, names.SHARED_DOWN)),
               strict=True)


def _peak_rows(chunks: Iterator[Chunk]) -> list[np.ndarray]:
    """For each of gate, up and down, the row of largest norm of every chunk: `up_divisor` depends only on the
    largest row norms, so it gives the same A for these rows as for the whole stacks."""
    peaks: list[list[np.ndarray]] = [[], [], []]
    for chunk in chunks:
        for rows, w in zip(peaks, chunk):
            norms = np.einsum("...i,...i->...", w, w)
            rows.append(w[np.unravel_index(norms.argmax(), norms.shape)].copy())  # a view would keep w alive
    return [np.stack(rows) for rows in peaks]


def _expert_weights(chunks: Iterator[Chunk], count: int, fmt: WeightFormat, divisor: float):
    """Gate, up / A and down of `count` experts: quantised chunk by chunk for an integer `fmt`, else the float32
    stacks (one chunk)."""
    scaled = ((gate, up / np.float32(divisor), down) for gate, up, down in chunks)
    if fmt.is_integer:
        return tuple(quantize_stacks(scaled, count, fmt))
    (whole,) = scaled
    return whole
