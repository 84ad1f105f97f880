"""Choosing the next token from logits: greedy, or temperature and nucleus (top-p) sampling.

A random draw is seeded by (seed, a hash of the stream's tokens up to the row it samples from), so a stream's tokens
depend on its own prompt and earlier tokens only: not on its slot, the rows it shares a frame with, or the timing.
`cascadia generate` (one stream on one engine) and `cascadia run` (many on the pipeline) draw the same tokens for
the same prompt and seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import attrs
import numpy as np

from cascadia.spec.types import WorkloadSpec


@attrs.frozen
class Sampling:
    """temperature 0 means greedy. top_p keeps the smallest set of most likely tokens whose probability reaches p."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @classmethod
    def of(cls, workload: WorkloadSpec) -> Sampling:
        return cls(0.0 if workload.greedy else workload.temperature, workload.top_p, workload.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def draw(self, logits: np.ndarray, history: int) -> int:
        """One token id from logits [V] of a stream whose tokens so far hash to `history` (`extend_history`)."""
        if self.greedy:
            return greedy(logits)
        return sample(logits, np.random.default_rng([self.seed, history]), self.temperature, self.top_p)


def extend_history(history: int, tokens: Iterable[int]) -> int:
    """The hash of a stream's tokens after `tokens` more (a new stream starts at 0): crc32 over 4 bytes a token."""
    for token in tokens:
        history = zlib.crc32(int(token).to_bytes(4, "little"), history)
    return history


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float = 1.0) -> int:
    with np.errstate(over="ignore"):
        scaled = logits.astype(np.float64) / temperature
    if not np.isfinite(scaled).all():  # a temperature so near 0 that the logits overflow: its limit, greedy
        return greedy(logits)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]  # up to and including the token that reaches p
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])
