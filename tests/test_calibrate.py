"""`cascadia calibrate`: its measuring parts on the tiny model, and a whole calibration of specs/tiny-local.yaml that
the simulator takes. Timings are never asserted, only what was measured and where it went."""

import json
from pathlib import Path

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

import cascadia.pipeline.stage as pipeline_stage
from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import StageEngine
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.layers import Routing
from cascadia.errors import SpecError
from cascadia.graph.planner import plan as make_plan
from cascadia.measure import calibrate as calibrate_module
from cascadia.measure import pipeline_probe
from cascadia.measure.calibrate import format_calibration
from cascadia.measure.tables import Grid, StageProbe, SteeredRouter
from cascadia.pipeline.stage import load_stage
from cascadia.sim.calibration import KIND_AXES, MEASURED, Calibration, CoordinatorCalibration
from cascadia.sim.fit import (AloneFrames, burst_streams, fit_non_negative, fit_overheads, shared_speedup,
                              simulate_burst)
from cascadia.sim.model import FrameShape, PipelineModel, stage_kinds
from cascadia.spec.load import load_spec
from cascadia.spec.types import RuntimeSpec
from tests.sim_specs import calibration as hand_calibration
from tests.sim_specs import even_plan, tiny_spec

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


def test_fit_non_negative():
    x = np.arange(1.0, 9.0)
    assert fit_non_negative([np.ones(8), x], 2 + 0.5 * x) == pytest.approx((2, 0.5))
    # a falling line: the best fit with no negative slope is its mean
    assert fit_non_negative([np.ones(8), x], 10 - x) == pytest.approx((np.mean(10 - x), 0))
    # through the origin when the intercept would be negative
    assert fit_non_negative([np.ones(8), x], 3 * x - 1) == pytest.approx((0, (3 * x - 1) @ x / (x @ x)))


def test_the_coordinators_own_work_is_fitted_apart_from_the_nodes_handling():
    spec = tiny_spec()
    plan = even_plan(spec)
    layers = hand_calibration(spec, lambda kind, rows, x: 1e-4 * rows + 1e-6 * x)
    truth = attrs.evolve(layers, nodes={name: attrs.evolve(node, frame_s=2e-4, row_s=3e-6)
                                        for name, node in layers.nodes.items()},
                         coordinator=CoordinatorCalibration(5e-4, 7e-6))
    model = PipelineModel(spec, plan, truth)
    frames = []
    for n in (1, 2, 4, 8):  # frames alone as the pipeline probe measures them: round trip, busy, coordinator CPU
        shapes = tuple(FrameShape(n, n, float(step + 1), float(step + 1), n, n) for step in range(3))
        alone = [model.alone_s(shape) for shape in shapes]
        busy = [sum(stages[i] - (2e-4 + 3e-6 * shape.rows) for (stages, _), shape in zip(alone, shapes))
                for i in range(len(plan.stages))]
        frames.append(AloneFrames(shapes, sum(trip for _, trip in alone), tuple(busy),
                                  sum(truth.coordinator.seconds(shape.rows) for shape in shapes)))
    fitted = fit_overheads(spec, plan, layers, frames)
    assert attrs.astuple(fitted.coordinator) == pytest.approx((5e-4, 7e-6))
    for node in fitted.nodes.values():
        assert (node.frame_s, node.row_s, node.stream_s) == pytest.approx((2e-4, 3e-6, 0.0), abs=1e-12)


@pytest.mark.parametrize("speedup", [(1.0, 1.0, 1.0), (1.0, 1.37, 1.1), (1.0, 2.0, 2.2), (1.0, 2.0, 3.0)])
def test_shared_speedup_is_the_one_with_which_the_simulator_takes_as_long_as_the_bursts(speedup):
    spec = tiny_spec(host="box")
    plan = even_plan(spec)
    assert burst_streams(spec, plan) == [2, 6]
    cal = hand_calibration(spec, lambda kind, rows, x: 1e-3 * (1 + rows / 8), frame_s=2e-4)
    steps = 12
    bursts = []
    for streams in burst_streams(spec, plan):
        burst = simulate_burst(spec, plan, attrs.evolve(cal, hosts={"box": speedup}), streams, steps)
        assert len(burst) == streams * steps and burst == sorted(burst)
        # three passes as measured: one 5% slower, one 5% faster; their median is the simulator's own
        bursts.append([[t * 1.05 for t in burst], burst, [t * 0.95 for t in burst]])
    assert shared_speedup(spec, plan, cal, bursts) == {"box": pytest.approx(speedup, rel=1e-4)}


def test_shared_speedup_stays_between_its_bounds():
    spec = tiny_spec(host="box")
    plan = even_plan(spec)
    cal = hand_calibration(spec, lambda kind, rows, x: 1e-3)
    bursts = [simulate_burst(spec, plan, attrs.evolve(cal, hosts={"box": (1.0,)}), n, 8)
              for n in burst_streams(spec, plan)]
    assert shared_speedup(spec, plan, cal, [[[t * 9 for t in b]] for b in bursts]) == {"box": (1.0, 0.5, 0.5)}
    assert shared_speedup(spec, plan, cal, [[[t / 9 for t in b]] for b in bursts]) == {"box": (1.0, 2.0, 3.0)}
    assert shared_speedup(tiny_spec(), even_plan(tiny_spec()), cal, []) == {}  # no shared host
    assert burst_streams(tiny_spec(), even_plan(tiny_spec())) == []
    one_stream = tiny_spec(host="box", runtime=RuntimeSpec(context_budget=64, max_streams=1, row_buckets=(1, 2)))
    assert burst_streams(one_stream, plan) == []  # nodes never compute at once
    assert shared_speedup(one_stream, plan, cal, []) == {"box": (1.0,)}


@pytest.mark.parametrize("rows, distinct", [(1, 2), (2, 3), (4, 8), (3, 5), (8, 8)])
def test_steered_router_touches_exactly_the_asked_experts(rows, distinct):
    def router(h):
        return Routing(np.zeros((len(h), 2), np.int32), np.ones((len(h), 2), np.float32),
                       np.ones((len(h), 1), np.float32))

    steered = SteeredRouter(router, distinct)
    index = steered(np.zeros((rows, 4), np.float32)).index
    assert index.shape == (rows, 2) and index.dtype == np.int32
    assert all(len(set(row)) == 2 for row in index.tolist())  # two different experts per row
    assert len(np.unique(index)) == min(distinct, 2 * rows)
    steered.distinct = None
    assert not steered(np.zeros((rows, 4), np.float32)).index.any()  # the router's own choice


def test_stage_probe_measures_every_kind_of_the_stage_on_the_grid(spec, checkpoint):
    plan = make_plan(spec)
    stage = plan.stages[0]  # embedding, layer 0 (sliding, dense), layer 1 (sliding, moe)
    loaded = load_stage(spec, stage, checkpoint, 1, False, lambda done, total: None)
    kinds = stage_kinds(stage, spec.model.config)
    grid = attrs.evolve(Grid.of(spec), rounds=3)
    probe = StageProbe(loaded, kinds)
    frame = probe.frame(4, 10)
    assert frame.slots.tolist() == [0] * 4 and frame.positions.tolist() == [8, 9, 10, 11]  # mean attended 10.5
    assert probe.engine.lengths[0] == 8
    tables, levels = probe.tables(grid, lambda text: None)
    assert len(levels) == 3 and sorted(levels)[1] == 1.0 and all(level > 0 for level in levels)  # over their median
    assert set(tables) == set(kinds) == {"embedding", "sliding", "dense", "moe"}
    for kind, table in tables.items():
        assert table.rows == grid.rows == (1, 2, 4, 8, 16, 24)
        assert table.points == (grid.points[kind] if KIND_AXES[kind] else ())
        assert all(t > 0 for line in table.time_s for t in line)
    assert tables["moe"].points == (2, 4, 8) and tables["sliding"].points == (1, 2, 4, 8, 16)


def test_steered_frames_reach_the_expert_grouped_moe_with_the_asked_experts(spec, checkpoint, monkeypatch):
    """The MoE table times the path the engine runs: with the grouped one at every call size, each measured frame
    still touches exactly the distinct experts asked."""
    grouped = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, moe_grouped_from=1))
    stage = make_plan(grouped).stages[0]
    engine = StageEngine.for_stage(grouped, stage, Checkpoint.open(checkpoint), threads=1)
    probe = StageProbe(pipeline_stage.EngineStage(engine), stage_kinds(stage, spec.model.config))  # no head, no sampler
    touched = []
    call = GroupedBlock.__call__
    monkeypatch.setattr(GroupedBlock, "__call__", lambda self, x, index, *rest:
                        touched.append(len(np.unique(index))) or call(self, x, index, *rest))
    for rows, distinct in ((1, 2), (4, 6), (8, 8)):
        touched.clear()
        assert probe.run(rows, 1, distinct)["moe"][0] > 0
        assert touched == [min(distinct, 2 * rows)]


# ---- a whole calibration -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibration_file(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration") / "cal.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_probe, "PASSES", 1)
        result = CliRunner().invoke(cli, ["calibrate", str(SPEC), "--checkpoint", str(checkpoint), "--rounds", "1",
                                          "--watch", "1.5", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result.stdout


def test_calibrate_writes_a_measured_calibration_with_every_table_the_plan_needs(spec, calibration_file):
    path, output = calibration_file
    calibration = Calibration.load(path)
    meta = calibration.meta
    assert meta.kind == MEASURED and meta.date and meta.openvino and meta.precision == "f32"
    assert meta.device.count("CPU") == 3 and "(1 threads)" in meta.device
    assert calibration.check_model(spec) == []
    for stage in make_plan(spec).stages:
        node = calibration.nodes[stage.node]
        assert set(node.tables) == set(stage_kinds(stage, spec.model.config))
        assert node.stream_s >= 0 and node.frame_s >= 0 and node.row_s >= 0
        assert node.restart_s > 0  # timed (a node not back within the node timeout fails the calibration)
    assert calibration.coordinator.frame_s > 0 and calibration.coordinator.row_s >= 0  # its CPU time, its own
    assert "the coordinator: " in output
    assert set(calibration.links) == {("node0", "node1"), ("node1", "node2"), ("node2", "node0")}
    assert all(link.latency > 0 and link.bandwidth > 0 for link in calibration.links.values())
    speedup = calibration.hosts["localhost"]  # three nodes share this machine
    assert len(speedup) == 3 and speedup[0] == 1 and all(0.5 <= s <= k for k, s in enumerate(speedup, start=1))
    spread = calibration.spread
    assert spread.tables == {name: (1.0,) for name in calibration.nodes} and spread.pipeline == (1.0,)  # one round
    assert 1 <= len(spread.watch) <= 2 and all(level > 0 for level in spread.watch)  # a probe a second for 1.5 s
    assert spread.seconds > 1.5
    raw = json.loads(path.read_text())
    assert raw["grid_bounds"]["global"] == {"rows": [1, 24], "context": [1, 64]}
    assert f"the median round's time ({4 + len(spread.watch)} rounds over {spread.seconds:.0f} s)" in output
    assert output.splitlines()[0].split() == ["node", "sliding", "global", "moe", "dense", "embedding", "head",
                                              "per", "stream", "per", "frame", "per", "row", "restart", "s"]
    assert output.splitlines()[-1] == f"wrote {path}"


def test_simulate_takes_the_measured_calibration(calibration_file, tmp_path):
    path, _ = calibration_file
    out = tmp_path / "predicted.json"
    result = CliRunner().invoke(cli, ["simulate", str(SPEC), "--calibration", str(path), "--concurrency", "1,4",
                                      "--interval", "80", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    predicted = json.loads(out.read_text())
    assert predicted["calibration"]["kind"] == MEASURED and predicted["warnings"] == []
    assert [level["concurrency"] for level in predicted["levels"]] == [1, 4]
    assert all(level["decode_tokens_per_s"] > 0 for level in predicted["levels"])
    for level, interval in zip(predicted["levels"], predicted["interval"]["levels"]):
        tokens = interval["figures"]["decode tok/s"]
        assert tokens["low"] <= tokens["median"] <= tokens["high"] and tokens["low"] > 0


def test_a_simulated_loss_takes_the_measured_restart(calibration_file, tmp_path):
    path, _ = calibration_file
    out = tmp_path / "predicted.json"
    result = CliRunner().invoke(cli, ["simulate", str(SPEC), "--calibration", str(path), "--concurrency", "1",
                                      "--fail", "node1@0.01", "--detect", "0.1", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    [loss] = json.loads(out.read_text())["losses"]
    assert loss["back_s"] == pytest.approx(0.1 + Calibration.load(path).nodes["node1"].restart_s)


def test_format_calibration():
    from sim_specs import calibration, tiny_spec

    spec = tiny_spec()
    cal = attrs.evolve(calibration(spec, lambda kind, r, x: 1e-3 * r, rows=(1, 4), stream_s=2e-4, frame_s=1e-3),
                       hosts={"box": (1.0, 1.5)}, coordinator=CoordinatorCalibration(3e-4, 2e-6))
    lines = format_calibration(cal).splitlines()
    assert lines[0].split() == ["node", "sliding", "global", "moe", "dense", "embedding", "head", "per", "stream",
                                "per", "frame", "per", "row", "restart", "s"]
    assert lines[1].split() == ["n0", *["1.000-4.000"] * 6, "0.200", "1.000", "0.000", "-"]
    assert lines[4] == "the coordinator: 0.300 ms per frame + 0.002 ms per row (its own work)"
    assert lines[5] == "link n0 -> n1: latency 100 us, bandwidth 800 Mbit/s"
    assert lines[-1] == "host box: speedup 1.00, 1.50 with 1, 2, ... nodes computing at once"


def test_calibrate_refuses_tcp_nodes(spec, checkpoint):
    remote = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=tuple(
        attrs.evolve(node, address=f"tcp://10.0.0.{i}:5601") for i, node in enumerate(spec.cluster.nodes))))
    with pytest.raises(SpecError, match="calibrate measures local nodes only; node0, node1, node2 have tcp"):
        calibrate_module.calibrate(remote, make_plan(spec), checkpoint)


# ---- long contexts -----------------------------------------------------------------------------------------------
def long_context(spec, budget: int = 1024):
    return attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, context_budget=budget))


def test_the_grid_reaches_a_long_context_budget_at_one_frame_a_point(spec, checkpoint):
    long = long_context(spec)
    grid = Grid.of(long, rounds=1)
    assert grid.points["global"][-1] == 1024 and grid.points["sliding"][-1] == spec.model.config.sliding_window_size
    stage = make_plan(long).stages[1]  # layers 2 (global) and 3
    probe = StageProbe(load_stage(long, stage, checkpoint, 1, False, lambda done, total: None),
                       stage_kinds(stage, long.model.config))
    assert probe.run(1, 1024, None)["global"][0] > 0  # no prefill: the stream's length is set where the row starts
    pool = probe.engine.pool
    assert probe.engine.lengths[0] == 1024 and pool.held(0) == pool.layout.stream_blocks(1024)


def test_calibrate_layers_only_measures_the_tables_to_the_budget_without_the_pipeline(checkpoint, tmp_path):
    spec_file = tmp_path / "long.yaml"
    spec_file.write_text(SPEC.read_text().replace("hf_config: tiny/config.json",
                                                  f"hf_config: {SPEC.parent / 'tiny' / 'config.json'}")
                         .replace("context_budget: 64", "context_budget: 1024"))
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(cli, ["calibrate", str(spec_file), "--checkpoint", str(checkpoint), "--rounds", "1",
                                      "--layers-only", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    calibration = Calibration.load(out)
    assert calibration.grid_bounds()["global"]["context"] == [1, 1024]
    assert calibration.hosts == {} and len(calibration.links) == 3
    assert calibration.spread.tables == {name: (1.0,) for name in calibration.nodes}
    assert calibration.spread.pipeline == calibration.spread.watch == ()  # no pipeline
    result = CliRunner().invoke(cli, ["calibrate", str(spec_file), "--layers-only", "--watch", "60", "-o", str(out)])
    assert result.exit_code == 2 and "--watch times frames on the pipeline" in result.output
    assert all((node.frame_s, node.row_s, node.stream_s, node.restart_s) == (0, 0, 0, None)
               for node in calibration.nodes.values())


def test_a_stage_as_one_graph_is_not_calibrated_yet(tmp_path):
    """Its layers cannot be timed one by one: the calibration says so before it starts any node."""
    fixture = Path(__file__).parent / "fixtures" / "llama_odd"
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(f"model: {{hf_config: {fixture}/config.json, checkpoint: {fixture}, formats: f32}}\n"
                         "cluster: {reserve: 64MiB, nodes: [{name: a, memory: 1GiB, host: localhost}]}\n"
                         "runtime: {stage_graph: true, context_budget: 64}\n")
    spec = load_spec(spec_file)
    with pytest.raises(SpecError, match="with runtime.stage_graph they run as one graph"):
        calibrate_module.calibrate(spec, make_plan(spec))
