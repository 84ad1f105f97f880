"""Every tensor of an Inkling text checkpoint: its name (as transformers' `save_pretrained` writes it), its shape,
its weight-format group and the dataflow op it belongs to.

This is the one module that spells checkpoint names; the graph's parameter counts, the checkpoint reader, the
engine's layers and the random-checkpoint writer all take them from here. Shapes follow `modeling_inkling.py`.
"""

from __future__ import annotations

from cascadia.model_config import InklingConfig

EMBED = "model.embed_tokens.weight"
EMBED_NORM = "model.embed_tokens.embed_norm.weight"
FINAL_NORM = "model.norm.weight"
HEAD = "lm_head.weight"
MTP_PREFIX = "model.mtp."  # multi-token-prediction layers: listed apart, not part of the text model's forward
_IGNORED_PREFIXES = ("model.vision_tower.", "model.audio_tower.")
_MULTIMODAL_TEXT_PREFIX = "model.language_model."

# Names within a decoder layer (after `layer_prefix`), by module of InklingDecoderLayer.
INPUT_NORM = "input_layernorm.weight"
POST_NORM = "post_attention_layernorm.weight"
Q_PROJ, K_PROJ, V_PROJ, R_PROJ, O_PROJ = (f"self_attn.{p}_proj.weight" for p in "qkvro")
K_SCONV, V_SCONV = "self_attn.k_sconv.conv1d.weight", "self_attn.v_sconv.conv1d.weight"
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
REL_BANK = "self_attn.rel_logits_proj.proj"  # [d_rel, extent]: bias profiles over backward distance
ATTN_SCONV, MLP_SCONV = "attn_sconv.conv1d.weight", "mlp_sconv.conv1d.weight"
DENSE_GATE, DENSE_UP, DENSE_DOWN = (f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
DENSE_SCALE = "mlp.global_scale"
ROUTER, ROUTER_SCALE, ROUTER_CORRECTION = "mlp.gate.weight", "mlp.gate.global_scale", "mlp.gate.e_score_correction_bias"
EXPERTS_GATE_UP, EXPERTS_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
SHARED_GATE, SHARED_UP, SHARED_DOWN = (f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down"))

# Tensor groups, as in the spec's `formats`; "vector" marks small tensors kept in f32 whatever the format.
VECTOR = "vector"

# The dataflow op each layer tensor belongs to, by name prefix (the first that matches: "mlp.gate." before the
# dense "mlp."). The op kinds, in dataflow order, are `cascadia.graph.costs.LAYER_KINDS`.
_OP_PREFIXES = (
    ("input_layernorm.", "input_norm"),
    ("post_attention_layernorm.", "post_norm"),
    ("self_attn.", "attention"),
    ("attn_sconv.", "attn_sconv"),
    ("mlp_sconv.", "mlp_sconv"),
    ("mlp.gate.", "router"),
    ("mlp.experts.", "routed_experts"),
    ("mlp.shared_experts.", "shared_experts"),
    ("mlp.", "dense_mlp"),
)
# transformers' `_keep_in_fp32_modules_strict` for Inkling: these stay float32 in a bf16 checkpoint.
_KEPT_F32 = ("sconv.conv1d.weight", "e_score_correction_bias", "gate.global_scale")


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_tensors(cfg: InklingConfig, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer."""
    n_heads, n_kv, head_dim = cfg.heads(layer)
    hidden, kernel = cfg.hidden_size, cfg.conv_kernel_size
    kv_width = n_kv * head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {
        INPUT_NORM: ((hidden,), VECTOR),
        POST_NORM: ((hidden,), VECTOR),
        Q_PROJ: ((n_heads * head_dim, hidden), "attention"),
        K_PROJ: ((kv_width, hidden), "attention"),
        V_PROJ: ((kv_width, hidden), "attention"),
        R_PROJ: ((n_heads * cfg.d_rel, hidden), "attention"),
        O_PROJ: ((hidden, n_heads * head_dim), "attention"),
        K_SCONV: ((kv_width, 1, kernel), VECTOR),
        V_SCONV: ((kv_width, 1, kernel), VECTOR),
        Q_NORM: ((head_dim,), VECTOR),
        K_NORM: ((head_dim,), VECTOR),
        REL_BANK: ((cfg.d_rel, cfg.layer_rel_extent(layer)), VECTOR),
        ATTN_SCONV: ((hidden, 1, kernel), VECTOR),
        MLP_SCONV: ((hidden, 1, kernel), VECTOR),
    }
    if cfg.is_dense(layer):
        width = cfg.intermediate_size
        out |= {
            DENSE_GATE: ((width, hidden), "dense_mlp"),
            DENSE_UP: ((width, hidden), "dense_mlp"),
            DENSE_DOWN: ((hidden, width), "dense_mlp"),
            DENSE_SCALE: ((1,), VECTOR),
        }
    else:
        n_exp, n_shared, width = cfg.n_routed_experts, cfg.n_shared_experts, cfg.moe_intermediate_size
        out |= {
            ROUTER: ((n_exp + n_shared, hidden), VECTOR),  # routing is computed in FP32
            ROUTER_SCALE: ((1,), VECTOR),
            ROUTER_CORRECTION: ((n_exp,), VECTOR),
            EXPERTS_GATE_UP: ((n_exp, 2 * width, hidden), "routed_experts"),
            EXPERTS_DOWN: ((n_exp, hidden, width), "routed_experts"),
            SHARED_GATE: ((n_shared, width, hidden), "shared_experts"),
            SHARED_UP: ((n_shared, width, hidden), "shared_experts"),
            SHARED_DOWN: ((n_shared, hidden, width), "shared_experts"),
        }
    return out


def embedding_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    return {EMBED: ((cfg.vocab_size, cfg.hidden_size), "embedding"), EMBED_NORM: ((cfg.hidden_size,), VECTOR)}


def head_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Final norm and LM head. transformers always builds a `vocab_size`-row head; logits beyond
    `unpadded_vocab_size` are dropped after the matmul."""
    return {FINAL_NORM: ((cfg.hidden_size,), VECTOR), HEAD: ((cfg.vocab_size, cfg.hidden_size), "head")}


def all_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every text-model tensor by full checkpoint name."""
    out = dict(embedding_tensors(cfg))
    for layer in range(cfg.num_hidden_layers):
        out |= {layer_prefix(layer) + k: v for k, v in layer_tensors(cfg, layer).items()}
    out |= head_tensors(cfg)
    return out


def op_kind(name: str) -> str:
    """The dataflow op of a layer tensor, from its name relative to the layer prefix (e.g. `Q_PROJ`: "attention")."""
    for prefix, kind in _OP_PREFIXES:
        if name.startswith(prefix):
            return kind
    raise KeyError(f"no op kind for layer tensor {name!r}")


def canonical_name(stored: str) -> str | None:
    """The text-model name of a stored tensor (as this module spells it), or None for tensors Cascadia ignores.
    Multimodal checkpoints keep the text model under `model.language_model.`."""
    if stored.startswith(_IGNORED_PREFIXES):
        return None
    if stored.startswith(_MULTIMODAL_TEXT_PREFIX):
        return "model." + stored.removeprefix(_MULTIMODAL_TEXT_PREFIX)
    return stored


def kept_f32(name: str) -> bool:
    """Whether a bf16 checkpoint stores this tensor in float32 anyway (as transformers saves Inkling)."""
    return name.endswith(_KEPT_F32)


# ---- what a tensor holds, for drawing random ones ------------------------------------------------------------------
def is_gain(name: str) -> bool:
    """Norm weights and global scales: multipliers near 1."""
    return name.endswith(("norm.weight", "global_scale"))


def is_short_conv(name: str) -> bool:
    return name.endswith("conv1d.weight")


def is_routing_correction(name: str) -> bool:
    return name.endswith(ROUTER_CORRECTION.rsplit(".", 1)[1])


def fan_in(name: str, shape: tuple[int, ...]) -> int:
    """The inputs each output of a matrix sums over: its last axis ([..., out, in]), except the relative-bias bank,
    applied as `relative_states @ bank`, whose first axis it is."""
    return shape[0] if name.endswith(REL_BANK) else shape[-1]
