"""The Llama family's description: its config read as transformers reads it (RoPE under either spelling), refused
with the key at fault, and planned and simulated like any model. Parameter counts and tensor shapes against
transformers' own are in tests/test_graph.py (tests/fixtures/param_counts.json)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.graph.build import build_graph, graph_totals
from cascadia.models import config_from_hf_dict, family, llama
from cascadia.models.base import ConfigError, LayerKind, UnsupportedModel
from cascadia.models.llama import LlamaConfig
from cascadia.models.rope import RopeScaling
from cascadia.spec.types import ModelSpec, RuntimeSpec
from test_graph import FIXTURE


def test_defaults_are_transformers_and_every_layer_is_global_and_dense():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert cfg.heads(1) == (4, 4, 16)  # key/value heads and head_dim from the query heads
    assert [cfg.attention_kind(i) for i in range(2)] == [LayerKind.GLOBAL] * 2
    assert [cfg.mlp_kind(i) for i in range(2)] == [LayerKind.DENSE] * 2
    assert cfg.routed_experts == (0, 0) and cfg.sliding_window is None
    assert cfg.kv_entries(0, 4096, 8) == 4096
    assert config_from_hf_dict(cfg.to_hf_dict()) == cfg
    assert family(cfg) is llama


def test_released_configs_spell_rope_either_way():
    legacy = {"model_type": "llama", "rope_theta": 5e5, "max_position_embeddings": 1024,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    saved = {"model_type": "llama", "max_position_embeddings": 1024,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
    assert config_from_hf_dict(legacy) == config_from_hf_dict(saved)
    assert config_from_hf_dict(legacy).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)


@pytest.mark.parametrize("raw, problem", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling type 'yarn' is not supported \(supported: default, linear, llama3\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling: factor: expected a number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}},
     "rope_scaling: unknown key 'beta_fast' for type 'linear'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads must be a multiple"),
    ({"hidden_size": 50, "num_attention_heads": 4}, "hidden_size must be a multiple of num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"eos_token_id": [2, 40000]}, r"eos_token_id 40000 lies outside the vocabulary \(0..31999\)"),
])
def test_a_config_that_is_no_llama_is_refused_naming_the_key(raw, problem):
    with pytest.raises(ConfigError, match=f"^{problem}"):
        config_from_hf_dict({"model_type": "llama"} | raw)


def test_llama_is_known_by_its_architectures_and_other_families_still_are_not():
    assert family(config_from_hf_dict({"architectures": ["LlamaForCausalLM"]})) is llama
    with pytest.raises(UnsupportedModel, match=r"model_type 'mistral' is not supported \(supported: inkling, "
                                               r"inkling_text, llama, qwen3_moe, deepseek_v3\)"):
        config_from_hf_dict({"model_type": "mistral"})


def test_a_llama_plans_as_a_dense_model_of_its_published_size():
    cfg = config_from_hf_dict(FIXTURE["llama-3.1-8b"]["config"])
    totals = graph_totals(build_graph(ModelSpec(cfg), RuntimeSpec()))
    assert totals.params == totals.active_params == 8_030_261_248  # Meta's 8.03B
    assert set(totals.params_by_kind) >= {"attention", "dense_mlp", "embedding", "head"}
    assert totals.params_by_kind.get("routed_experts", 0) == 0


LLAMA_8B_ON_TWO = """\
model:
  name: llama-3.1-8b
  hf_config: config.json
  formats: {routed_experts: int4, shared_experts: int4, dense_mlp: int4, attention: int4, head: int8,
            embedding: int8}
cluster:
  nodes: [{name: pc, count: 2, memory: 61.2GiB, memory_bandwidth: 120GB/s, compute: 30TFLOPS}]
  links: {default: {bandwidth: 1gbit, latency: 100us}}
runtime: {context_budget: 2048, max_streams: 2, row_buckets: [1, 2], prefill_window: 8}
workload: {concurrency: [1, 2], prompt_tokens: 32, output_tokens: 8, greedy: true}
"""


def test_a_llama_spec_plans_and_simulates(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FIXTURE["llama-3.1-8b"]["config"]))
    (tmp_path / "spec.yaml").write_text(LLAMA_8B_ON_TWO)
    planned = CliRunner().invoke(cli, ["plan", str(tmp_path / "spec.yaml")])
    assert planned.exit_code == 0, planned.output
    assert "8.03B" in planned.output
    simulated = CliRunner().invoke(cli, ["simulate", str(tmp_path / "spec.yaml"), "--analytic", "--json",
                                         str(tmp_path / "sim.json")])
    assert simulated.exit_code == 0, simulated.output
    levels = json.loads((tmp_path / "sim.json").read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    assert all(level["decode_tokens_per_s"] > 0 for level in levels)


@pytest.mark.parametrize("name", ["llama_small_plain", "llama_small_odd"])
def test_a_random_llama_checkpoint_holds_transformers_tensors_and_generates(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(FIXTURE[name]["config"]))
    wrote = CliRunner().invoke(cli, ["init-model", str(tmp_path / "config.json"), str(tmp_path / "ckpt")])
    assert wrote.exit_code == 0, wrote.output
    checkpoint = Checkpoint.open(tmp_path / "ckpt")
    checkpoint.validate(embed=True, head=True)  # every tensor transformers has, at its shape
    assert checkpoint.names() == sorted(FIXTURE[name]["shapes"])
    generated = CliRunner().invoke(cli, ["generate", str(tmp_path / "ckpt"), "--ids", "1,2", "--max-new-tokens", "3"])
    if FIXTURE[name]["config"].get("mlp_bias"):  # the one part of a Llama the engine does not run
        assert generated.exit_code == 2
        assert generated.output == "Error: mlp_bias: the engine does not run a Llama whose MLP has biases\n"
    else:
        assert generated.exit_code == 0, generated.output
