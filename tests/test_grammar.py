"""Structured outputs' matcher (`cascadia.grammar`) on the tiny checkpoint's tokenizer: the tokens a schema allows
at each step, the end it leaves to EOS, a rewind, a draft outside the grammar, and schemas it refuses."""

import json

import numpy as np
import pytest

from cascadia.grammar import Constraint, GrammarError, json_grammar, vocabulary
from cascadia.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokens(spec, checkpoint):
    return vocabulary(checkpoint, spec.model.config.output_vocab_size, spec.model.config.eos_ids)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


def test_a_schema_allows_its_json_alone_and_then_the_end(tokens, tokenizer, spec):
    constraint = Constraint(tokens, json_grammar(SCHEMA))
    text = '{"ok":true,"n":2}'  # compact: no whitespace between JSON's tokens
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for i, token in enumerate(ids):
        allowed = constraint.allowed(ids[:i])
        assert allowed[token], f"{tokenizer.decode(ids[:i])!r} then {tokenizer.decode([token])!r}"
        assert not allowed[tokenizer.encode(" ", add_special_tokens=False).ids[0]]  # no space anywhere
    assert np.flatnonzero(constraint.allowed(ids)).tolist() == sorted(spec.model.config.eos_ids)
    assert json.loads(text) == {"ok": True, "n": 2}


def test_a_rewind_and_a_draft_outside_the_grammar(tokens, tokenizer):
    constraint = Constraint(tokens, json_grammar(SCHEMA))
    ids = tokenizer.encode('{"ok":false', add_special_tokens=False).ids
    after = constraint.allowed(ids).copy()
    assert constraint.allowed(ids[:2]) is not None  # back two tokens, then on again: the same mask
    np.testing.assert_array_equal(constraint.allowed(ids), after)
    stray = tokenizer.encode("x", add_special_tokens=False).ids
    assert constraint.allowed(ids[:1] + stray) is None  # `{x`: no JSON goes on from there
    np.testing.assert_array_equal(constraint.allowed(ids), after)  # ... and the stream goes on without it


def test_any_json_object_and_schemas_that_cannot_hold_a_reply(tokens, tokenizer):
    constraint = Constraint(tokens, json_grammar(None))
    first = np.flatnonzero(constraint.allowed([]))
    assert [tokenizer.decode([int(t)]) for t in first] == ["{"]
    for schema in ({"type": "bogus"}, {"type": "object", "required": "a"}):
        with pytest.raises(GrammarError):
            json_grammar(schema)


def test_a_checkpoint_without_a_tokenizer_is_named(tmp_path, spec):
    with pytest.raises(GrammarError, match="a grammar needs the checkpoint's tokenizer"):
        vocabulary(tmp_path, spec.model.config.output_vocab_size, spec.model.config.eos_ids)
