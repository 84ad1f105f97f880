"""The trained tiny model (specs/tiny-chat, made by scripts/train_tiny.py), which the demo and the serving quick start
speak with: the f32 engine against transformers' logits of a chat and a sentence (tests/fixtures/tiny_chat/
reference.npz), prefilled and decoded; transformers' greedy reply, token for token; and that it has learned: its
perplexity on the reference's text is a small fraction of random weights' of the same shape."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate, score_logits
from cascadia.engine.init_model import init_model
from cascadia.sampling import Sampling
from cascadia.serve.chat import ChatTemplate
from cascadia.spec.types import RuntimeSpec
from cascadia.tokenizer import load_tokenizer
from tests.test_engine_exact import assert_close

CHECKPOINT = Path(__file__).parent.parent / "specs" / "tiny-chat"
REFERENCE = Path(__file__).parent / "fixtures" / "tiny_chat" / "reference.npz"
RUNTIME = RuntimeSpec(precision="f32", max_streams=2, context_budget=128)


def words_share(text: str) -> float:
    """The share of a text's whitespace-separated pieces that are words: letters, maybe an apostrophe or a hyphen
    within, maybe punctuation around."""
    pieces = text.split()
    return sum(bool(re.fullmatch(r"[(\"'`]*[A-Za-z]+(['-][A-Za-z]+)*[.,:;!?)\"'`]*", p)) for p in pieces) / len(pieces)


@pytest.fixture(scope="module")
def engine():
    return Engine(Checkpoint.open(CHECKPOINT), RUNTIME)


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REFERENCE))


def test_prefill_and_decode_match_transformers(engine, reference):
    ids, prefill = reference["ids"], int(reference["prefill_len"])
    assert_close(engine.score(ids), reference["prefill_logits"])
    logits = engine.score(ids, prefill=prefill, slot=1)
    assert_close(logits[prefill:], reference["decode_logits"])


def test_the_greedy_reply_is_transformers(engine, reference):
    prompt, expected = reference["ids"][:int(reference["prefill_len"])], reference["greedy_ids"]
    assert generate(engine, prompt, len(expected), Sampling()).ids == tuple(int(i) for i in expected)


def test_it_has_learned(engine, reference, tmp_path):
    """Perplexity over the chat and the sentence after it, against random weights of the same configuration (about
    the vocabulary's 2,048): the trained model's is below 30 and below a twentieth of theirs."""
    trained = score_logits(engine.score(reference["ids"]), reference["ids"]).perplexity
    init_model(engine.config, tmp_path, seed=0)
    random = score_logits(Engine(Checkpoint.open(tmp_path), RUNTIME).score(reference["ids"]),
                          reference["ids"]).perplexity
    assert trained < 30 and trained < random / 20, (trained, random)


def test_a_chat_is_answered_in_words(engine):
    tokenizer = load_tokenizer(CHECKPOINT)
    chat = ChatTemplate.of_checkpoint(CHECKPOINT).render([{"role": "user", "content": "What is a generator?"}])
    reply = generate(engine, tokenizer.encode(chat).ids, 32, Sampling(), engine.config.eos_ids)
    text = tokenizer.decode(list(reply.ids))
    assert len(text.split()) >= 5 and words_share(text) >= 0.7, text


def test_its_multi_token_prediction_head_travels_apart():
    """scripts/train_mtp.py's head: a shard of its own under `model.mtp.layers.0.`, listed apart from the text
    model's tensors (which the tests above hold to transformers with the head beside them)."""
    checkpoint = Checkpoint.open(CHECKPOINT)
    head = checkpoint.mtp_names()
    assert checkpoint.config.num_mtp_layers == 1 and all(name.startswith("model.mtp.layers.0.") for name in head)
    assert {f"model.mtp.layers.0.{part}.weight" for part in ("hnorm", "enorm", "eh_proj", "norm")} <= set(head)
    assert checkpoint.tensor("model.mtp.layers.0.eh_proj.weight").shape == (128, 256)
    assert not set(head) & set(checkpoint.names())
