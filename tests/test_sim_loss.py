"""A lost node in the simulator: which frames are lost, when the stage is back, the replay, and `simulate --fail`."""

import json

import attrs
import pytest
from click.testing import CliRunner
from sim_specs import calibration, even_plan, tiny_spec, tiny_spec_yaml

from cascadia.cli import cli
from cascadia.metrics import Recorder
from cascadia.policy import Policy, Request
from cascadia.sim.calibration import CalibrationError
from cascadia.sim.loss import Loss, Recovery, format_losses, recovery
from cascadia.sim.model import PipelineModel
from cascadia.spec.types import LinkSpec
from cascadia.workload import ClosedLoop

STAGE_S = 1.0  # every stage takes a second a frame, whatever its rows; links are instant
ROUND_S = 3 * STAGE_S


def _one_stream_loses(node: int, at_s: float, detect_s: float = 2.0, restart_s: float = 5.0):
    spec = tiny_spec()  # 3 nodes, prefill window 4
    instant = LinkSpec(1e30, 0.0)
    cal = calibration(spec, lambda kind, r, x: 0.0, frame_s=STAGE_S, links={pair: instant for pair in (
        ("n0", "n1"), ("n1", "n2"), ("n2", "n0"))})
    plan = even_plan(spec)
    model = PipelineModel(spec, plan, cal)
    policy = Policy.for_runtime(spec.runtime, 1)
    recorder = Recorder(1, "measured")
    how = Recovery(node, detect_s, restart_s)
    model.run_phase(policy, ClosedLoop([(Request(0, (5,), 8),)], 1), 1, recorder, (Loss(f"n{node}", at_s), how))
    [record] = recorder.records
    return record, model.losses


def test_a_frame_not_past_the_lost_node_is_made_again_after_the_replay():
    # tokens at 3, 6, 9 s; the 4th frame (9-12 s) is on n1 at 10.5 s, not past n2: lost
    record, [loss] = _one_stream_loses(node=2, at_s=10.5)
    back = 10.5 + 2.0 + 5.0
    # the replay prefills the prompt and the 3 tokens (4 positions: one window of 4 rows) and samples the 4th
    expected = [3.0, 6.0, 9.0] + [back + ROUND_S * k for k in range(1, 6)]
    assert list(record.token_times) == pytest.approx(expected)
    assert loss == {"node": "n2", "at_s": 10.5, "detected_s": 2.0, "back_s": 7.0,
                    "first_token_s": pytest.approx(7.0 + ROUND_S)}


def test_a_frame_past_the_lost_node_still_brings_its_token():
    # the 4th frame left n0 at 10 s: its token comes at 12 s; the next frame, sent into the lost stage, is lost
    record, [loss] = _one_stream_loses(node=0, at_s=10.5)
    back = 10.5 + 7.0
    # 4 tokens and the prompt: 5 positions to prefill again, in windows of 4 and 1
    expected = [3.0, 6.0, 9.0, 12.0] + [back + 2 * ROUND_S + ROUND_S * k for k in range(4)]
    assert list(record.token_times) == pytest.approx(expected)
    assert loss["first_token_s"] == pytest.approx(7.0 + 2 * ROUND_S)


def test_the_restart_is_the_calibrations_or_the_stages_weights_at_disk_speed():
    spec = tiny_spec()
    plan = even_plan(spec)
    plan = attrs.evolve(plan, stages=tuple(attrs.evolve(s, weight_bytes=6e9) for s in plan.stages))
    cal = calibration(spec, lambda kind, r, x: 1e-3)
    with pytest.raises(CalibrationError, match="no restart time for it and the spec no disk_bandwidth"):
        recovery(Loss("n1", 1.0), spec, plan.stages, cal)
    nodes = tuple(attrs.evolve(n, disk_bandwidth=2e9) for n in spec.cluster.nodes)
    spec = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))
    assert recovery(Loss("n1", 1.0), spec, plan.stages, cal, detect_s=0.1) == Recovery(1, 0.1, 3.0)
    timed = attrs.evolve(cal, nodes={**cal.nodes, "n1": attrs.evolve(cal.nodes["n1"], restart_s=1.25)})
    assert recovery(Loss("n1", 1.0), spec, plan.stages, timed).restart_s == 1.25
    with pytest.raises(CalibrationError, match="no stage on that node"):
        recovery(Loss("n9", 1.0), spec, plan.stages, cal)


def _simulate(tmp_path, *args):
    path = tmp_path / "spec.yaml"
    path.write_text(tiny_spec_yaml(concurrency="[1, 4]", output_tokens=48).replace(
        "compute: 1TFLOPS", "compute: 1TFLOPS, disk_bandwidth: 100MB/s"))
    return CliRunner().invoke(cli, ["simulate", str(path), *args])


def test_simulate_fail_shows_the_dip_and_what_the_loss_cost(tmp_path):
    plain = _simulate(tmp_path, "--json", str(tmp_path / "plain.json"))
    lossy = _simulate(tmp_path, "--fail", "node1@0.02", "--detect", "0.1", "--json", str(tmp_path / "lossy.json"))
    assert plain.exit_code == 0 and lossy.exit_code == 0, plain.output + lossy.output
    before, after = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "lossy"))
    assert "losses" not in before
    assert [loss["concurrency"] for loss in after["losses"]] == [1, 4]
    for loss in after["losses"]:
        assert loss["node"] == "node1" and loss["detected_s"] == 0.1 and loss["back_s"] > 0.1
        assert loss["first_token_s"] > loss["back_s"]
    for plain_level, lossy_level in zip(before["levels"], after["levels"]):
        assert lossy_level["decode_tokens_per_s"] < plain_level["decode_tokens_per_s"]
    lines = lossy.stdout.splitlines()
    assert lines[-1] == f"wrote {tmp_path / 'lossy.json'}"
    assert lines[-4].split() == ["streams", "lost", "at", "s", "found", "after", "s", "back", "after", "s", "first",
                                 "token", "after", "s"]
    assert lines[-3].split()[:4] == ["1", "node1", "0.02", "0.10"]
    at_rate = [loss | {"concurrency": None, "rate": 2.0} for loss in after["losses"]]
    assert format_losses(at_rate).splitlines()[1].split()[:4] == ["2/s", "node1", "0.02", "0.10"]
    assert format_losses(at_rate).split()[0] == "load"


@pytest.mark.parametrize("args, message", [
    (["--fail", "node1"], "'node1' is not NODE@SECONDS"),
    (["--fail", "node1@-2"], "'node1@-2' is not NODE@SECONDS"),
    (["--fail", "node7@1"], "--fail node7: the plan has no stage on that node"),
    (["--detect", "1"], "give --fail NODE@SECONDS with it"),
])
def test_bad_losses_are_named(tmp_path, args, message):
    result = _simulate(tmp_path, *args)
    assert result.exit_code != 0 and message in result.output


def test_a_loss_after_the_phase_is_said(tmp_path):
    result = _simulate(tmp_path, "--fail", "node1@1000", "--json", str(tmp_path / "late.json"))
    assert result.exit_code == 0, result.output
    late = json.loads((tmp_path / "late.json").read_text())
    assert late["losses"] == []
    assert any("before node1 was lost at 1000 s" in w for w in late["warnings"])
