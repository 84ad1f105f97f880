"""Single-stream generation and teacher-forced scoring on the single-process engine (what `cascadia generate` and
`cascadia score` run)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np
from llguidance import LLTokenizer

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.errors import RequestError
from cascadia.grammar import Constraint
from cascadia.graph.costs import stage_memory
from cascadia.host_memory import shortfall
from cascadia.sampling import Sampling, extend_history
from cascadia.spec.types import ModelSpec, RuntimeSpec, WeightFormats
from cascadia.units import format_bytes


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


def check_request(checkpoint: Checkpoint, ids: Sequence[int], new_tokens: int, formats: WeightFormats,
                  runtime: RuntimeSpec) -> None:
    """Refuse, before an engine allocates anything, what the model or this machine cannot serve: a token id beyond
    the vocabulary, more positions than the model's `max_position_embeddings`, and weights plus the state of
    `runtime` (its streams of its context budget) beyond this machine's available memory."""
    cfg = checkpoint.config
    if (beyond := max(ids)) >= cfg.vocab_size:
        raise RequestError(f"token id {beyond} lies outside the vocabulary of {checkpoint.path} "
                           f"(0..{cfg.vocab_size - 1})")
    positions = len(ids) + new_tokens
    if positions > cfg.max_position_embeddings:
        raise RequestError(f"{len(ids)} prompt + {new_tokens} new tokens take {positions} positions, more than the "
                           f"model's max_position_embeddings ({cfg.max_position_embeddings}, in "
                           f"{checkpoint.path / 'config.json'})")
    weights, state = stage_memory(ModelSpec(cfg, formats), runtime, range(cfg.num_hidden_layers), True, True)
    if short := shortfall(weights + state):
        raise RequestError(f"the engine needs {format_bytes(weights + state, digits=3)} (weights "
                           f"{format_bytes(weights, digits=3)}, K/V and convolution state "
                           f"{format_bytes(state, digits=3)} for {runtime.context_budget} positions) {short}")


def generate(engine: Engine, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids: Iterable[int] = (),
             slot: int = 0, progress: Callable[[int, int], None] | None = None,
             vocabulary: LLTokenizer | None = None) -> Generation:
    """Prefill the prompt into a fresh slot, then decode one token at a time; draws as `cascadia run`'s would.
    `progress(done, total)` hears of the prompt's tokens as the prefill takes them in. A grammar the sampling holds
    the tokens to is matched over `vocabulary` (`cascadia.grammar.vocabulary`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    grammar = sampling.adjust.grammar if sampling.adjust is not None else None
    if grammar is not None and vocabulary is None:
        raise ValueError("a grammar needs the vocabulary it is matched over")
    constraint = Constraint(vocabulary, grammar) if grammar is not None else None
    prompt = tuple(int(i) for i in prompt_ids)
    stop = set(stop_ids)
    engine.release(slot)
    start = time.perf_counter()
    history = extend_history(0, prompt)
    tokens = [sampling.draw(engine.prefill(slot, prompt, progress), history, prompt,
                            None if constraint is None else constraint.allowed([]))]
    prefilled = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        history = extend_history(history, tokens[-1:])
        tokens.append(sampling.draw(engine.step([slot], tokens[-1:])[0], history,
                                    prompt + tuple(tokens) if sampling.adjust else (),
                                    None if constraint is None else constraint.allowed(tokens)))
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
