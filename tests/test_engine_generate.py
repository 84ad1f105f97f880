"""Sampling, single-stream generation and scoring, and the `cascadia generate` / `cascadia score` commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import runs_as
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate, score_logits
from cascadia.sampling import LogitAdjustments, Sampling, extend_history, sample
from cascadia.spec.types import RuntimeSpec
from cascadia.tokenizer import build_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "sharded" / "reference.npz"))


@pytest.fixture(scope="module")
def engine():
    return Engine(Checkpoint.open(FIXTURES / "sharded"), RuntimeSpec(precision="f32", max_streams=2, context_budget=64))


def test_greedy_generation_follows_the_reference(engine, reference):
    """Prompt = the reference's first 10 tokens, then greedy tokens; teacher-forcing our own greedy tokens through
    the f32 engine must give back the same tokens (cached decode consistent with prefill)."""
    result = generate(engine, reference["ids"][:10], 12, Sampling())
    assert result.ids[0] == int(reference["prefill_logits"][9].argmax())
    assert len(result.ids) == 12 and not result.stopped and result.decode_tokens_per_s > 0
    sequence = np.concatenate([reference["ids"][:10], result.ids])
    rescored = engine.score(sequence)
    np.testing.assert_array_equal(rescored[9:-1].argmax(-1), result.ids)


def test_generation_stops_on_a_stop_token(engine, reference):
    first = int(reference["prefill_logits"][9].argmax())
    result = generate(engine, reference["ids"][:10], 12, Sampling(), stop_ids=[first])
    assert result.ids == (first,) and result.stopped


def test_seeded_sampling_depends_on_seed_and_history_only_and_top_p_narrows():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    sampling = Sampling(temperature=1.0, seed=5)
    assert len({sampling.draw(logits, history=3) for _ in range(5)}) == 1
    assert len({sampling.draw(logits, history) for history in range(200)}) == 5  # every token possible
    assert extend_history(extend_history(0, [4, 7]), [9]) == extend_history(0, [4, 7, 9]) != extend_history(0, [9])
    rng = np.random.default_rng(0)
    assert {sample(logits, rng, 1.0, top_p=0.4) for _ in range(50)} == {0}  # p(token 0) = 0.53 >= 0.4
    assert {sample(logits, rng, 1.0, top_p=0.6) for _ in range(200)} == {0, 1}
    assert Sampling().draw(logits, 0) == 0  # temperature 0 = greedy
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300])
def test_a_temperature_too_small_to_divide_by_is_its_limit_greedy(temperature):
    """Found by schemathesis: a request's temperature of 5e-324 put NaN into the draw and failed the pipeline."""
    logits = np.array([0.5, 3.0, -1.0, 2.9], np.float32)
    assert sample(logits, np.random.default_rng(0), temperature) == 1
    assert Sampling(temperature, 0.5, 7).draw(logits, 0) == 1


def test_score_logits_log_prob_and_perplexity():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]))
    result = score_logits(logits, [0, 1, 2])
    assert result.tokens == 2
    assert result.mean_log_prob == pytest.approx((np.log(0.25) + np.log(0.8)) / 2)
    assert result.perplexity == pytest.approx(np.exp(-result.mean_log_prob))


def test_cli_generate_ids_json(tmp_path, reference):
    out = tmp_path / "gen.json"
    ids = ",".join(map(str, reference["ids"][:10]))
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", ids, "--max-new-tokens", "5",
                                      "--precision", "f32", "--ignore-eos", "--json", str(out)])
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    assert len(body["ids"]) == 5 and body["ids"][0] == int(reference["prefill_logits"][9].argmax())
    assert body["decode_tokens_per_s"] > 0 and body["precision"] == "f32"
    assert f"ids: {','.join(map(str, body['ids']))}" in result.output
    to_stdout = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", ids, "--max-new-tokens", "5",
                                         "--precision", "f32", "--ignore-eos", "--json", "-"])
    assert json.loads(to_stdout.stdout)["ids"] == body["ids"]  # `--json -`: the JSON alone on stdout
    assert f"ids: {','.join(map(str, body['ids']))}" in to_stdout.stderr


def test_cli_generate_text(tmp_path):
    checkpoint = tmp_path / "model"
    shutil.copytree(FIXTURES / "sharded", checkpoint)
    build_tokenizer(Checkpoint.open(checkpoint).config).save(str(checkpoint / "tokenizer.json"))
    result = CliRunner().invoke(cli, ["generate", str(checkpoint), "--prompt", "A fleet of computers",
                                      "--max-new-tokens", "4", "--temperature", "0.7", "--top-p", "0.9",
                                      "--seed", "2", "--compressed"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].startswith("ids: ") and f"{runs_as('bf16', 'CPU')} on CPU" in result.output


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The sharded fixture with a tokenizer of its vocabulary."""
    checkpoint = tmp_path_factory.mktemp("with-tokenizer") / "model"
    shutil.copytree(FIXTURES / "sharded", checkpoint)
    build_tokenizer(Checkpoint.open(checkpoint).config).save(str(checkpoint / "tokenizer.json"))
    return checkpoint


def cli_ids(*args: str) -> list[int]:
    result = CliRunner().invoke(cli, ["generate", *args, "--precision", "f32", "--json", "-"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["ids"]


def test_cli_generate_changes_the_logits_as_the_generate_function_does(engine, reference):
    """Penalties, biases and `--min-tokens` on the command line give the tokens of the `generate` function with the
    same `LogitAdjustments` (which tests/test_sampling_warpers.py holds to transformers' processors)."""
    prompt = reference["ids"][:10].tolist()
    args = [str(FIXTURES / "sharded"), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "12", "--ignore-eos"]
    changed = cli_ids(*args, "--presence-penalty", "0.5", "--frequency-penalty", "0.7", "--repetition-penalty", "1.3",
                      "--logit-bias", "5=4", "--logit-bias", "9=-100", "--temperature", "0.8", "--seed", "3")
    adjust = LogitAdjustments(10, logit_bias=((5, 4.0), (9, -100.0)), repetition_penalty=1.3, frequency_penalty=0.7,
                              presence_penalty=0.5)
    assert changed == list(generate(engine, prompt, 12, Sampling(0.8, seed=3, adjust=adjust)).ids)
    assert 9 not in changed and changed != cli_ids(*args, "--temperature", "0.8", "--seed", "3")


def test_cli_generate_holds_the_reply_to_a_json_schema(tmp_path, with_tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = CliRunner().invoke(cli, ["generate", str(with_tokenizer), "--prompt", "Well?", "--max-new-tokens", "16",
                                      "--json-schema", str(tmp_path / "schema.json"), "--temperature", "1.0",
                                      "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(json.loads(result.stdout)["text"]) in ({"ok": True}, {"ok": False})
    anything = CliRunner().invoke(cli, ["generate", str(with_tokenizer), "--prompt", "Well?", "--max-new-tokens", "4",
                                        "--json-object", "--json", "-"])
    assert anything.exit_code == 0 and json.loads(anything.stdout)["text"].startswith("{")


@pytest.mark.parametrize("args, message", [
    (["--logit-bias", "5"], "'5': give ID=BIAS, a token id in 0..319 and a bias in -100..100"),
    (["--logit-bias", "320=1"], "'320=1': give ID=BIAS"),
    (["--logit-bias", "5=nan"], "'5=nan': give ID=BIAS"),
    (["--json-object", "--json-schema", "{schema}"], "give --json-schema or --json-object, not both"),
    (["--json-schema", "{schema}"], "a JSON schema is an object"),
    (["--json-object"], "a grammar needs the checkpoint's tokenizer"),
    (["--presence-penalty", "3"], "3.0 is not in the range -2<=x<=2"),
])
def test_cli_generate_refuses_impossible_adjustments_by_name(tmp_path, args, message):
    (tmp_path / "schema.json").write_text("[1, 2]")
    args = [arg.format(schema=tmp_path / "schema.json") for arg in args]
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", "1,2", *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_cli_score_matches_the_engine(tmp_path, engine, reference):
    ids_file, out = tmp_path / "ids.json", tmp_path / "logits.npy"
    ids_file.write_text(json.dumps({"ids": reference["ids"].tolist()}))
    result = CliRunner().invoke(cli, ["score", str(FIXTURES / "sharded"), "--ids", str(ids_file), "--prefill", "7",
                                      "--precision", "f32", "--out", str(out)])
    assert result.exit_code == 0, result.output
    logits = np.load(out)
    np.testing.assert_allclose(logits, reference["prefill_logits"], atol=1e-4 * np.abs(logits).max())
    expected = score_logits(reference["prefill_logits"], reference["ids"])
    assert f"perplexity {expected.perplexity:.2f}" in result.output


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi"], "needs"),
    (["--ids", "1,x"], "not a comma-separated list"),
    ([], "give --prompt or --ids"),
    (["--ids", "1,2", "--greedy", "--temperature", "1"], "give --greedy or --temperature/--top-p/--top-k/--min-p"),
    (["--ids", "1,2", "--greedy", "--top-k", "5"], "give --greedy or --temperature/--top-p/--top-k/--min-p"),
    (["--ids", "99999"], "token id 99999 lies outside the vocabulary of"),
])
def test_cli_generate_errors(args, message):
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), *args])
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("ids", ["5,4611686018427387904", "5,123456789012345678901"])
def test_cli_generate_refuses_ids_beyond_the_vocabulary_before_any_work(ids):
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", ids])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: token id {ids.split(',')[1]} lies outside the vocabulary of "
                             f"{FIXTURES / 'sharded'} (0..319)\n")


def test_cli_generate_refuses_more_positions_than_the_model_has():
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", "5,6",
                                      "--max-new-tokens", "100000000"])
    assert result.exit_code == 1
    assert result.stderr == ("Error: 2 prompt + 100000000 new tokens take 100000002 positions, more than the model's "
                             f"max_position_embeddings (131072, in {FIXTURES / 'sharded' / 'config.json'})\n")


def test_cli_generate_refuses_state_beyond_the_machines_memory(tmp_path):
    """A model that allows 10^12 positions: one stream of them needs 256 TB of K/V, more than any machine has."""
    checkpoint = tmp_path / "model"
    shutil.copytree(FIXTURES / "sharded", checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2 * 10**12}))
    result = CliRunner().invoke(cli, ["generate", str(checkpoint), "--ids", "5,6", "--max-new-tokens",
                                      str(10**12 - 2)])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the engine needs 256 TB (weights 1.05 MB, K/V and convolution state "
                                    "256 TB for 1000000000000 positions) but this machine has ")
    assert "available (" in result.stderr


def test_cli_score_refuses_ids_beyond_the_vocabulary(tmp_path):
    (tmp_path / "ids.json").write_text(json.dumps([1, 2, 10**30]))
    result = CliRunner().invoke(cli, ["score", str(FIXTURES / "sharded"), "--ids", str(tmp_path / "ids.json"),
                                      "--out", str(tmp_path / "l.npy")])
    assert result.exit_code == 1 and f"token id {10**30} lies outside the vocabulary" in result.stderr
    (tmp_path / "ids.json").write_bytes(b"\xff\x00" * 10)
    result = CliRunner().invoke(cli, ["score", str(FIXTURES / "sharded"), "--ids", str(tmp_path / "ids.json"),
                                      "--out", str(tmp_path / "l.npy")])
    assert result.exit_code == 1 and f"{tmp_path / 'ids.json'}: not UTF-8 text" in result.stderr


def test_cli_generate_shows_the_progress_of_a_long_prefill(engine):
    ids = ",".join(["7"] * 100)  # 4 calls of at most 32 rows (the default row buckets)
    result = CliRunner().invoke(cli, ["generate", str(FIXTURES / "sharded"), "--ids", ids, "--max-new-tokens", "1",
                                      "--precision", "f32"])
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("prefill:")] == [
        "prefill: 32/100 tokens", "prefill: 64/100 tokens", "prefill: 96/100 tokens", "prefill: 100/100 tokens"]


def test_cli_generate_names_a_malformed_tokenizer(tmp_path):
    checkpoint = tmp_path / "model"
    shutil.copytree(FIXTURES / "sharded", checkpoint)
    (checkpoint / "tokenizer.json").write_text("{")
    result = CliRunner().invoke(cli, ["generate", str(checkpoint), "--ids", "1,2", "--max-new-tokens", "1"])
    assert result.exit_code == 1
    assert f"{checkpoint / 'tokenizer.json'}: cannot read a tokenizer" in result.output
