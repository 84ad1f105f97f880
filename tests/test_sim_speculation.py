"""Speculation in the simulator: drafts accepted at a seeded rate, or as a run's trace says, verified by the policy
as real ones are."""

import json

import pytest
from click.testing import CliRunner
from sim_specs import tiny_spec_yaml

from cascadia.cli import cli
from cascadia.sim.drafts import REJECTED_TOKEN, RateDrafter, TraceDrafter, fitted_rates
from cascadia.sim.model import PLACEHOLDER_TOKEN


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(tiny_spec_yaml())
    return path


def simulate(spec_path, tmp_path, *options) -> list[dict]:
    out = tmp_path / "result.json"
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--concurrency", "1,3", "--requests", "3",
                                      "--max-new-tokens", "24", "--json", str(out), *options], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["levels"]


def test_the_speed_up_follows_the_acceptance_rate(spec_path, tmp_path):
    off = simulate(spec_path, tmp_path)
    assert all(level["speculation"] == {"proposed": 0, "accepted": 0, "mean_accepted_per_step": None}
               for level in off)
    rates = {}
    for acceptance in (0.0, 0.6, 1.0):
        levels = simulate(spec_path, tmp_path, "--speculate", "ngram:4", "--acceptance", str(acceptance))
        assert levels == simulate(spec_path, tmp_path, "--speculate", "ngram:4", "--acceptance", str(acceptance))
        drafts = levels[0]["speculation"]
        assert drafts["proposed"] > 0 and drafts["accepted"] == (drafts["proposed"] if acceptance == 1 else
                                                                 0 if acceptance == 0 else drafts["accepted"])
        rates[acceptance] = levels[0]["decode_tokens_per_s"]
    assert rates[0.0] < rates[0.6] < rates[1.0] and rates[1.0] > 1.5 * off[0]["decode_tokens_per_s"]
    assert all(level["output_tokens"] == 3 * 24 for level in off)


def trace_file(tmp_path, steps_by_request: dict[int, list[list[int]]]):
    path = tmp_path / "outputs.jsonl"
    path.write_text("".join(json.dumps({"request_id": request_id, "output_ids": [], "drafts": steps}) + "\n"
                            for request_id, steps in steps_by_request.items()))
    return path


def test_a_trace_of_every_draft_accepted_is_acceptance_one_and_one_of_none_found_is_no_speculation(
        spec_path, tmp_path):
    """Requests 0..2 are the warm-up of level 1, 3..5 its measured phase, and so on (the workload numbers them)."""
    speculate = ("--speculate", "ngram:4")
    all_accepted = trace_file(tmp_path, {r: [[4, 4]] * 24 for r in range(12)})
    assert simulate(spec_path, tmp_path, *speculate, "--acceptance-trace", str(all_accepted)) == \
        simulate(spec_path, tmp_path, *speculate, "--acceptance", "1")
    none_found = trace_file(tmp_path, {r: [[0, 0]] * 24 for r in range(12)})
    levels = simulate(spec_path, tmp_path, *speculate, "--acceptance-trace", str(none_found))
    plain = simulate(spec_path, tmp_path)
    assert [level["decode_tokens_per_s"] for level in levels] == [level["decode_tokens_per_s"] for level in plain]
    assert levels[0]["speculation"]["proposed"] == 0


def test_rates_fitted_to_one_levels_trace_draft_at_every_level(spec_path, tmp_path):
    """Level 1's requests (0..5) only, every draft accepted: fitted, acceptance 1 at every step, for level 3's
    requests too, which the trace does not hold (there the busy stages leave no drafting); a trace of half the
    steps proposing proposes less."""
    speculate = ("--speculate", "ngram:4")
    level_one = trace_file(tmp_path, {r: [[4, 4]] * 24 for r in range(6)})
    fitted = simulate(spec_path, tmp_path, *speculate, "--acceptance-trace", str(level_one), "--fit-acceptance")
    assert fitted == simulate(spec_path, tmp_path, *speculate, "--acceptance", "1")
    half = trace_file(tmp_path, {r: [[4, 4], [0, 0]] * 12 for r in range(6)})
    sparse = simulate(spec_path, tmp_path, *speculate, "--acceptance-trace", str(half), "--fit-acceptance")
    assert 0 < sparse[0]["speculation"]["proposed"] < fitted[0]["speculation"]["proposed"]
    assert sparse[0]["speculation"]["accepted"] == sparse[0]["speculation"]["proposed"]
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *speculate, "--acceptance-trace",
                                      str(trace_file(tmp_path, {0: [[0, 0]]})), "--fit-acceptance"])
    assert result.exit_code == 1 and "the trace proposes no drafts" in result.output
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *speculate, "--fit-acceptance"])
    assert result.exit_code == 2 and "give --acceptance-trace with it" in result.output


def test_a_trace_is_replayed_request_by_request_step_by_step():
    drafter = TraceDrafter({7: [(3, 1), (0, 0), (4, 4)]})
    assert drafter.propose(7, (), (), 4) == [PLACEHOLDER_TOKEN, REJECTED_TOKEN, REJECTED_TOKEN]
    assert drafter.propose(7, (), (), 4) == []
    assert drafter.propose(7, (), (), 2) == [PLACEHOLDER_TOKEN] * 2  # cut to the policy's limit
    assert drafter.propose(7, (), (), 4) == [] and drafter.propose(8, (), (), 4) == []  # beyond its trace; absent


def test_rates_fitted_to_a_trace_are_those_it_was_drawn_with():
    """By hand: 3 accepted of 4 (a rejection), 2 of 2, 0 of 1 (a rejection), and a step without drafts: 5
    acceptances, 2 rejections, 3 of 4 steps proposing. Then a trace of RateDrafter's own drafts gives back its
    rates, to the draws' error."""
    assert fitted_rates({0: [(4, 3), (2, 2)], 1: [(1, 0), (0, 0)]}) == (5 / 7, 3 / 4)
    drafter, steps = RateDrafter(0.6, seed=1, proposing=0.7), []
    for _ in range(20000):
        drafts = drafter.propose(0, (), (), 4)
        steps.append((len(drafts), next((i for i, token in enumerate(drafts) if token != PLACEHOLDER_TOKEN),
                                        len(drafts))))
    acceptance, proposing = fitted_rates({0: steps})
    assert acceptance == pytest.approx(0.6, abs=0.01) and proposing == pytest.approx(0.7, abs=0.01)
    with pytest.raises(ValueError, match="the trace proposes no drafts"):
        fitted_rates({0: [(0, 0)]})


@pytest.mark.parametrize("text, message", [
    ('{"request_id": 0, "output_ids": [1]}\n', "no request holds drafts (was the run made with --speculate?)"),
    ('{"request_id": 0, "drafts": [[1, 2]]}\n', "line 1: expected a request_id and drafts"),
    ('{"request_id": 0, "drafts": [[1, 1]]}\nnot json\n', "line 2: not valid JSON"),
])
def test_a_bad_acceptance_trace_says_which_line(spec_path, tmp_path, text, message):
    (tmp_path / "bad.jsonl").write_text(text)
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), "--speculate", "ngram",
                                      "--acceptance-trace", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("options, message", [
    (["--acceptance-trace", "x.jsonl"], "give --speculate with it"),
    (["--speculate", "ngram", "--acceptance", "0.5", "--acceptance-trace", "x.jsonl"], "not both"),
    (["--speculate", "ngram:0"], "speculate must be ngram, mtp, ngram+mtp, each optionally :MAX_DRAFT"),
    (["--speculate", "eagle"], "speculate must be ngram, mtp, ngram+mtp, each optionally :MAX_DRAFT"),
    (["--acceptance", "0.5"], "give --speculate with it"),
    (["--speculate", "ngram", "--acceptance", "2"], "--acceptance"),
])
def test_bad_speculation_options_say_so_in_one_line(spec_path, options, message):
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *options])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
