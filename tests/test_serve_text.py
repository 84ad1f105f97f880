"""A stream's text: pieces that are valid text, add up to the one-shot decoding, and stop before a stop string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from cascadia.serve.logprobs import TokenText
from cascadia.serve.text import TextStream
from cascadia.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


def pieces(tokenizer, ids, stop=()):
    stream = TextStream(tokenizer, stop)
    out = [stream.push(i) for i in ids]
    return out + [stream.finish()], stream


def cut(text: str, stop) -> str:
    ends = [text.find(s) for s in stop if s and s in text]
    return text[:min(ends)] if ends else text


def test_a_character_split_across_tokens_comes_whole(tokenizer):
    ids = tokenizer.encode("héllo wörld ✓ ok").ids
    out, _ = pieces(tokenizer, ids)
    assert "".join(out) == "héllo wörld ✓ ok"
    assert "" in out[:-1]  # some token ended inside a character and was held back
    assert all("\ufffd" not in piece for piece in out)


def test_text_before_a_stop_string_is_all_that_comes(tokenizer):
    ids = tokenizer.encode("one two three four").ids
    out, stream = pieces(tokenizer, ids, stop=["thr", "zzz"])
    assert "".join(out) == "one two " and stream.stopped and stream.text == "one two "
    assert stream.stopped_by == "thr"
    assert "".join(pieces(tokenizer, ids, stop=["four"])[0]) == "one two three "


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=24),
       stop=st.lists(st.text(alphabet="ab e\u00e9", min_size=1, max_size=3), max_size=2))
def test_pieces_add_up_to_the_one_shot_decoding_cut_at_the_first_stop(tokenizer, ids, stop):
    """Whatever the ids (random ones make broken UTF-8 too), the pieces are the decoding of all of them, up to the
    first stop string; a piece never holds text a stop string takes back."""
    out, stream = pieces(tokenizer, ids, stop)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(out) == cut(whole, stop)
    found = [s for s in stop if s and s in whole]  # and the stream names a stop string it found there
    assert (stream.stopped_by in found and whole.find(stream.stopped_by) == min(map(whole.find, found))) if found \
        else stream.stopped_by is None


def test_token_bytes_add_up_to_the_text_where_tokens_split_characters(tokenizer):
    """A byte-level tokenizer's tokens carry their exact bytes (those that split a character its bytes between
    them); a special token its own text; another tokenizer's token what decoding it alone gives."""
    ids = tokenizer.encode("héllo wörld ✓ ok", add_special_tokens=False).ids
    text = TokenText(tokenizer)
    assert any(text.text(i) == "\ufffd" for i in ids)  # some token holds part of a character
    assert b"".join(text.bytes(i) for i in ids).decode() == "héllo wörld ✓ ok"
    eos = tokenizer.token_to_id("<|eos|>")
    assert text.text(eos) == "<|eos|>"
    words = Tokenizer(WordLevel({"fleet": 0, "of": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert [TokenText(words).text(i) for i in range(2)] == ["fleet", "of"]
    assert TokenText(None).text(42) == "42" and TokenText(None).bytes(42) == b"42"
