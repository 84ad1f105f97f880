"""Every tensor of an Inkling text checkpoint: its name (as transformers' `save_pretrained` writes it) and shape.

This is the one place that knows the checkpoint layout; the graph's parameter counts, the checkpoint reader's
validation and the random-checkpoint writer all read it. Shapes follow `modeling_inkling.py`.
"""

from __future__ import annotations

from cascadia.model_config import InklingConfig

EMBED = "model.embed_tokens.weight"
EMBED_NORM = "model.embed_tokens.embed_norm.weight"
FINAL_NORM = "model.norm.weight"
HEAD = "lm_head.weight"

# Tensor groups, as in the spec's `formats`; "vector" marks small tensors kept in f32 whatever the format.
VECTOR = "vector"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def layer_tensors(cfg: InklingConfig, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer."""
    n_heads, n_kv, head_dim = cfg.heads(layer)
    hidden, kernel = cfg.hidden_size, cfg.conv_kernel_size
    kv_width = n_kv * head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "input_layernorm.weight": ((hidden,), VECTOR),
        "post_attention_layernorm.weight": ((hidden,), VECTOR),
        "self_attn.q_proj.weight": ((n_heads * head_dim, hidden), "attention"),
        "self_attn.k_proj.weight": ((kv_width, hidden), "attention"),
        "self_attn.v_proj.weight": ((kv_width, hidden), "attention"),
        "self_attn.r_proj.weight": ((n_heads * cfg.d_rel, hidden), "attention"),
        "self_attn.o_proj.weight": ((hidden, n_heads * head_dim), "attention"),
        "self_attn.k_sconv.conv1d.weight": ((kv_width, 1, kernel), VECTOR),
        "self_attn.v_sconv.conv1d.weight": ((kv_width, 1, kernel), VECTOR),
        "self_attn.q_norm.weight": ((head_dim,), VECTOR),
        "self_attn.k_norm.weight": ((head_dim,), VECTOR),
        "self_attn.rel_logits_proj.proj": ((cfg.d_rel, cfg.layer_rel_extent(layer)), VECTOR),
        "attn_sconv.conv1d.weight": ((hidden, 1, kernel), VECTOR),
        "mlp_sconv.conv1d.weight": ((hidden, 1, kernel), VECTOR),
    }
    if cfg.is_dense(layer):
        width = cfg.intermediate_size
        out |= {
            "mlp.gate_proj.weight": ((width, hidden), "dense_mlp"),
            "mlp.up_proj.weight": ((width, hidden), "dense_mlp"),
            "mlp.down_proj.weight": ((hidden, width), "dense_mlp"),
            "mlp.global_scale": ((1,), VECTOR),
        }
    else:
        n_exp, n_shared, width = cfg.n_routed_experts, cfg.n_shared_experts, cfg.moe_intermediate_size
        out |= {
            "mlp.gate.weight": ((n_exp + n_shared, hidden), VECTOR),  # routing is computed in FP32
            "mlp.gate.global_scale": ((1,), VECTOR),
            "mlp.gate.e_score_correction_bias": ((n_exp,), VECTOR),
            "mlp.experts.gate_up_proj": ((n_exp, 2 * width, hidden), "routed_experts"),
            "mlp.experts.down_proj": ((n_exp, hidden, width), "routed_experts"),
            "mlp.shared_experts.gate_proj": ((n_shared, width, hidden), "shared_experts"),
            "mlp.shared_experts.up_proj": ((n_shared, width, hidden), "shared_experts"),
            "mlp.shared_experts.down_proj": ((n_shared, hidden, width), "shared_experts"),
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
