"""One Inkling decoder layer: its compiled weight blocks, its FP32 host weights, its per-slot state, its forward.

Split of the work: OpenVINO runs the weight-heavy blocks (q/k/v/r projection, o projection, the dense SwiGLU or the
MoE experts) at the engine's precision, on compressed weights; the host runs in FP32 everything between them, as
the reference keeps it: norms, the four short convolutions with their states, the router, attention with its
relative-position bias, residuals and the FP32 output restoration of the MLP (see `cascadia.engine.restoration`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import openvino as ov

from cascadia.engine import graphs
from cascadia.engine.attention import AttentionShape, attend
from cascadia.engine.checkpoint import LayerTensors
from cascadia.engine.device import CompiledBlock
from cascadia.engine.host_ops import head_rms_norm, rms_norm, short_conv
from cascadia.engine.quantize import quantize_stacks
from cascadia.engine.restoration import row_factor, up_divisor
from cascadia.engine.routing import Router
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.model_config import InklingConfig
from cascadia.spec.types import WeightFormat, WeightFormats

Compile = Callable[[ov.Model], CompiledBlock]
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down of a few experts


class SlotState:
    """A layer's state for every slot: K/V rings [slots, kv_heads, ring, head_dim] and the last K-1 inputs of
    its short convolutions [slots, K-1, width] (those of k and v side by side: they run as one), all stored in
    `fmt`. Zero-filled, so pages are only committed as slots fill."""

    def __init__(self, shape: AttentionShape, ring: int, hidden: int, kernel: int, slots: int,
                 fmt: StateFormat = StateFormat()):
        self.fmt = fmt
        kv = (slots, shape.kv_heads, ring, shape.head_dim)
        self.k, self.v = fmt.zeros(kv), fmt.zeros(kv)
        kv_width = shape.kv_heads * shape.head_dim
        self.conv = {name: fmt.zeros((slots, kernel - 1, width))
                     for name, width in (("kv", 2 * kv_width), ("attn", hidden), ("mlp", hidden))}

    def release(self, slot: int) -> None:
        """Ready a slot for a new stream. Stale K/V need no clearing: a stream only reads entries it wrote."""
        for states in self.conv.values():
            states[slot] = 0


class DecoderLayer:
    def __init__(self, cfg: InklingConfig, layer: int, tensors: Mapping[str, np.ndarray], formats: WeightFormats,
                 compile: Compile, dense_slices: int | None = None):
        """`tensors`: the layer's float32 tensors by name relative to its prefix (`Checkpoint.layer`: expert stacks
        in an integer format are then read and quantised one expert at a time, never held whole in float32).
        `dense_slices`: run a dense MLP as that many all-active expert slices through the fused MoE graph."""
        t = tensors
        heads, kv_heads, head_dim = cfg.heads(layer)
        log_scaling = None
        if not cfg.is_sliding(layer) and cfg.log_scaling_n_floor is not None:
            log_scaling = (cfg.log_scaling_n_floor, cfg.log_scaling_alpha)
        self.shape = AttentionShape(heads, kv_heads, head_dim, cfg.sliding_window_size if cfg.is_sliding(layer)
                                    else None, cfg.layer_rel_extent(layer), log_scaling)
        self.eps = cfg.rms_norm_eps
        self.input_norm, self.post_norm = t["input_layernorm.weight"], t["post_attention_layernorm.weight"]
        self.q_norm, self.k_norm = t["self_attn.q_norm.weight"], t["self_attn.k_norm.weight"]
        self.rel_bank = t["self_attn.rel_logits_proj.proj"]  # [d_rel, extent]
        # Convolution weights [C, 1, K] as taps [K, C]; k's and v's side by side, as their columns in q|k|v|r.
        self.conv = {name: np.ascontiguousarray(np.concatenate([t[key][:, 0, :] for key in keys]).T) for name, keys in (
            ("kv", ("self_attn.k_sconv.conv1d.weight", "self_attn.v_sconv.conv1d.weight")),
            ("attn", ("attn_sconv.conv1d.weight",)), ("mlp", ("mlp_sconv.conv1d.weight",)))}

        qkvr = [t[f"self_attn.{p}_proj.weight"] for p in "qkvr"]
        q_width, kv_width = qkvr[0].shape[0], qkvr[1].shape[0]
        self.kv_columns = slice(q_width, q_width + 2 * kv_width)  # k then v in the q|k|v|r projection
        self.qkvr = compile(graphs.projection(qkvr, formats.attention))
        self.o_proj = compile(graphs.projection([t["self_attn.o_proj.weight"]], formats.attention))

        self.router: Router | None = None
        self.dense_slices = dense_slices if cfg.is_dense(layer) else None
        if cfg.is_dense(layer):
            gate, up, down = (t[f"mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
            self.up_divisor = up_divisor(gate, up, down, self.post_norm)
            self.output_scale = t["mlp.global_scale"]
            up = up / np.float32(self.up_divisor)
            if dense_slices:
                self.mlp = compile(graphs.expert_slices(*_slices(gate, up, down, dense_slices), formats.dense_mlp))
            else:
                self.mlp = compile(graphs.swiglu_mlp(gate, up, down, formats.dense_mlp))
        else:
            self.router = Router(t["mlp.gate.weight"], t["mlp.gate.e_score_correction_bias"], cfg.route_scale,
                                 t["mlp.gate.global_scale"], cfg.num_experts_per_tok)
            width = cfg.moe_intermediate_size
            groups = ((lambda per: _routed_chunks(t, width, per), cfg.n_routed_experts, formats.routed_experts),
                      (lambda per: _shared_chunks(t, per), cfg.n_shared_experts, formats.shared_experts))
            # Integer formats stream one expert at a time (twice: A must be known before quantising up / A).
            self.up_divisor = max(up_divisor(*_peak_rows(chunks(_per(fmt))), self.post_norm)
                                  for chunks, _, fmt in groups)
            routed, shared = (_expert_weights(chunks(_per(fmt)), count, fmt, self.up_divisor)
                              for chunks, count, fmt in groups)
            model = graphs.moe(routed, formats.routed_experts, shared, formats.shared_experts,
                               cfg.num_experts_per_tok)
            del routed, shared  # the graph holds copies of 4-bit stacks: not twice while it compiles
            self.mlp = compile(model)

    def blocks(self) -> list[CompiledBlock]:
        return [self.qkvr, self.o_proj, self.mlp]

    def forward(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H] residual stream of the rows -> after this layer. Updates the rows' slots in `state`."""
        h = rms_norm(x, self.input_norm, self.eps)
        x = x + short_conv(self.o_proj(self.attention(h, rows, state))[0], self.conv["attn"], state.conv["attn"],
                           rows, state.fmt)
        h = rms_norm(x, self.post_norm, self.eps)
        return x + short_conv(self.feed_forward(h), self.conv["mlp"], state.conv["mlp"], rows, state.fmt)

    def attention(self, h: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        qkvr, kv = self.qkvr(h)[0], self.kv_columns
        k, v = np.split(short_conv(qkvr[:, kv], self.conv["kv"], state.conv["kv"], rows, state.fmt), 2, axis=1)
        q, r = qkvr[:, :kv.start], qkvr[:, kv.stop:]
        q, k = head_rms_norm(q, self.q_norm, self.eps), head_rms_norm(k, self.k_norm, self.eps)
        v = v.reshape(k.shape)
        rel = r.reshape(len(r), self.shape.heads, -1) @ self.rel_bank  # [T, heads, extent]: bias per distance
        out = np.empty((len(h), self.shape.heads * self.shape.head_dim), np.float32)
        for slot, start, count, first in rows.groups():
            part = slice(start, start + count)
            out[part] = attend(self.shape, q[part], k[part], v[part], rel[part], state.k[slot], state.v[slot],
                               first, state.fmt)
        return out

    def feed_forward(self, h: np.ndarray) -> np.ndarray:
        """The MLP of the rows h [T, H], restored to full scale in FP32."""
        if self.router is None:
            if self.dense_slices:
                out = self.mlp(h, np.ones((len(h), self.dense_slices), np.float32))[0]
            else:
                out = self.mlp(h)[0]
            return out * np.float32(self.up_divisor) * self.output_scale
        routing = self.router(h)
        factor = row_factor(routing.weights, routing.shared_weights)
        out = self.mlp(h, routing.index, routing.weights / factor, routing.shared_weights / factor)[0]
        return out * (np.float32(self.up_divisor) * factor)


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


def _stack_chunks(t: Mapping[str, np.ndarray], rel: str, per: int | None) -> Iterator[np.ndarray]:
    """A stack whole (`per` None) or `per` experts at a time, read expert by expert from a checkpoint's layer."""
    if per is None:
        return iter([t[rel]])
    if isinstance(t, LayerTensors):
        return t.slices(rel, per)
    stack = t[rel]
    return (stack[first: first + per] for first in range(0, len(stack), per))


def _routed_chunks(t: Mapping[str, np.ndarray], width: int, per: int | None) -> Iterator[Chunk]:
    for gate_up, down in zip(_stack_chunks(t, "mlp.experts.gate_up_proj", per),
                             _stack_chunks(t, "mlp.experts.down_proj", per), strict=True):
        yield gate_up[:, :width], gate_up[:, width:], down


def _shared_chunks(t: Mapping[str, np.ndarray], per: int | None) -> Iterator[Chunk]:
    return zip(*(_stack_chunks(t, f"mlp.shared_experts.{p}_proj", per) for p in ("gate", "up", "down")), strict=True)


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
