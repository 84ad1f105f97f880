"""How well a draft head's tokens follow the deployed path's, position by position along captured sequences.

A draft head proposes, at each position t of a sequence, the token the deployed path produced there. A chain of
k drafts starting at t is accepted up to its first mismatch. While every earlier draft of the chain agreed, the
stream's tokens are exactly those captured, and so is the hidden state at the next position (to the rounding of a
call of another row count); so the drafts a chain of k starting at t gets accepted are the consecutive agreeing
positions from t on, capped at k:

    accepted_k(t) = min(k, run(t)),  run(t) = the number of positions t, t+1, ... that agree before the first
                                              that does not (0 when t itself does not)

A run never continues past the end of its own sequence: near its end a chain has fewer positions to be accepted
at. The expected accepted drafts for chains of k is the mean of accepted_k(t) over every position t of every
sequence (each position counts once, so longer sequences weigh more). For k = 1 it is the top-1 agreement.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def agreeing_runs(agree: np.ndarray) -> np.ndarray:
    """run(t) for each position t of one sequence: how many positions from t on agree, up to the first that does
    not, e.g. [1, 1, 0, 1] -> [2, 1, 0, 1]."""
    agree = np.asarray(agree, dtype=bool)
    runs = np.zeros(len(agree) + 1, np.int64)
    for t in range(len(agree) - 1, -1, -1):
        runs[t] = runs[t + 1] + 1 if agree[t] else 0
    return runs[:-1]


def expected_accepted(sequences: Sequence[np.ndarray], chain: int) -> np.ndarray:
    """Expected accepted drafts [chain] for chains of 1..`chain` drafts: entry k-1 is the mean over every position
    of every sequence (each an array of whether the draft agreed there) of min(k, run(t))."""
    if chain < 1:
        raise ValueError(f"a chain has at least one draft, got {chain}")
    runs = np.concatenate([agreeing_runs(agree) for agree in sequences] or [np.zeros(0, np.int64)])
    if not len(runs):
        raise ValueError("no positions to evaluate")
    return np.minimum(runs[:, None], np.arange(1, chain + 1)).mean(axis=0)


def most_frequent_tokens(corpus: Sequence[Sequence[int]], count: int, vocabulary: int) -> np.ndarray:
    """The `count` token ids below `vocabulary` that occur most often in `corpus` (ties, and tokens that never
    occur, in id order), sorted by id, so that an argmax over them breaks ties as one over the whole vocabulary
    does."""
    if not 1 <= count <= vocabulary:
        raise ValueError(f"a reduced vocabulary holds 1..{vocabulary} tokens, got {count}")
    ids = np.concatenate([np.asarray(tokens, np.int64) for tokens in corpus] or [np.zeros(0, np.int64)])
    counts = np.bincount(ids[ids < vocabulary], minlength=vocabulary)
    by_frequency = np.lexsort((np.arange(vocabulary), -counts))
    return np.sort(by_frequency[:count])
