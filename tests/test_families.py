"""The families' seam: every family the config dict names answers the description the rest of Cascadia reads
(`cascadia.models`' docstring), and the engine can run its layers (`cascadia.engine.families`' docstring)."""

from __future__ import annotations

import pytest

from cascadia.engine.families import HOST_LAYERS, host_layers
from cascadia.models import FAMILIES, config_from_hf_dict, family

DESCRIPTION = ("Config", "MODEL_TYPES", "ARCHITECTURES", "FIELD_TYPES", "ALIASES", "MTP_PREFIX", "text_fields",
               "layer_tensors", "embedding_tensors", "head_tensors", "all_tensors", "op_kind", "canonical_name",
               "kept_f32", "random_values", "extra_row_flops", "conv_history", "conv_state_channels")
HOST = ("build_layer", "slot_state", "embedded", "head_input")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_family_is_described_and_run(model_type):
    described = FAMILIES[model_type]
    assert [name for name in DESCRIPTION if not hasattr(described, name)] == []
    assert model_type in described.MODEL_TYPES
    assert [name for name in HOST if not hasattr(HOST_LAYERS[described], name)] == []


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_config_finds_its_family_by_its_model_type(model_type):
    config = config_from_hf_dict({"model_type": model_type, "num_hidden_layers": 2})
    assert family(config) is FAMILIES[model_type]
    assert host_layers(config) is HOST_LAYERS[FAMILIES[model_type]]
    assert family(config_from_hf_dict(config.to_hf_dict())) is family(config)  # and keeps it when written
