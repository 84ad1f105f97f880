"""The sampling controls against transformers' logits warpers and processors: the tokens a draw chooses among, and
their probabilities, for temperature, top-k, top-p and min-p alone and together (tests/fixtures/sampling, written by
scripts/make_fixtures.py from transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and
MinPLogitsWarper, in that order); the logits as min_tokens, logit_bias and repetition_penalty change them (its
MinNewTokensLength, SequenceBias and RepetitionPenalty processors); frequency and presence penalties by OpenAI's
formula; the log-probabilities reported beside a token."""

import json
from pathlib import Path

import numpy as np
import pytest

from cascadia.sampling import LogitAdjustments, Sampling, candidates, log_probabilities, sample

WARPERS = np.load(Path(__file__).parent / "fixtures" / "sampling" / "warpers.npz")
ADJUSTMENTS = np.load(Path(__file__).parent / "fixtures" / "sampling" / "adjustments.npz")


@pytest.mark.parametrize("case", range(len(WARPERS["settings"])))
def test_the_kept_tokens_and_their_probabilities_are_transformers(case):
    logits, probs = WARPERS["logits"][case], WARPERS["probs"][case]
    temperature, top_k, top_p, min_p = WARPERS["settings"][case]
    ids, kept = candidates(logits, temperature, top_p, int(top_k), min_p)
    assert sorted(ids.tolist()) == np.flatnonzero(probs).tolist()
    ours = np.zeros(len(logits))
    ours[ids] = kept
    np.testing.assert_allclose(ours, probs, rtol=0, atol=1e-6)  # transformers' float32 softmax against float64


def test_draws_stay_among_the_kept_tokens():
    logits = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    top = np.argsort(-logits)
    rng = np.random.default_rng(0)
    assert {sample(logits, rng, 2.0, top_k=3) for _ in range(300)} == set(top[:3].tolist())
    share = np.exp(logits - logits.max())  # each token's probability over the likeliest's
    assert {sample(logits, rng, 1.0, min_p=0.5) for _ in range(300)} == set(np.flatnonzero(share >= 0.5).tolist())
    assert {sample(logits, rng, 1.0, top_k=1) for _ in range(20)} == {int(top[0])}


@pytest.mark.parametrize("settings, message", [({"top_k": -1}, "top_k must be >= 0"),
                                               ({"min_p": 1.5}, "min_p must lie in"),
                                               ({"min_p": -0.1}, "min_p must lie in")])
def test_impossible_limits_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Sampling(temperature=1.0, **settings)


def test_log_probabilities_are_the_float64_log_softmax_most_likely_first():
    logits = np.random.default_rng(2).standard_normal((5, 300)).astype(np.float32) * 6
    logits[0, [7, 3]] = logits[0].max() + 1  # a tie for the likeliest: the lower id first
    tokens = np.array([3, 0, 17, 299, 150])
    chosen, ids, values = log_probabilities(logits, tokens, 4)
    exact = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64), axis=1, keepdims=True)
    # within 1e-7: the exponentials are float32's (their sum float64's)
    np.testing.assert_allclose(chosen, exact[np.arange(5), tokens], rtol=0, atol=1e-7)
    assert ids.tolist() == [np.lexsort((np.arange(300), -row))[:4].tolist() for row in exact]
    assert ids[0, :2].tolist() == [3, 7]
    np.testing.assert_allclose(values, np.take_along_axis(exact, ids, axis=1), rtol=0, atol=1e-7)
    assert log_probabilities(logits, tokens, 0)[1].shape == (5, 0)


@pytest.mark.parametrize("case", range(len(ADJUSTMENTS["logits"])))
def test_min_tokens_logit_bias_and_repetition_penalty_are_transformers_processors(case):
    min_tokens, bias, penalty = json.loads(str(ADJUSTMENTS["settings"]))[case]
    adjust = LogitAdjustments(int(ADJUSTMENTS["prompt"]), min_tokens, ADJUSTMENTS["stop"].tolist(), bias, penalty)
    changed = adjust.apply(ADJUSTMENTS["logits"][case], ADJUSTMENTS["tokens"][case])
    np.testing.assert_array_equal(changed, ADJUSTMENTS["changed"][case])  # the same float32 operations


def test_frequency_and_presence_penalties_count_the_output_alone():
    """OpenAI's formula: each token loses frequency_penalty per time it is in the output, presence_penalty once."""
    adjust = LogitAdjustments(prompt_tokens=3, frequency_penalty=0.5, presence_penalty=1.0)
    changed = adjust.apply(np.zeros(8, np.float32), [3, 3, 6, 3, 5, 5])  # prompt 3 3 6, output 3 5 5
    assert changed.tolist() == [0, 0, 0, -1.5, 0, -2.0, 0, 0]
    assert adjust.apply(np.zeros(8, np.float32), [3, 3, 6]).tolist() == [0] * 8  # no output yet


@pytest.mark.parametrize("fields, message", [({"repetition_penalty": 0}, "repetition_penalty > 0"),
                                             ({"presence_penalty": float("nan")}, "finite"),
                                             ({"logit_bias": [(5, float("inf"))]}, "finite"),
                                             ({"stop_ids": [-1]}, "token ids are integers >= 0"),
                                             ({"prompt_tokens": 0}, "prompt_tokens >= 1")])
def test_impossible_adjustments_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LogitAdjustments(**{"prompt_tokens": 4} | fields)
