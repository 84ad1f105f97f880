"""A stream's tokens as text, piece by piece: valid UTF-8 only, stop strings cut out.

`tokenizers`' `DecodeStream` turns token ids into text as they come, holding back a token that ends inside a
multi-byte character until the character is whole. On top of it, text that could still turn out to be the start of
a stop string is held back too, so a client never sees text that a stop string later takes away. At the end,
`finish` gives whatever is left (as the one-shot decoding of all the ids has it), so the pieces always add up to
`tokenizer.decode(ids)`, cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._text = ""  # decoded so far
        self._sent = 0  # characters of it given out
        self.stopped = False  # a stop string was found: nothing more comes
        self.stopped_by: str | None = None  # which one (the first in the text)

    @property
    def text(self) -> str:
        """All the text given out so far."""
        return self._text[:self._sent]

    @property
    def offset(self) -> int:
        """Characters decoded so far (given out or held back): where the next token's text starts."""
        return len(self._text)

    def push(self, token_id: int) -> str:
        """Take the next token; the text that may be given out now ("" while held back, or once stopped)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._text += self._decoder.step(self._tokenizer, token_id) or ""
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, the stream having ended."""
        if self.stopped:
            return ""
        whole = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if whole.startswith(self._text):  # an incomplete character at the end is replaced, as decode does it
            self._text = whole
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self._text)
        for stop in self._stop:
            at = self._text.find(stop, max(0, self._sent - len(stop) + 1))
            if at != -1 and at < end:
                end, self.stopped, self.stopped_by = at, True, stop
        if not self.stopped and not final:
            end -= self._held_back()
        piece, self._sent = self._text[self._sent:end], max(self._sent, end)
        return piece

    def _held_back(self) -> int:
        """How many characters at the end could begin a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text) - self._sent), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
