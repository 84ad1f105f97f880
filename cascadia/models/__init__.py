"""The model families Cascadia runs, one module each, chosen by the `model_type` a config names (as transformers
chooses a config's class, and mlx-lm a model's module): a plain dict, no registry.

A family module holds its `Config` (frozen; transformers' field names and defaults), `MODEL_TYPES`,
`ARCHITECTURES`, `FIELD_TYPES` and `ALIASES` (the keys a config may hold), `text_fields` (a config's text-model
keys), its checkpoint tensors (`layer_tensors`, `embedding_tensors`, `head_tensors`, `all_tensors`, `op_kind`,
`canonical_name`, `stacked_parts`: tensors a checkpoint may store stacked, `kept_f32`, `is_mtp`), what those
tensors hold (`random_values`, the draw of a random checkpoint), and the costs that are no weight matmul
(`extra_row_flops`, `conv_history`, `conv_state_channels`).
Everything downstream reads a model through `family(config)`; what every `Config` answers is
`cascadia.models.base.ModelConfig`; `layer_flows` gives the tensors a layer's ops pass each other, for the
dataflow graph.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from cascadia.errors import shown
from cascadia.models import deepseek_v3, inkling, llama, qwen3_moe
from cascadia.models.base import ConfigError, UnsupportedModel, read_config_json

FAMILIES: dict[str, ModuleType] = {model_type: module for module in (inkling, llama, qwen3_moe, deepseek_v3)
                                   for model_type in module.MODEL_TYPES}


def _supported() -> str:
    return f"(supported: {', '.join(FAMILIES)})"


def family_of(raw: dict[str, Any]) -> ModuleType:
    """The family of a transformers config dict (a config.json's, or a spec's inline fields), by its `model_type`,
    else by the classes its `architectures` lists. Refuses one that names another model before any of its fields is
    read, so that another family's config is never read as this one's defaults, and one that names neither (as
    transformers does): no config is read as some family's by default."""
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    families = list(dict.fromkeys(FAMILIES.values()))
    if model_type is not None:
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise UnsupportedModel(f"model_type {shown(model_type)} is not supported {_supported()}")
        families = [FAMILIES[model_type]]
    if architectures is not None:
        # as the model_type, when it names one, says: the classes may not name another family's model
        named = [f for f in families if isinstance(architectures, list)
                 and any(name in f.ARCHITECTURES for name in architectures)]
        if not named:
            known = ", ".join(name for f in families for name in f.ARCHITECTURES)
            raise UnsupportedModel(f"architectures {shown(architectures)} names no supported model "
                                   f"(supported: {known})")
        return named[0]
    if model_type is None:
        raise UnsupportedModel(f"model_type missing (a model config names its model's type; {_supported()[1:]}")
    return families[0]


def family(config: Any) -> ModuleType:
    """The family module of a config object (any family's `Config`)."""
    return FAMILIES[config.model_type]


def mtp_layers(config: Any) -> int:
    """The multi-token-prediction layers of a config that Cascadia can draft with (`cascadia.engine.mtp`): its
    `num_mtp_layers`, in a family that describes the layer (`mtp_config`, `mtp_tensors`: Inkling's); 0 otherwise."""
    return (getattr(config, "num_mtp_layers", None) or 0) if hasattr(family(config), "mtp_config") else 0


def config_from_hf_dict(raw: Any) -> Any:
    """The config of a transformers config dict, of the family it names (`family_of`)."""
    if not isinstance(raw, dict):
        raise ConfigError("expected a JSON object")
    return family_of(raw).Config.from_hf_dict(raw)


def read_fields(path: str | Path) -> tuple[ModuleType, dict[str, Any], Path]:
    """The family of a `config.json` (or of the one in folder `path`), its text-model keys and the file read.
    Raises `ConfigError` naming the file."""
    raw, path = read_config_json(path)
    try:
        found = family_of(raw)
        return found, found.text_fields(raw), path
    except ConfigError as e:
        raise type(e)(f"{path}: {e}") from None


def read_config(path: str | Path) -> Any:
    """The config of a `config.json` (or of the one in folder `path`), of the family it names."""
    raw, path = read_config_json(path)
    try:
        return config_from_hf_dict(raw)
    except ConfigError as e:
        raise type(e)(f"{path}: {e}") from None
