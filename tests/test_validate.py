"""`cascadia validate`: the comparison's arithmetic on hand-made results, and a real run against the simulator on the
tiny local spec (its structure only: the errors depend on the machine's load)."""

import json
import statistics
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from sim_specs import calibration

from cascadia.cli import cli
from cascadia.metrics import FIGURES
from cascadia.measure.validate import (SCHEMA, compare, compare_frame_times, compare_interval,
                                      compare_phase_frame_times, compare_replays, format_comparison,
                                      format_phase_frame_times, frames_by_phase)
from cascadia.pipeline.run import RunFailed, RunResult
from cascadia.sim.calibration import Spread
from cascadia.trace import FrameTiming, StageTiming

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


def level(concurrency, decode, phase, ttft50, ttft95, tpot50):
    return {"concurrency": concurrency, "decode_tokens_per_s": decode, "phase_tokens_per_s": phase,
            "ttft_s": {"p50": ttft50, "p95": ttft95}, "tpot_s": {"p50": tpot50, "p95": None}}


MEASURED = {"levels": [level(1, 100.0, 80.0, 0.050, 0.060, 0.010), level(4, 200.0, 160.0, 0.100, 0.200, None),
                       level(8, 250.0, 0.0, 0.200, 0.300, 0.040)]}
PREDICTED = {"levels": [level(1, 110.0, 80.0, 0.045, 0.060, 0.011), level(4, 150.0, 168.0, 0.100, 0.150, 0.030),
                        level(8, 260.0, 240.0, 0.300, 0.330, None)]}


def test_errors_are_relative_to_the_measurement_and_medians_skip_what_is_missing():
    result = compare([MEASURED], PREDICTED)
    errors = [{name: m["error"] for name, m in lv["metrics"].items()} for lv in result["levels"]]
    assert errors[0] == pytest.approx({"decode tok/s": 0.1, "phase tok/s": 0.0, "TTFT p50": -0.1, "TTFT p95": 0.0,
                                       "TPOT p50": 0.1})
    assert errors[1]["decode tok/s"] == pytest.approx(-0.25) and errors[1]["TPOT p50"] is None  # nothing measured
    assert errors[2]["phase tok/s"] is None and errors[2]["TPOT p50"] is None  # zero measured; nothing predicted
    assert errors[2]["TTFT p50"] == pytest.approx(0.5)
    assert result["levels"][1]["metrics"]["TPOT p50"] == {"measured": None, "spread": None, "predicted": 0.030,
                                                          "error": None}
    assert result["median_abs_error"] == pytest.approx({"decode tok/s": 0.1, "phase tok/s": 0.025, "TTFT p50": 0.1,
                                                        "TTFT p95": 0.1, "TPOT p50": 0.1})


def test_several_runs_are_measured_by_their_median():
    slow = {"levels": [level(1, 80.0, 70.0, 0.070, None, 0.012), level(4, 180.0, 150.0, 0.120, 0.250, None),
                       level(8, 240.0, 0.0, 0.250, 0.350, None)]}
    fast = {"levels": [level(1, 130.0, 90.0, 0.040, 0.050, None), level(4, 230.0, 170.0, 0.090, 0.180, None),
                       level(8, 300.0, 0.0, 0.150, 0.250, None)]}
    three = compare([slow, MEASURED, fast], PREDICTED)
    first = three["levels"][0]["metrics"]
    assert first["decode tok/s"] == {"measured": 100.0, "spread": pytest.approx(0.5), "predicted": 110.0,
                                     "error": pytest.approx(0.1)}  # spread: (130 - 80) / 100
    assert first["TTFT p95"]["measured"] == pytest.approx(0.055)  # the median of the runs that have one
    assert first["TPOT p50"]["measured"] == pytest.approx(0.011)
    assert first["TPOT p50"]["spread"] == pytest.approx(0.002 / 0.011)
    assert three["median_spread"]["decode tok/s"] == pytest.approx(0.25)  # of the levels' 0.5, 0.25 and 0.24
    alike = compare([MEASURED] * 3, PREDICTED)
    assert alike["median_abs_error"] == compare([MEASURED], PREDICTED)["median_abs_error"]
    assert alike["median_spread"]["decode tok/s"] == 0.0
    assert compare([MEASURED], PREDICTED)["median_spread"] == dict.fromkeys(FIGURES)  # one run: no spread


def test_a_level_the_prediction_lacks_is_an_error():
    with pytest.raises(ValueError, match="no level of concurrency 8"):
        compare([MEASURED], {"levels": PREDICTED["levels"][:2]})


def test_the_comparison_table():
    lines = format_comparison(compare([MEASURED], PREDICTED)).splitlines()
    assert lines[0].split() == ["streams", "metric", "measured", "spread", "predicted", "error"]
    assert len(lines) == 1 + 3 * len(FIGURES) + 1
    assert lines[1].split() == ["1", "decode", "tok/s", "100.00", "-", "110.00", "+10.0%"]
    assert lines[3].split() == ["TTFT", "p50", "(ms)", "50.00", "-", "45.00", "-10.0%"]
    assert lines[10].split() == ["TPOT", "p50", "(ms)", "-", "-", "30.00", "-"]
    assert lines[-1] == ("median |error|: decode tok/s 10.0%, phase tok/s 2.5%, TTFT p50 10.0%, TTFT p95 10.0%, "
                         "TPOT p50 10.0%")
    two = format_comparison(compare([MEASURED, MEASURED], PREDICTED)).splitlines()
    assert two[1].split() == ["1", "decode", "tok/s", "100.00", "0.0%", "110.00", "+10.0%"]
    assert two[-2].startswith("median spread of the runs: decode tok/s 0.0%")


def test_each_run_is_compared_with_its_own_replay():
    slow = {"levels": [level(1, 80.0, 70.0, 0.070, None, 0.012), level(4, 180.0, 150.0, 0.120, 0.250, None),
                       level(8, 240.0, 0.0, 0.250, 0.350, None)]}
    replayed_slow = {"levels": [level(1, 84.0, 70.0, 0.070, 0.060, 0.012), *PREDICTED["levels"][1:]]}
    one = compare_replays([MEASURED], [PREDICTED])  # one run: its replay's errors are compare's
    assert [{name: m["error"] for name, m in lv["metrics"].items()} for lv in one["levels"]] == [
        {name: m["error"] for name, m in lv["metrics"].items()} for lv in compare([MEASURED], PREDICTED)["levels"]]
    two = compare_replays([MEASURED, slow], [PREDICTED, replayed_slow])
    decode = two["levels"][0]["metrics"]["decode tok/s"]
    # the median of the replays (110, 84) against the median of the runs (100, 80); each run against its own
    assert decode == {"replayed": 97.0, "error": pytest.approx(97 / 90 - 1), "run_errors": pytest.approx([0.1, 0.05])}
    assert two["levels"][0]["metrics"]["TTFT p95"]["run_errors"] == [0.0, None]  # the slow run measured none
    table = format_comparison({**compare([MEASURED], PREDICTED), "replay": one,
                               "replayed": [PREDICTED | {"replay": {"frames": 9, "replayed": 7, "tabled": 2}}]})
    lines = table.splitlines()
    assert lines[0].split() == ["streams", "metric", "measured", "spread", "predicted", "error", "replayed", "replay",
                                "error"]
    assert lines[1].split() == ["1", "decode", "tok/s", "100.00", "-", "110.00", "+10.0%", "110.00", "+10.0%"]
    assert lines[-2].startswith("median |error| replayed: decode tok/s 10.0%")
    assert lines[-1] == "replayed from each run's trace: run 1: 7 of 9 frames"


def bounds(low, high):
    return {"low": low, "median": (low + high) / 2, "high": high}


INTERVAL = {"percent": 80, "samples": 5, "machine_levels": [0.9, 0.95, 1.0, 1.05, 1.2], "seconds": 64.0, "levels": [
    {"concurrency": 1, "rate": None, "figures": {"decode tok/s": bounds(90.0, 105.0), "phase tok/s": bounds(70.0, 75.0),
                                                 "TTFT p50": bounds(0.04, 0.05), "TTFT p95": None,
                                                 "TPOT p50": bounds(0.009, 0.011)}}]}


def test_an_interval_counts_the_runs_values_it_holds():
    slow = {"levels": [level(1, 80.0, 70.0, 0.070, None, 0.012)]}
    held = compare_interval([MEASURED, slow], INTERVAL)
    figures = held["levels"][0]["figures"]
    assert figures["decode tok/s"] == {**bounds(90.0, 105.0), "measured": [100.0, 80.0], "inside": [True, False]}
    assert figures["phase tok/s"]["inside"] == [False, True]  # 80 above it; 70 on its edge
    assert figures["TTFT p50"]["inside"] == [True, False]  # its bounds held: 0.05 at the edge
    assert figures["TTFT p95"] == {"measured": [0.060, None], "inside": [None, None]}  # no interval: not counted
    assert figures["TPOT p50"]["inside"] == [True, False]
    assert (held["held"], held["values"], held["coverage"]) == (4, 8, 0.5)
    assert held["coverage_by_figure"] == {"decode tok/s": 0.5, "phase tok/s": 0.5, "TTFT p50": 0.5, "TTFT p95": None,
                                          "TPOT p50": 0.5}
    assert held["median_width"] == pytest.approx((15 / 97.5 + 0.002 / 0.01) / 2)  # and 5/72.5, 0.01/0.045
    one = {"levels": MEASURED["levels"][:1]}
    lines = format_comparison({**compare([one, slow], {"levels": PREDICTED["levels"][:1]}),
                               "interval": held}).splitlines()
    assert lines[0].split() == ["streams", "metric", "measured", "spread", "predicted", "error", "80%", "interval",
                                "runs", "in", "it"]
    assert lines[1].split()[-2:] == ["90.00-105.00", "1/2"]
    assert lines[4].split()[-2:] == ["-", "0/0"]  # TTFT p95
    assert lines[-1] == ("80% intervals (over 5 speeds, 0.90-1.20x the calibration's time over 64 s; median width "
                         "17.7%) held 4 of 8 measured values (50.0%): decode tok/s 50.0%, phase tok/s 50.0%, TTFT p50 "
                         "50.0%, TTFT p95 -, TPOT p50 50.0%")


def test_open_loop_levels_are_headed_load_not_streams():
    def at_rate(result):
        return {"levels": [lv | {"concurrency": None, "rate": 0.5 * (i + 1)} for i, lv in enumerate(result["levels"])]}
    lines = format_comparison(compare([at_rate(MEASURED)], at_rate(PREDICTED))).splitlines()
    assert lines[0].split() == ["load", "metric", "measured", "spread", "predicted", "error"]
    assert lines[1].split() == ["0.5/s", "decode", "tok/s", "100.00", "-", "110.00", "+10.0%"]


def _frame(i, *stages, done):
    return FrameTiming(i, 0, 1, 1, 0.0, tuple(StageTiming(*stage) for stage in stages), done)


def test_per_frame_times_of_both_backends_node_by_node():
    measured = [_frame(i, (0.0, 0.0, 0.010 * (i + 1)), (0.05, 0.06, 0.08), done=0.1) for i in range(3)]
    predicted = [_frame(0, (0.0, 0.0, 0.015), (0.02, 0.02, 0.04), done=0.045)]
    times = compare_frame_times(measured, predicted, ["a", "b"])
    assert times["a"]["compute"] == {"measured": {"frames": 3, "p50": pytest.approx(0.02), "p95": pytest.approx(0.029)},
                                     "predicted": {"frames": 1, "p50": pytest.approx(0.015),
                                                   "p95": pytest.approx(0.015)}}
    assert times["b"]["link"]["measured"]["p50"] == pytest.approx(0.02)  # from its compute's end to the tokens back
    assert times["a"]["link"]["predicted"]["p50"] == pytest.approx(0.005)  # ... to the next stage taking it in
    comparison = compare([MEASURED], PREDICTED) | {"frame_times": times}
    lines = format_comparison(comparison).splitlines()
    assert lines[-7].split() == ["node", "per", "frame", "frames", "measured", "p50", "p95", "predicted", "p50", "p95",
                                 "error", "p50"]
    assert lines[-6].split() == ["a", "compute", "3/1", "20.00", "29.00", "15.00", "15.00", "-25.0%"]
    assert lines[-2].split() == ["link", "to", "coordinator", "3/1", "20.00", "20.00", "5.00", "5.00", "-75.0%"]
    assert lines[-1].split()[:4] == ["between", "frames,", "busy", "2/0"]  # none simulated after the one


def test_time_between_frames_counts_the_frames_that_were_on_their_way():
    """A node's gap from one frame's end to its next's start counts where the stage before was done with the next
    one first: not where the node sat idle waiting for it."""
    busy = [_frame(0, (0.0, 0.0, 0.010), (0.011, 0.011, 0.020), done=0.021),
            _frame(1, (0.0, 0.0101, 0.019), (0.0202, 0.0203, 0.029), done=0.030),  # sent at once: queued at a and b
            _frame(2, (0.0, 0.040, 0.050), (0.051, 0.051, 0.060), done=0.061)]  # a sat idle first: not counted
    busy = [attrs.evolve(frame, sent=sent) for frame, sent in zip(busy, (0.0, 0.0, 0.035))]
    times = compare_frame_times(busy, [], ["a", "b"])
    assert times["a"]["between"]["measured"] == {"frames": 1, "p50": pytest.approx(1e-4), "p95": pytest.approx(1e-4)}
    assert times["b"]["between"]["measured"]["frames"] == 1  # frame 1 was done at a (0.019) before b's end (0.020)
    assert times["b"]["between"]["measured"]["p50"] == pytest.approx(0.0003)


def _request(level, phase, arrival, finish):
    return {"level": level, "rate": None, "phase": phase, "t_arrival": arrival, "t_finish": finish}


def test_frames_go_to_the_phase_they_were_sent_in_and_each_runs_phases_are_compared():
    """Two phases of one level and one of another, their requests overlapping within a phase; a frame sent between
    phases belongs to none, one sent as a phase ends and the next begins (as simulated phases meet) to the next.
    Per phase of each run, a node's compute against the same phase simulated."""
    requests = [_request(1, "warmup", 0.0, 1.0), _request(1, "warmup", 0.5, 1.5), _request(1, "measured", 2.0, 3.0),
                _request(4, "warmup", 4.0, 5.0)]
    frames = [attrs.evolve(_frame(i, (0.0, 0.0, 0.001 * (i + 1)), done=0.0), sent=sent)
              for i, sent in enumerate([0.0, 1.4, 1.7, 2.5, 4.5, 5.5])]
    grouped = frames_by_phase(frames, requests)
    assert {key: [f.frame_id for f in group] for key, group in grouped.items()} == {
        (1, None, "warmup"): [0, 1], (1, None, "measured"): [3], (4, None, "warmup"): [4]}
    assert list(grouped) == [(1, None, "warmup"), (1, None, "measured"), (4, None, "warmup")]  # as they ran
    meeting = [_request(None, "warmup", 0.0, 1.0) | {"rate": 2.0}, _request(None, "measured", 1.0, 2.0) | {"rate": 2.0}]
    assert {key: [f.frame_id for f in group] for key, group in frames_by_phase(frames[:3], meeting).items()} == {
        (None, 2.0, "warmup"): [0], (None, 2.0, "measured"): [1, 2]}
    assert frames_by_phase([attrs.evolve(frames[0], sent=1.0)], meeting)[(None, 2.0, "measured")]  # sent at 1.0
    simulated = [attrs.evolve(_frame(9, (0.0, 0.0, 0.002), done=0.0), sent=sent) for sent in (0.2, 2.2)]
    phases = compare_phase_frame_times([(frames, {"requests": requests})] * 2, simulated,
                                       {"requests": requests[:3]}, ["a"])
    assert [(p["run"], p["concurrency"], p["phase"]) for p in phases] == [
        (run, level, phase) for run in (1, 2) for level, phase in ((1, "warmup"), (1, "measured"), (4, "warmup"))]
    compute = [p["frame_times"]["a"]["compute"] for p in phases[:3]]
    assert [c["measured"]["p50"] for c in compute] == pytest.approx([0.0015, 0.004, 0.005])
    assert [c["predicted"]["frames"] for c in compute] == [1, 1, 0]  # nothing simulated in the last phase
    lines = format_comparison(compare([MEASURED], PREDICTED) | {"phase_frame_times": phases}).splitlines()
    table = lines[lines.index("compute per frame by phase (ms, p50; frames measured/predicted)") + 1:]
    assert table[0].split() == ["run", "streams", "phase", "frames", "a", "measured", "a", "predicted", "a", "error"]
    assert table[1].split() == ["1", "1", "warmup", "2/1", "1.50", "2.00", "+33.3%"]
    assert table[3].split() == ["1", "4", "warmup", "1/0", "5.00", "-", "-"]
    assert len(table) == 7
    at_rate = [p | {"concurrency": None, "rate": 2.0} for p in phases[:1]]
    table = format_phase_frame_times(at_rate).splitlines()
    assert table[1].split()[:4] == ["run", "load", "phase", "frames"] and table[2].split()[:3] == ["1", "2/s", "warmup"]


# ---- against the real pipeline -----------------------------------------------------------------------------------
def test_validate_runs_and_simulates_the_same_requests(spec, checkpoint, tmp_path):
    cal_path, out = tmp_path / "cal.json", tmp_path / "validation.json"
    hand_made = calibration(spec, lambda kind, r, x: 1e-4 * r)  # the errors and intervals mean nothing here
    attrs.evolve(hand_made, spread=Spread({}, (0.5, 1.0, 2.0))).save(cal_path)
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(cal_path), "--checkpoint",
                                      str(checkpoint), "--concurrency", "1,3", "--max-new-tokens", "3",
                                      "--prompt-tokens", "5", "--repeats", "2", "--interval", "80", "--json", str(out)],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["streams", "metric", "measured", "spread", "predicted", "error", "80%", "interval",
                                "runs", "in", "it"]
    assert [line.split()[0] for line in lines[1::len(FIGURES)][:2]] == ["1", "3"]
    assert lines[-4].startswith("median spread of the runs: decode tok/s ")
    assert lines[-3].startswith("median |error|: decode tok/s ")
    assert lines[-2].startswith("80% intervals (over 11 speeds, 0.50-2.00x the calibration's time over 0 s; median ")
    assert lines[-1] == f"wrote {out}"
    saved = json.loads(out.read_text())
    assert saved["schema"] == SCHEMA
    assert len(saved["measured"]) == 2 and saved["predicted"]["source"] == "simulate"
    for result in [*saved["measured"], saved["predicted"]]:
        assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
        requests = sorted((r["request_id"], r["prompt_tokens"], r["output_tokens"]) for r in result["requests"])
        assert requests == [(i, 5, 3) for i in range(8)]  # warm-up and measured phases of both levels
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 3]
    assert set(saved["median_abs_error"]) == set(FIGURES)
    first = saved["levels"][0]["metrics"]["decode tok/s"]
    assert all(run["source"] == "run" for run in saved["measured"])
    assert first["measured"] == pytest.approx(statistics.median(
        run["levels"][0]["decode_tokens_per_s"] for run in saved["measured"]))
    assert first["predicted"] == saved["predicted"]["levels"][0]["decode_tokens_per_s"]
    interval = saved["interval"]["levels"][0]["figures"]["decode tok/s"]
    assert interval["measured"] == [run["levels"][0]["decode_tokens_per_s"] for run in saved["measured"]]
    assert interval["low"] < first["predicted"] < interval["high"]  # a steady 2x either way of the calibration
    assert saved["interval"]["values"] == 2 * 2 * len(FIGURES)  # two runs, two levels, every figure measured


def test_a_calibration_for_another_model_fails_before_the_pipeline_starts(spec, tmp_path):
    other = attrs.evolve(spec, model=attrs.evolve(spec.model, config=attrs.evolve(spec.model.config, hidden_size=32)))
    path = tmp_path / "other.json"
    calibration(other, lambda kind, r, x: 1e-4).save(path)
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(path)])
    assert result.exit_code == 1
    assert "made for another model: hidden_size 32" in result.output
    calibration(spec, lambda kind, r, x: 1e-4).save(path)  # measured before calibrations kept their rounds
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(path), "--interval", "80"])
    assert result.exit_code == 1 and "has no spread of its rounds" in result.output


def test_a_failed_run_keeps_the_prediction_and_the_runs_before_it(spec, tmp_path, monkeypatch):
    """The run itself is replaced here (the pipeline's own failures are tested in test_pipeline.py): the second of
    three repeats fails, and the JSON keeps the prediction, the first run and the failed one's partial result."""
    finished, partial = {"source": "run", "levels": []}, {"source": "run", "levels": [], "warnings": ["early"]}
    runs = iter([RunResult(finished, []), RunFailed("node1: gone", partial, [])])

    def run_or_fail(*args, **kwargs):
        outcome = next(runs)
        if isinstance(outcome, RunFailed):
            raise outcome
        return outcome

    monkeypatch.setattr("cascadia.measure.validate.run", run_or_fail)
    cal_path, out = tmp_path / "cal.json", tmp_path / "validation.json"
    calibration(spec, lambda kind, r, x: 1e-4 * r).save(cal_path)
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(cal_path), "--concurrency", "1",
                                      "--repeats", "3", "--json", str(out)])
    assert result.exit_code == 1 and "run failed: node1: gone" in result.output
    saved = json.loads(out.read_text())
    assert saved["failed"] == "node1: gone" and saved["measured"] == [finished, partial]
    assert saved["predicted"]["source"] == "simulate"


def test_validate_writes_both_timelines_and_compares_each_node_per_frame(spec, checkpoint, tmp_path):
    cal_path, traces = tmp_path / "cal.json", tmp_path / "traces"
    calibration(spec, lambda kind, r, x: 1e-4 * r).save(cal_path)  # hand-made: the errors mean nothing here
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(cal_path), "--checkpoint",
                                      str(checkpoint), "--concurrency", "1", "--max-new-tokens", "4",
                                      "--prompt-tokens", "5", "--trace-dir", str(traces)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    documents = {path.name: json.loads(path.read_text()) for path in traces.iterdir()}
    assert set(documents) == {"run.json", "simulate.json"}
    assert {name: d["otherData"]["source"] for name, d in documents.items()} == {"run.json": "run",
                                                                                "simulate.json": "simulate"}
    # one stream: both backends compute the same frames (2 prompt windows or fewer, then the decode steps)
    computed = [sorted(e["args"]["rows"] for e in d["traceEvents"] if e["ph"] == "X" and e["pid"] == 1
                       and e["tid"] == 1) for d in documents.values()]
    assert computed[0] == computed[1] and len(computed[0]) > 0
    lines = result.stdout.splitlines()
    table = lines[lines.index("per frame (ms; frames measured/predicted)") + 1:]
    frames = len(computed[0])
    table = table[:table.index("")]
    assert [line.split()[:3] for line in table[1::3]] == [[node, "compute", f"{frames}/{frames}"]
                                                          for node in ("node0", "node1", "node2")]
    phases = lines[lines.index("compute per frame by phase (ms, p50; frames measured/predicted)") + 2:]
    assert [line.split()[:3] for line in phases[:-1]] == [["1", "1", "warmup"], ["1", "1", "measured"]]
    assert [sum(int(line.split()[3].split("/")[side]) for line in phases[:-1]) for side in (0, 1)] == [frames] * 2
    assert phases[-1] == f"wrote the timelines to {traces}: run.json, simulate.json"


def test_validate_replays_each_run_from_its_own_trace(spec, checkpoint, tmp_path):
    """One stream: the simulation cuts the frames the run did, so each takes its compute from the run's trace."""
    cal_path, out = tmp_path / "cal.json", tmp_path / "validation.json"
    calibration(spec, lambda kind, r, x: 1e-4 * r).save(cal_path)  # hand-made: the tables' errors mean nothing here
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(cal_path), "--checkpoint",
                                      str(checkpoint), "--concurrency", "1", "--max-new-tokens", "4",
                                      "--prompt-tokens", "5", "--replay", "--json", str(out), "--trace-dir",
                                      str(tmp_path / "traces")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(path.name for path in (tmp_path / "traces").iterdir()) == ["replay.json", "run.json",
                                                                             "simulate.json"]
    lines = result.stdout.splitlines()
    replayed = lines[lines.index("per frame (ms; frames measured/replayed)") + 2::3][:3]  # the nodes' compute rows
    assert [line.split()[0] for line in replayed] == ["node0", "node1", "node2"]
    assert all(line.split()[3] == line.split()[5] for line in replayed)  # the run's own compute, replayed
    assert lines[0].split() == ["streams", "metric", "measured", "spread", "predicted", "error", "replayed", "replay",
                                "error"]
    saved = json.loads(out.read_text())
    [replayed] = saved["replayed"]
    frames = replayed["replay"]["frames"]
    assert frames > 0 and replayed["replay"] == {"frames": frames, "replayed": frames, "tabled": 0}
    assert f"replayed from each run's trace: run 1: {frames} of {frames} frames" in lines
    decode = saved["replay"]["levels"][0]["metrics"]["decode tok/s"]
    measured = saved["measured"][0]["levels"][0]["decode_tokens_per_s"]
    assert decode["replayed"] == replayed["levels"][0]["decode_tokens_per_s"] != \
        saved["predicted"]["levels"][0]["decode_tokens_per_s"]
    assert decode["error"] == pytest.approx(decode["replayed"] / measured - 1) == decode["run_errors"][0]


def test_validate_with_speculation_simulates_the_drafts_the_run_accepted(spec, checkpoint, tmp_path):
    """One stream: the simulated policy asks for drafts at the steps the run's did, and the trace answers as the run's
    drafter did, so the simulated counts are the measured ones."""
    cal_path, out, prompts = tmp_path / "cal.json", tmp_path / "validation.json", tmp_path / "prompts.jsonl"
    calibration(spec, lambda kind, r, x: 1e-4 * r).save(cal_path)
    prompts.write_text("".join(json.dumps({"ids": [3 + i, 9, 4, 3 + i, 9, 4, 3 + i, 9]}) + "\n" for i in range(4)))
    result = CliRunner().invoke(cli, ["validate", str(SPEC), "--calibration", str(cal_path), "--checkpoint",
                                      str(checkpoint), "--concurrency", "1", "--requests", "2", "--max-new-tokens",
                                      "12", "--prompts", str(prompts), "--speculate", "ngram:3", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    measured = saved["measured"][0]["levels"][0]["speculation"]
    assert measured["proposed"] > 0
    assert saved["predicted"]["levels"][0]["speculation"] == measured
