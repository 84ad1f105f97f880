"""Structured outputs: a stream's tokens held to a grammar, a JSON schema's or any JSON object's, by llguidance's
matcher over the checkpoint's own vocabulary.

llguidance (a Rust library with no dependency; xgrammar, its peer, needs torch, transformers and triton at run
time) turns a JSON schema into a grammar and, at each step, into the set of tokens that can continue the text within
it. The JSON is compact: no whitespace but what a string holds, so that a small or random model is never led into
runs of spaces. The last stage keeps one `Constraint` per stream that asks: before each of its rows is drawn from,
the constraint follows the stream's output up to that row (consuming new tokens, rolling back those a rewind
dropped) and masks every token the grammar does not allow, so a speculating or replayed stream is held exactly as a
plain one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from cascadia.tokenizer import TOKENIZER_FILE

COMPACT = {"whitespace_flexible": False}  # JSON with no whitespace between its tokens


class GrammarError(ValueError):
    """A schema or grammar that cannot hold a stream; the text says why."""


def json_grammar(schema: dict | None) -> str:
    """The grammar of compact JSON that `schema` describes (None: any JSON object), GrammarError if it is no schema
    llguidance takes."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                     defaults=COMPACT)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error)
    return grammar


def vocabulary(checkpoint: Path, vocab_size: int, eos_ids: Sequence[int]) -> LLTokenizer:
    """The checkpoint's tokenizer as llguidance reads it, over the model's output vocabulary (its padding ids
    never allowed)."""
    path = Path(checkpoint) / TOKENIZER_FILE
    try:
        text = path.read_text()
    except OSError as e:
        raise GrammarError(f"{path}: a grammar needs the checkpoint's tokenizer ({e.strerror})") from None
    # a model without EOS ids (a random one's config may name none): llguidance takes the tokenizer's own end token
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)


class Constraint:
    """One stream's matcher, following its output tokens."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str):
        self._matcher = LLMatcher(tokenizer, grammar)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._vocab = tokenizer.vocab_size
        self._bitmask = allocate_token_bitmask(1, self._vocab)
        self._consumed: list[int] = []  # the output tokens the matcher has taken

    def allowed(self, output: Sequence[int]) -> np.ndarray | None:
        """bool [V]: the tokens the grammar allows after `output` (the stream's output so far); None where `output`
        leaves the grammar (a draft it does not allow: the row's token is dropped with the draft)."""
        output = list(output)
        kept = min(len(self._consumed), len(output))
        differ = np.flatnonzero(np.asarray(self._consumed[:kept]) != np.asarray(output[:kept]))
        kept = int(differ[0]) if len(differ) else kept
        if kept < len(self._consumed):
            self._matcher.rollback(len(self._consumed) - kept)
            del self._consumed[kept:]
        taken = self._matcher.try_consume_tokens(output[kept:])
        self._consumed += output[kept:kept + taken]
        if kept + taken < len(output):
            return None
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self._vocab].view(np.bool_)

