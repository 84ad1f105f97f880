"""Intervals (`simulate --interval`): the workload simulated again at the speeds the calibration's rounds ran at, each
figure's middle share of them."""

from __future__ import annotations

import json

import attrs
import pytest
from click.testing import CliRunner
from sim_specs import calibration, even_plan, tiny_spec, tiny_spec_yaml

from cascadia.cli import cli
from cascadia.errors import CalibrationError
from cascadia.metrics import FIGURES, figure
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import CoordinatorCalibration, Spread
from cascadia.sim.interval import middle, scaled, simulate_interval, stratified_levels
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.spec.types import LengthSpec, WorkloadSpec

WORKLOAD = WorkloadSpec(concurrency=(1, 4), requests=6, prompt_tokens=LengthSpec(3, 9), output_tokens=5)


def measured(spec, *levels: float):
    """A calibration whose pipeline passes ran at `levels`."""
    cal = calibration(spec, lambda kind, rows, x: 1e-3 * (1 + rows / 8), frame_s=2e-5, row_s=1e-6, stream_s=3e-6)
    return attrs.evolve(cal, spread=Spread({}, levels))


def test_scaled_makes_every_cpu_time_of_the_model_that_many_times_slower():
    cal = attrs.evolve(measured(tiny_spec(), 1.0), coordinator=CoordinatorCalibration(3e-4, 5e-6))
    slow = scaled(cal, 2.0)
    assert slow.coordinator == CoordinatorCalibration(6e-4, 1e-5)
    for name, node in cal.nodes.items():
        twice = slow.nodes[name]
        assert (twice.frame_s, twice.row_s, twice.stream_s) == (2 * node.frame_s, 2 * node.row_s, 2 * node.stream_s)
        for kind, table in node.tables.items():
            assert twice.tables[kind].time_s == tuple(tuple(2 * t for t in line) for line in table.time_s)
    assert slow.links == cal.links and slow.hosts == cal.hosts and scaled(cal, 1.0) == cal


def test_levels_are_the_spread_at_the_middles_of_equal_strata():
    cal = measured(tiny_spec(), 1.2, 0.9, 1.0)
    assert stratified_levels(cal, 3) == pytest.approx([0.9, 1.0, 1.2])  # one round per stratum: the rounds
    assert stratified_levels(cal, 2) == pytest.approx([0.925, 1.15])  # quantiles 1/4 and 3/4, linear between rounds
    with_tables = attrs.evolve(cal, spread=Spread({"n0": (0.8, 1.0)}, (1.0, 1.4)))
    assert stratified_levels(with_tables, 4) == pytest.approx([0.8, 1.0, 1.0, 1.4])  # every node's and pass's rounds


def test_middle_reads_the_share_in_the_middle_at_the_strata():
    values = [float(v) for v in range(10, 0, -1)]  # in any order
    assert middle(values, 80) == pytest.approx((1.5, 5.5, 9.5))  # 10% lies halfway between the first two strata
    assert middle([3.0], 80) == (3.0, 3.0, 3.0)


def test_an_interval_spans_the_figures_simulated_at_the_spread_levels():
    spec = attrs.evolve(tiny_spec(), workload=WORKLOAD)
    plan = even_plan(spec)
    cal = measured(spec, 0.8, 1.0, 1.5)
    interval = simulate_interval(spec, cal, plan, 50, samples=2)
    assert interval["machine_levels"] == pytest.approx([0.85, 1.375])
    fast, slow = (simulate(spec, scaled(cal, level), plan) for level in (0.85, 1.375))
    for i, level in enumerate(interval["levels"]):
        assert level["concurrency"] == (1, 4)[i]
        for name in FIGURES:  # with 2 strata, 50% spans exactly the two simulations
            values = sorted([figure(fast["levels"][i], name), figure(slow["levels"][i], name)])
            f = level["figures"][name]
            assert (f["low"], f["high"]) == pytest.approx(values, rel=1e-12)
            assert f["median"] == pytest.approx(sum(values) / 2, rel=1e-12)
        tokens = level["figures"]["decode tok/s"]
        assert tokens["low"] < tokens["high"]  # the machine's speed moves what it decodes


def test_a_steady_machine_gives_the_point_prediction_as_its_interval():
    spec = attrs.evolve(tiny_spec(), workload=WORKLOAD)
    plan = even_plan(spec)
    cal = measured(spec, 1.0, 1.0, 1.0)
    point = simulate(spec, cal, plan)
    interval = simulate_interval(spec, cal, plan, 80, samples=3)
    for level, predicted in zip(interval["levels"], point["levels"]):
        for name in FIGURES:
            f = level["figures"][name]
            assert f["low"] == f["median"] == f["high"] == pytest.approx(figure(predicted, name), rel=1e-12)


def test_a_calibration_without_rounds_has_no_interval():
    spec = tiny_spec()
    with pytest.raises(CalibrationError, match="has no spread of its rounds.*calibrate again"):
        stratified_levels(attrs.evolve(measured(spec, 1.0), spread=None), 5)
    with pytest.raises(CalibrationError, match="an analytic estimate measured nothing"):
        stratified_levels(analytic_calibration(spec), 5)


def test_simulate_interval_on_the_command_line(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(tiny_spec_yaml(concurrency="[1, 3]"))
    cal, out = tmp_path / "cal.json", tmp_path / "out.json"
    measured(load_spec(spec), 0.9, 1.0, 1.3).save(cal)
    runner = CliRunner()
    result = runner.invoke(cli, ["simulate", str(spec), "--calibration", str(cal), "--interval", "80",
                                 "--interval-samples", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert ("80% intervals: median (low-high) over 5 speeds, 0.90-1.30x the calibration's time (its rounds over 0 s)"
            in result.output)
    interval = json.loads(out.read_text())["interval"]
    assert interval["percent"] == 80 and interval["samples"] == 5 and len(interval["levels"]) == 2
    result = runner.invoke(cli, ["simulate", str(spec), "--interval", "80"])  # analytic
    assert result.exit_code == 1 and "an analytic estimate measured nothing" in result.output
    result = runner.invoke(cli, ["simulate", str(spec), "--interval", "80", "--replay-trace", str(out)])
    assert result.exit_code == 2 and "give one of them" in result.output
    result = runner.invoke(cli, ["simulate", str(spec), "--interval", "100"])
    assert result.exit_code == 2 and "Traceback" not in result.output
