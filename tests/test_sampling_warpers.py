"""The sampling controls against transformers' logits warpers: the tokens a draw chooses among, and their
probabilities, for temperature, top-k, top-p and min-p alone and together (tests/fixtures/sampling, written by
scripts/make_fixtures.py from transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and
MinPLogitsWarper, in that order)."""

from pathlib import Path

import numpy as np
import pytest

from cascadia.sampling import Sampling, candidates, log_probabilities, sample

WARPERS = np.load(Path(__file__).parent / "fixtures" / "sampling" / "warpers.npz")


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
