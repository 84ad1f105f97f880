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


def expert(j: int, projection: str) -> str:
    """Routed expert j's `gate`, `up` or `down` projection relative to the layer prefix, as released checkpoints and
    `save_pretrained` name them one expert at a time (Qwen3-MoE, DeepSeek-V3)."""
    return f"mlp.experts.{j}.{projection}_proj.weight"


def expert_tensors(n: int, width: int, hidden: int) -> Tensors:
    """The gate, up and down projections of `n` routed experts `width` wide, named by `expert`."""
    shapes = (("gate", (width, hidden)), ("up", (width, hidden)), ("down", (hidden, width)))
    return {expert(j, projection): (shape, "routed_experts") for j in range(n) for projection, shape in shapes}


Stacked = tuple[tuple[int, ...], list[tuple[str, int]]]  # a stored stack's shape, and each part's name and first row


def stacked_experts(stored: str, n: int, hidden: int, width: int) -> Stacked | None:
    """A layer's `n` experts (each `width` wide) as transformers holds them in memory, and saves them with
    `save_original_format=False`: `mlp.experts.gate_up_proj` [n, 2 width, hidden] (each expert's gate rows, then its
    up rows) and `mlp.experts.down_proj` [n, hidden, width]. Their shape, and each expert's tensor (as `expert`
    names it) with its first row of the stack's first two axes flattened; None for any other stored tensor."""
    prefix, sep, rest = stored.partition("mlp.experts.")
    if not sep or rest not in ("gate_up_proj", "down_proj"):
        return None
    if rest == "down_proj":
        return (n, hidden, width), [(prefix + expert(j, "down"), j * hidden) for j in range(n)]
    return (n, 2 * width, hidden), [(prefix + expert(j, projection), (2 * j + half) * width)
                                    for j in range(n) for half, projection in enumerate(("gate", "up"))]
