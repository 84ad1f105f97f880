"""The scheduling policy shared by `cascadia run` and `cascadia simulate`: admission, slots, groups, frames.

Pure and deterministic: no I/O, no clock, no tensors. The same three calls drive both backends (vLLM v1's seam,
adapted to a pipeline):

    events = policy.add_request(request)              # a client asks (at any time: admission is continuous)
    events = policy.add_choices(requests)             # ... for several choices of one prompt
    frame = policy.next_frame(group)                  # for every group with no frame in flight, after every change
    events = policy.complete_frame(frame, tokens)     # the last stage's sampled tokens came back, in row order
    events = policy.cancel(request_id)                # a client went away: its slot is free within one frame
    events = policy.replay()                          # a node was replaced: every stream's state is rebuilt

Scenario: `max_streams` slots each hold one stream's state (K/V, convolution states) on every node. A waiting request
takes the lowest free slot and joins the least-populated of `n_groups` pipeline groups (ties: lowest group). A group has
at most one frame in flight, because its next decode rows need the tokens its current frame samples. A frame carries
one decode row per decoding stream of the group plus at most `prefill_window` prompt rows of the group's streams still
being prefilled (oldest first), so admitting a long prompt delays the others' next token by one window, never by a
whole prompt. A stream's first token is sampled from the row of its last prompt position.

Choices of one prompt (`add_choices`: a client's `n`) are admitted together into one group, each with its slot. The
first computes the prompt; the others start as copies of its state before its last prompt row (a row that forks
it: the nodes share the prompt's K/V blocks, `cascadia.engine.engine.StageEngine.fork`), so that their rows of the
last position, each sampling its choice's first token, go in the frame with the first's. A replay rebuilds each
choice as a stream of its own.

Speculation (with a `Speculation`): while the pipeline has idle stages (fewer groups with streams than groups), a
frame's rows left free in the largest row bucket after its decode and prompt rows carry draft tokens, each draft row
right after its stream's decode row at the positions that follow, every one sampled. Drafts are accepted up to the
first whose token differs from the one sampled from the row before it: a draw depends only on the seed and the
stream's tokens, so each accepted token is the one the stream gets without speculation. The next frame's rows start
where the stream stands, and every stage rewinds to there (K/V are masked by position; convolution inputs and the
sampler's history are kept for the positions a rewind can drop). Such frames ask the last stage to propose drafts
(`Frame.propose`: drafters there, the MTP layer, spend time only when they will be used).

Memory by need: K/V live in blocks from a pool per node (`KVPool`): a stream holds a few for its sliding layers'
rings and, on a node with global layers, one per `kv_block` positions. Every node holds every stream, so a request
is admitted when a slot is free and every node's pool has the blocks for its prompt plus `max_new_tokens` (held until
it finishes, so that a stream never runs out mid-way), otherwise it waits, in arrival order. Requests whose prompt
plus `max_new_tokens` exceeds the context budget, or needs more blocks than some pool holds, are rejected with a
reason, never truncated: truncation would
silently change what the client asked for. A stream finishes after `max_new_tokens` tokens, or
earlier when it samples one of its request's `stop_ids` (EOS, when the workload says `stop_at_eos`).
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import attrs

from cascadia.sampling import Sampling
from cascadia.spec.types import RuntimeSpec
from cascadia.speculation import Drafter, Speculation, drafter_of

GREEDY = Sampling()

PREFILL, DECODE, DRAFT = "prefill", "decode", "draft"
LENGTH, STOP, CANCELLED = "length", "stop", "cancelled"  # why a stream finished


@attrs.frozen
class Request:
    id: int
    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    max_new_tokens: int
    stop_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    sampling: Sampling = GREEDY  # how its tokens are drawn (the last stage samples each row by its own)


# Rows and tokens, made by the hundred thousand in a simulation, are named tuples: as immutable, hashable and compared
# by value as a frozen attrs class, and made in two thirds of its time (a slotted frozen one sets each field with a
# call of object.__setattr__, a dict class fills a __dict__).
class Row(NamedTuple):
    """One position of one stream in a frame: what the first stage embeds and where the nodes write its state."""

    slot: int
    request_id: int
    position: int
    kind: str  # PREFILL, DECODE or DRAFT
    token: int  # the prompt token, the stream's last sampled token, or a draft token
    sampled: bool  # the last stage samples a token from this row's logits
    sampling: Sampling = GREEDY  # its stream's
    fork: int = -1  # the slot whose stream this row's starts as a copy of, as that stands (its first row); -1: none


# Frames keep their fields in a __dict__ (attrs fills it directly, where a slotted frozen class calls
# object.__setattr__ per field), so that their sampled ids are a plain entry made with them.
@attrs.frozen(slots=False)
class Frame:
    seq: int  # serial number over the policy's life
    group: int
    rows: tuple[Row, ...]  # decode rows (by admission order), each followed by its stream's drafts, then prompt rows
    padded_rows: int  # the row bucket the engine runs; rows beyond len(rows) are padding
    drafted: bool = False  # some rows are drafts
    # the last stage proposes drafts after the sampled rows' tokens (its MTP layer runs their rows now, for the next
    # frame's drafts; otherwise it holds them to run later): set while the pipeline has idle stages
    propose: bool = False
    # the request ids of the sampled rows, in order (a speculating stream's once per row): made with the frame, as
    # the backend, the policy and the simulator's costs all read them
    sampled_ids: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    @sampled_ids.default
    def _sampled_ids(self) -> tuple[int, ...]:
        return tuple([row.request_id for row in self.rows if row.sampled])  # a list first: quicker than a generator


# ---- events: what changed, in order; the backends timestamp them ------------------------------------------------
@attrs.frozen
class Rejected:
    request_id: int
    reason: str


@attrs.frozen
class Admitted:
    request_id: int
    slot: int  # the nodes reset this slot's state before its first row (position 0)
    group: int


class Token(NamedTuple):  # as Row
    request_id: int
    token: int
    index: int  # 0 = the first token


# How the policy makes its rows and tokens, one per row and one per token: tuple.__new__ of a tuple of all the fields
# makes the same named tuple without calling the class's Python-level __new__ (which takes a third of the time).
_row = functools.partial(tuple.__new__, Row)
_token = functools.partial(tuple.__new__, Token)


@attrs.frozen
class Verified:
    """A stream's drafts in a frame: how many it proposed, and how many of them gave it their token."""

    request_id: int
    proposed: int
    accepted: int


@attrs.frozen
class Finished:
    request_id: int
    slot: int | None  # released: free for the next waiting request (None: cancelled while still waiting)
    reason: str  # LENGTH, STOP or CANCELLED
    output_tokens: int


Event = Rejected | Admitted | Token | Verified | Finished


def padded_size(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `rows`; beyond the largest bucket, the next multiple of it."""
    i = bisect.bisect_left(buckets, rows)
    if i < len(buckets):
        return buckets[i]
    return -(-rows // buckets[-1]) * buckets[-1]


def score_schedule(n: int, prefill: int | None, chunk: int) -> list[tuple[int, int]]:
    """The calls that teacher-force a stream of `n` tokens, as (start, end) positions: the first `prefill` tokens
    (None: all) in chunks of at most `chunk` rows, then one row at a time, as decoding feeds them. One schedule
    for the single-process engine and the pipeline, so that both score alike, bit for bit."""
    prefill = n if prefill is None else prefill
    if not 0 < prefill <= n:
        raise ValueError(f"prefill must lie in 1..{n}, got {prefill}")
    starts = [*range(0, prefill, chunk), *range(prefill, n)]
    return list(zip(starts, [*starts[1:], n]))


@attrs.define
class _Stream:
    request: Request
    slot: int
    group: int
    prompt_len: int
    prefilled: int = 0  # rows of its tokens (the prompt; in a replay, its output too) already put in a frame
    output: list[int] = attrs.Factory(list)
    replaying: bool = False  # its state is being rebuilt (`Policy.replay`): no decode row until that is done
    # choices of its prompt that fork it before its last prompt row, until they do; and, for such a choice, that one
    choices: list[_Stream] = attrs.Factory(list)
    source: _Stream | None = attrs.field(default=None, eq=False, repr=False)

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Its tokens at positions start..end - 1: its prompt's, then (in a replay) its output's."""
        prompt = self.request.prompt_ids
        return prompt[start:end] if end <= self.prompt_len else (*prompt, *self.output)[start:end]


@attrs.frozen
class KVPool:
    """A node's K/V pool as admission counts it: `blocks` in all, of which a stream holds `ring_blocks` for its
    sliding layers' rings and, where `paged` (the node has global layers), one per `kv_block` positions."""

    blocks: int
    ring_blocks: int = 0
    paged: bool = True

    def stream_blocks(self, positions: int, kv_block: int) -> int:
        return stream_blocks(positions, kv_block, self.ring_blocks, self.paged)


def stream_blocks(positions: int, kv_block: int, ring_blocks: int, paged: bool) -> int:
    """Blocks a stream of `positions` positions holds in a node's pool: its rings', and where the node has global
    layers (`paged`) one per `kv_block` positions. The one rule the planner, the engine and admission share."""
    return ring_blocks + (-(-positions // kv_block) if paged else 0)


class Policy:
    def __init__(self, n_groups: int, max_streams: int, prefill_window: int, row_buckets: tuple[int, ...],
                 context_budget: int, kv_pools: Sequence[KVPool] | None = None, kv_block: int = 64,
                 speculation: Speculation | None = None) -> None:
        """`kv_pools`: every node's (None: one with enough for every slot at the context budget, so that blocks
        never bound admission)."""
        for name, value in (("n_groups", n_groups), ("max_streams", max_streams), ("prefill_window", prefill_window),
                            ("context_budget", context_budget), ("kv_block", kv_block)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if kv_pools is None:
            kv_pools = (KVPool(max_streams * -(-context_budget // kv_block)),)
        if any(pool.blocks < 1 for pool in kv_pools):
            raise ValueError(f"every K/V pool needs at least one block, got {kv_pools}")
        if not row_buckets or list(row_buckets) != sorted(set(row_buckets)) or row_buckets[0] < 1:
            raise ValueError(f"row_buckets must be increasing positive sizes, got {row_buckets}")
        self.n_groups, self.max_streams, self.prefill_window = n_groups, max_streams, prefill_window
        self.row_buckets, self.context_budget = tuple(row_buckets), context_budget
        self.kv_pools, self.kv_block = tuple(kv_pools), kv_block
        self.held_blocks = [0] * len(self.kv_pools)  # by pool, what the admitted streams hold
        self.speculation = speculation
        self._waiting: deque[tuple[Request, ...]] = deque()  # the choices of one prompt together
        self._free_slots = list(range(max_streams))  # a heap: the lowest free slot goes first
        self._groups: list[list[_Stream]] = [[] for _ in range(n_groups)]  # streams by admission order
        self._prefilling: list[deque[_Stream]] = [deque() for _ in range(n_groups)]  # with prompt rows still to send
        self._streams: dict[int, _Stream] = {}  # by request id
        self._in_flight: dict[int, Frame] = {}  # by group
        self._seen: set[int] = set()
        # streams cancelled while a frame in flight holds their rows: released when that frame completes
        self._cancelling: set[int] = set()
        self._seq = 0

    @classmethod
    def for_runtime(cls, runtime: RuntimeSpec, stages: int, kv_pools: Sequence[KVPool] | None = None,
                    drafter: Drafter | None = None) -> Policy:
        """The policy `runtime` says on a plan of `stages` stages. `kv_pools`: the nodes' (`Plan.kv_pools`); with
        `runtime.speculate`, drafts from `drafter` (default: those it names, `drafter_of`)."""
        speculation = Speculation(drafter or drafter_of(runtime.drafters), runtime.max_draft) \
            if runtime.max_draft else None
        return cls(runtime.groups(stages), runtime.max_streams, runtime.prefill_window, runtime.row_buckets,
                   runtime.context_budget, kv_pools, runtime.kv_block, speculation)

    # ---- state ------------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No frame in flight."""
        return not self._in_flight

    @property
    def done(self) -> bool:
        """Every request added so far has finished or was rejected."""
        return not self._waiting and not self._streams

    @property
    def in_flight(self) -> tuple[Frame, ...]:
        return tuple(self._in_flight[g] for g in sorted(self._in_flight))

    @property
    def waiting(self) -> int:
        return sum(map(len, self._waiting))

    @property
    def active(self) -> int:
        """Streams holding a slot."""
        return len(self._streams)

    # ---- the three calls ----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> list[Event]:
        return self.add_choices([request])

    def add_choices(self, requests: Sequence[Request]) -> list[Event]:
        """Requests for choices of one prompt: the same prompt, `max_new_tokens` and sampling, each with a seed of
        its own. Admitted together, or rejected together."""
        first = requests[0]
        if first.id in self._seen:
            raise ValueError(f"request {first.id} was already added")
        if not first.prompt_ids:
            raise ValueError(f"request {first.id} has an empty prompt")
        if first.max_new_tokens < 1:
            raise ValueError(f"request {first.id}: max_new_tokens must be at least 1, got {first.max_new_tokens}")
        for i, request in enumerate(requests[1:], 1):
            if request.id in self._seen or any(r.id == request.id for r in requests[:i]):
                raise ValueError(f"request {request.id} was already added")
            if (request.prompt_ids, request.max_new_tokens, attrs.evolve(request.sampling, seed=0)) != \
                    (first.prompt_ids, first.max_new_tokens, attrs.evolve(first.sampling, seed=0)):
                raise ValueError(f"request {request.id} is not a choice of request {first.id}'s prompt: its prompt, "
                                 "max_new_tokens or sampling (but for the seed) differ")
        if len(requests) > self.max_streams:
            raise ValueError(f"{len(requests)} choices of one prompt need as many slots, more than max_streams "
                             f"({self.max_streams})")
        self._seen.update(request.id for request in requests)
        needed = len(first.prompt_ids) + first.max_new_tokens
        if needed > self.context_budget:
            return [Rejected(request.id, f"prompt ({len(first.prompt_ids)} tokens) + max_new_tokens "
                                         f"({first.max_new_tokens}) = {needed} exceeds the context budget "
                                         f"of {self.context_budget} positions") for request in requests]
        if (too_big := self._too_big(requests)) is not None:
            return too_big
        self._waiting.append(tuple(requests))
        return self._admit()

    def next_frame(self, group: int) -> Frame | None:
        """The group's next frame, now in flight; None while it has a frame in flight or nothing to compute."""
        if not 0 <= group < self.n_groups:
            raise ValueError(f"group {group} is not in 0..{self.n_groups - 1}")
        if group in self._in_flight:
            return None
        rows = [_row((s.slot, s.request.id, s.prompt_len + len(s.output) - 1, DECODE, s.output[-1], True,
                      s.request.sampling, -1)) for s in self._groups[group] if s.output and not s.replaying]
        decoding = len(rows)  # the decode rows come first, one per decoding stream
        window, prefilling = self.prefill_window, self._prefilling[group]
        while window and prefilling:
            s = prefilling[0]
            target = s.prompt_len + len(s.output)  # the next token is sampled from the row of its last position
            end = min(target, s.prefilled + window)
            if s.choices and end == target and s.prefilled < target - 1:
                end = target - 1  # its choices fork it as it stands before its last row: that goes in the next frame
            rows += [_row((s.slot, s.request.id, pos, PREFILL, token, pos == target - 1, s.request.sampling, -1))
                     for pos, token in zip(range(s.prefilled, end), s.tokens(s.prefilled, end))]
            window -= end - s.prefilled
            s.prefilled = end
            if end < target:
                break
            prefilling.popleft()
            s.replaying = False
            if s.choices:
                rows += self._forks(s, target)
                window = max(0, window - len(s.choices))
                s.choices = []
        if not rows:
            return None
        drafted = False
        speculating = self.speculation is not None and sum(map(bool, self._groups)) < self.n_groups
        if speculating and decoding:
            undrafted = len(rows)
            rows = self._with_drafts(rows, decoding)
            drafted = len(rows) > undrafted
        frame = Frame(self._seq, group, tuple(rows), padded_size(len(rows), self.row_buckets), drafted, speculating)
        self._seq += 1
        self._in_flight[group] = frame
        return frame

    def next_frames(self) -> list[Frame]:
        """`next_frame` of every group without a frame in flight, in group order, where it has rows to compute."""
        return [frame for group in range(self.n_groups)
                if group not in self._in_flight and self._groups[group]  # a group without streams has no rows
                and (frame := self.next_frame(group)) is not None]

    def complete_frame(self, frame: Frame, tokens: Sequence[int],
                       proposed: Mapping[int, tuple[int, Sequence[int]]] | None = None) -> list[Event]:
        """Take the tokens sampled from a frame's sampled rows, in row order; accept drafts up to the first that
        differs from the token sampled before it; finish streams, admit waiting ones. `proposed`: drafts the last
        stage proposed with these tokens, by request id (the length of the stream's tokens they follow, and
        themselves), for the drafter (`Drafter.offer`)."""
        in_flight = self._in_flight.get(frame.group)
        if in_flight is not frame and in_flight != frame:  # the same frame, as a rule: no need to compare its rows
            raise ValueError(f"frame {frame.seq} of group {frame.group} is not in flight")
        if isinstance(tokens, dict):  # the interface before speculation: its keys would pass for tokens
            raise TypeError(f"frame {frame.seq}: complete_frame takes the sampled rows' tokens in row order (a "
                            f"sequence), not {{request id: token}}")
        if len(tokens) != len(frame.sampled_ids):
            raise ValueError(f"frame {frame.seq} samples {len(frame.sampled_ids)} rows, got {len(tokens)} tokens")
        del self._in_flight[frame.group]
        if proposed and self.speculation is not None:
            for request_id, (length, drafts) in proposed.items():
                self.speculation.drafter.offer(request_id, length, drafts)
        events: list[Event] = []
        if not frame.drafted:  # a token per stream: as a rule, and the simulator's every frame, so kept short
            cancelling, streams = self._cancelling, self._streams
            for request_id, token in zip(frame.sampled_ids, tokens):
                if request_id not in cancelling:
                    stream = streams[request_id]
                    if finished := self._take(stream, token, events):
                        events.append(self._release(stream, finished))
        else:
            for request_id, drafts, sampled in _by_stream(frame, tokens):
                if request_id in self._cancelling:
                    continue
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
                    accepted += 1
                self._verify(self._streams[request_id], sampled[:accepted + 1], len(drafts), events)
        if self._cancelling:
            cancelled = sorted({row.request_id for row in frame.rows if row.request_id in self._cancelling})
            events += [self._release(self._streams[request_id], CANCELLED) for request_id in cancelled]
        if self._waiting:  # what _admit checks first, without its call for every frame
            events += self._admit()
        return events

    def cancel(self, request_id: int) -> list[Event]:
        """Stop a request: a waiting one leaves the queue; a stream gives its slot back now, or, when a frame in
        flight holds its rows, as soon as that frame completes (the nodes are still writing its state), its token
        from that frame dropped. Nothing for a request that already finished, was rejected or was cancelled."""
        for i, choices in enumerate(self._waiting):
            if any(request.id == request_id for request in choices):
                self._waiting[i] = tuple(request for request in choices if request.id != request_id)
                if not self._waiting[i]:
                    del self._waiting[i]
                return [Finished(request_id, None, CANCELLED, 0)]
        stream = self._streams.get(request_id)
        if stream is None or request_id in self._cancelling:
            return []
        in_flight = self._in_flight.get(stream.group)
        if in_flight is not None and any(row.request_id == request_id for row in in_flight.rows):
            self._cancelling.add(request_id)
            return []
        return [self._release(stream, CANCELLED)] + self._admit()

    def fits(self, kv_pools: Sequence[KVPool]) -> bool:
        """Whether the streams admitted so far fit `kv_pools` (a new plan's)."""
        return all(held <= pool.blocks for pool, held in zip(kv_pools, self._holdings(kv_pools)))

    def replay(self, kv_pools: Sequence[KVPool] | None = None) -> list[Event]:
        """The nodes lost the streams' state (a node was replaced): forget the frames in flight, and rebuild every
        stream by prefilling its prompt and the tokens it has made so far again, in windows as any prompt, before it
        decodes on. A draw depends only on its stream's seed and tokens, so the tokens that follow are those a run
        without the loss makes. Streams cancelled with rows in flight are released now. With `kv_pools` the nodes
        have those pools from now on (a new plan's, which `fits` the streams): waiting requests that never can fit
        them are rejected."""
        self._in_flight.clear()
        events: list[Event] = [self._release(self._streams[r], CANCELLED) for r in sorted(self._cancelling)]
        if kv_pools is not None:
            if not self.fits(kv_pools):
                raise ValueError(f"the streams hold {self._holdings(kv_pools)} K/V blocks, more than the pools' "
                                 f"{[pool.blocks for pool in kv_pools]}")
            self.kv_pools, self.held_blocks = tuple(kv_pools), self._holdings(kv_pools)
            for choices in list(self._waiting):
                if (too_big := self._too_big(choices)) is not None:
                    self._waiting.remove(choices)
                    events += too_big
        for group, streams in enumerate(self._groups):
            for stream in streams:
                stream.prefilled, stream.replaying = 0, bool(stream.output)
            self._prefilling[group] = deque(s for s in streams if s.source is None)  # the others fork theirs
        return events + self._admit()

    # ---- internals ----------------------------------------------------------------------------------------------
    def _too_big(self, choices: Sequence[Request]) -> list[Rejected] | None:
        """The rejections of the choices of a prompt more than some node's whole pool can hold (each is counted
        whole: a choice outlives the one it shares its prompt's blocks with, if that finishes first); None if every
        pool can."""
        request = choices[0]
        needed = len(request.prompt_ids) + request.max_new_tokens
        for pool, blocks in zip(self.kv_pools, self._blocks(request)):
            if len(choices) * blocks > pool.blocks:
                rings = f" (with {pool.ring_blocks} for its rings)" if pool.ring_blocks else ""
                room = f" ({(pool.blocks - pool.ring_blocks) * self.kv_block} positions)" if pool.paged else ""
                each = f" each, {len(choices)} choices" if len(choices) > 1 else ""
                reason = (f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = "
                          f"{needed} positions need {blocks} K/V blocks of {self.kv_block}{rings}{each}, more than "
                          f"a node's pool of {pool.blocks}{room}")
                return [Rejected(choice.id, reason) for choice in choices]
        return None

    def _blocks(self, request: Request, kv_pools: Sequence[KVPool] | None = None) -> list[int]:
        """K/V blocks a request holds in each pool from admission to its end: its rings', and its prompt's and
        every token's it may make."""
        positions = len(request.prompt_ids) + request.max_new_tokens
        return [pool.stream_blocks(positions, self.kv_block)
                for pool in (self.kv_pools if kv_pools is None else kv_pools)]

    def _holdings(self, kv_pools: Sequence[KVPool]) -> list[int]:
        """What the admitted streams would hold in each of `kv_pools`."""
        held = [0] * len(kv_pools)
        for stream in self._streams.values():
            held = [h + b for h, b in zip(held, self._blocks(stream.request, kv_pools))]
        return held

    def _has_room(self, choices: Sequence[Request]) -> bool:
        return all(h + len(choices) * b <= pool.blocks
                   for pool, h, b in zip(self.kv_pools, self.held_blocks, self._blocks(choices[0])))

    def _take(self, stream: _Stream, token: int, events: list[Event]) -> str | None:
        """A stream's next token, its event added to `events`; why the stream is finished with it (None: it is not).
        Called once per token, so it makes nothing but the event."""
        request, output = stream.request, stream.output
        index = len(output)
        output.append(token)
        events.append(_token((request.id, token, index)))
        if token in request.stop_ids:
            return STOP
        return LENGTH if index + 1 == request.max_new_tokens else None

    def _verify(self, stream: _Stream, tokens: Sequence[int], proposed: int, events: list[Event]) -> None:
        """A speculating stream's accepted tokens, cut after a stop id or its last token as without speculation."""
        for kept, token in enumerate(tokens):  # `kept`: drafts whose token the stream kept
            if finished := self._take(stream, token, events):
                break
        if proposed:  # a stream without drafts in a frame with others' has nothing verified
            events.append(Verified(stream.request.id, proposed, kept))
            self.speculation.verified(stream.request.id, proposed, kept)
        if finished:
            events.append(self._release(stream, finished))

    def _with_drafts(self, rows: list[Row], decoding: int) -> list[Row]:
        """The `decoding` decode rows each followed by their stream's drafts, in the rows left free in the largest
        bucket (in admission order), then the prompt rows."""
        room = self.row_buckets[-1] - len(rows)
        if room <= 0:
            return rows
        with_drafts = []
        for row in rows[:decoding]:
            with_drafts.append(row)
            stream = self._streams[row.request_id]
            left = stream.request.max_new_tokens - len(stream.output) - 1  # tokens after this row's
            drafts = self.speculation.drafts(stream.request.id, stream.request.prompt_ids, stream.output,
                                             min(room, left))
            with_drafts += [_row((row.slot, row.request_id, row.position + 1 + i, DRAFT, token, True, row.sampling,
                                  -1)) for i, token in enumerate(drafts)]
            room -= len(drafts)
        return with_drafts + rows[decoding:]

    def _admit(self) -> list[Event]:
        events: list[Event] = []
        while self._waiting and len(self._free_slots) >= len(self._waiting[0]) and self._has_room(self._waiting[0]):
            choices = self._waiting.popleft()
            group = min(range(self.n_groups), key=lambda g: (len(self._groups[g]), g))
            source = None
            for request in choices:
                self.held_blocks = [h + b for h, b in zip(self.held_blocks, self._blocks(request))]
                slot = heapq.heappop(self._free_slots)
                stream = _Stream(request, slot, group, len(request.prompt_ids), source=source)
                self._groups[group].append(stream)
                if source is None:
                    self._prefilling[group].append(stream)
                    source = stream
                else:
                    source.choices.append(stream)
                self._streams[request.id] = stream
                events.append(Admitted(request.id, slot, group))
        return events

    def _forks(self, source: _Stream, target: int) -> list[Row]:
        """The rows of the last prompt position of `source`'s choices, each starting its stream as a copy of
        `source`'s before that row (none to copy for a one-token prompt)."""
        rows = []
        for choice in source.choices:
            rows.append(_row((choice.slot, choice.request.id, target - 1, PREFILL, choice.request.prompt_ids[-1], True,
                              choice.request.sampling, source.slot if target > 1 else -1)))
            choice.prefilled, choice.source = target, None
        return rows

    def _release(self, stream: _Stream, reason: str) -> Finished:
        self._groups[stream.group].remove(stream)
        if stream in self._prefilling[stream.group]:  # cancelled before its prompt was all sent
            self._prefilling[stream.group].remove(stream)
        if stream.source is not None:  # a choice cancelled before it forked
            stream.source.choices.remove(stream)
        for choice in stream.choices:  # ... and those of a stream cancelled before they forked it: on their own
            choice.source = None
            self._prefilling[stream.group].append(choice)
        stream.choices = []
        del self._streams[stream.request.id]
        self._cancelling.discard(stream.request.id)
        if self.speculation is not None:
            self.speculation.finished(stream.request.id, stream.request.prompt_ids, stream.output)
        heapq.heappush(self._free_slots, stream.slot)
        self.held_blocks = [h - b for h, b in zip(self.held_blocks, self._blocks(stream.request))]
        return Finished(stream.request.id, stream.slot, reason, len(stream.output))


def _by_stream(frame: Frame, tokens: Sequence[int]) -> Iterator[tuple[int, list[int], list[int]]]:
    """(request id, its drafts, the tokens sampled from its rows) per stream with sampled rows in the frame."""
    streams: dict[int, tuple[list[int], list[int]]] = {}
    for row, token in zip((row for row in frame.rows if row.sampled), tokens):
        drafts, sampled = streams.setdefault(row.request_id, ([], []))
        if row.kind == DRAFT:
            drafts.append(row.token)
        sampled.append(token)
    for request_id, (drafts, sampled) in streams.items():
        yield request_id, drafts, sampled
