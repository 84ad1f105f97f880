import errno
import json
import sys

import attrs
import click
import pytest
from click.testing import CliRunner
from sim_specs import tiny_spec_yaml

from cascadia.cli import cli
from cascadia.cli.common import writing
from cascadia.sim.analytic import analytic_calibration
from cascadia.spec.dump import write_spec
from cascadia.spec.load import load_spec
from cascadia.tokenizer import TOKENIZER_FILE, build_tokenizer

SPEC = tiny_spec_yaml()


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def invoke(*args):
    return CliRunner().invoke(cli, ["simulate", *map(str, args)], catch_exceptions=False)


def test_simulate_prints_the_table_and_writes_json(spec_path, tmp_path):
    out = tmp_path / "result.json"
    result = invoke(spec_path, "--concurrency", "1,3", "--requests", "3", "--max-new-tokens", "5",
                    "--prompt-tokens", "6", "--json", out)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == ("closed loop at 1, 3 streams; each level a warm-up, then 3 measured requests; prompts of 6 "
                        "tokens, 5 tokens out each, greedy")  # what the table measured, said above it
    assert lines[1].split()[:2] == ["streams", "requests"]
    assert [line.split()[:3] for line in lines[2:4]] == [["1", "3", "15"], ["3", "3", "15"]]
    assert lines[4:] == ["(analytic estimate)", f"wrote {out}"]
    data = json.loads(out.read_text())
    assert data["schema"] == "cascadia.metrics/1" and data["source"] == "simulate"
    assert data["calibration"]["kind"] == "analytic"
    assert {r["prompt_tokens"] for r in data["requests"]} == {6} and len(data["requests"]) == 12


def test_simulate_trace_holds_every_frame_once_per_node_and_every_request(spec_path, tmp_path):
    out, trace = tmp_path / "result.json", tmp_path / "trace.json"
    result = invoke(spec_path, "--concurrency", "1,3", "--requests", "3", "--max-new-tokens", "5", "--json", out,
                    "--trace", trace)
    assert result.exit_code == 0, result.output
    document, report = json.loads(trace.read_text()), json.loads(out.read_text())
    nodes = [stage["node"] for stage in report["plan"]["stages"]]
    assert document["otherData"] == {"source": "simulate", "nodes": nodes}
    events = document["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["pid"] > 0 and e["tid"] == 1]
    frames = {e["args"]["frame"] for e in compute}
    per_node = {pid: sorted(e["args"]["frame"] for e in compute if e["pid"] == pid) for pid in range(1, len(nodes) + 1)}
    assert all(seen == sorted(frames) for seen in per_node.values())  # each frame once on every node
    assert sum(e["ph"] == "b" for e in events) == len(report["requests"]) == 12  # a span per request


def test_a_saved_calibration_gives_the_same_prediction(spec_path, tmp_path):
    calibration = tmp_path / "cal.json"
    analytic_calibration(load_spec(spec_path)).save(calibration)
    by_file, by_spec = tmp_path / "file.json", tmp_path / "spec.json"
    assert invoke(spec_path, "--calibration", calibration, "--json", by_file).exit_code == 0
    assert invoke(spec_path, "--analytic", "--json", by_spec).exit_code == 0
    assert json.loads(by_file.read_text())["levels"] == json.loads(by_spec.read_text())["levels"]


def test_a_saved_plan_and_groups(spec_path, tmp_path):
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(cli, ["plan", str(spec_path), "-o", str(plan)]).exit_code == 0
    out = tmp_path / "result.json"
    assert invoke(spec_path, "--plan", plan, "--groups", "1", "--json", out).exit_code == 0
    assert json.loads(out.read_text())["plan"] == json.loads(plan.read_text())


def test_pipeline_groups_come_from_the_spec_or_the_command_line(spec_path, tmp_path):
    one_group = tmp_path / "one.yaml"
    write_spec(attrs.evolve(spec := load_spec(spec_path), runtime=attrs.evolve(spec.runtime, pipeline_groups=1)),
               one_group)
    levels = {}
    for name, args in {"spec": [one_group], "flag": [spec_path, "--groups", "1"], "stages": [spec_path]}.items():
        out = tmp_path / f"{name}.json"
        assert invoke(*args, "--concurrency", "3", "--requests", "6", "--json", out).exit_code == 0
        levels[name] = json.loads(out.read_text())["levels"]
    assert levels["spec"] == levels["flag"]
    # three streams in one group take turns round the three stages; in a group each, all three are busy
    assert levels["stages"][0]["decode_tokens_per_s"] > 1.5 * levels["flag"][0]["decode_tokens_per_s"]


@pytest.mark.parametrize("args, code, message", [
    (["--calibration", "{bad}"], 1, "bad.json: format: expected 'cascadia.calibration/2'"),
    (["--calibration", "{bad}", "--analytic"], 2, "give --calibration or --analytic, not both"),
    (["--concurrency", "1,x"], 2, "'1,x' is not a comma-separated list of integers"),
    (["--concurrency", "0"], 2, "every value must be at least 1"),
    (["--concurrency", "2,2"], 2, "'2,2': values repeat"),
    (["--concurrency", "1,9"], 2, "9 streams exceed runtime.max_streams (8)"),
    (["--max-new-tokens", "100"], 2, "prompt (8) + output (100) tokens exceed runtime.context_budget (64)"),
])
def test_bad_arguments(spec_path, tmp_path, args, code, message):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *[a.format(bad=bad) for a in args]])
    assert result.exit_code == code and message in result.output


def test_plot_draws_a_png(spec_path, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--analytic", "--concurrency", "1,2,4",
                                      "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_matplotlib_says_so(spec_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1 and "plotting needs matplotlib" in result.output


def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(spec_path, tmp_path):
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--json", str(tmp_path / "no" / "r.json")])
    assert result.exit_code == 2
    missing = tmp_path / "no"
    assert f"Invalid value for '--json': {missing / 'r.json'}: no such folder {missing}" in result.output


def test_a_failed_write_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(click.ClickException, match=r"r.json: cannot write \(No space left on device\)$"):
        with writing(str(path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))


def test_text_prompts_are_encoded_with_the_checkpoints_tokenizer(spec_path, tmp_path):
    """{"text": ...} prompts take the checkpoint's tokenizer.json (simulate reads no weights: only that file)."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    tokenizer = build_tokenizer(load_spec(spec_path).model.config)
    tokenizer.save(str(checkpoint / TOKENIZER_FILE))
    texts = ["A fleet of ordinary computers", "Measure first, then predict."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    spec_path.write_text(SPEC.replace("  formats: f32\n", f"  formats: f32\n  checkpoint: {checkpoint}\n"))
    out = tmp_path / "result.json"
    result = invoke(spec_path, "--prompts", prompts, "--concurrency", "1", "--requests", "2", "--json", out)
    assert result.exit_code == 0, result.output
    lengths = [len(tokenizer.encode(text).ids) for text in texts]
    assert lengths[0] != lengths[1]
    assert [r["prompt_tokens"] for r in json.loads(out.read_text())["requests"]] == lengths * 2  # warm-up, measured


def test_text_prompts_without_a_tokenizer_name_the_line(spec_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [5, 6]}\n{"text": "hello"}\n')
    result = invoke(spec_path, "--prompts", prompts)
    assert result.exit_code == 1
    needs = f"{prompts}:2: a 'text' prompt needs the checkpoint's tokenizer.json, and the model names no"
    assert needs in result.output
    spec_path.write_text(SPEC.replace("  formats: f32\n", f"  formats: f32\n  checkpoint: {tmp_path}\n"))
    result = invoke(spec_path, "--prompts", prompts)
    assert result.exit_code == 1
    assert f"{prompts}:2: {tmp_path / TOKENIZER_FILE}: cannot read a tokenizer" in result.output


def test_prompts_longer_than_the_context_are_said_and_none_fitting_fails(spec_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [5, 6]}\n{"ids": [%s]}\n' % ",".join(["3"] * 100))
    result = invoke(spec_path, "--prompts", prompts, "--concurrency", "1", "--requests", "2")
    assert result.exit_code == 0, result.output
    assert (f"warning: {prompts}: 1 of its 2 prompts are rejected: prompt + output (4) tokens exceed "
            "runtime.context_budget (64)") in result.stderr
    assert [line.split()[:2] for line in result.stdout.splitlines()[2:3]] == [["1", "1"]]  # one request served
    prompts.write_text('{"ids": [%s]}\n' % ",".join(["3"] * 100))
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--prompts", str(prompts)])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {prompts}: none of its 1 prompts fits: prompt + output (4) tokens exceed "
                             "runtime.context_budget (64) (the shortest has 100 tokens)\n")


def test_prompt_ids_beyond_the_vocabulary_are_refused(spec_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [1, 123456789012345678901]}\n')
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--prompts", str(prompts)])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {prompts}:1: token id 123456789012345678901 lies outside the model's "
                             "vocabulary (0..511)\n")


@pytest.mark.parametrize("streams", [10**7, 10**18])
def test_a_runtime_no_node_can_hold_is_refused_by_the_plan_before_any_table(spec_path, streams):
    spec_path.write_text(SPEC.replace("max_streams: 8", f"max_streams: {streams}"))
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--concurrency", "1"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {spec_path}: no plan fits. node node")
    assert f"{streams} streams' slots and rings, and one stream's K/V at 64 positions" in result.stderr


def test_slots_the_workload_never_fills_cost_the_simulation_nothing(spec_path):
    """Nodes that could hold 10^7 streams: the tables reach the workload's frames only, not 10^7 slots' worth."""
    spec_path.write_text(SPEC.replace("max_streams: 8", "max_streams: 10000000").replace("memory: 1GiB",
                                                                                        "memory: 10TB"))
    loaded = load_spec(spec_path)
    assert {table.rows for node in analytic_calibration(loaded).nodes.values() for table in node.tables.values()} \
        == {(2, 4, 8)}  # 2 streams + 4 prompt rows: frames of 8 rows at most
    result = invoke(spec_path, "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert [line.split()[:3] for line in result.stdout.splitlines()[2:4]] == [["1", "1", "3"], ["2", "2", "6"]]


def test_a_spec_no_plan_fits_is_named(spec_path):
    spec_path.write_text(SPEC.replace("memory: 1GiB", "memory: 64.1MiB"))
    result = invoke(spec_path)
    assert result.exit_code == 1 and f"Error: {spec_path}: no plan fits. node node" in result.output


def test_dash_is_standard_output_and_the_report_goes_to_standard_error(spec_path):
    """Every output option takes '-': the file's content alone on stdout, the table for people on stderr."""
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--analytic", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"] == "simulate"
    assert "decode tok/s" in result.stderr and "decode tok/s" not in result.stdout
    both = CliRunner().invoke(cli, ["simulate", str(spec_path), "--analytic", "--json", "-", "--plot", "-"])
    assert both.exit_code == 2 and "only one output may go to standard output" in both.output


def test_simulate_an_open_loop_sweep_with_an_slo(spec_path):
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--analytic", "--rate", "1,40", "--requests", "8",
                                      "--slo", "ttft=1s,tpot=100ms", "--json", "-"])
    assert result.exit_code == 0, result.output
    levels = json.loads(result.stdout)["levels"]
    assert [(level["rate"], level["concurrency"], level["requests"]) for level in levels] == [(1.0, None, 8),
                                                                                            (40.0, None, 8)]
    assert levels[0]["goodput"]["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1} and levels[0]["ttft_s"]["p99"] > 0
    said = result.stderr.splitlines()
    assert said[0].startswith("open loop at 1, 40 requests/s (Poisson arrivals); each level a warm-up, then 8 measured")
    assert said[1].split()[0] == "load" and "goodput" in said[1]


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1", "--rate", "2"], "give --concurrency (closed loop) or --rate (open loop), not both"),
    (["--rate", "0,2"], "rates must be positive and distinct"),
    (["--slo", "ttft=2s"], "is not like ttft=2s,tpot=200ms"),
    (["--slo", "ttft=2s,tpot=fast"], "expected a duration")])
def test_bad_open_loop_options_are_usage_errors(spec_path, args, message):
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--analytic", *args])
    assert result.exit_code == 2 and message in result.output
