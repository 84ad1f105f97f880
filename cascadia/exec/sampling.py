"""Choosing the next token from logits: greedy, or temperature and nucleus (top-p) sampling with a seeded generator."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class Sampler:
    """temperature 0 means greedy. top_p keeps the smallest set of most likely tokens whose probability reaches p."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    rng: np.random.Generator = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        object.__setattr__(self, "rng", np.random.default_rng(self.seed))

    def __call__(self, logits: np.ndarray) -> int:
        """One token id from logits [V]."""
        if self.temperature == 0:
            return greedy(logits)
        return sample(logits, self.rng, self.temperature, self.top_p)


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float = 1.0) -> int:
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]  # up to and including the token that reaches p
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])
