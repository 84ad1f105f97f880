"""One DeepSeek-V3 decoder layer on the host (`modeling_deepseek_v3.py`'s order), attending in the latent (the absorbed
form), and its build from a checkpoint's tensors.

transformers expands each position's latent c (normed) into every head's key k_nope = W_uk c and value v = W_uv c.
The absorbed form attends over c itself: q_nope . (W_uk c) = (W_uk^T q_nope) . c, and p . (W_uv c) = W_uv (p . c).
So a stream keeps [c, k_rot] per position, one "head" of kv_lora_rank + qk_rope_head_dim values that is both key
and value (`PagedKV` with `values_are_keys`), and each query head attends with [W_uk^T q_nope, q_rot]; the first
kv_lora_rank columns of its output, times W_uv, are that head's value. The same sums as the reference's, in
another order: f32 logits agree to about 1e-6. kv_b_proj's rows are compiled per head into the blocks before and
after the attention, in the attention's weight format.

    DecoderLayer.forward(x [T, H])
      q_a | kv_a = q_a_proj | kv_a_proj_with_mqa (input_layernorm(x)) (+ bias)     compiled
      q = q_b_proj(q_a_layernorm(q_a))              (or q_proj with no q_lora_rank) compiled query
      q_latent = W_uk^T q_nope, q_rot                                              in the same block
      c | k_rot = kv_a;  c = kv_a_layernorm(c)
      q_rot, k_rot = rope(q_rot), rope(k_rot)       YaRN, interleaved pairs where the config says
      o = attention([q_latent, q_rot], [c, k_rot])[:, :, :kv_lora_rank]           scaled by qk_head_dim^-0.5 m^2
      x = x + o_proj(W_uv o) (+ bias)                                              compiled output
      h = post_attention_layernorm(x)
      x = x + experts(h, router(h)) + shared(h)     MoE layers (from first_k_dense_replace on), compiled
            | mlp(h)                                dense layers

Shapes: T rows of one call, H hidden, h heads, L kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import numpy as np

from cascadia.engine import graphs
from cascadia.engine.attention import AttentionShape, attend_rows
from cascadia.engine.device import Compiled, CompiledBlock
from cascadia.engine.families.llama import SlotState, embedded, head_input, slot_state
from cascadia.engine.layer_build import Chunk, Compile, CompileGrouped, moe_blocks, swiglu_block
from cascadia.engine.layers import Routing, rms_norm, router_logits
from cascadia.engine.mlp import Mlp
from cascadia.engine.rope import cos_sin_factor, inverse_frequencies, rotate, yarn_mscale
from cascadia.engine.rows import Rows
from cascadia.models import deepseek_v3 as names
from cascadia.models import llama
from cascadia.models.deepseek_v3 import DeepseekV3Config
from cascadia.models.rope import YARN
from cascadia.spec.types import WeightFormats

__all__ = ["DecoderLayer", "Router", "build_layer", "embedded", "head_input", "slot_state"]

LATENT_EPS = 1e-6  # the q and kv latents' norms keep their class default, not rms_norm_eps


@attrs.frozen(eq=False)
class Router:
    """Sigmoid scores in FP32; each row's experts chosen on the scores plus the correction bias, among the experts of
    its best `topk_group` groups (a group scored by its two best); weighted by their unbiased scores, divided by
    their sum when `normalise`, times `scale`. The shared experts weigh 1 in every row."""

    weight: np.ndarray  # [E, H]
    bias: np.ndarray  # [E] e_score_correction_bias
    top_k: int
    groups: int
    topk_group: int
    normalise: bool
    scale: float
    shared: int  # shared experts (slices of the shared MLP), each of weight 1

    def __call__(self, h: np.ndarray) -> Routing:
        scores = np.float32(1) / (np.float32(1) + np.exp(-router_logits(h, self.weight)))
        choice = scores + self.bias
        if self.topk_group < self.groups:
            by_group = choice.reshape(len(h), self.groups, -1)
            best_two = np.sort(by_group, axis=2)[:, :, -2:].sum(axis=2)  # [T, groups]
            kept = np.argpartition(-best_two, self.topk_group - 1, axis=1)[:, :self.topk_group]
            mask = np.ones(best_two.shape, bool)
            np.put_along_axis(mask, kept, False, axis=1)
            choice = np.where(np.repeat(mask, by_group.shape[2], axis=1), np.float32(-np.inf), choice)
        index = np.argpartition(-choice, self.top_k - 1, axis=1)[:, :self.top_k]
        weights = np.take_along_axis(scores, index, axis=1)
        if self.normalise:
            weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
        weights = weights * np.float32(self.scale)
        return Routing(index.astype(np.int32), weights, np.ones((len(h), self.shared), np.float32))


@attrs.define(eq=False, slots=False, kw_only=True)  # no slots: calibration times a layer's methods by wrapping them
class DecoderLayer(Mlp):
    """A layer's FP32 host weights and compiled blocks (made by `build_layer`), its MLP's among them."""

    shape: AttentionShape  # h heads over one latent "head" of L + R values
    eps: float
    inv_freq: np.ndarray  # [R/2]
    rope_factor: float  # cos and sin times this (YaRN's attention factor)
    interleaved: bool
    q_width: int  # columns of the first projection: q_a (L_q) or, with no q_lora_rank, q (h (N + R))
    inputs: CompiledBlock  # x [T, H] -> q_a or q [T, q_width], kv_a [T, L + R]
    input_bias: np.ndarray | None  # [q_width + L + R]
    q_a_norm: np.ndarray | None  # [L_q]
    query: CompiledBlock  # q_a (normed) or q [T, q_width] -> q_latent [T, h L], q_rot [T, h R] (`graphs.latent_query`)
    kv_a_norm: np.ndarray  # [L]: its length is the latent's
    output: CompiledBlock  # [T, h L] -> [T, H] (`graphs.latent_output`)
    o_bias: np.ndarray | None  # [H]

    def blocks(self) -> list[Compiled]:
        return [block for block in (self.inputs, self.query, self.output, self.mlp, self.grouped) if block is not None]

    def forward(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream of the rows -> after this layer. Updates the rows' latents."""
        x = x + self.attention(x, rows, state)
        return x + self.feed_forward(rms_norm(x, self.post_norm, self.eps), rows.bucket)

    def attention(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream -> the attention's output [T, H], o_proj's (and its bias)."""
        q, kv = self.inputs(x, bucket=rows.bucket)
        if self.input_bias is not None:
            q, kv = q + self.input_bias[:self.q_width], kv + self.input_bias[self.q_width:]
        if self.q_a_norm is not None:
            q = rms_norm(q, self.q_a_norm, LATENT_EPS)
        q_latent, q_rot = self.query(q, bucket=rows.bucket)
        heads, latent = self.shape.heads, len(self.kv_a_norm)
        c, k_rot = rms_norm(kv[:, :latent], self.kv_a_norm, LATENT_EPS), kv[:, None, latent:]
        q_rot = rotate(q_rot.reshape(len(x), heads, -1), rows.positions, self.inv_freq, self.rope_factor,
                       self.interleaved)
        k_rot = rotate(k_rot, rows.positions, self.inv_freq, self.rope_factor, self.interleaved)
        query = np.concatenate([q_latent.reshape(len(x), heads, latent), q_rot], axis=-1)  # [T, h, L + R]
        key = np.concatenate([c[:, None], k_rot], axis=-1)  # [T, 1, L + R]
        no_bias = np.empty((len(x), heads, 0), np.float32)
        out = attend_rows(self.shape, query, key, key, no_bias, state.kv, rows).reshape(len(x), heads, -1)
        out = self.output(np.ascontiguousarray(out[..., :latent]).reshape(len(x), -1), bucket=rows.bucket)[0]
        return out if self.o_bias is None else out + self.o_bias


def _scale(cfg: DeepseekV3Config) -> float:
    """The scores' scale: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where it has one."""
    scale = cfg.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == YARN and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def attention_parts(cfg: DeepseekV3Config, t: Mapping[str, np.ndarray], formats: WeightFormats,
                    compile: Compile) -> dict:
    """A layer's attention (and the norm before its MLP), as `DecoderLayer` fields, from its tensors."""
    heads, latent, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    first = names.Q_PROJ if cfg.q_lora_rank is None else names.Q_A
    input_bias = o_bias = None
    if cfg.attention_bias:
        q_bias = np.zeros(t[first].shape[0], np.float32) if cfg.q_lora_rank is None else t[names.Q_A.replace(
            ".weight", ".bias")]
        input_bias = np.concatenate([q_bias, t[names.KV_A.replace(".weight", ".bias")]])
        o_bias = t[names.O_PROJ.replace(".weight", ".bias")]
    kv_b = t[names.KV_B].reshape(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, latent)
    w_uk = np.ascontiguousarray(kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))  # [h, L, N]: q_nope -> latent
    w_uv = np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim:])  # [h, V, L]: latent -> value
    q_b = None if cfg.q_lora_rank is None else t[names.Q_B]
    return dict(
        shape=AttentionShape(heads, 1, latent + rope, window=None, bias_extent=0, log_scaling=None,
                             scale=_scale(cfg), values_are_keys=True),
        eps=cfg.rms_norm_eps, post_norm=t[llama.POST_NORM],
        inv_freq=inverse_frequencies(rope, cfg.rope_theta, cfg.rope_scaling),
        rope_factor=cos_sin_factor(cfg.rope_scaling), interleaved=cfg.rope_interleave, q_width=t[first].shape[0],
        inputs=compile(graphs.attention_input([t[first], t[names.KV_A]], formats.attention,
                                              t[llama.INPUT_NORM], None, cfg.rms_norm_eps)),
        input_bias=input_bias, q_a_norm=None if q_b is None else t[names.Q_A_NORM],
        query=compile(graphs.latent_query(q_b, w_uk, rope, formats.attention)), kv_a_norm=t[names.KV_A_NORM],
        output=compile(graphs.latent_output(w_uv, t[names.O_PROJ], formats.attention)), o_bias=o_bias)


def build_layer(cfg: DeepseekV3Config, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                compile: Compile, dense_slices: int | None = None, compile_grouped: CompileGrouped | None = None,
                fused: bool = True) -> DecoderLayer:
    """Layer `layer` from its float32 tensors `t` by name relative to its prefix (`Checkpoint.layer`; experts are
    read one at a time where an integer format streams them). `cascadia.engine.families` says what the other
    arguments do."""
    parts = attention_parts(cfg, t, formats, compile)
    post_norm = parts["post_norm"]
    if not cfg.is_sparse(layer):
        mlp, divisor = swiglu_block(t[names.GATE], t[names.UP], t[names.DOWN], post_norm, formats.dense_mlp, compile,
                                    dense_slices)
        return DecoderLayer(**parts, mlp=mlp, up_divisor=divisor, dense_slices=dense_slices)
    n, shared = cfg.n_routed_experts, cfg.n_shared_experts

    def routed(per: int | None) -> Iterator[Chunk]:
        step = per or n
        for first in range(0, n, step):
            experts = range(first, min(first + step, n))
            yield tuple(np.stack([t[names.expert(j, projection)] for j in experts])
                        for projection in ("gate", "up", "down"))

    def shared_slices(per: int | None) -> Iterator[Chunk]:
        """The shared MLP (width n_shared x moe_intermediate_size) as n_shared experts of the routed width: the
        sum of their outputs is its output."""
        gate, up, down = (t[names.shared(projection)] for projection in ("gate", "up", "down"))
        width = cfg.moe_intermediate_size
        stacks = (gate.reshape(shared, width, -1), up.reshape(shared, width, -1),
                  np.ascontiguousarray(down.reshape(len(down), shared, width).transpose(1, 0, 2)))
        step = per or shared
        for first in range(0, shared, step):
            yield tuple(stack[first:first + step] for stack in stacks)

    mlp, grouped, divisor = moe_blocks(routed, n, shared_slices if shared else None, shared,
                                       cfg.num_experts_per_tok, formats, post_norm, compile if fused else None,
                                       compile_grouped)
    router = Router(t[names.ROUTER], t[names.ROUTER_BIAS], cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                    cfg.norm_topk_prob, cfg.routed_scaling_factor, shared)
    return DecoderLayer(**parts, mlp=mlp, up_divisor=divisor, router=router, grouped=grouped)
