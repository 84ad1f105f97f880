"""The Qwen3-MoE family's description: its config read as transformers reads it (its experts under either key, dense
layers where mlp_only_layers or decoder_sparse_step say), refused with the key at fault, and planned at its published
sizes. Parameter counts against transformers' own are in tests/test_graph.py (tests/fixtures/param_counts.json)."""

from __future__ import annotations

import pytest

from cascadia.graph.build import build_graph, graph_totals
from cascadia.models import config_from_hf_dict, family, qwen3_moe
from cascadia.models.base import ConfigError, LayerKind
from cascadia.spec.types import ModelSpec, RuntimeSpec
from test_graph import FIXTURE


def test_dense_layers_are_where_transformers_puts_them():
    cfg = config_from_hf_dict(FIXTURE["qwen3_small_odd"]["config"])  # decoder_sparse_step 2, mlp_only_layers [3]
    assert [cfg.mlp_kind(i) for i in range(4)] == [LayerKind.DENSE, LayerKind.MOE, LayerKind.DENSE, LayerKind.DENSE]
    assert [cfg.attention_kind(i) for i in range(4)] == [LayerKind.GLOBAL] * 4
    assert cfg.heads(0) == (4, 2, 20) and cfg.routed_experts == (6, 2)
    assert family(cfg) is qwen3_moe and config_from_hf_dict(cfg.to_hf_dict()) == cfg


def test_the_defaults_are_transformers_and_either_expert_key_is_read():
    cfg = config_from_hf_dict({"model_type": "qwen3_moe", "num_hidden_layers": 2})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.moe_intermediate_size) == \
        (128, 8, False, 768)
    assert cfg.heads(0) == (32, 4, 64) and cfg.mlp_only_layers == () and cfg.decoder_sparse_step == 1
    assert config_from_hf_dict({"model_type": "qwen3_moe", "num_local_experts": 16}).num_experts == 16
    assert config_from_hf_dict({"model_type": "qwen3_moe", "mlp_only_layers": None}).mlp_only_layers == ()


@pytest.mark.parametrize("raw, problem", [
    ({"num_experts": 4, "num_experts_per_tok": 6}, r"num_experts_per_tok \(6\) exceeds num_experts \(4\)"),
    ({"use_sliding_window": True}, "use_sliding_window: sliding-window attention is not supported"),
    ({"mlp_only_layers": [1, "2"]}, "mlp_only_layers: expected a list of integers or null"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
])
def test_a_config_that_is_no_qwen3_moe_is_refused_naming_the_key(raw, problem):
    with pytest.raises(ConfigError, match=f"^{problem}"):
        config_from_hf_dict({"model_type": "qwen3_moe"} | raw)


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
                                                 ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520)])
def test_the_published_sizes_plan_with_their_parameter_counts(name, total, active):
    """Qwen's model cards: 30.5B / 3.3B activated, 235B / 22B."""
    totals = graph_totals(build_graph(ModelSpec(config_from_hf_dict(FIXTURE[name]["config"])), RuntimeSpec()))
    assert (totals.params, totals.active_params) == (total, active) == (FIXTURE[name]["total"], FIXTURE[name]["active"])
