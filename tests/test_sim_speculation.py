"""Speculation in the simulator: drafts accepted at a seeded rate, verified by the policy as real ones are."""

import json

import pytest
from click.testing import CliRunner
from sim_specs import tiny_spec_yaml

from cascadia.cli import cli


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


@pytest.mark.parametrize("options, message", [
    (["--speculate", "ngram:0"], "speculate must be ngram or ngram:MAX_DRAFT"),
    (["--speculate", "eagle"], "speculate must be ngram or ngram:MAX_DRAFT"),
    (["--acceptance", "0.5"], "give --speculate with it"),
    (["--speculate", "ngram", "--acceptance", "2"], "--acceptance"),
])
def test_bad_speculation_options_say_so_in_one_line(spec_path, options, message):
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *options])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
