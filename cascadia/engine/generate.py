"""Single-stream generation and teacher-forced scoring on the single-process engine (what `cascadia generate` and
`cascadia score` run)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import attrs
import numpy as np

from cascadia.engine.engine import Engine
from cascadia.errors import RequestError
from cascadia.sampling import Sampling, extend_history


@attrs.frozen
class Generation:
    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]  # the generated tokens
    prefill_s: float  # prompt in, first token's logits out
    decode_s: float  # every later token
    stopped: bool  # ended on a stop token rather than the token limit

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.ids) - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps else 0.0

    def to_json(self) -> dict:
        return {"prompt_ids": list(self.prompt_ids), "ids": list(self.ids), "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "decode_tokens_per_s": self.decode_tokens_per_s, "stopped": self.stopped}


def generate(engine: Engine, prompt_ids, max_new_tokens: int, sampling: Sampling,
             stop_ids: Iterable[int] = (), slot: int = 0) -> Generation:
    """Prefill the prompt into a fresh slot, then decode one token at a time; draws as `cascadia run`'s would."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    prompt = tuple(int(i) for i in prompt_ids)
    stop = set(stop_ids)
    engine.release(slot)
    start = time.perf_counter()
    history = extend_history(0, prompt)
    tokens = [sampling.draw(engine.prefill(slot, prompt), history)]
    prefilled = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        history = extend_history(history, tokens[-1:])
        tokens.append(sampling.draw(engine.step([slot], tokens[-1:])[0], history))
    return Generation(prompt, tuple(tokens), prefilled - start, time.perf_counter() - prefilled, tokens[-1] in stop)


@attrs.frozen
class Score:
    mean_log_prob: float  # mean over positions 1.. of log p(token | the tokens before it), in nats
    tokens: int  # tokens scored

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.mean_log_prob))


def score_logits(logits: np.ndarray, ids) -> Score:
    """How well teacher-forced `logits` [N, V] (row t predicts token t+1) predict `ids` [N]."""
    ids = np.asarray(ids, dtype=np.int64)
    targets = ids[1:]
    if not len(targets):
        raise RequestError("scoring needs at least two tokens")
    if targets.max() >= logits.shape[1]:
        raise RequestError(f"token id {targets.max()} is beyond the model's output vocabulary ({logits.shape[1]})")
    rows = logits[:-1].astype(np.float64)
    log_probs = rows[np.arange(len(targets)), targets] - np.logaddexp.reduce(rows, axis=1)
    return Score(float(log_probs.mean()), len(targets))
