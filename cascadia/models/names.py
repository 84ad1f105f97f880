"""Checkpoint names every family shares, as transformers' `save_pretrained` writes them: the embedding, the final
norm, the LM head and the decoder layers' prefix; and the weight-format group of small tensors."""

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
HEAD = "lm_head.weight"

# Tensor groups, as in the spec's `formats`; "vector" marks small tensors kept in f32 whatever the format.
VECTOR = "vector"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."
