import json
from pathlib import Path

import attrs
import networkx as nx
import pytest

from cascadia.models import config_from_hf_dict, family
from cascadia.graph.build import build_graph, graph_totals, render
from cascadia.graph.costs import embedding_cost, head_cost, layer_costs, state_bytes
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import ModelSpec, RuntimeSpec, WeightFormat, WeightFormats

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "param_counts.json").read_text())["configs"]
INKLING = InklingConfig.from_hf_dict(FIXTURE["inkling"]["config"])
INT4_G32_ASYM = WeightFormat("int4", group_size=32, symmetric=False)
INT8_ROW_ASYM = WeightFormat("int8", symmetric=False)
# The paper's formats: experts (and the dense MLP, run as expert slices) int4 g32, attention and head int8 per row.
# Its figures come out only with zero points (asymmetric, OpenVINO's default compression): symmetric int4 g32 would
# make the experts 16.31 GB per token, not 16.76.
PAPER_FORMATS = WeightFormats(routed_experts=INT4_G32_ASYM, shared_experts=INT4_G32_ASYM, dense_mlp=INT4_G32_ASYM,
                              attention=INT8_ROW_ASYM, head=INT8_ROW_ASYM, embedding=INT8_ROW_ASYM)


def small_model(**overrides) -> ModelSpec:
    raw = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 3, "dense_mlp_idx": 1, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 96, "sliding_window_size": 8,
           "rel_extent": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 16, "d_rel": 4} | overrides
    return ModelSpec(InklingConfig.from_hf_dict(raw))


@pytest.mark.parametrize("name", sorted(FIXTURE))
def test_parameter_counts_match_transformers(name):
    expected = FIXTURE[name]
    g = build_graph(ModelSpec(config_from_hf_dict(expected["config"])), RuntimeSpec())
    totals = graph_totals(g)
    counted = {kind: n for kind, n in totals.params_by_kind.items() if n}
    assert counted == expected["params_by_kind"]
    assert (totals.params, totals.active_params) == (expected["total"], expected["active"])


@pytest.mark.parametrize("name", sorted(n for n in FIXTURE if "rope_parameters" in FIXTURE[n]))
def test_rope_is_read_as_transformers_reads_it(name):
    """Llama's, Qwen3-MoE's and DeepSeek-V3's RoPE (default, linear, llama3, yarn), under either set of keys."""
    cfg = config_from_hf_dict(FIXTURE[name]["config"])
    expected = FIXTURE[name]["rope_parameters"]
    assert cfg.rope_theta == expected["rope_theta"]
    scaling = {k: v for k, v in expected.items() if k not in ("rope_theta", "type")}
    assert (cfg.rope_scaling.to_hf_dict() if cfg.rope_scaling else {"rope_type": "default"}) == scaling


@pytest.mark.parametrize("name", sorted(n for n in FIXTURE if "shapes" in FIXTURE[n]))
def test_tensor_shapes_match_transformers(name):
    """Every tensor but, for the families transformers holds them stacked for, the routed experts (the fixture
    leaves them out; their counts are checked above)."""
    cfg, expected = config_from_hf_dict(FIXTURE[name]["config"]), FIXTURE[name]["shapes"]
    stacked = not any(".mlp.experts." in tensor for tensor in expected)
    shapes = {tensor: list(shape) for tensor, (shape, _) in family(cfg).all_tensors(cfg).items()
              if not (stacked and ".mlp.experts." in tensor)}
    assert shapes == expected


def test_inkling_has_947b_parameters_41b_active():
    counts = FIXTURE["inkling"]["params_by_kind"]
    moe_layers = INKLING.mlp_layer_types.count("sparse")
    one_expert = counts["routed_experts"] // (moe_layers * INKLING.n_routed_experts)
    idle_experts = moe_layers * (INKLING.n_routed_experts - INKLING.num_experts_per_tok)
    totals = graph_totals(build_graph(ModelSpec(INKLING), RuntimeSpec()))
    assert totals.active_params == FIXTURE["inkling"]["total"] - idle_experts * one_expert
    assert (round(totals.params / 1e7), round(totals.active_params / 1e7)) == (94703, 4106)


def test_weight_bytes_read_per_token_under_the_papers_formats():
    by_kind = graph_totals(build_graph(ModelSpec(INKLING, PAPER_FORMATS), RuntimeSpec())).bytes_per_row_by_kind
    gb = {kind: round(n / 1e9, 2) for kind, n in by_kind.items()}
    # the paper: experts 16.76 GB, attention 8.59 GB, dense MLP 0.52 GB, head 1.24 GB
    assert round((by_kind["routed_experts"] + by_kind["shared_experts"]) / 1e9, 2) == 16.76
    assert (gb["attention"], gb["dense_mlp"]) == (8.59, 0.52)
    # the stored head has 200058 rows (1.23 GB); the paper's 1.24 GB is the padded 201024-row head
    assert gb["head"] == 1.23
    padded = ModelSpec(attrs.evolve(INKLING, unpadded_vocab_size=None), PAPER_FORMATS)
    assert round(head_cost(padded).bytes_per_row / 1e9, 2) == 1.24


def test_int4_group_bytes_count_scales_and_zero_points():
    # one routed expert of Inkling: [2I, H] + [H, I] int4, an f16 scale and a 4-bit zero point per 32 weights
    expert = 3 * 3072 * 6144
    moe = layer_costs(ModelSpec(INKLING, PAPER_FORMATS))[2]
    assert moe.expert_bytes == expert // 2 + expert // 32 * 2 + expert // 32 // 2
    assert moe.weight_bytes - moe.bytes_per_row == (256 - 6) * moe.expert_bytes


def test_small_tensors_stay_f32_whatever_the_format():
    int8 = WeightFormat("int8")
    model = small_model()
    quantised = ModelSpec(model.config, WeightFormats(*[int8] * 6))
    g, q = build_graph(model, RuntimeSpec()), build_graph(quantised, RuntimeSpec())
    for kind in ("input_norm", "attn_sconv", "router", "mlp_sconv"):
        node = f"L1.{kind}"
        assert q.nodes[node]["weight_bytes"] == g.nodes[node]["weight_bytes"] == 4 * g.nodes[node]["params"]
    assert q.nodes["L1.attention"]["weight_bytes"] < g.nodes["L1.attention"]["weight_bytes"]


def test_state_bytes_of_a_six_layer_stage_grow_8_kib_per_position():
    costs = layer_costs(ModelSpec(INKLING), RuntimeSpec(kv_precision="f32"))[:6]  # layers 0-4 slide, 5 is global
    assert [c.kv_window for c in costs] == [511 + 32] * 5 + [None]  # the window's last 511 keys and 32 rows of a call
    # K+V f32: 16 kv heads x 128 x 2 x 4 B = 16 KiB per position on a sliding layer, 8 KiB on the global one
    assert state_bytes(costs, 1001) - state_bytes(costs, 1000) == 8 * 2**10
    assert state_bytes(costs, 101) - state_bytes(costs, 100) == (5 * 16 + 8) * 2**10
    # four short convolutions (kernel 4 keeps 3 inputs): k and v (kv width) and two of the hidden width
    convs = sum(3 * 4 * (2 * INKLING.heads(i)[1] * 128 + 2 * 6144) for i in range(6))
    assert state_bytes(costs, 0) == convs
    half = layer_costs(ModelSpec(INKLING), RuntimeSpec(kv_precision="bf16"))[:6]
    assert 2 * state_bytes(half, 4096) == state_bytes(costs, 4096)


def test_flops_per_row_are_twice_the_active_matmul_parameters():
    model = small_model()
    cfg = model.config
    dense, moe = layer_costs(model)[:2]
    n_heads, n_kv, head_dim = cfg.heads(1)
    attention = (2 * n_heads * head_dim + 2 * n_kv * head_dim + n_heads * cfg.d_rel) * cfg.hidden_size
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    router = (cfg.n_routed_experts + cfg.n_shared_experts) * cfg.hidden_size
    rel_bank = n_heads * cfg.d_rel * cfg.sliding_window_size
    assert moe.flops_per_row == 2 * (attention + experts + router + rel_bank)
    assert dense.flops_per_row == 2 * (attention + 3 * cfg.intermediate_size * cfg.hidden_size + rel_bank)
    assert moe.attn_flops_per_position == 4 * n_heads * head_dim
    assert head_cost(model).flops_per_row == 2 * cfg.vocab_size * cfg.hidden_size
    assert embedding_cost(model).bytes_per_row == 2 * 4 * cfg.hidden_size  # one f32 row and the norm


def test_graph_is_one_dataflow_from_embedding_to_sampler():
    model = small_model(num_hidden_layers=4, dense_mlp_idx=2)
    g = build_graph(model, RuntimeSpec())
    assert nx.is_directed_acyclic_graph(g)
    order = list(nx.topological_sort(g))
    assert order[0] == "embedding" and order[-1] == "sampler"
    layers = [g.nodes[n]["layer"] for n in order if g.nodes[n]["layer"] is not None]
    assert layers == sorted(layers) and set(layers) == {0, 1, 2, 3}
    assert {g.nodes[n]["kind"] for n in g if g.nodes[n]["layer"] == 0} == {
        "input_norm", "attention", "attn_sconv", "post_norm", "dense_mlp", "mlp_sconv"}
    assert {g.nodes[n]["kind"] for n in g if g.nodes[n]["layer"] == 3} >= {"router", "routed_experts", "shared_experts"}
    residual = 4 * model.config.hidden_size
    assert g.edges["L2.mlp_sconv", "L3.input_norm"] == {"tensor": "residual", "bytes_per_row": residual}
    assert g.edges["L3.router", "L3.routed_experts"]["bytes_per_row"] == 8 * model.config.num_experts_per_tok
    assert g.edges["head", "sampler"]["bytes_per_row"] == 4 * model.config.vocab_size
    assert g.nodes["L3.attention"]["state_bytes_per_position"] == layer_costs(model)[3].kv_bytes_per_position
    assert sum(g.nodes[n]["state_bytes_per_stream"] for n in g if g.nodes[n]["layer"] == 3) == \
        layer_costs(model)[3].conv_state_bytes


def test_graph_totals_equal_the_layer_and_end_costs():
    model = small_model(unpadded_vocab_size=97)
    totals = graph_totals(build_graph(model, RuntimeSpec()))
    costs = layer_costs(model)
    ends = (embedding_cost(model), head_cost(model))
    assert totals.weight_bytes == sum(c.weight_bytes for c in costs) + sum(e.weight_bytes for e in ends)
    assert totals.bytes_per_row == sum(c.bytes_per_row for c in costs) + sum(e.bytes_per_row for e in ends)
    assert totals.weight_bytes_by_kind["head"] == 97 * model.config.hidden_size * 4


def test_json_round_trips_and_dot_lists_every_node_and_edge():
    g = build_graph(small_model(), RuntimeSpec())
    back = nx.node_link_graph(json.loads(render(g, "json")), edges="edges")
    assert dict(back.nodes(data=True)) == dict(g.nodes(data=True))
    assert {(a, b): d for a, b, d in back.edges(data=True)} == {(a, b): d for a, b, d in g.edges(data=True)}
    dot = render(g, "dot")
    assert dot.startswith('digraph "inkling" {') and dot.rstrip().endswith("}")
    assert dot.count(" -> ") == g.number_of_edges()
    assert all(f'"{node}" [label=' in dot for node in g)
    with pytest.raises(ValueError, match="unknown graph format 'svg'"):
        render(g, "svg")


def test_dot_labels_give_parameters_and_bytes_to_three_digits():
    # L0.attention: q, k, v, o 4096 each, r 1024, k/v convs 512, q/k norms 32, bias bank 4 x 8 = 17,984 f32 values
    dot = render(build_graph(small_model(), RuntimeSpec()), "dot")
    assert '"L0.attention" [label="L0.attention\\n18 k params, 71.9 kB"];' in dot
    assert '"L0.attention" -> "L0.attn_sconv" [label="attn_out 256 B"];' in dot
