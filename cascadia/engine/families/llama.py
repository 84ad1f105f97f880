"""One Llama decoder layer on the host, in the order transformers' `modeling_llama.py` computes it, and its build
from a checkpoint's tensors.

OpenVINO runs the weight-heavy blocks at the engine's precision on compressed weights: the input RMSNorm with the
q|k|v projection as one matmul, the o projection, and the MLP (`cascadia.engine.mlp`, with its FP32 restoration).
What lies between them runs here in FP32, as the reference keeps it: the projections' biases, the per-head norms of
q and k of a family that has them (Qwen3-MoE's: after the biases, so not in the compiled block), RoPE, attention over
the stream's keys in the stage's K/V pool, residuals and the post-attention norm.

    DecoderLayer.forward(x [T, H])
      q, k|v = qkv(input_layernorm(x)) (+ bias)           compiled
      q, k = q_norm(q), k_norm(k)                         per head, where the family has them
      q, k = rope(q), rope(k)                             each row at its own position
      a = attention(q, k, v)                              over each stream's keys, scaled by d^-0.5
      x = x + o_proj(a) (+ bias)                          compiled
      x = x + mlp(post_attention_layernorm(x))            SwiGLU or experts, compiled

Shapes: T rows of one call (several streams, each at its own positions), H hidden, h query heads, kv key/value
heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine import graphs, ov_ops
from cascadia.engine.attention import AttentionShape, KeyStore, attend_rows
from cascadia.engine.device import Compiled, CompiledBlock
from cascadia.engine.layer_build import Compile, CompileGrouped, swiglu_block
from cascadia.engine.layers import head_rms_norm, rms_norm
from cascadia.engine.mlp import Mlp
from cascadia.engine.rope import inverse_frequencies, rotate
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.models import llama as names
from cascadia.models.base import UnsupportedModel
from cascadia.models.llama import LlamaConfig
from cascadia.spec.types import WeightFormats


class SlotState:
    """A layer's state for every slot: its keys and values alone (blocks of the stage's pool)."""

    nbytes = 0  # beyond the pool's blocks

    def __init__(self, kv: KeyStore):
        self.kv = kv

    def release(self, slot: int) -> None:
        """Stale K/V need no clearing: a stream only reads entries it wrote."""

    def fork(self, source: int, target: int) -> None:
        """Nothing beyond the keys and values (`BlockPool.fork`)."""


@attrs.define(eq=False, slots=False, kw_only=True)  # no slots: calibration times a layer's methods by wrapping them
class DecoderLayer(Mlp):
    """A layer's FP32 host weights and compiled blocks (made by `build_layer`), its MLP's among them."""

    shape: AttentionShape
    eps: float
    inv_freq: np.ndarray  # [d/2] RoPE's
    q_width: int  # h d: q's columns, first of the q|k|v output
    qkv: CompiledBlock  # x [T, H] -> q [T, h d], k|v [T, 2 kv d] (`graphs.attention_input`)
    qkv_bias: np.ndarray | None  # [h d + 2 kv d]
    o_proj: CompiledBlock  # [T, h d] -> [T, H]
    o_bias: np.ndarray | None  # [H]
    q_norm: np.ndarray | None = None  # [d], per head (Qwen3-MoE)
    k_norm: np.ndarray | None = None  # [d], per head (Qwen3-MoE)

    def blocks(self) -> list[Compiled]:
        return [block for block in (self.qkv, self.o_proj, self.mlp, self.grouped) if block is not None]

    def forward(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream of the rows -> after this layer. Updates the rows' keys and values."""
        out = self.o_proj(self.attention(x, rows, state), bucket=rows.bucket)[0]
        x = x + (out if self.o_bias is None else out + self.o_bias)
        return x + self.feed_forward(rms_norm(x, self.post_norm, self.eps), rows.bucket)

    def attention(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream -> attention output [T, h d], before o_proj."""
        q, kv = self.qkv(x, bucket=rows.bucket)
        if self.qkv_bias is not None:
            q, kv = q + self.qkv_bias[:self.q_width], kv + self.qkv_bias[self.q_width:]
        heads, kv_heads, d = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        k, v = np.split(kv, 2, axis=1)
        q, k = q.reshape(len(q), heads, d), k.reshape(len(k), kv_heads, d)
        if self.q_norm is not None:
            q, k = head_rms_norm(q, self.q_norm, self.eps), head_rms_norm(k, self.k_norm, self.eps)
        q, k = rotate(q, rows.positions, self.inv_freq), rotate(k, rows.positions, self.inv_freq)
        no_bias = np.empty((len(x), heads, 0), np.float32)
        return attend_rows(self.shape, q, k, v.reshape(k.shape), no_bias, state.kv, rows)


def attention_parts(cfg: LlamaConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                    compile: Compile) -> dict:
    """A layer's attention (and the norm before its MLP), as `DecoderLayer` fields, from its tensors."""
    heads, kv_heads, head_dim = cfg.heads(layer)
    projections = [t[name] for name in (names.Q_PROJ, names.K_PROJ, names.V_PROJ)]
    biases = None
    if cfg.attention_bias:
        biases = [t[name.replace(".weight", ".bias")] for name in (names.Q_PROJ, names.K_PROJ, names.V_PROJ,
                                                                   names.O_PROJ)]
    return dict(
        shape=AttentionShape(heads, kv_heads, head_dim, window=None, bias_extent=0, log_scaling=None,
                             scale=head_dim ** -0.5),
        eps=cfg.rms_norm_eps, post_norm=t[names.POST_NORM],
        inv_freq=inverse_frequencies(head_dim, cfg.rope_theta, cfg.rope_scaling), q_width=heads * head_dim,
        qkv=compile(graphs.attention_input(projections, formats.attention, t[names.INPUT_NORM], None,
                                           cfg.rms_norm_eps)),
        qkv_bias=np.concatenate(biases[:3]) if biases else None,
        o_proj=compile(graphs.projection([t[names.O_PROJ]], formats.attention)), o_bias=biases[3] if biases else None)


def build_layer(cfg: LlamaConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                compile: Compile, dense_slices: int | None = None, compile_grouped: CompileGrouped | None = None,
                fused: bool = True) -> DecoderLayer:
    """Layer `layer` from its float32 tensors `t` by name relative to its prefix (`Checkpoint.layer`). A Llama has
    no experts: `compile_grouped` and `fused` have nothing to choose."""
    if cfg.mlp_bias:
        raise UnsupportedModel("mlp_bias: the engine does not run a Llama whose MLP has biases")
    mlp, divisor = swiglu_block(t[names.GATE], t[names.UP], t[names.DOWN], t[names.POST_NORM], formats.dense_mlp,
                                compile, dense_slices)
    return DecoderLayer(**attention_parts(cfg, layer, t, formats, compile), mlp=mlp, up_divisor=divisor,
                        dense_slices=dense_slices)


# ---- the layer inside a stage graph (`cascadia.engine.stage_graph`) -----------------------------------------------
Attend = Callable[[ov.Output, ov.Output, ov.Output], ov.Output]  # q [T, h, d], k, v [T, kv, d] -> [T, h d]


def graph_layer(cfg: LlamaConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats, x: ov.Output,
                attend: Attend, q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
                mlp: Callable[[ov.Output], ov.Output] | None = None) -> ov.Output:
    """Layer `layer` built into a stage graph on the rows x [T, H] -> after it, the order `DecoderLayer.forward`
    computes: q|k|v of the input norm (+ biases), q and k normed per head by `q_norm` and `k_norm` where given,
    `attend` (RoPE and attention, the stage graph's), o (+ bias), the residual, then `mlp` of the post-attention
    norm (default: the dense SwiGLU) and the residual."""
    heads, kv_heads, d = cfg.heads(layer)
    projections = (names.Q_PROJ, names.K_PROJ, names.V_PROJ)
    projected = ov_ops.linear(ov_ops.rms_norm(x, t[names.INPUT_NORM], cfg.rms_norm_eps),
                              ov_ops.weight(np.concatenate([t[name] for name in projections]), formats.attention))
    if cfg.attention_bias:
        projected = _plus(projected, np.concatenate([t[name.replace(".weight", ".bias")] for name in projections]))
    widths = ov_ops.ints(heads * d, kv_heads * d, kv_heads * d)
    q, k, v = (ops.reshape(z, ov_ops.ints(0, n, d), True).output(0) for z, n in zip(
        ops.variadic_split(projected, ov_ops.const(np.int64(-1)), widths).outputs(), (heads, kv_heads, kv_heads)))
    if q_norm is not None:
        q, k = ov_ops.rms_norm(q, q_norm, cfg.rms_norm_eps), ov_ops.rms_norm(k, k_norm, cfg.rms_norm_eps)
    out = ov_ops.linear(attend(q, k, v), ov_ops.weight(t[names.O_PROJ], formats.attention))
    if cfg.attention_bias:
        out = _plus(out, t[names.O_PROJ.replace(".weight", ".bias")])
    x = ops.add(x, out).output(0)
    normed = ov_ops.rms_norm(x, t[names.POST_NORM], cfg.rms_norm_eps)
    if mlp is not None:
        return ops.add(x, mlp(normed)).output(0)
    dense = [ov_ops.weight(t[name], formats.dense_mlp) for name in (names.GATE, names.UP, names.DOWN)]
    return ops.add(x, ov_ops.swiglu(normed, *dense)).output(0)


def _plus(x: ov.Output, bias: np.ndarray) -> ov.Output:
    return ops.add(x, ov_ops.const(np.asarray(bias, np.float32))).output(0)


# ---- the ends of the model and the state of a stream ------------------------------------------------------------
def embedded(cfg: LlamaConfig, x: np.ndarray, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The embedding table's rows are the first layer's input."""
    return x


def head_input(cfg: LlamaConfig, h: np.ndarray) -> np.ndarray:
    """The final norm's output is the LM head's input."""
    return h


def slot_state(cfg: LlamaConfig, kv: KeyStore, slots: int, fmt: StateFormat, rewind: int) -> SlotState:
    """A layer's state for `slots` streams: its keys and values in `kv`, nothing more."""
    return SlotState(kv)
