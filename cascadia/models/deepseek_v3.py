"""The DeepSeek-V3 family (transformers' `DeepseekV3ForCausalLM`: DeepSeek-V3 and R1, Kimi K2): its configuration
and every tensor of its checkpoints.

Every layer is multi-head latent attention (MLA): the query through a low-rank `q_a_proj` (normed) and `q_b_proj`
(or one `q_proj` where `q_lora_rank` is null), and per position one latent of `kv_lora_rank` values plus one key
part of `qk_rope_head_dim` shared by all heads (`kv_a_proj_with_mqa`), which `kv_b_proj` expands into each head's
key (`qk_nope_head_dim`, beside the rotated part) and value (`v_head_dim`). A stream keeps the latent and the rotated
key part, nothing per head: decode attends in the latent (the absorbed form), q.k over kv_lora_rank +
qk_rope_head_dim values and p.v over kv_lora_rank per head and position.
The first `first_k_dense_replace` layers are a dense SwiGLU; the rest route each row to `num_experts_per_tok` of
`n_routed_experts` (sigmoid scores plus a correction bias that only selects, within the best `topk_group` of
`n_group` groups; weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`), beside
`n_shared_experts` shared experts run as one MLP `n_shared_experts` times as wide.
RoPE may be YaRN-scaled, as the published configs are. Released checkpoints also hold a multi-token-prediction layer
after the last (`num_nextn_predict_layers`), which transformers ignores and so does this description.
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
from cascadia.models.rope import ROPE_TYPES, YARN

MODEL_TYPES = ("deepseek_v3",)
ARCHITECTURES = ("DeepseekV3ForCausalLM",)
ALIASES = {"num_local_experts": "n_routed_experts", "num_nextn_predict_layers": "num_mtp_layers"}


@attrs.frozen(kw_only=True)
class DeepseekV3Config(LlamaConfig):
    model_type: ClassVar[str] = "deepseek_v3"
    ROPE_TYPES: ClassVar[tuple[str, ...]] = (*ROPE_TYPES, YARN)  # planned with; the engine rotates ROPE_TYPES'

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # the dense layers' MLP
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    moe_intermediate_size: int = 2048  # one expert's width
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536  # None: one q_proj
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool = True
    num_mtp_layers: int = 1  # layers after the last that predict further tokens (not part of the model run)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)  # as transformers sets it: the rotated width

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DeepseekV3Config:
        d = dict(raw)
        for alias, name in ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        for derived in ("head_dim", "qk_head_dim"):  # what transformers derives and may save beside the rest
            d.pop(derived, None)
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        for name in ("mlp_bias", "head_dim"):  # no keys of DeepSeek-V3's: head_dim is derived
            del d[name]
        d["model_type"], d["architectures"] = "deepseek_v3", ["DeepseekV3ForCausalLM"]
        return d

    def problems(self) -> list[str]:
        out = [p for p in super().problems() if not p.startswith("hidden_size must be a multiple")]  # not asked
        if out:
            return out
        for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_mtp_layers"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            out.append(f"q_lora_rank must be a positive integer (or null), got {self.q_lora_rank!r}")
        if self.routed_scaling_factor <= 0:
            out.append(f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor!r}")
        if out:
            return out
        if self.n_routed_experts % self.n_group:
            out.append(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
        elif self.n_group > 1 and self.n_routed_experts // self.n_group < 2:  # a group scores by its top two
            out.append(f"n_group ({self.n_group}) leaves fewer than two experts a group")
        elif self.topk_group > self.n_group:
            out.append(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        elif self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            out.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                       f"({self.topk_group}) groups of {self.n_routed_experts // self.n_group}")
        if self.mlp_bias:
            out.append("mlp_bias: not a DeepSeek-V3 key")
        return out

    # ---- per-layer geometry --------------------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        """transformers' rule: MoE from layer first_k_dense_replace on (moe_layer_freq is not read)."""
        return layer >= self.first_k_dense_replace

    def mlp_kind(self, layer: int) -> LayerKind:
        return LayerKind.MOE if self.is_sparse(layer) else LayerKind.DENSE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def heads(self, layer: int) -> tuple[int, int, int]:
        """(query heads, key/value heads, query and key width) of the expanded form."""
        return self.num_attention_heads, self.num_attention_heads, self.qk_head_dim

    def kv_values(self, layer: int) -> int:
        """The latent and the shared rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_macs(self, layer: int) -> int:
        """Absorbed: each head's q.k over the latent and the rotated part, and p.v over the latent."""
        return self.num_attention_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def routed_experts(self) -> tuple[int, int]:
        return (self.n_routed_experts, self.num_experts_per_tok) \
            if self.num_hidden_layers > self.first_k_dense_replace else (0, 0)


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The keys of a DeepSeek-V3 config (all at its top level)."""
    return dict(raw)


_HINTS = typing.get_type_hints(DeepseekV3Config)
FIELD_TYPES: dict[str, Any] = {f.name: _HINTS[f.name] for f in attrs.fields(DeepseekV3Config)
                               if f.name != "rope_scaling"}
FIELD_TYPES.update({"rope_scaling": dict | None, "rope_parameters": dict | None, "num_local_experts": int,
                    "num_nextn_predict_layers": int, "qk_head_dim": int})
DeepseekV3Config.FIELD_TYPES = FIELD_TYPES
Config = DeepseekV3Config


# ---- checkpoint tensors --------------------------------------------------------------------------------------------
Q_PROJ, Q_A, Q_A_NORM, Q_B = (f"self_attn.{name}.weight" for name in ("q_proj", "q_a_proj", "q_a_layernorm",
                                                                      "q_b_proj"))
KV_A, KV_A_NORM, KV_B, O_PROJ = (f"self_attn.{name}.weight" for name in ("kv_a_proj_with_mqa", "kv_a_layernorm",
                                                                         "kv_b_proj", "o_proj"))
GATE, UP, DOWN = llama.GATE, llama.UP, llama.DOWN  # a dense layer's MLP
ROUTER, ROUTER_BIAS = "mlp.gate.weight", "mlp.gate.e_score_correction_bias"
expert = names.expert


def shared(projection: str) -> str:
    """The shared experts' `gate`, `up` or `down` projection (one MLP), relative to the layer prefix."""
    return f"mlp.shared_experts.{projection}_proj.weight"


_OP_PREFIXES = (("mlp.gate.", "router"), ("mlp.experts.", "routed_experts"), ("mlp.shared_experts.", "shared_experts"),
                *llama.OP_PREFIXES)


def layer_tensors(cfg: DeepseekV3Config, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[tuple[int, ...], str]] = {
        llama.INPUT_NORM: ((hidden,), VECTOR),
        llama.POST_NORM: ((hidden,), VECTOR),
    }
    if cfg.q_lora_rank is None:
        out[Q_PROJ] = ((heads * cfg.qk_head_dim, hidden), "attention")
    else:
        out |= {Q_A: ((cfg.q_lora_rank, hidden), "attention"), Q_A_NORM: ((cfg.q_lora_rank,), VECTOR),
                Q_B: ((heads * cfg.qk_head_dim, cfg.q_lora_rank), "attention")}
    out |= {KV_A: ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden), "attention"),
            KV_A_NORM: ((cfg.kv_lora_rank,), VECTOR),
            KV_B: ((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "attention"),
            O_PROJ: ((hidden, heads * cfg.v_head_dim), "attention")}
    if cfg.attention_bias:  # on the projections from the hidden row and on the output, as transformers has them
        out |= {name.replace(".weight", ".bias"): ((out[name][0][0],), VECTOR)
                for name in (Q_A, KV_A, O_PROJ) if name in out}
    if not cfg.is_sparse(layer):
        width = cfg.intermediate_size
        return out | {GATE: ((width, hidden), "dense_mlp"), UP: ((width, hidden), "dense_mlp"),
                      DOWN: ((hidden, width), "dense_mlp")}
    width, n = cfg.moe_intermediate_size, cfg.n_routed_experts
    out |= {ROUTER: ((n, hidden), VECTOR), ROUTER_BIAS: ((n,), VECTOR)}  # routing is computed in FP32
    out |= names.expert_tensors(n, width, hidden)
    if cfg.n_shared_experts:
        wide = width * cfg.n_shared_experts
        out |= {shared("gate"): ((wide, hidden), "shared_experts"), shared("up"): ((wide, hidden), "shared_experts"),
                shared("down"): ((hidden, wide), "shared_experts")}
    return out


embedding_tensors = llama.embedding_tensors
head_tensors = llama.head_tensors


def all_tensors(cfg: DeepseekV3Config) -> Tensors:
    """Every tensor by full checkpoint name."""
    layers = (layer_tensors(cfg, layer) for layer in range(cfg.num_hidden_layers))
    return checkpoint_tensors(embedding_tensors(cfg), layers, head_tensors(cfg))


def op_kind(name: str) -> str:
    """The dataflow op of a layer tensor, from its name relative to the layer prefix."""
    return op_by_prefix(name, _OP_PREFIXES)


canonical_name = llama.canonical_name


def is_mtp(cfg: DeepseekV3Config, name: str) -> bool:
    """Whether a stored tensor belongs to the multi-token-prediction layers released checkpoints hold after the
    last (`model.layers.N.*` .. for N = num_hidden_layers, num_mtp_layers of them), which transformers ignores."""
    prefix, _, rest = name.partition("model.layers.")
    index = rest.split(".", 1)[0]
    return not prefix and index.isdigit() and 0 <= int(index) - cfg.num_hidden_layers < cfg.num_mtp_layers


def kept_f32(name: str) -> bool:
    """The router's correction bias: a float32 buffer, whatever the checkpoint's dtype."""
    return name.endswith(ROUTER_BIAS)


def stacked_parts(cfg: DeepseekV3Config, stored: str) -> names.Stacked | None:
    """A layer's routed experts stacked as transformers holds them (`names.stacked_experts`); None for others."""
    return names.stacked_experts(stored, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def random_values(name: str, shape: tuple[int, ...], noise: np.ndarray) -> np.ndarray:
    """As a Llama's (the latent norms near 1, matrices and the router N(0, 1/fan_in)); the correction bias small,
    so that it reorders close scores only."""
    if name.endswith(ROUTER_BIAS):
        return np.float32(0.02) * noise
    return llama.random_values(name, shape, noise)


# ---- costs that are no weight matmul -------------------------------------------------------------------------------
def extra_row_flops(cfg: DeepseekV3Config, layer: int) -> dict[str, float]:
    """The router's matmul, computed in FP32 (its weight is an f32 vector group)."""
    return {"router": 2.0 * cfg.n_routed_experts * cfg.hidden_size} if cfg.is_sparse(layer) else {}


conv_history = llama.conv_history
conv_state_channels = llama.conv_state_channels


# ---- the dataflow between a layer's ops (`cascadia.graph.build`) -----------------------------------------------
ROUTING_BYTES = 8  # per selected expert: an f32 weight and an int32 index


def layer_flows(cfg: DeepseekV3Config, layer: int) -> tuple[list[tuple[str, str, str, int | None]], str]:
    """As a Llama's; on a MoE layer the router's choice goes to the routed experts, and the shared experts' output
    joins theirs, which is the residual stream."""
    if not cfg.is_sparse(layer):
        return llama.layer_flows(cfg, layer)
    flows = [("in", "input_norm", "residual", None), ("input_norm", "attention", "normed", None),
             ("in", "attention", "residual", None), ("attention", "post_norm", "residual", None),
             ("post_norm", "router", "normed", None), ("post_norm", "routed_experts", "normed", None),
             ("router", "routed_experts", "routing", cfg.num_experts_per_tok * ROUTING_BYTES),
             ("attention", "routed_experts", "residual", None)]
    if cfg.n_shared_experts:
        flows += [("post_norm", "shared_experts", "normed", None), ("shared_experts", "routed_experts", "shared_out",
                                                                    None)]
    return flows, "routed_experts"
