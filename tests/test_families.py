"""The families' seam: every family the config dict names answers the description the rest of Cascadia reads
(`cascadia.models`' docstring), and the engine runs its layers (`cascadia.engine.families`' docstring)."""

from __future__ import annotations

import pytest

from cascadia.engine.families import HOST_LAYERS, host_layers
from cascadia.models import FAMILIES, config_from_hf_dict, family

DESCRIPTION = ("Config", "MODEL_TYPES", "ARCHITECTURES", "FIELD_TYPES", "ALIASES", "is_mtp", "text_fields",
               "layer_tensors", "embedding_tensors", "head_tensors", "all_tensors", "op_kind", "canonical_name",
               "stacked_parts",
               "kept_f32", "random_values", "extra_row_flops", "conv_history", "conv_state_channels", "layer_flows")
HOST = ("build_layer", "slot_state", "embedded", "head_input")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_is_described(model_type):
    described = FAMILIES[model_type]
    assert [name for name in DESCRIPTION if not hasattr(described, name)] == []
    assert model_type in described.MODEL_TYPES
    config = config_from_hf_dict({"model_type": model_type, "num_hidden_layers": 2})
    assert family(config) is described
    assert family(config_from_hf_dict(config.to_hf_dict())) is described  # and keeps it when written


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_engine_runs_each_familys_layers(model_type):
    assert [name for name in HOST if not hasattr(HOST_LAYERS[FAMILIES[model_type]], name)] == []
    assert host_layers(config_from_hf_dict({"model_type": model_type})) is HOST_LAYERS[FAMILIES[model_type]]

