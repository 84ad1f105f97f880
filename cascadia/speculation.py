"""Draft tokens for speculative decoding, without a second model; the policy verifies them (`cascadia.policy`).

Prompt lookup: the longest suffix of a stream's tokens (prompt and output), between `min_n` and `max_n` tokens, that
occurred before proposes the tokens that followed its most recent occurrence. Failing the stream's own tokens, the
phrase table (the token sequences of the policy's most recently finished requests) is searched alike, longest suffix
first. A stream's draft length adapts to its acceptance: one more after a step that accepted every draft, one more
than it accepted after a step that did not.

Pure: no I/O, no clock, no tensors. A drafter only proposes: whatever it proposes, the tokens a stream gets are those
it gets without speculation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

NGRAM = "ngram"
DEFAULT_MAX_DRAFT = 4
MIN_N, MAX_N = 2, 4  # suffix lengths prompt lookup tries
PHRASE_TABLE_SEQUENCES = 32  # finished requests' token sequences a policy's phrase table keeps


def parse_speculate(value: str | None) -> int:
    """The most draft tokens per step of `--speculate` / `runtime.speculate`: "ngram" or "ngram:MAX_DRAFT" (None,
    "off": 0, no speculation). ValueError with the accepted forms otherwise."""
    if value is None or value == "off":
        return 0
    name, _, count = str(value).partition(":")
    if name == NGRAM and not count:
        return DEFAULT_MAX_DRAFT
    if name == NGRAM and count.isdigit() and int(count) >= 1:
        return int(count)
    raise ValueError(f"speculate must be {NGRAM} or {NGRAM}:MAX_DRAFT (a draft length >= 1) or off, got {value!r}")


class Drafter(Protocol):
    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> Sequence[int]:
        """At most `limit` tokens that might follow a stream's `prompt` and `output` so far."""

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """The stream ended with this `output`: forget it."""


class NgramIndex:
    """A growing token sequence and, for each of its n-grams (min_n..max_n tokens), where the token that followed
    its latest occurrence stands."""

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def follows(self, suffix: tuple[int, ...], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of `suffix` (none if it never did)."""
        start = self._next.get(suffix)
        return [] if start is None else self.tokens[start:start + limit]


class NgramDrafter:
    """Prompt lookup over each stream's own tokens, then over a phrase table shared by the streams of one policy."""

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N, table_size: int = PHRASE_TABLE_SEQUENCES) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._streams: dict[int, NgramIndex] = {}
        self._table: deque[NgramIndex] = deque(maxlen=table_size)  # the newest last

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        own = self._streams.get(request_id)
        if own is None:
            own = self._streams[request_id] = NgramIndex(self.min_n, self.max_n)
            own.extend(prompt)
        own.extend(output[len(own.tokens) - len(prompt):])
        for n in range(min(self.max_n, len(own.tokens)), self.min_n - 1, -1):
            suffix = tuple(own.tokens[-n:])
            for index in (own, *reversed(self._table)):
                if drafts := index.follows(suffix, limit):
                    return drafts
        return []

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._streams.pop(request_id, None)
        finished = NgramIndex(self.min_n, self.max_n)
        finished.extend([*prompt, *output])
        self._table.append(finished)


class RecordedDrafter:
    """Another drafter, its proposals counted: for each stream, how many drafts it was given at each step it was
    asked (0: none found), so that a run's acceptance can be replayed in the simulator (`cascadia.sim.drafts`)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.proposed: dict[int, list[int]] = {}  # by request id

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> Sequence[int]:
        drafts = self.drafter.propose(request_id, prompt, output, limit)
        self.proposed.setdefault(request_id, []).append(len(drafts))
        return drafts

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.drafter.finish(request_id, prompt, output)


class ReplayDrafter:
    """Proposes what a previous run's stream with the same prompt made next: when the run is the same, every draft
    is accepted (the ceiling of speculation)."""

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        self._outputs = {tuple(prompt): list(output) for prompt, output in outputs.items()}

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        recorded = self._outputs.get(tuple(prompt), [])
        return recorded[len(output):len(output) + limit]

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        pass


class Speculation:
    """A policy's speculation: a drafter, and each stream's draft length, adapting to what it accepts."""

    def __init__(self, drafter: Drafter, max_draft: int) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, got {max_draft}")
        self.drafter, self.max_draft = drafter, max_draft
        self._lengths: dict[int, int] = {}  # by request id

    def drafts(self, request_id: int, prompt: Sequence[int], output: Sequence[int], room: int) -> tuple[int, ...]:
        """The drafts to verify after a stream's next decode row: at most `room` (rows free in the frame, tokens
        the stream may still make after that row) and its draft length."""
        limit = min(room, self._lengths.get(request_id, self.max_draft))
        return tuple(self.drafter.propose(request_id, prompt, output, limit))[:limit] if limit > 0 else ()

    def verified(self, request_id: int, proposed: int, accepted: int) -> None:
        length = self._lengths.get(request_id, self.max_draft)
        self._lengths[request_id] = min(self.max_draft, length + 1 if accepted == proposed else accepted + 1)

    def finished(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._lengths.pop(request_id, None)
        self.drafter.finish(request_id, prompt, output)
