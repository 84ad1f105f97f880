"""A saved plan given back with --plan is checked against the spec: shape and types, every layer once and in order,
the embedding and head at the ends, the cluster's nodes once each, and memory as the planner counts it."""

import json

import pytest
from click.testing import CliRunner
from sim_specs import tiny_spec_yaml

from cascadia.cli import cli
from cascadia.errors import PlanError
from cascadia.graph.planner import load_plan, plan
from cascadia.spec.load import load_spec

# 6 layers on 3 nodes with 1 MiB each beyond the reserve: the planner puts 2 layers on each
SPEC = tiny_spec_yaml(memory="65MiB", concurrency="[1]", prompt_tokens=4, output_tokens=2)


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


@pytest.fixture
def saved(spec_path, tmp_path):
    """The planner's plan for SPEC, saved."""
    path = tmp_path / "plan.json"
    plan(load_spec(spec_path)).save(path)
    return path


def edited(saved, change) -> str:
    """A copy of the saved plan with change(plan dict) applied; its path."""
    d = json.loads(saved.read_text())
    change(d)
    bad = saved.with_name("bad.json")
    bad.write_text(json.dumps(d))
    return str(bad)


def set_stage(i, key, value):
    return lambda d: d["stages"][i].update({key: value})


def reverse_stages(d):
    d["stages"].reverse()


def drop_key(d):
    del d["stages"][1]["node"]


def everything_on_node0(d):
    d["stages"][0]["layers"] = [0, 3]
    d["stages"][1]["layers"] = [4, 4]
    d["stages"][2]["layers"] = [5, 5]


@pytest.mark.parametrize("change, message", [
    (set_stage(1, "layers", [2, 2]),
     "stages[2].layers: starts at layer 4, but stages[1] ends at layer 2: each stage must start right after"),
    (reverse_stages, "stages[0].layers: the first stage must start at layer 0, not 4"),
    (set_stage(0, "layers", [-1, 1]), "stages[0].layers: the first stage must start at layer 0, not -1"),
    (set_stage(1, "layers", [2, 1]), "stages[1].layers: ends at layer 1, before it starts"),
    (set_stage(2, "layers", [4, 9]), "stages[2].layers: ends at layer 9, but the model's last layer is 5"),
    (set_stage(2, "layers", [4, 4]), "the last stage ends at layer 4, but the model's last layer is 5: layers 5-5"),
    (set_stage(0, "layers", "0-1"), 'stages[0].layers must be a list, not "0-1"'),
    (set_stage(0, "layers", [0]), "stages[0].layers must be [first, last], two layer numbers, not [0]"),
    (set_stage(0, "layers", [0, "1"]), 'stages[0].layers[1] must be an integer, not "1"'),
    (set_stage(0, "roles", ["layers"]), 'stages[0].roles must be ["embed", "layers"], not ["layers"]'),
    (set_stage(2, "roles", ["layers"]), 'stages[2].roles must be ["layers", "head"], not ["layers"]'),
    (set_stage(2, "node", "node0"), "stages[2].node: 'node0' already holds stages[0]; a node holds one stage"),
    (set_stage(1, "node", "ghost"), 
     "stages[1].node: 'ghost' is not a node of the spec's cluster (node0, node1, node2)"),
    (drop_key, "stages[1].node is missing"),
    (set_stage(1, "est_time_s", True), "stages[1].est_time_s must be a number, not true"),
    (lambda d: d.update(stages=[]), "stages is empty"),
    (lambda d: d.update(version=1), "plan version 1 is not 3"),
    (everything_on_node0, "stages[0] has a K/V pool of 25 blocks of 64 positions (2 a stream's rings), where the "
                          "spec needs blocks of 64 positions (3 a stream's rings), at least 25 (8 streams' rings, one "
                          "stream at 64 positions): plan again for this spec"),
    (set_stage(0, "ring_blocks", -1), "stages[0] has a K/V pool of 25 blocks of 64 positions (-1 a stream's rings)"),
    (set_stage(0, "paged", 1), "stages[0].paged must be true or false, not 1"),
    (set_stage(1, "kv_blocks", 10**6), "stages[1] needs 15.32 GiB on node node1 (weights 597.07 KiB, state 15.26 "
                                       "GiB: 8 streams' slots and a K/V pool of 1,000,000 blocks of 64 positions"),
    (set_stage(1, "kv_block", 32), "stages[1] has a K/V pool of "),
])
def test_a_bad_plan_names_the_file_and_the_stage_at_fault(spec_path, saved, change, message):
    bad = edited(saved, change)
    with pytest.raises(PlanError) as info:
        load_plan(bad, load_spec(spec_path))
    assert str(info.value).startswith(f"{bad}: ") and message in str(info.value)


def test_a_plan_that_is_not_an_object(spec_path, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(PlanError, match=r"bad.json must be an object, not \[\]"):
        load_plan(bad, load_spec(spec_path))


def test_a_plan_saved_for_fewer_streams_does_not_fit_once_max_streams_grows(spec_path, saved):
    spec_path.write_text(SPEC.replace("max_streams: 8", "max_streams: 64"))
    with pytest.raises(PlanError, match=r"stages\[0\] has a K/V pool of 25 blocks .* at least 128 \(64 streams' rings"):
        load_plan(saved, load_spec(spec_path))


def test_a_plan_saved_by_the_planner_loads_unchanged(spec_path, saved):
    spec = load_spec(spec_path)
    assert load_plan(saved, spec) == plan(spec)


def test_simulate_with_a_bad_plan_exits_1_with_the_message(spec_path, saved):
    bad = edited(saved, set_stage(1, "layers", [2, 2]))
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--plan", bad])
    assert result.exit_code == 1
    assert f"Error: {bad}: stages[2].layers: starts at layer 4, but stages[1] ends at layer 2" in result.output
