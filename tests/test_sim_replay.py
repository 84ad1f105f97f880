"""Replay (`simulate --replay-trace`): a trace read back is the frames it was written from, and a simulation that
replays a trace takes every frame's compute from it, not from its calibration's tables."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from sim_specs import calibration, even_plan, tiny_spec, tiny_spec_yaml

from cascadia.cli import cli
from cascadia.errors import CalibrationError
from cascadia.graph.planner import plan as make_plan
from cascadia.measure.validate import compare
from cascadia.sim.calibration import Calibration
from cascadia.sim.replay import ReplayTimes
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_spec
from cascadia.spec.types import LengthSpec, WorkloadSpec
from cascadia.trace import FrameTiming, StageTiming, chrome_trace, frame_timings, records_of
from cascadia.workload import override

SPECS = Path(__file__).parent.parent / "specs"

CLOSED = WorkloadSpec(concurrency=(1, 4), requests=6, prompt_tokens=LengthSpec(3, 9), output_tokens=5)
OPEN = WorkloadSpec(rate=(20.0, 200.0), requests=8, prompt_tokens=LengthSpec(3, 9), output_tokens=5)


def tables(scale: float):
    """Layer times that grow with rows and context, `scale` times over; the same message handling for every scale."""
    return lambda kind, rows, x: scale * 1e-3 * (1 + rows / 8) * (1 + x / 128)


def traced(spec, scale: float = 1.0) -> tuple[dict, dict]:
    """A simulation of `spec` and its trace document."""
    timings = []
    cal = calibration(spec, tables(scale), frame_s=2e-5, row_s=1e-6, stream_s=3e-6)
    result = simulate(spec, cal, even_plan(spec), timings=timings)
    return result, chrome_trace(timings, records_of(result), [n.name for n in spec.cluster.nodes], "simulate")


def figures(result: dict) -> dict[str, float]:
    """Every level's numbers, flat; not its nodes' busy seconds, which on a shared host differ in kind: replayed,
    the time a node's frames took as the host was shared; simulated, their work at the host's full speed."""
    flat = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix] = value

    for i, level in enumerate(result["levels"]):
        add(str(i), {key: value for key, value in level.items() if key != "busy"})
    return flat


def busy(result: dict) -> dict[str, float]:
    return {f"{i}.{node}": s for i, level in enumerate(result["levels"]) for node, s in level["busy"].items()}


def moments(frame) -> list[float]:
    return [frame.sent, *(t for stage in frame.stages for t in attrs.astuple(stage)), frame.done]


def test_a_trace_reads_back_as_the_frames_it_was_written_from():
    spec = tiny_spec(workload=CLOSED)
    timings = []
    result = simulate(spec, calibration(spec, tables(1.0)), even_plan(spec), timings=timings)
    nodes, frames = frame_timings(chrome_trace(timings, records_of(result), ["n0", "n1", "n2"], "simulate"))
    assert nodes == ["n0", "n1", "n2"] and len(frames) == len(timings) > 20
    written = sorted(timings, key=lambda frame: frame.sent)  # read back in the order sent
    for read, frame in zip(frames, written):
        assert (read.frame_id, read.group, read.rows, read.bucket) == (frame.frame_id, frame.group, frame.rows,
                                                                          frame.bucket)
        assert moments(read) == pytest.approx(moments(frame), abs=1e-9)


@pytest.mark.parametrize("workload", [CLOSED, OPEN], ids=["closed loop", "open loop"])
@pytest.mark.parametrize("host", [None, "one-host"], ids=["own hosts", "one shared host"])
def test_replaying_its_own_trace_a_simulation_gives_its_figures_whatever_its_tables_say(workload, host):
    spec = tiny_spec(host=host, workload=workload)
    original, document = traced(spec)
    nodes, frames = frame_timings(document)
    replay = ReplayTimes(nodes, frames)
    # tables three times over, and handling too: a replay fits the handling on the trace's frames that went alone
    three_times = calibration(spec, tables(3.0), frame_s=6e-5, row_s=3e-6, stream_s=9e-6)
    replayed = simulate(spec, three_times, even_plan(spec), replay=replay)
    assert (replay.replayed, replay.tabled) == (len(frames), 0)
    assert figures(replayed) == pytest.approx(figures(original), rel=1e-9)
    if host is None:
        assert busy(replayed) == pytest.approx(busy(original), rel=1e-9)
    assert replayed["replay"] == {"frames": len(frames), "replayed": len(frames), "tabled": 0}
    assert figures(simulate(spec, three_times, even_plan(spec))) != pytest.approx(figures(original), rel=0.1)


def test_the_frames_alone_in_the_pipeline_are_those_nothing_overlapped():
    def frame(i, sent, done, rows=1):
        return FrameTiming(i, 0, rows, rows, sent, (StageTiming(sent, sent + 0.1, sent + 0.2),), done, 1)

    replay = ReplayTimes(["n0"], [frame(0, 0.0, 1.0), frame(1, 1.0, 2.0, rows=2), frame(2, 2.5, 3.5),
                                  frame(3, 3.0, 4.0), frame(4, 5.0, 6.0)])
    assert replay.alone == [(1, 1, 1, pytest.approx(0.9)), (2, 2, 1, pytest.approx(0.9)), (1, 1, 1, pytest.approx(0.9))]


def test_frames_the_trace_lacks_are_costed_from_the_tables_and_counted():
    _, document = traced(tiny_spec(workload=attrs.evolve(CLOSED, concurrency=(1,))))
    nodes, frames = frame_timings(document)
    replay = ReplayTimes(nodes, frames)
    spec = tiny_spec(workload=CLOSED)  # four streams cut frames that one stream never made
    result = simulate(spec, calibration(spec, tables(1.0)), even_plan(spec), replay=replay)
    assert replay.tabled > 0 and replay.replayed > 0
    assert f"replay: {replay.tabled} of {replay.replayed + replay.tabled} simulated frames found no traced frame " \
           "of their rows and padding left" in "\n".join(result["warnings"])


def test_a_trace_of_other_nodes_or_not_a_trace_is_refused():
    _, document = traced(tiny_spec(workload=CLOSED))
    nodes, frames = frame_timings(document)
    replay = ReplayTimes(nodes, frames, "t.json")
    with pytest.raises(CalibrationError, match="^t.json: the trace's stages ran on n0, n1, n2, the plan's on n0, n1; "
                                               "replay a trace on the plan that made it$"):
        simulate(tiny_spec(2), calibration(tiny_spec(2), tables(1.0)), even_plan(tiny_spec(2)), replay=replay)
    with pytest.raises(ValueError, match="not a Cascadia trace"):
        frame_timings({"traceEvents": []})
    cut = {**document, "traceEvents": [e for e in document["traceEvents"]
                                       if not (e["ph"] == "X" and e["pid"] == 2 and e["tid"] == 1)]}
    with pytest.raises(ValueError, match=r"frame \d+: no compute span on n1"):
        frame_timings(cut)


def test_simulate_replay_trace_on_the_command_line(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(tiny_spec_yaml(concurrency="[1, 3]"))
    trace, first, again = tmp_path / "trace.json", tmp_path / "first.json", tmp_path / "again.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["simulate", str(spec), "--trace", str(trace), "--json", str(first)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["simulate", str(spec), "--replay-trace", str(trace), "--json", str(again)])
    assert result.exit_code == 0, result.output
    assert "replayed the compute of" in result.output
    assert figures(json.loads(again.read_text())) == pytest.approx(figures(json.loads(first.read_text())), rel=1e-9)
    (tmp_path / "bad.json").write_text('{"traceEvents": []}')
    result = runner.invoke(cli, ["simulate", str(spec), "--replay-trace", str(tmp_path / "bad.json")])
    assert result.exit_code == 1 and "bad.json: not a Cascadia trace" in result.output
    assert "Traceback" not in result.output


RECORDED = Path(__file__).parent / "fixtures" / "replay_mid_pinned"


def test_a_recorded_runs_replay_is_within_two_percent_of_it_at_every_level():
    """A real run of specs/mid-pinned.yaml at 1 to 16 streams (its trace, its result and the calibration made just
    before it, recorded as the fixture's README says): the simulator, replaying the run's own compute, gives the
    run's decode rate, TTFT p50 and p95 within 2% at every level. What it checks is the model's
    structure (the policy, queueing, messages' handling, the coordinator) against a real pipeline's. TPOT p50 gets
    2.5%: this run's, at 2 streams, replays 2.1% slow."""
    recorded = json.loads((RECORDED / "result.json").read_text())
    spec = load_spec(SPECS / "mid-pinned.yaml")
    spec = attrs.evolve(spec, workload=override(spec.workload, tuple(recorded["concurrency"]), recorded["requests"]))
    nodes, frames = frame_timings(json.loads(gzip.decompress((RECORDED / "trace.json.gz").read_bytes())))
    replay = ReplayTimes(nodes, frames)
    replayed = simulate(spec, Calibration.load(RECORDED / "calibration.json"), make_plan(spec), replay=replay)
    assert replay.tabled == 0 and replay.replayed == len(frames)  # every frame of the run, each once
    errors = {(level["concurrency"], name): metrics["error"]
              for level in compare([recorded["measured"]], replayed)["levels"]
              for name, metrics in level["metrics"].items() if name in ("decode tok/s", "TTFT p50", "TTFT p95",
                                                                          "TPOT p50")}
    assert len(errors) == 4 * len(recorded["concurrency"])
    assert all(abs(error) <= (0.025 if name == "TPOT p50" else 0.02) for (_, name), error in errors.items()), errors
