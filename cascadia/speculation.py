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

NGRAM, MTP = "ngram", "mtp"  # prompt lookup; the checkpoint's multi-token-prediction layer (`cascadia.engine.mtp`)
DRAFTERS = (NGRAM, MTP, f"{NGRAM}+{MTP}")  # ngram+mtp: prompt lookup's drafts where it finds some, else the layer's
DEFAULT_MAX_DRAFT = {NGRAM: 4, MTP: 1}  # by drafter; with both, the larger
MIN_N, MAX_N = 2, 4  # suffix lengths prompt lookup tries
PHRASE_TABLE_SEQUENCES = 32  # finished requests' token sequences a policy's phrase table keeps


def speculate_setting(value: str | None) -> tuple[tuple[str, ...], int]:
    """The drafters and the most draft tokens per step of `--speculate` / `runtime.speculate`: "ngram", "mtp" or
    "ngram+mtp", each optionally ":MAX_DRAFT" (None, "off": none, 0). ValueError with the accepted forms
    otherwise."""
    if value is None or value == "off":
        return (), 0
    name, _, count = str(value).partition(":")
    if name in DRAFTERS and (not count or count.isdigit() and int(count) >= 1):
        drafters = tuple(name.split("+"))
        return drafters, int(count) if count else max(DEFAULT_MAX_DRAFT[d] for d in drafters)
    raise ValueError(f"speculate must be {', '.join(DRAFTERS)}, each optionally :MAX_DRAFT (a draft length >= 1), "
                     f"or off, got {value!r}")


def parse_speculate(value: str | None) -> int:
    """The most draft tokens per step of a `speculate` setting (`speculate_setting`)."""
    return speculate_setting(value)[1]


class Drafter:
    """Proposes draft tokens; the policy asks it at each of a stream's steps and tells it when the stream ends."""

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> Sequence[int]:
        """At most `limit` tokens that might follow a stream's `prompt` and `output` so far."""
        raise NotImplementedError

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """The stream ended with this `output`: forget it."""

    def offer(self, request_id: int, length: int, drafts: Sequence[int]) -> None:
        """The last stage proposed `drafts` to follow a stream's first `length` tokens (prompt and output: the MTP
        layer's, `cascadia.engine.mtp`). Only a `StageDrafter` takes them."""


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


class NgramDrafter(Drafter):
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


class RecordedDrafter(Drafter):
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

    def offer(self, request_id: int, length: int, drafts: Sequence[int]) -> None:
        self.drafter.offer(request_id, length, drafts)


class ReplayDrafter(Drafter):
    """Proposes what a previous run's stream with the same prompt made next: when the run is the same, every draft
    is accepted (the ceiling of speculation)."""

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        self._outputs = {tuple(prompt): list(output) for prompt, output in outputs.items()}

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        recorded = self._outputs.get(tuple(prompt), [])
        return recorded[len(output):len(output) + limit]



class StageDrafter(Drafter):
    """The drafts the last stage proposed with a stream's latest tokens (its MTP layer's), while the stream stands
    where they follow."""

    def __init__(self) -> None:
        self._offered: dict[int, tuple[int, list[int]]] = {}  # by request id: (length, drafts)

    def offer(self, request_id: int, length: int, drafts: Sequence[int]) -> None:
        self._offered[request_id] = (length, list(drafts))

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        length, drafts = self._offered.get(request_id, (-1, []))
        return drafts[:limit] if length == len(prompt) + len(output) else []

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._offered.pop(request_id, None)


class FirstOf(Drafter):
    """The drafts of the first of several drafters that proposes some."""

    def __init__(self, *drafters: Drafter) -> None:
        self.drafters = drafters

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> Sequence[int]:
        for drafter in self.drafters:
            if drafts := drafter.propose(request_id, prompt, output, limit):
                return drafts
        return []

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(request_id, prompt, output)

    def offer(self, request_id: int, length: int, drafts: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.offer(request_id, length, drafts)


def drafter_of(drafters: Sequence[str]) -> Drafter:
    """The drafter a `speculate` setting names (`speculate_setting`): prompt lookup, the last stage's MTP drafts, or
    prompt lookup's where it finds some and the MTP layer's otherwise."""
    made = [NgramDrafter() if name == NGRAM else StageDrafter() for name in drafters]
    return made[0] if len(made) == 1 else FirstOf(*made)


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
