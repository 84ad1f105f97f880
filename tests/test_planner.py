import itertools
import json
import math
import random
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

import cascadia.cli
from cascadia.graph.costs import embedding_cost, head_cost, layer_costs, layer_ops, least_state_bytes, pool_layout
from cascadia.graph.plan import Plan
from cascadia.graph.planner import InfeasiblePlan, RooflineStageTime, min_max_split, plan, stage_roles
from cascadia.models import read_config
from cascadia.models.inkling import InklingConfig
from cascadia.policy import KVPool
from cascadia.spec.load import load_spec
from cascadia.spec.types import (ClusterSpec, LinkSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WeightFormat,
                                 WeightFormats)

GIB = 2**30
PAPER_CONFIG = Path(__file__).parent.parent / "specs" / "inkling-975b" / "config.json"
INT4_G32_ASYM = WeightFormat("int4", group_size=32, symmetric=False)
INT8_ROW_ASYM = WeightFormat("int8", symmetric=False)


def paper_spec(max_streams: int = 176, context_budget: int = 1024, bandwidth: float | None = 120e9) -> Spec:
    """The paper's deployment: 11 PCs of 61.2 GiB on gigabit Ethernet, experts int4 g32, attention and head int8."""
    cfg = (read_config(PAPER_CONFIG) if PAPER_CONFIG.exists()
           else InklingConfig.from_hf_dict({"dense_mlp_idx": 2, "unpadded_vocab_size": 200058}))
    formats = WeightFormats(routed_experts=INT4_G32_ASYM, shared_experts=INT4_G32_ASYM, dense_mlp=INT4_G32_ASYM,
                            attention=INT8_ROW_ASYM, head=INT8_ROW_ASYM, embedding=INT8_ROW_ASYM)
    nodes = tuple(NodeSpec(f"pc{i}", memory_bytes=round(61.2 * GIB), memory_bandwidth=bandwidth,
                           compute_flops=None if bandwidth is None else 30e12) for i in range(11))
    return Spec(ModelSpec(cfg, formats), ClusterSpec(nodes),
                RuntimeSpec(max_streams=max_streams, context_budget=context_budget))


def small_spec(rng: random.Random, n_layers: int, n_nodes: int) -> Spec:
    cfg = InklingConfig.from_hf_dict({
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": n_layers, "dense_mlp_idx": rng.randint(0, 2),
        "local_layer_ids": [i for i in range(n_layers) if rng.random() < 0.7], "sliding_window_size": 8,
        "rel_extent": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 8, "d_rel": 2,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 48})
    model = ModelSpec(cfg)
    total = sum(c.weight_bytes for c in layer_costs(model)) + embedding_cost(model).weight_bytes \
        + head_cost(model).weight_bytes
    nodes = tuple(NodeSpec(f"n{i}", memory_bytes=rng.randint(total // (2 * n_nodes), total),
                           memory_bandwidth=rng.choice([1e9, 2e9, 5e9]), compute_flops=rng.choice([None, 1e9, 4e9]))
                  for i in range(n_nodes))
    links = {("n0", "n1"): LinkSpec(bandwidth=1e6, latency=1e-3)}
    return Spec(model, ClusterSpec(nodes, links=links, reserve_bytes=1000),
                RuntimeSpec(max_streams=rng.randint(1, 4), context_budget=rng.choice([4, 16, 40])))


def memory_need(spec: Spec, stage: int, first: int, last: int) -> int:
    """Written out again from the costs, to check the planner's running sums."""
    costs = layer_costs(spec.model, spec.runtime)[first:last + 1]
    roles = stage_roles(stage, len(spec.cluster.nodes))
    return (sum(c.weight_bytes for c in costs) + embedding_cost(spec.model).weight_bytes * ("embed" in roles)
            + head_cost(spec.model).weight_bytes * ("head" in roles)
            + least_state_bytes(costs, spec.runtime) + spec.cluster.reserve(spec.cluster.nodes[stage]))


def brute_force(spec: Spec, stage_time) -> tuple[float, float] | None:
    """(bottleneck, largest memory fraction) of the best split over every contiguous split, None if none fits."""
    nodes, n_layers = spec.cluster.nodes, spec.model.config.num_hidden_layers
    best = None
    for cuts in itertools.combinations(range(1, n_layers), len(nodes) - 1):
        bounds = list(zip((0, *cuts), (*cuts, n_layers)))
        needs = [memory_need(spec, j, a, b - 1) / nodes[j].memory_bytes for j, (a, b) in enumerate(bounds)]
        if max(needs) > 1:
            continue
        times = [stage_time(nodes[j], range(a, b), stage_roles(j, len(nodes))) for j, (a, b) in enumerate(bounds)]
        best = min(best or (math.inf, math.inf), (max(times), max(needs)))
    return best


def stage_sizes(p: Plan) -> list[int]:
    return [len(s.layers) for s in p.stages]


def test_min_max_split_matches_brute_force_on_random_scores():
    rng = random.Random(7)
    for _ in range(200):
        n_layers, n_stages = rng.randint(1, 8), rng.randint(1, 4)
        if n_stages > n_layers:
            continue
        table = {(j, a, b): rng.choice([math.inf, *range(20)])
                 for j in range(n_stages) for a in range(n_layers) for b in range(a, n_layers)}
        value, firsts = min_max_split(n_stages, n_layers, lambda j, a, b: table[j, a, b])
        expected = min(
            max(table[j, a, b - 1] for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n_layers))))
            for cuts in itertools.combinations(range(1, n_layers), n_stages - 1))
        assert value == expected
        if value < math.inf:
            bounds = list(zip(firsts, [*firsts[1:], n_layers]))
            assert firsts[0] == 0 and max(table[j, a, b - 1] for j, (a, b) in enumerate(bounds)) == value


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    spec = small_spec(rng, n_layers=rng.randint(3, 8), n_nodes=rng.randint(1, 3))
    expected = brute_force(spec, RooflineStageTime(spec))
    if expected is None:
        with pytest.raises(InfeasiblePlan, match="short of memory"):
            plan(spec)
        return
    p = plan(spec)
    fullest = max(memory_need(spec, j, s.first_layer, s.last_layer) / n.memory_bytes
                  for j, (s, n) in enumerate(zip(p.stages, spec.cluster.nodes)))
    assert (p.bottleneck_s, fullest) == expected
    assert [s.node for s in p.stages] == [n.name for n in spec.cluster.nodes]
    assert sum(stage_sizes(p)) == spec.model.config.num_hidden_layers and min(stage_sizes(p)) >= 1
    for j, (s, node) in enumerate(zip(p.stages, spec.cluster.nodes)):
        # the pool takes what the least state leaves, in whole blocks
        assert s.weight_bytes + s.state_bytes + spec.cluster.reserve_bytes >= memory_need(spec, j, s.first_layer,
                                                                                         s.last_layer)
        assert s.weight_bytes + s.state_bytes + s.free_bytes + spec.cluster.reserve_bytes == node.memory_bytes
        assert s.free_bytes >= 0


def test_faster_node_gets_more_layers_and_small_node_fewer():
    rng = random.Random(3)
    spec = small_spec(rng, n_layers=8, n_nodes=3)
    plenty = 10 * spec.cluster.nodes[0].memory_bytes
    nodes = tuple(attrs.evolve(n, memory_bytes=plenty, memory_bandwidth=bw, compute_flops=None)
                  for n, bw in zip(spec.cluster.nodes, (1e9, 3e9, 1e9)))
    spec = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))
    fast_middle = stage_sizes(plan(spec))
    assert fast_middle[1] > max(fast_middle[0], fast_middle[2])
    # now the fast node can hold only two layers' worth: the planner must give it fewer
    two_layers = memory_need(spec, 1, 2, 3)
    nodes = nodes[:1] + (attrs.evolve(nodes[1], memory_bytes=two_layers),) + nodes[2:]
    assert stage_sizes(plan(attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))))[1] <= 2


def test_ties_in_time_go_to_the_split_with_the_least_full_node():
    spec = paper_spec()
    sizes = stage_sizes(plan(spec, stage_time=lambda node, layers, roles: 1.0, cost_source="flat"))
    # every split takes the same time; the least full puts the small dense layers and the embedding together
    assert sizes[0] > 6 and max(sizes[1:]) == 6


def test_papers_deployment_six_layers_per_node_when_only_layers_count():
    p = plan(paper_spec(), stage_time=lambda node, layers, roles: len(layers), cost_source="layer count")
    assert stage_sizes(p) == [6] * 11 and p.cost_source == "layer count"
    assert p.total_params == 947_025_564_226 and round(p.active_params / 1e9, 2) == 41.06
    middle = p.stages[3]
    # 6 MoE layers: about 48 GiB of weights; 176 streams x 1024 positions of state fit in 61.2 GiB
    assert round(middle.weight_bytes / GIB) == 48 and middle.free_bytes > 0


def test_papers_deployment_moves_a_layer_off_the_head_node():
    # the head reads 1.23 GB per row, three layers' worth: the fastest split gives the embedding's node
    # (two small dense layers) a seventh layer and the head's node five, as far as memory allows
    spec = paper_spec()
    p = plan(spec)
    assert stage_sizes(p) == [7] + [6] * 9 + [5]
    assert p.cost_source.startswith("spec figures")
    timing = RooflineStageTime(spec)
    six_each = max(timing(n, range(6 * j, 6 * j + 6), stage_roles(j, 11)) for j, n in enumerate(spec.cluster.nodes))
    assert p.bottleneck_s < six_each


def pinned(spec: Spec, pins: dict[str, int]) -> Spec:
    nodes = tuple(attrs.evolve(n, layers=pins.get(n.name)) for n in spec.cluster.nodes)
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))


def test_layer_pins_fix_those_nodes_and_the_rest_is_still_optimised():
    spec = paper_spec()
    assert stage_sizes(plan(pinned(spec, {f"pc{i}": 6 for i in range(11)}))) == [6] * 11
    # pinning only the head's node to six: the other ten nodes share the other 60 layers as fast as they can
    p = plan(pinned(spec, {"pc10": 6}))
    assert stage_sizes(p)[-1] == 6 and sum(stage_sizes(p)[:-1]) == 60
    assert p.bottleneck_s >= plan(spec).bottleneck_s


def test_pins_that_cannot_split_the_layers_are_infeasible():
    spec = paper_spec()
    with pytest.raises(InfeasiblePlan, match=r"pins \(pc0 7, .*77 layers\) cannot split the model's 66 layers"):
        plan(pinned(spec, {f"pc{i}": 7 for i in range(11)}))
    with pytest.raises(InfeasiblePlan, match="short of memory"):  # 8 expert layers do not fit in 61.2 GiB
        plan(pinned(spec, {"pc1": 8}))


def test_papers_deployment_context_grows_8_kib_per_position_per_node():
    p = plan(paper_spec(max_streams=1, context_budget=4096, bandwidth=None))
    assert p.cost_source.startswith("uniform")
    middle = p.stages[5]
    costs = layer_costs(paper_spec().model)[middle.first_layer:middle.last_layer + 1]
    sliding = [c for c in costs if c.kv_window]
    assert len(costs) - len(sliding) == 1  # one global layer per six
    # the pool's blocks hold 64 positions of the global layer's K/V, 8 KiB each (f32), or as many entries of a
    # sliding layer's ring as fit: a stream's ring keeps the window's last 511 keys and a call's 32 rows
    block = 64 * 8 * 2**10
    room = middle.free_bytes + middle.state_bytes
    assert middle.kv_blocks == (room - sum(c.conv_state_bytes for c in costs)) // block
    ring_entry = sliding[0].kv_bytes_per_position  # of one layer
    assert middle.ring_blocks == len(sliding) * math.ceil(543 / (block // ring_entry))
    one_stream = 64 * (middle.kv_blocks - middle.ring_blocks)
    assert middle.max_positions_per_stream == middle.positions_one_stream == one_stream
    assert middle.max_positions_per_stream > 512 * 2**10  # the paper: 512k positions per stream fit


def test_a_stream_may_reach_the_whole_pool_when_the_others_are_short():
    """176 slots and a context budget of 256k: every node keeps each slot's convolution states, and pool blocks for
    every slot's rings and one stream's 256k positions of K/V; the rest of its memory is pool too, shared by the
    streams as they start and grow."""
    p = plan(paper_spec(max_streams=176, context_budget=256 * 1024))
    assert p.kv_pools == tuple(KVPool(s.kv_blocks, s.ring_blocks) for s in p.stages)
    for s in p.stages:
        assert s.kv_blocks >= 176 * s.ring_blocks + 4096 and s.positions_one_stream >= 256 * 1024
        assert s.max_positions_per_stream == (s.kv_blocks // 176 - s.ring_blocks) * 64
    with pytest.raises(InfeasiblePlan, match="176 streams' slots and rings, and one stream's K/V at 524288 positions"):
        plan(paper_spec(max_streams=176, context_budget=512 * 1024))


def test_the_pool_takes_what_weights_slots_and_reserve_leave_in_whole_blocks():
    checked = 0
    for seed in range(60):
        spec = small_spec(random.Random(seed), n_layers=6, n_nodes=2)
        try:
            p = plan(spec)
        except InfeasiblePlan:
            continue
        runtime, streams = spec.runtime, spec.runtime.max_streams
        for s, node in zip(p.stages, spec.cluster.nodes):
            costs = layer_costs(spec.model, runtime)[s.first_layer:s.last_layer + 1]
            slots = streams * sum(c.conv_state_bytes for c in costs)
            layout = pool_layout(costs, runtime)
            room = node.memory_bytes - s.weight_bytes - spec.cluster.reserve_bytes - slots
            assert s.kv_blocks == room // layout.block_bytes and s.ring_blocks == layout.ring_blocks
            assert s.state_bytes == slots + s.kv_blocks * layout.block_bytes
            assert s.kv_blocks >= layout.least_blocks(streams, runtime.context_budget)
            if not layout.paged:
                assert all(c.kv_window for c in costs) and s.max_positions_per_stream is None
            else:
                assert s.positions_one_stream >= runtime.context_budget
                assert s.max_positions_per_stream == max(0, s.kv_blocks // streams - s.ring_blocks) * runtime.kv_block
            checked += 1
    assert checked > 20


def test_link_time_is_added_to_the_sending_stage():
    rng = random.Random(5)
    spec = small_spec(rng, n_layers=4, n_nodes=2)
    timing = RooflineStageTime(spec)
    node = spec.cluster.nodes[0]
    # the n0-n1 link of small_spec, carrying a frame of one row: the 52-byte header, 53 bytes of row (slot,
    # position, token, sample flag, temperature, top-p, seed, top-k, min-p, logprobs), the residual
    frame = 52 + 53 + spec.model.config.hidden_size * 4
    assert timing.send_time(node, ("embed", "layers")) == 1e-3 + frame / 1e6
    assert timing.send_time(spec.cluster.nodes[1], ("layers", "head")) == 1e-3 + (52 + 8) / 1e6  # a token back
    alone = attrs.evolve(spec, cluster=ClusterSpec(spec.cluster.nodes[:1]))
    assert RooflineStageTime(alone).send_time(node, ("embed", "layers", "head")) == 0.0


def test_infeasible_plan_names_the_node_and_what_would_fit():
    spec = paper_spec(max_streams=400)
    with pytest.raises(InfeasiblePlan) as info:
        plan(spec)
    message = str(info.value)
    assert "node pc1 is short of memory by 5.80 GiB" in message
    assert "state 17.04 GiB: 400 streams' slots and rings, and one stream's K/V at 1024 positions" in message
    assert "max_streams 263, or context_budget 352, or 2 more nodes like pc0 (61.20 GiB each, 13 in all)" in message
    # each suggestion is the edge of what fits
    runtime = spec.runtime
    plan(attrs.evolve(spec, runtime=attrs.evolve(runtime, max_streams=263)))
    plan(attrs.evolve(spec, runtime=attrs.evolve(runtime, context_budget=352)))
    for too_much in (attrs.evolve(runtime, max_streams=264), attrs.evolve(runtime, context_budget=353)):
        with pytest.raises(InfeasiblePlan):
            plan(attrs.evolve(spec, runtime=too_much))
    for extra, fits in ((1, False), (2, True)):
        bigger = attrs.evolve(spec.cluster, nodes=spec.cluster.nodes + spec.cluster.nodes[:1] * extra)
        if fits:
            plan(attrs.evolve(spec, cluster=bigger))
        else:
            with pytest.raises(InfeasiblePlan):
                plan(attrs.evolve(spec, cluster=bigger))


def test_weights_that_fit_nowhere_say_nothing_would_help():
    spec = paper_spec()
    small = tuple(attrs.evolve(n, memory_bytes=8 * GIB) for n in spec.cluster.nodes)
    with pytest.raises(InfeasiblePlan, match="Neither fewer streams, a smaller context budget nor more such nodes"):
        plan(attrs.evolve(spec, cluster=ClusterSpec(small)))


def test_more_nodes_than_layers_is_infeasible():
    spec = small_spec(random.Random(0), n_layers=3, n_nodes=3)
    four = spec.cluster.nodes + (attrs.evolve(spec.cluster.nodes[0], name="n3"),)
    with pytest.raises(InfeasiblePlan, match="4 nodes but only 3 layers.*use at most 3 nodes"):
        plan(attrs.evolve(spec, cluster=ClusterSpec(four)))


def test_plan_json_round_trips_with_unbounded_positions(tmp_path):
    spec = small_spec(random.Random(2), n_layers=4, n_nodes=1)
    sliding = attrs.evolve(spec.model.config, layer_types=("hybrid_sliding",) * 4)
    big = (attrs.evolve(spec.cluster.nodes[0], memory_bytes=10**9),)
    p = plan(attrs.evolve(spec, model=attrs.evolve(spec.model, config=sliding),
                          cluster=attrs.evolve(spec.cluster, nodes=big)))
    assert p.stages[0].max_positions_per_stream is None and p.stages[0].roles == ("embed", "layers", "head")
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p


def test_hops_join_each_stage_to_the_next_and_the_last_to_the_first():
    three = plan(small_spec(random.Random(0), n_layers=6, n_nodes=3))
    assert three.hops() == [("n0", "n1"), ("n1", "n2"), ("n2", "n0")]
    one = attrs.evolve(three, stages=three.stages[:1])
    assert one.hops() == [("n0", "n0")]


# ---- command line: the spec loader is another module; these tests hand the commands a built Spec -----------------

@pytest.fixture
def given_spec(monkeypatch):
    def use(spec: Spec) -> None:
        monkeypatch.setattr(cascadia.cli.specs, "load_spec", lambda path: spec)
    return use


def test_cli_plan_prints_the_table_and_writes_json(tmp_path, given_spec):
    given_spec(paper_spec())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("unused\n")
    out = CliRunner().invoke(cascadia.cli.cli, ["plan", str(spec_file), "--json", str(tmp_path / "p.json"),
                                                "-o", str(tmp_path / "plan.json")])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].split() == ["node", "layers", "roles", "weight", "GiB", "state", "GiB", "free",
                                                  "GiB", "K/V", "blocks", "positions:", "1", "stream", "each", "of",
                                                  "max", "est.", "ms"]
    assert "pc0   0-6     embed+layers" in out.output and "params: 947.03B total, 41.06B active" in out.output
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved == json.loads((tmp_path / "plan.json").read_text())
    assert saved["stages"][0]["layers"] == [0, 6] and saved["total_params"] == 947_025_564_226
    out = CliRunner().invoke(cascadia.cli.cli, ["plan", str(spec_file), "--json", "-"])
    assert json.loads(out.stdout)["stages"][-1]["roles"] == ["layers", "head"]
    assert out.stderr.startswith("node  layers  roles")  # the table for people, out of the JSON's way


def test_cli_plan_infeasible_exits_1_with_the_reason(tmp_path, given_spec):
    given_spec(paper_spec(max_streams=400))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("unused\n")
    out = CliRunner().invoke(cascadia.cli.cli, ["plan", str(spec_file)])
    assert out.exit_code == 1 and "no plan fits. node pc1 is short of memory" in out.output
    assert "Traceback" not in out.output


def test_cli_graph_writes_dot_and_json(tmp_path, given_spec):
    spec = small_spec(random.Random(1), n_layers=3, n_nodes=1)
    given_spec(spec)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("unused\n")
    out = CliRunner().invoke(cascadia.cli.cli, ["graph", str(spec_file), "--format", "dot", "-o",
                                                str(tmp_path / "g.dot")])
    assert out.exit_code == 0 and out.output.startswith(f"wrote {tmp_path / 'g.dot'}: ")
    assert (tmp_path / "g.dot").read_text().startswith('digraph "inkling"')
    out = CliRunner().invoke(cascadia.cli.cli, ["graph", str(spec_file)])
    assert json.loads(out.output)["nodes"][0]["id"] == "embedding"


def test_cli_spec_error_exits_2(tmp_path):
    pytest.importorskip("cascadia.spec.load")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: 42\n")
    out = CliRunner().invoke(cascadia.cli.cli, ["plan", str(bad)])
    assert out.exit_code == 2 and out.output.startswith("Error: ") and "Traceback" not in out.output


def test_a_node_that_may_build_the_grouped_moe_path_is_planned_with_its_experts_twice():
    spec = load_spec(Path(__file__).parent.parent / "specs" / "tiny-local.yaml")
    fused = plan(spec)
    grouped_spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, moe_grouped_from="auto"))
    grouped = plan(grouped_spec)
    experts = [sum(op.weight_bytes for op in layer_ops(spec.model, layer).values()
                   if op.kind in ("routed_experts", "shared_experts")) for layer in range(6)]
    for a, b in zip(fused.stages, grouped.stages):
        assert (a.first_layer, a.last_layer) == (b.first_layer, b.last_layer)
        assert b.weight_bytes - a.weight_bytes == sum(experts[a.first_layer:a.last_layer + 1]) > 0
    smallest = spec.runtime.row_buckets[0]  # every call expert-grouped: that graph alone, the experts once
    alone = plan(attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, moe_grouped_from=smallest)))
    assert [s.weight_bytes for s in alone.stages] == [s.weight_bytes for s in fused.stages]
