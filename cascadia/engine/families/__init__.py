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
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cascadia import models
from cascadia.engine.families import inkling, llama, qwen3_moe
from cascadia.models.base import UnsupportedModel

HOST_LAYERS: dict[ModuleType, ModuleType] = {models.inkling: inkling, models.llama: llama,
                                             models.qwen3_moe: qwen3_moe}


def host_layers(config: Any) -> ModuleType:
    """The module that runs the layers of a config's family; `UnsupportedModel` for a family it does not run."""
    described = models.family(config)
    if described not in HOST_LAYERS:
        runs = ", ".join(t for t, f in models.FAMILIES.items() if f in HOST_LAYERS)
        raise UnsupportedModel(f"model_type {config.model_type!r}: the engine does not run this family yet (it plans "
                               f"and simulates it); it runs {runs}")
    return HOST_LAYERS[described]
