"""Each family's layer on the host, one module per family (`cascadia.models` describes the model; these run it),
chosen by the family module a config belongs to. A module holds:

- `build_layer(cfg, layer, tensors, formats, compile, dense_slices, compile_grouped, fused)`: a decoder layer (its
  FP32 host weights and compiled blocks, a `cascadia.engine.mlp.Mlp`) whose `forward(x, rows, state)` computes it in
  the reference's order, from its float32 tensors by name relative to its prefix (`Checkpoint.layer`).
  `dense_slices`: run a dense MLP as that many all-active expert slices through the fused MoE graph;
  `compile_grouped`: also compile a MoE layer's experts expert-grouped (`graphs.moe_grouped`), for the engine to
  choose between the two by rows (`Mlp.grouped_from`, unset here); `fused=False` with it: the grouped graph alone
  (for an engine that runs it at every call size);
- `slot_state(cfg, kv, slots, fmt, rewind)`: a layer's per-stream state, keys and values in `kv` and whatever else
  the family keeps (`nbytes`, `release(slot)`, `fork(source, target)`: a new stream's state as another's stands);
- `embedded(cfg, x, tensors)` and `head_input(cfg, h)`: what the family does between the embedding table and the
  first layer, and between the final norm and the LM head.
- where the family's stages can run as one graph (`runtime.stage_graph`, `spec.types.STAGE_GRAPH_FAMILIES`):
  `graph_layer(cfg, layer, tensors, formats, x, attend)`, the layer built into that graph around the attention the
  stage graph builds (`cascadia.engine.stage_graph`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cascadia import models
from cascadia.engine.families import deepseek_v3, inkling, llama, qwen3_moe

HOST_LAYERS: dict[ModuleType, ModuleType] = {models.inkling: inkling, models.llama: llama,
                                             models.qwen3_moe: qwen3_moe, models.deepseek_v3: deepseek_v3}


def host_layers(config: Any) -> ModuleType:
    """The module that runs the layers of a config's family."""
    return HOST_LAYERS[models.family(config)]
