"""One Qwen3-MoE decoder layer on the host: a Llama's (`cascadia.engine.families.llama`: its attention, RoPE and
state), with q and k normed per head after their biases and before RoPE, and on MoE layers its experts in place of
the dense MLP, chosen by its router (`Router`) and run by the shared MoE blocks (`cascadia.engine.mlp`), without
shared experts.

    DecoderLayer.forward(x [T, H])
      q, k|v = qkv(input_layernorm(x)) (+ bias)           compiled
      q, k = q_norm(q), k_norm(k)                         per head
      q, k = rope(q), rope(k)
      x = x + o_proj(attention(q, k, v)) (+ bias)         compiled o_proj
      h = post_attention_layernorm(x)
      x = x + experts(h, router(h))                       MoE layers, compiled, fused or expert-grouped by rows
            | mlp(h)                                      dense layers (mlp_only_layers, decoder_sparse_step)

Shapes: T rows of one call, H hidden, E experts, k chosen per row, I an expert's width.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine import ov_ops
from cascadia.engine.families import llama
from cascadia.engine.families.llama import DecoderLayer, attention_parts, embedded, head_input, slot_state
from cascadia.engine.layer_build import (Chunk, Chunks, Compile, CompileGrouped, expert_weights, moe_blocks,
                                         swiglu_block)
from cascadia.engine.layers import Routing, router_logits, softmax
from cascadia.models import qwen3_moe as names
from cascadia.models.qwen3_moe import Qwen3MoeConfig
from cascadia.spec.types import WeightFormats

__all__ = ["Router", "build_layer", "embedded", "graph_layer", "head_input", "slot_state"]


@attrs.frozen(eq=False)
class Router:
    """Logits over the experts in FP32, their softmax, the top k of it as each row's experts and weights, divided by
    their sum when `normalise` (`norm_topk_prob`); no shared expert."""

    weight: np.ndarray  # [E, H]
    top_k: int
    normalise: bool

    def __call__(self, h: np.ndarray) -> Routing:
        probabilities = softmax(router_logits(h, self.weight), axis=1)
        index = np.argpartition(-probabilities, self.top_k - 1, axis=1)[:, :self.top_k]
        weights = np.take_along_axis(probabilities, index, axis=1)
        if self.normalise:
            weights = weights / weights.sum(axis=1, keepdims=True)
        return Routing(index.astype(np.int32), weights, np.zeros((len(h), 0), np.float32))


def _routed(cfg: Qwen3MoeConfig, t: Mapping[str, np.ndarray]) -> Chunks:
    """A layer's routed experts' gate, up and down stacks, `per` experts at a time (None: whole)."""
    def chunks(per: int | None) -> Iterator[Chunk]:
        step = per or cfg.num_experts
        for first in range(0, cfg.num_experts, step):
            experts = range(first, min(first + step, cfg.num_experts))
            yield tuple(np.stack([t[names.expert(j, projection)] for j in experts])
                        for projection in ("gate", "up", "down"))
    return chunks


def build_layer(cfg: Qwen3MoeConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                compile: Compile, dense_slices: int | None = None, compile_grouped: CompileGrouped | None = None,
                fused: bool = True) -> DecoderLayer:
    """Layer `layer` from its float32 tensors `t` by name relative to its prefix (`Checkpoint.layer`; experts are
    read one at a time where an integer format streams them). `cascadia.engine.families` says what the other
    arguments do."""
    parts = attention_parts(cfg, layer, t, formats, compile) | {"q_norm": t[names.Q_NORM], "k_norm": t[names.K_NORM]}
    post_norm = parts["post_norm"]
    if not cfg.is_sparse(layer):
        mlp, divisor = swiglu_block(t[names.GATE], t[names.UP], t[names.DOWN], post_norm, formats.dense_mlp, compile,
                                    dense_slices)
        return DecoderLayer(**parts, mlp=mlp, up_divisor=divisor, dense_slices=dense_slices)

    mlp, grouped, divisor = moe_blocks(_routed(cfg, t), cfg.num_experts, None, 0, cfg.num_experts_per_tok, formats,
                                       post_norm, compile if fused else None, compile_grouped)
    router = Router(t[names.ROUTER], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return DecoderLayer(**parts, mlp=mlp, up_divisor=divisor, router=router, grouped=grouped)


def graph_layer(cfg: Qwen3MoeConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                x: ov.Output, attend: llama.Attend) -> ov.Output:
    """Layer `layer` built into a stage graph (`llama.graph_layer`) with q and k normed per head and, on MoE layers,
    the router (softmax of its logits, top k, divided by their sum where `norm_topk_prob`) and the experts in the
    tiled form the CPU plugin fuses."""
    def experts(normed: ov.Output) -> ov.Output:
        logits = ov_ops.linear(normed, ov_ops.const(np.asarray(t[names.ROUTER], np.float32)))
        top = ops.topk(ops.softmax(logits, -1), ov_ops.const(np.int64(cfg.num_experts_per_tok)), -1, "max", "value",
                       ov.Type.i32)
        weights, index = top.output(0), top.output(1)
        if cfg.norm_topk_prob:
            weights = ops.divide(weights, ops.reduce_sum(weights, ov_ops.ints(-1), True)).output(0)
        fmt = formats.routed_experts  # an integer format's stacks quantised an expert at a time
        stacks = expert_weights(_routed(cfg, t)(1 if fmt.is_integer else None), cfg.num_experts, fmt)
        return ov_ops.tiled_experts(normed, *(ov_ops.weight(w, fmt) for w in stacks), cfg.num_experts,
                                    cfg.hidden_size, index, weights)

    return llama.graph_layer(cfg, layer, t, formats, x, attend, t[names.Q_NORM], t[names.K_NORM],
                             experts if cfg.is_sparse(layer) else None)
