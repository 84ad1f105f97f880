"""The Qwen3-MoE family (transformers' `Qwen3MoeForCausalLM`): its configuration and every tensor of its
checkpoints.

As a Llama (its config extends `LlamaConfig`), plus a per-head RMSNorm of q and of k before RoPE, and MoE layers:
a softmax router over `num_experts` (`num_local_experts` in the newest configs) choosing `num_experts_per_tok`,
their weights renormalised to sum to one when `norm_topk_prob`, and no shared expert. A layer is MoE unless
`mlp_only_layers` names it or `decoder_sparse_step` skips it; the others are a dense SwiGLU of `intermediate_size`.
There is no `head_dim` field: a config.json that has one sets it, else hidden / heads. Expert tensors are named
one expert at a time (`mlp.experts.J.gate_proj.weight`), as released checkpoints and `save_pretrained` write them.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar

import attrs
import numpy as np

from cascadia.models import llama, names
from cascadia.models.base import LayerKind
from cascadia.models.llama import LlamaConfig
from cascadia.models.names import VECTOR, Tensors, checkpoint_tensors, op_by_prefix

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = ("Qwen3MoeForCausalLM",)
ALIASES = {"num_local_experts": "num_experts"}


@attrs.frozen(kw_only=True)
class Qwen3MoeConfig(LlamaConfig):
    model_type: ClassVar[str] = "qwen3_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # the dense layers' MLP
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_sliding_window: bool = False
    moe_intermediate_size: int = 768  # one expert's width
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> Qwen3MoeConfig:
        d = dict(raw)
        for alias, name in ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        if "mlp_only_layers" in d and d["mlp_only_layers"] is None:  # transformers' None: no layer
            del d["mlp_only_layers"]
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        del d["mlp_bias"]  # not a Qwen3-MoE key
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["model_type"], d["architectures"] = "qwen3_moe", ["Qwen3MoeForCausalLM"]
        return d

    def problems(self) -> list[str]:
        out = [p for p in super().problems() if not p.startswith("hidden_size must be a multiple")]  # not asked
        if out:
            return out
        for name in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if out:
            return out
        if self.num_experts_per_tok > self.num_experts:
            out.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.use_sliding_window:
            out.append("use_sliding_window: sliding-window attention is not supported for qwen3_moe")
        if self.mlp_bias:
            out.append("mlp_bias: not a Qwen3-MoE key")
        return out

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule: MoE unless mlp_only_layers names the layer or decoder_sparse_step skips it."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def mlp_kind(self, layer: int) -> LayerKind:
        return LayerKind.MOE if self.is_sparse(layer) else LayerKind.DENSE

    @property
    def routed_experts(self) -> tuple[int, int]:
        return (self.num_experts, self.num_experts_per_tok) if any(map(self.is_sparse, range(self.num_hidden_layers))) \
            else (0, 0)


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The keys of a Qwen3-MoE config (all at its top level)."""
    return dict(raw)


_HINTS = typing.get_type_hints(Qwen3MoeConfig)
FIELD_TYPES: dict[str, Any] = {f.name: _HINTS[f.name] for f in attrs.fields(Qwen3MoeConfig)
                               if f.name not in ("rope_scaling", "mlp_only_layers")}
FIELD_TYPES.update({"rope_scaling": dict | None, "rope_parameters": dict | None, "mlp_only_layers": list[int] | None,
                    "num_local_experts": int})
Qwen3MoeConfig.FIELD_TYPES = FIELD_TYPES
Config = Qwen3MoeConfig


# ---- checkpoint tensors --------------------------------------------------------------------------------------------
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
GATE, UP, DOWN = llama.GATE, llama.UP, llama.DOWN  # a dense layer's MLP
ROUTER = "mlp.gate.weight"


expert = names.expert


_OP_PREFIXES = (("mlp.gate.", "router"), ("mlp.experts.", "routed_experts"), *llama.OP_PREFIXES)


def layer_tensors(cfg: Qwen3MoeConfig, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer: a Llama's, with q and k normed per
    head, and the experts and their router in place of the dense MLP on a MoE layer."""
    out = llama.layer_tensors(cfg, layer)
    head_dim = cfg.heads(layer)[2]
    out |= {Q_NORM: ((head_dim,), VECTOR), K_NORM: ((head_dim,), VECTOR)}
    if cfg.is_sparse(layer):
        for name in (GATE, UP, DOWN):
            del out[name]
        hidden, width = cfg.hidden_size, cfg.moe_intermediate_size
        out[ROUTER] = ((cfg.num_experts, hidden), VECTOR)  # routing is computed in FP32
        out |= names.expert_tensors(cfg.num_experts, width, hidden)
    return out


embedding_tensors = llama.embedding_tensors
head_tensors = llama.head_tensors


def all_tensors(cfg: Qwen3MoeConfig) -> Tensors:
    """Every tensor by full checkpoint name."""
    layers = (layer_tensors(cfg, layer) for layer in range(cfg.num_hidden_layers))
    return checkpoint_tensors(embedding_tensors(cfg), layers, head_tensors(cfg))


def op_kind(name: str) -> str:
    """The dataflow op of a layer tensor, from its name relative to the layer prefix."""
    return op_by_prefix(name, _OP_PREFIXES)


canonical_name = llama.canonical_name
is_mtp = llama.is_mtp
kept_f32 = llama.kept_f32


def stacked_parts(cfg: Qwen3MoeConfig, stored: str) -> tuple[tuple[int, ...], list[tuple[str, int]]] | None:
    """A layer's experts stacked as transformers holds them (`names.stacked_experts`); None for other tensors."""
    return names.stacked_experts(stored, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def random_values(name: str, shape: tuple[int, ...], noise: np.ndarray) -> np.ndarray:
    """As a Llama's: norm weights (q and k's too) near 1, matrices (the router's too) N(0, 1/fan_in)."""
    return llama.random_values(name, shape, noise)


# ---- costs that are no weight matmul -------------------------------------------------------------------------------
def extra_row_flops(cfg: Qwen3MoeConfig, layer: int) -> dict[str, float]:
    """The router's matmul, computed in FP32 (its weight is an f32 vector group)."""
    return {"router": 2.0 * cfg.num_experts * cfg.hidden_size} if cfg.is_sparse(layer) else {}


conv_history = llama.conv_history
conv_state_channels = llama.conv_state_channels


# ---- the dataflow between a layer's ops (`cascadia.graph.build`) -----------------------------------------------
ROUTING_BYTES = 8  # per selected expert: an f32 weight and an int32 index


def layer_flows(cfg: Qwen3MoeConfig, layer: int) -> tuple[list[tuple[str, str, str, int | None]], str]:
    """As a Llama's; on a MoE layer the router's choice goes to the experts, whose output is the residual stream."""
    if not cfg.is_sparse(layer):
        return llama.layer_flows(cfg, layer)
    return [("in", "input_norm", "residual", None), ("input_norm", "attention", "normed", None),
            ("in", "attention", "residual", None), ("attention", "post_norm", "residual", None),
            ("post_norm", "router", "normed", None), ("post_norm", "routed_experts", "normed", None),
            ("router", "routed_experts", "routing", cfg.num_experts_per_tok * ROUTING_BYTES),
            ("attention", "routed_experts", "residual", None)], "routed_experts"
