"""Captured-state draft evaluation: accepted drafts on hand-made agreement, the reduced vocabulary, capturing the
deployed path, draft heads built with the engine's quantisation, and `cascadia draft-eval`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.drafts import heads
from cascadia.drafts.acceptance import agreeing_runs, expected_accepted, most_frequent_tokens
from cascadia.drafts.capture import capture
from cascadia.drafts.evaluate import INT4_FORMAT, draft_eval
from cascadia.drafts.heads import DEPLOYED, F32, FULL, INT4, REDUCED, CompiledHead, DraftHead, head_matrix
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.engine.quantize import quantize
from cascadia.sampling import Sampling
from cascadia.spec.types import ClusterSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WeightFormat, WeightFormats
from cascadia.models.names import HEAD

FIXTURES = Path(__file__).parent / "fixtures"
TINY_SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


# ---- accepted drafts ------------------------------------------------------------------------------------------------
def test_runs_count_the_agreeing_positions_up_to_the_first_mismatch():
    assert agreeing_runs(np.array([1, 1, 0, 1, 1, 1], bool)).tolist() == [2, 1, 0, 3, 2, 1]
    assert agreeing_runs(np.array([0, 0], bool)).tolist() == [0, 0]
    assert agreeing_runs(np.zeros(0, bool)).tolist() == []


def test_expected_accepted_drafts_by_hand():
    """Runs [2, 1, 0, 3, 2, 1]: a chain of 1 accepts 5 of 6 positions' drafts; of 2, min(2, run) sums to 8; of 3
    and more, 9 (the longest run is 3)."""
    agree = np.array([1, 1, 0, 1, 1, 1], bool)
    np.testing.assert_allclose(expected_accepted([agree], 4), [5 / 6, 8 / 6, 9 / 6, 9 / 6])


def test_a_run_never_continues_into_the_next_sequence():
    """[1, 1] then [1]: runs [2, 1] and [1], not the [3, 2, 1] of one sequence of three."""
    np.testing.assert_allclose(expected_accepted([np.ones(2, bool), np.ones(1, bool)], 3), [1, 4 / 3, 4 / 3])
    np.testing.assert_allclose(expected_accepted([np.ones(3, bool)], 3), [1, 5 / 3, 2])


def test_expected_accepted_drafts_start_at_the_agreement_and_grow_by_at_most_one_per_draft():
    rng = np.random.default_rng(0)
    sequences = [rng.random(n) < 0.8 for n in (5, 17, 30)]
    accepted = expected_accepted(sequences, 8)
    assert accepted[0] == pytest.approx(np.concatenate(sequences).mean())
    steps = np.diff(accepted)
    assert (steps >= 0).all() and (steps <= accepted[0]).all() and steps[0] > 0


@pytest.mark.parametrize("chain", [0, -1])
def test_a_chain_has_at_least_one_draft(chain):
    with pytest.raises(ValueError, match="at least one draft"):
        expected_accepted([np.ones(3, bool)], chain)


def test_most_frequent_tokens_break_ties_by_id_and_fill_with_unseen_ids():
    corpus = [(5, 5, 7, 9), (7, 5, 3, 12)]  # 5 three times, 7 twice, 3 and 9 once; 12 is beyond a vocabulary of 10
    assert most_frequent_tokens(corpus, 2, 10).tolist() == [5, 7]
    assert most_frequent_tokens(corpus, 3, 10).tolist() == [3, 5, 7]  # 3 before 9: same count, lower id
    assert most_frequent_tokens(corpus, 6, 10).tolist() == [0, 1, 3, 5, 7, 9]  # then ids never seen, lowest first
    for count in (0, 11):
        with pytest.raises(ValueError, match="1..10 tokens"):
            most_frequent_tokens(corpus, count, 10)


# ---- capture and heads ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded():
    return Checkpoint.open(FIXTURES / "sharded")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "sharded" / "reference.npz"))


def test_capture_keeps_what_the_head_reads_and_the_deployed_tokens(sharded, reference):
    """The f32 engine's greedy tokens, and head inputs that the head matrix turns into the reference's logits."""
    engine = Engine(sharded, RuntimeSpec(precision="f32", max_streams=1, context_budget=32))
    prompt = reference["ids"][:10]
    captured = capture(engine, prompt, 6)
    assert captured.tokens.tolist() == list(generate(engine, prompt, 6, Sampling()).ids)
    assert captured.head_inputs.shape == (6, sharded.config.hidden_size)
    logits = captured.head_inputs[0] @ sharded.tensor(HEAD).T  # the prompt's last row
    np.testing.assert_allclose(logits, reference["prefill_logits"][9], atol=1e-4 * np.abs(logits).max())
    assert engine.stage.head_input_observer is None  # listening stops with the capture


def test_a_head_on_some_rows_is_those_rows_of_the_whole_head_quantised(sharded, monkeypatch):
    """Read in blocks of 100 rows (the vocabulary has 320): rows picked across blocks come out as in the whole
    head quantised at once."""
    monkeypatch.setattr(heads, "_BLOCK_ROWS", 100)
    ids = np.array([0, 7, 99, 100, 250, 319])
    whole = sharded.tensor(HEAD)
    np.testing.assert_array_equal(head_matrix(sharded, ids, WeightFormat("f32")), whole[ids])
    np.testing.assert_array_equal(head_matrix(sharded, ids, INT4_FORMAT).dequantize(),
                                  quantize(whole, INT4_FORMAT).dequantize()[ids])


def test_a_reduced_head_picks_the_best_of_its_own_tokens(sharded):
    ids = np.arange(3, 320, 5)
    compiled = CompiledHead(DraftHead(REDUCED, F32, ids, WeightFormat("f32"), "f32"), sharded, "CPU", (1, 2, 4))
    rows = np.random.default_rng(0).standard_normal((11, sharded.config.hidden_size)).astype(np.float32)
    expected = ids[(rows @ sharded.tensor(HEAD)[ids].T).argmax(axis=1)]
    np.testing.assert_array_equal(compiled.tokens(rows), expected)
    assert compiled.weight_bytes == len(ids) * sharded.config.hidden_size * 4


def fixture_spec(checkpoint: Checkpoint, head: WeightFormat, precision: str) -> Spec:
    return Spec(ModelSpec(checkpoint.config, WeightFormats(head=head)), ClusterSpec((NodeSpec("node"),)),
                RuntimeSpec(precision=precision, row_buckets=(1, 2, 4, 8)))


@pytest.fixture(scope="module")
def prompts(reference):
    ids = reference["ids"].tolist()
    return [tuple(ids[:10]), tuple(ids[10:17]), tuple(ids[20:32])]


def test_draft_eval_in_f32_the_deployed_head_agrees_everywhere_and_the_reduced_as_far_as_it_covers(sharded, prompts):
    """An f32 deployment: its own head (and the f32 head, the same) agrees at every position, so a chain of k
    accepts min(k, positions left) drafts; a reduced f32 head agrees exactly where the deployed token is one of its
    tokens."""
    result = draft_eval(fixture_spec(sharded, WeightFormat("f32"), "f32"), sharded, prompts, 40, 3, 8)
    assert [len(c.tokens) for c in result.captured] == [8, 8, 8] and result.positions == 24
    left = np.arange(8, 0, -1)  # positions left in its sequence, at each position
    for weights in (F32, DEPLOYED):
        head = result.head(FULL, weights)
        assert head.tokens == 320 and head.precision == "f32"
        np.testing.assert_allclose(head.expected_accepted, [np.minimum(k, left).mean() for k in (1, 2, 3)])
    reduced = result.head(REDUCED, F32)
    assert reduced.tokens == 40 and 0 < result.coverage < 1 and reduced.agreement == pytest.approx(result.coverage)
    assert result.head(REDUCED, INT4).agreement <= result.coverage
    effects = result.view()["effects"]["agreement"]
    assert effects["vocabulary"] == pytest.approx(result.coverage - 1)
    assert effects["quantisation"] == pytest.approx(result.head(FULL, INT4).agreement - 1)


def test_draft_eval_in_a_lower_precision_the_deployed_head_replays_the_deployed_tokens(sharded, prompts):
    """An int8 head at bf16 (f32 on a CPU without bf16): the same head fed the captured rows gives back every deployed
    token, whatever the CPU runs; its weights take a quarter of f32's, and int4's fewer."""
    result = draft_eval(fixture_spec(sharded, WeightFormat("int8"), "bf16"), sharded, prompts, 40, 2, 8)
    deployed, f32 = result.head(FULL, DEPLOYED), result.head(FULL, F32)
    assert deployed.agreement == 1.0 and deployed.format == "int8 per-row" and f32.precision == "f32"
    assert result.head(FULL, INT4).weight_bytes < deployed.weight_bytes < f32.weight_bytes / 3
    assert result.deployed["precision"] == deployed.precision and result.deployed["head_format"] == "int8 per-row"


# ---- the command ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"ids": list(range(start, start + 9))}) + "\n" for start in (3, 40, 200)))
    return path


def draft_cli(checkpoint, *args):
    return CliRunner().invoke(cli, ["draft-eval", str(TINY_SPEC), "--checkpoint", str(checkpoint), *args])


def test_cli_draft_eval_prints_the_heads_and_the_view_and_writes_json(checkpoint, prompts_file, tmp_path):
    out = tmp_path / "drafts.json"
    result = draft_cli(checkpoint, "--prompts", str(prompts_file), "--vocab", "100", "--chain", "3",
                       "--max-new-tokens", "6", "--json", str(out))
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    assert body["positions"] == 18 and body["chain"] == 3 and body["reduced_vocabulary"]["seen"] == 27
    assert [h["name"] for h in body["heads"]] == ["full f32", "full deployed", "full int4", "top 100 f32",
                                                  "top 100 deployed", "top 100 int4"]
    assert body["heads"][1]["expected_accepted"][0] == 1.0 and len(body["heads"][1]["expected_accepted"]) == 3
    assert set(body["view"]["cells"]) == {"full", "reduced"} and set(body["view"]["cells"]["full"]) == {"f32", "int4"}
    for line in ("head ", "full f32 ", "top 100 int4 ", "2x2 view: top-1 agreement / expected accepted drafts for a "
                 "chain of 3", "effects: vocabulary selection (at f32) "):
        assert line in result.stdout
    assert "captured prompt 3/3: 9 + 6 tokens" in result.stderr
    to_stdout = draft_cli(checkpoint, "--prompts", str(prompts_file), "--vocab", "100", "--chain", "3",
                          "--max-new-tokens", "6", "--json", "-")
    assert json.loads(to_stdout.stdout)["heads"] == body["heads"] and "2x2 view" in to_stdout.stderr


def test_cli_draft_eval_captures_on_the_pipeline_what_one_process_does(checkpoint, prompts_file, tmp_path):
    """The spec's three local nodes, the last sending back what its head read: the same tokens, and the heads
    agree with them as on the single process's capture."""
    args = ["--prompts", str(prompts_file), "--vocab", "100", "--chain", "2", "--max-new-tokens", "5"]
    bodies = {}
    for path in ("one", "pipeline"):
        out = tmp_path / f"{path}.json"
        result = draft_cli(checkpoint, *args, *(["--pipeline"] if path == "pipeline" else []), "--json", str(out))
        assert result.exit_code == 0, result.output
        bodies[path] = json.loads(out.read_text())
    one, pipeline = bodies["one"], bodies["pipeline"]
    assert pipeline["deployed"]["path"] == "pipeline (node0, node1, node2)" and one["deployed"]["path"] == "one process"
    assert pipeline["sequences"] == one["sequences"] and pipeline["positions"] == 15
    for mine, theirs in zip(pipeline["heads"], one["heads"]):
        assert mine["expected_accepted"] == pytest.approx(theirs["expected_accepted"], abs=1e-12), mine["name"]
    assert draft_cli(checkpoint, *args, "--plan", str(prompts_file)).exit_code == 2  # --plan goes with --pipeline


@pytest.mark.parametrize("args, status, message", [
    (["--prompts", "missing.jsonl", "--vocab", "8"], 2, "'missing.jsonl' does not exist"),
    (["--vocab", "8"], 2, "give --prompts: "),
    (["--prompts", "{prompts}", "--vocab", "0"], 2, "--vocab"),
    (["--prompts", "{prompts}", "--vocab", "512"], 2, "512: a reduced vocabulary is smaller than the model's 512"),
    (["--prompts", "{prompts}", "--vocab", "8", "--chain", "0"], 2, "--chain"),
    (["--prompts", "{prompts}", "--vocab", "8", "--chain", "9", "--max-new-tokens", "8"], 2,
     "9: a chain is at most the 8 tokens generated per prompt"),
    (["--prompts", "{bad}", "--vocab", "8"], 1, "bad.jsonl:2: 'ids' must be a non-empty list"),
])
def test_cli_draft_eval_errors(checkpoint, prompts_file, tmp_path, args, status, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"ids": []}\n')
    args = [a.format(prompts=prompts_file, bad=bad) for a in args]
    result = draft_cli(checkpoint, *args)
    assert result.exit_code == status and message in result.output, result.output
    assert "Traceback" not in result.output


def test_cli_draft_eval_counts_a_corpus_for_the_reduced_vocabulary(checkpoint, prompts_file, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"ids": [9, 9, 9, 300, 300, 4]}) + "\n")
    out = tmp_path / "drafts.json"
    result = draft_cli(checkpoint, "--prompts", str(prompts_file), "--corpus", str(corpus), "--vocab", "2",
                       "--chain", "2", "--max-new-tokens", "4", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["reduced_vocabulary"] | {"coverage": None} == {
        "tokens": 2, "seen": 2, "from": str(corpus), "coverage": None}
    assert f"the 2 tokens most frequent in {corpus} (2 of them occur there" in result.stdout


def test_cli_draft_eval_refuses_a_checkpoint_of_another_model(prompts_file):
    result = draft_cli(FIXTURES / "sharded", "--prompts", str(prompts_file), "--vocab", "8")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith(f"Error: {FIXTURES / 'sharded'}: its config.json describes another model than "
                                    f"{TINY_SPEC}'s: ")


def test_a_tied_head_is_read_from_the_embedding_table():
    """A Llama whose head is its embedding (llama_odd): the captured rows times the table give transformers'
    logits, and the f32 deployment's own head, built from the table, agrees at every position."""
    tied = Checkpoint.open(FIXTURES / "llama_odd")
    reference = dict(np.load(FIXTURES / "llama_odd" / "reference.npz"))
    assert tied.head_weight == "model.embed_tokens.weight"
    engine = Engine(tied, RuntimeSpec(precision="f32", max_streams=1, context_budget=32))
    captured = capture(engine, reference["ids"][:10], 4)
    logits = captured.head_inputs[0] @ tied.tensor(tied.head_weight).T
    np.testing.assert_allclose(logits, reference["prefill_logits"][9], atol=1e-4 * np.abs(logits).max())
    result = draft_eval(fixture_spec(tied, WeightFormat("f32"), "f32"), tied, [tuple(reference["ids"][:10])], 40, 2, 4)
    assert result.head(FULL, DEPLOYED).agreement == 1.0
