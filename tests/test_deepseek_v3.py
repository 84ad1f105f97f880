"""The DeepSeek-V3 family's description: its config read as transformers reads it (YaRN RoPE, dense layers before
first_k_dense_replace, the MTP key under either name), refused with the key at fault, its K/V counted as the latent
a stream keeps, and planned at its published sizes. Parameter counts and tensor shapes against transformers' own are
in tests/test_graph.py (tests/fixtures/param_counts.json)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.init_model import init_model
from cascadia.graph.build import build_graph, graph_totals
from cascadia.graph.costs import layer_costs
from cascadia.graph.planner import plan as make_plan
from cascadia.models import config_from_hf_dict, deepseek_v3, family
from cascadia.models.base import ConfigError, LayerKind
from cascadia.models.names import EMBED
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.spec.types import LengthSpec, ModelSpec, RuntimeSpec
from test_graph import FIXTURE

SPECS = Path(__file__).parent.parent / "specs"
DEEPSEEK = sorted(n for n in FIXTURE if FIXTURE[n]["config"].get("model_type") == "deepseek_v3")


@pytest.mark.parametrize("name", DEEPSEEK)
def test_each_published_and_odd_config_is_kept_when_written(name):
    cfg = config_from_hf_dict(FIXTURE[name]["config"])
    assert config_from_hf_dict(cfg.to_hf_dict()) == cfg and family(cfg) is deepseek_v3


def test_the_defaults_are_transformers_and_the_first_layers_dense():
    cfg = config_from_hf_dict({"model_type": "deepseek_v3", "num_hidden_layers": 5})
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == \
        (256, 8, 8, 4, 1)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.head_dim, cfg.v_head_dim) == (1536, 512, 192, 64,
                                                                                                  128)
    assert [cfg.mlp_kind(i) for i in range(5)] == [LayerKind.DENSE] * 3 + [LayerKind.MOE] * 2
    assert [cfg.attention_kind(i) for i in range(5)] == [LayerKind.GLOBAL] * 5
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5 and cfg.rope_scaling is None
    dense = config_from_hf_dict({"model_type": "deepseek_v3", "num_hidden_layers": 3})
    assert dense.routed_experts == (0, 0)  # every layer before first_k_dense_replace: no MoE at all
    # the keys transformers reads under other names, and those it derives and may save
    again = config_from_hf_dict({"model_type": "deepseek_v3", "num_local_experts": 16, "n_group": 4,
                                 "num_nextn_predict_layers": 0, "head_dim": 64, "qk_head_dim": 192})
    assert (again.n_routed_experts, again.num_mtp_layers) == (16, 0)


@pytest.mark.parametrize("raw, problem", [
    ({"n_routed_experts": 10}, r"n_routed_experts \(10\) must be a multiple of n_group \(8\)"),
    ({"topk_group": 9}, r"topk_group \(9\) exceeds n_group \(8\)"),
    ({"n_routed_experts": 16, "num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds the experts of "
                                                         r"topk_group \(4\) groups of 2"),
    ({"n_routed_experts": 8}, r"n_group \(8\) leaves fewer than two experts a group"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
    ({"q_lora_rank": 0}, r"q_lora_rank must be a positive integer \(or null\)"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace must be an integer >= 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": "x"}}, "rope_scaling: beta_fast: expected a number"),
    ({"rope_scaling": {"type": "longrope", "factor": 4}}, r"rope_scaling type 'longrope' is not supported "
                                                           r"\(supported: default, linear, llama3, yarn\)"),
])
def test_a_config_that_is_no_deepseek_v3_is_refused_naming_the_key(raw, problem):
    with pytest.raises(ConfigError, match=f"^{problem}"):
        config_from_hf_dict({"model_type": "deepseek_v3"} | raw)


def test_yarn_is_deepseek_v3s_alone():
    """The engine rotates Llama's RoPE kinds only: a Llama that asks for YaRN is refused, not run unscaled."""
    with pytest.raises(ConfigError, match=r"^rope_scaling type 'yarn' is not supported \(supported: default, "
                                          r"linear, llama3\)"):
        config_from_hf_dict({"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_a_stream_keeps_the_latent_and_the_rotated_key_per_position_and_layer():
    """DeepSeek-V3 at bf16 state: (512 + 64) values x 2 bytes = 1152 bytes a position and layer, not the 2 x 128
    heads x 192 x 2 = 98,304 of keys and values per head; decode attends in the latent, q.k over 576 values and p.v
    over 512 for each of 128 heads."""
    cfg = config_from_hf_dict(FIXTURE["deepseek-v3"]["config"])
    costs = layer_costs(ModelSpec(cfg), RuntimeSpec(kv_precision="bf16"))
    assert {c.kv_bytes_per_position for c in costs} == {1152}
    assert {c.attn_flops_per_position for c in costs} == {2.0 * 128 * (512 + 64 + 512)}
    assert {c.kv_window for c in costs} == {None}  # every layer global: the pool grows with the context


@pytest.mark.parametrize("name, total, active", [("deepseek-v3", 671_026_419_200, 37_552_297_472),
                                                 ("kimi-k2", 1_026_408_232_448, 32_861_500_928)])
def test_the_published_sizes_plan_with_their_parameter_counts(name, total, active):
    """DeepSeek's README_WEIGHTS: 671B total, 36.7B active (its count leaves out some of what one token reads);
    Moonshot's model card for Kimi K2: 1T total, 32B active. The multi-token-prediction layer is not counted."""
    totals = graph_totals(build_graph(ModelSpec(config_from_hf_dict(FIXTURE[name]["config"])), RuntimeSpec()))
    assert (totals.params, totals.active_params) == (total, active) == (FIXTURE[name]["total"], FIXTURE[name]["active"])


def test_a_random_checkpoint_is_written_read_whole_and_generates(tmp_path):
    """init-model writes every tensor the description names (transformers loads such a checkpoint with no key missing
    or unexpected: scripts/make_fixtures.py builds its reference models so); the checkpoint reads them back at their
    shapes, the bf16 one keeps the correction bias in f32, and `generate` runs it (exactness: test_engine_exact)."""
    cfg = config_from_hf_dict(FIXTURE["deepseek_small_odd"]["config"])
    init_model(cfg, tmp_path / "f32")
    checkpoint = Checkpoint.open(tmp_path / "f32")
    checkpoint.validate(range(cfg.num_hidden_layers), embed=True, head=True)
    layer = checkpoint.layer(2)  # the first MoE layer
    assert layer[deepseek_v3.ROUTER_BIAS].shape == (12,) and layer[deepseek_v3.KV_B].shape == (4 * (12 + 10), 16)
    init_model(cfg, tmp_path / "bf16", dtype="bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "np") as stored:
        dtypes = {name: stored.get_slice(name).get_dtype() for name in stored.keys()}
    assert dtypes["model.layers.2." + deepseek_v3.ROUTER_BIAS] == "F32" and dtypes[EMBED] == "BF16"
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "bf16"), "--ids", "1,2,3", "--max-new-tokens", "4",
                                      "--greedy"])
    assert result.exit_code == 0, result.output


def test_a_long_context_costs_each_decode_token_the_latents_read():
    """DeepSeek-V3 on its 6 PCs, one stream at a 131,072-token prompt (specs/deepseek-v3-6pc-long.yaml, as
    `cascadia simulate --prompt-tokens 131072` takes it): every PC's pool holds it, and each later token
    costs what reading the 61 layers' latents costs beyond a 128-token prompt's (131,072 x 1152 bytes a layer at
    120 GB/s: 77 ms), as the simulator predicts it: decode is memory-bound, and keys and values per head would cost
    71 times as much."""
    long = load_spec(SPECS / "deepseek-v3-6pc-long.yaml")
    tpot = {}
    for prompt in (128, 131_072):
        run = attrs.evolve(long, workload=attrs.evolve(long.workload, concurrency=(1,), requests=1,
                                                       prompt_tokens=LengthSpec.fixed(prompt), output_tokens=16))
        plan = make_plan(run)
        assert min(pool.blocks for pool in plan.kv_pools) * 256 >= 131_072 + 16
        tpot[prompt] = simulate(run, analytic_calibration(run), plan)["levels"][0]["tpot_s"]["p50"]
    latents = 61 * 131_072 * 1152 / 120e9
    assert tpot[131_072] - tpot[128] == pytest.approx(latents, rel=0.02)
