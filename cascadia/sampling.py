"""Choosing the next token from logits: greedy, or sampling at a temperature among the tokens that top-k, nucleus
(top-p) and min-p keep, in that order, as transformers' logits warpers filter them; before either, the logits
changed by what the stream has made so far where it asks (`LogitAdjustments`: penalties, a bias, a minimum length);
and the log-probabilities a client may ask for beside each token (`log_probabilities`).

A random draw is seeded by (seed, a hash of the stream's tokens up to the row it samples from), so a stream's tokens
depend on its own prompt and earlier tokens only: not on its slot, the rows it shares a frame with, or the timing.
`cascadia generate` (one stream on one engine) and `cascadia run` (many on the pipeline) draw the same tokens for
the same prompt and seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from cascadia.spec.types import WorkloadSpec

MAX_LOGPROBS = 20  # the most likely tokens reported beside each token at most (OpenAI's top_logprobs limit)


@attrs.frozen
class LogitAdjustments:
    """How a stream's logits change before each of its tokens is chosen (greedy too), from its tokens so far, as vLLM
    changes them and in its order: `min_tokens` holds its `stop_ids` back until its output has that many tokens;
    `logit_bias` adds to the logits of the tokens it names; `repetition_penalty` divides the positive logit (and
    multiplies the negative one) of every token in its prompt or output (transformers' and vLLM's); then each token
    in its output loses `frequency_penalty` once per time it is there, and `presence_penalty` once (OpenAI's). In
    float32, as the logits are. A `grammar` (`cascadia.grammar`) masks every token it does not allow after the
    output so far: that takes a matcher with a state, which the last stage keeps (`apply` leaves it out)."""

    prompt_tokens: int  # where the stream's output starts
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=lambda v: tuple(map(tuple, v)))
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: str | None = None

    def __attrs_post_init__(self):
        finite = (self.repetition_penalty, self.frequency_penalty, self.presence_penalty,
                  *(bias for _, bias in self.logit_bias))
        if not all(np.isfinite(finite)):
            raise ValueError("penalties and biases must be finite numbers")
        if self.prompt_tokens < 1 or self.min_tokens < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"needs prompt_tokens >= 1, min_tokens >= 0 and repetition_penalty > 0, got "
                             f"{self.prompt_tokens}, {self.min_tokens} and {self.repetition_penalty}")
        if any(token < 0 for token in self.stop_ids) or any(token < 0 for token, _ in self.logit_bias):
            raise ValueError("token ids are integers >= 0")

    @classmethod
    def of(cls, prompt_tokens: int, **changes) -> LogitAdjustments | None:
        """The adjustments `changes` ask for (their `stop_ids` held back only with `min_tokens`), or None where
        they change nothing."""
        if not changes.get("min_tokens"):
            changes["stop_ids"] = ()
        adjust = cls(prompt_tokens, **changes)
        return None if adjust == cls(prompt_tokens) else adjust

    def apply(self, logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The changed logits [V] (float32, a copy) of the row after `tokens` (the stream's prompt and output)."""
        out = np.array(logits, np.float32)
        tokens = np.asarray(tokens, np.int64)
        output = tokens[self.prompt_tokens:]
        if len(output) < self.min_tokens and self.stop_ids:
            out[list(self.stop_ids)] = -np.inf
        if self.logit_bias:
            ids, biases = zip(*self.logit_bias)
            out[list(ids)] += np.array(biases, np.float32)
        if self.repetition_penalty != 1.0:
            seen = np.unique(tokens)
            penalty = np.float32(self.repetition_penalty)
            out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
        if self.frequency_penalty or self.presence_penalty:
            counts = np.bincount(output, minlength=len(out)).astype(np.float32)
            out -= np.float32(self.frequency_penalty) * counts
            out -= np.float32(self.presence_penalty) * (counts > 0)
        return out


@attrs.frozen
class Sampling:
    """temperature 0 means greedy. top_k keeps the k most likely tokens (0: every one); top_p the fewest most likely
    whose probability reaches p; min_p those at least min_p times as likely as the most likely. logprobs does not
    change the draw: with k >= 0 the drawn token's log-probability is reported, and the k most likely tokens' (-1:
    nothing is); nor does `adjust` change them (they are the model's)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    logprobs: int = -1
    adjust: LogitAdjustments | None = None  # how the logits change first, from the stream's tokens so far
    prompt_logprobs: bool = False  # report the prompt's tokens' log-probabilities too (with logprobs >= 0)

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not -1 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must lie in -1..{MAX_LOGPROBS} (-1: none), got {self.logprobs}")

    @classmethod
    def of(cls, workload: WorkloadSpec) -> Sampling:
        return cls(0.0 if workload.greedy else workload.temperature, workload.top_p, workload.seed, workload.top_k,
                   workload.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def draw(self, logits: np.ndarray, history: int, tokens: Sequence[int] = (),
             allowed: np.ndarray | None = None) -> int:
        """One token id from logits [V] of a stream whose tokens so far (`tokens`: needed where `adjust` is set) hash
        to `history` (`extend_history`), among the tokens its grammar `allowed` (None: any; `cascadia.grammar`)."""
        raw = logits
        if self.adjust is not None:
            logits = self.adjust.apply(logits, tokens)
        logits = held(logits, raw, allowed)
        if self.greedy:
            return greedy(logits)
        return sample(logits, np.random.default_rng([self.seed, history]), self.temperature, self.top_p, self.top_k,
                      self.min_p)


def held(adjusted: np.ndarray, raw: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """A row's logits (float32, after any adjustments) with the tokens its grammar does not allow masked (-inf);
    where the adjustments leave no allowed token (min_tokens holding back the end the grammar has reached), the
    grammar wins over them (`raw`: the row's logits before). None: no grammar holds the row (or, at a pipeline's last
    stage, its stream left the grammar in a draft, and the row's token will be dropped)."""
    if allowed is None:
        return adjusted
    masked = np.where(allowed, adjusted, np.float32(-np.inf))
    return masked if np.isfinite(masked).any() else np.where(allowed, raw, np.float32(-np.inf))


def extend_history(history: int, tokens: Iterable[int]) -> int:
    """The hash of a stream's tokens after `tokens` more (a new stream starts at 0): crc32 over 4 bytes a token."""
    for token in tokens:
        history = zlib.crc32(int(token).to_bytes(4, "little"), history)
    return history


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_p: float = 1.0, top_k: int = 0,
           min_p: float = 0.0) -> int:
    kept = candidates(logits, temperature, top_p, top_k, min_p)
    if kept is None:  # a temperature so near 0 that the logits overflow: its limit, greedy
        return greedy(logits)
    ids, probs = kept
    return int(ids[rng.choice(len(ids), p=probs)])


def candidates(logits: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0,
               min_p: float = 0.0) -> tuple[np.ndarray, np.ndarray] | None:
    """The tokens a draw chooses among, most likely first, and their probabilities: softmax(logits / temperature)
    in float64, kept by top_k, then top_p, then min_p, each on what the one before kept, renormalised (None where
    the temperature overflows the logits)."""
    with np.errstate(over="ignore"):
        scaled = logits.astype(np.float64) / temperature
    if not np.isfinite(scaled).all():
        return None
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if top_k:
        order = order[:top_k]
        probs[order] /= probs[order].sum()
    cumulative = np.cumsum(probs[order])
    order = order[: int(np.searchsorted(cumulative, top_p)) + 1]  # up to and including the token that reaches p
    if min_p:
        order = order[probs[order] >= min_p * probs[order[0]]]  # most likely first: a prefix
    return order, probs[order] / probs[order].sum()


def log_probabilities(logits: np.ndarray, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The log-softmax of each row of logits [n, V], before any temperature or filter (what the model says, as vLLM
    reports it by default), in float64: at each row's token [n], and the k largest, ids [n, k] and values [n, k], most
    likely first (equal values: the lower id first)."""
    logits = np.asarray(logits, np.float32)
    peak = logits.max(axis=1, keepdims=True)
    # exp in float32 (vectorised, where float64's is ten times slower), summed in float64: within 1e-7 of float64's
    normaliser = peak + np.log(np.exp(logits - peak).sum(axis=1, dtype=np.float64, keepdims=True))
    chosen = np.take_along_axis(logits, np.asarray(tokens, np.int64)[:, None], axis=1)[:, 0] - normaliser[:, 0]
    if not k:
        return chosen, np.zeros((len(logits), 0), np.int32), np.zeros((len(logits), 0))
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logits, top, axis=1)
    order = np.lexsort((top, -values), axis=1)
    top = np.take_along_axis(top, order, axis=1)
    return chosen, top.astype(np.int32), np.take_along_axis(values, order, axis=1) - normaliser
