"""Checkpoint names every family shares, as transformers' `save_pretrained` writes them: the embedding, the final
norm, the LM head and the decoder layers' prefix; the weight-format group of small tensors; and how a family's
tensors make up a checkpoint."""

from __future__ import annotations

from collections.abc import Iterable

Tensors = dict[str, tuple[tuple[int, ...], str]]  # {name: (shape, weight-format group)}

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
HEAD = "lm_head.weight"

# Tensor groups, as in the spec's `formats`; "vector" marks small tensors kept in f32 whatever the format.
VECTOR = "vector"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def checkpoint_tensors(embedding: Tensors, layers: Iterable[Tensors], head: Tensors) -> Tensors:
    """Every tensor by full checkpoint name: the embedding's, each decoder layer's (named relative to its prefix) in
    order, the head's."""
    out = dict(embedding)
    for layer, tensors in enumerate(layers):
        out |= {layer_prefix(layer) + name: value for name, value in tensors.items()}
    return out | head


def op_by_prefix(name: str, prefixes: Iterable[tuple[str, str]]) -> str:
    """The dataflow op of a layer tensor (named relative to its prefix): that of the first (prefix, op) it starts
    with."""
    for prefix, kind in prefixes:
        if name.startswith(prefix):
            return kind
    raise KeyError(f"no op kind for layer tensor {name!r}")
