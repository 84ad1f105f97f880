"""Log-probabilities as the OpenAI API returns them: chat's `logprobs.content` (each token's text, exact UTF-8 bytes,
log-probability and likeliest alternatives) and completions' `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset).

A token's bytes are exact where the tokenizer is byte-level (GPT-2's table maps each byte to a printable character:
Llama 3, Qwen3 and Cascadia's own tokenizers), so that a client can join the bytes of the tokens that split a
character; its text is those bytes decoded, with U+FFFD for a character cut in two. Another tokenizer's token is
what decoding it alone gives. Without a tokenizer a token's text is its id.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs
from tokenizers import Tokenizer


@attrs.frozen
class Reported:
    """One token with what the model gave it (`cascadia.pipeline.coordinator.Logprobs`; None for a prompt's first
    token, which follows nothing), and where its text starts in the reply (characters before it)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None
    offset: int


def gpt2_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + len(chars) - len(printable)
    return [chr(chars[byte]) for byte in range(256)]


_BYTE_OF_CHAR = {char: byte for byte, char in enumerate(gpt2_alphabet())}


def _byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


class TokenText:
    """Each token's bytes and text in a tokenizer's vocabulary (see the module's text)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self._byte_level = tokenizer is not None and _byte_level(tokenizer)
        self._added = {} if tokenizer is None else {i: t.content
                                                    for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        if (known := self._cache.get(token)) is not None:
            return known
        if self._tokenizer is None:
            value = str(token).encode()
        elif token in self._added:
            value = self._added[token].encode()
        elif self._byte_level and (piece := self._tokenizer.id_to_token(token)) is not None \
                and all(char in _BYTE_OF_CHAR for char in piece):
            value = bytes(_BYTE_OF_CHAR[char] for char in piece)
        else:
            value = self._tokenizer.decode([token], skip_special_tokens=False).encode()
        self._cache[token] = value
        return value

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")

    def entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}


def chat_logprobs(reported: Sequence[Reported], text: TokenText) -> dict:
    """A chat choice's (or chunk's) `logprobs`."""
    return {"content": [text.entry(r.token, r.logprob) | {"top_logprobs": [text.entry(*top) for top in r.top]}
                        for r in reported], "refusal": None}


def completion_logprobs(reported: Sequence[Reported], text: TokenText) -> dict:
    """A completion choice's (or chunk's) `logprobs`. Alternatives whose texts coincide keep the likeliest's value,
    a JSON object having one value per text."""
    def alternatives(top: tuple[tuple[int, float], ...] | None) -> dict[str, float] | None:
        if top is None:
            return None
        found: dict[str, float] = {}
        for token, logprob in top:
            found.setdefault(text.text(token), logprob)
        return found

    return {"tokens": [text.text(r.token) for r in reported], "token_logprobs": [r.logprob for r in reported],
            "top_logprobs": [alternatives(r.top) for r in reported], "text_offset": [r.offset for r in reported]}
