"""Concrete requests from a WorkloadSpec, shared by `cascadia run` and `cascadia simulate` so both serve the same ones.

Each level runs two phases back to back, as the paper measured: a warm-up phase, then a measured phase, each of
`requests` requests. A phase starts on an empty pipeline (the previous phase has fully drained), so its first-token
latencies include the ramp-up of admission. Both phases are recorded; level summaries describe the measured phase
only, so the real run's first-use effects (allocation, caches) stay out of them.

A level is closed- or open-loop, and its `Arrivals` say when its requests are sent, for both backends alike:
- closed loop (`ClosedLoop`, a `concurrency` level): c clients each send a request and the next one as soon as theirs
  is done (finished or rejected), until the phase's requests are all sent; `requests` defaults to c;
- open loop (`OpenLoop`, a `rate` level): requests arrive at seeded Poisson times, `rate` per second on average,
  whatever the server is doing, as users of a server do; `requests` defaults to ten seconds' worth (at least 16).

Prompts come from the workload's JSONL file (one {"ids": [...]} object per line, or {"text": "..."} with a tokenizer),
taken in order and cycled over the whole workload; otherwise from seeded random token ids. Prompt lengths are drawn
per (seed, level, phase), so adding a level does not change the others.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np

from cascadia.errors import CascadiaError, RequestError
from cascadia.files import UnreadableFile, read_text
from cascadia.models.base import ModelConfig
from cascadia.policy import Request
from cascadia.sampling import Sampling
from cascadia.spec.types import LengthSpec, RuntimeSpec, SloSpec, WorkloadSpec

WARMUP, MEASURED = "warmup", "measured"
PHASES = (WARMUP, MEASURED)
MAX_PROMPTS_FILE_BYTES = 256 * 1024**2  # read whole: a million prompts of 256 bytes


OPEN_LOOP_SECONDS = 10  # an open-loop phase's default length, in seconds of arrivals
OPEN_LOOP_LEAST = 16  # ... and its fewest requests


@attrs.frozen
class Phase:
    name: str
    requests: tuple[tuple[Request, ...], ...]  # each client request's streams: its choices of one prompt
    seed: int  # of its arrival times (open loop)

    @property
    def streams(self) -> int:
        return sum(map(len, self.requests))


@attrs.frozen
class Level:
    """`concurrency` closed-loop clients, or (`rate` set) open-loop arrivals at `rate` requests per second."""

    concurrency: int | None
    rate: float | None
    phases: tuple[Phase, ...]

    @property
    def describe(self) -> str:
        """"concurrency 4" or "rate 2.5/s": for progress and messages."""
        return f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"

    def arrivals(self, phase: Phase) -> Arrivals:
        if self.rate is None:
            return ClosedLoop(phase.requests, self.concurrency)
        return OpenLoop(phase.requests, self.rate, phase.seed)


def load_prompts(path: str | Path, tokenize: Callable[[str], Sequence[int]] | None = None,
                 vocab_size: int | None = None) -> list[tuple[int, ...]]:
    """Prompt token ids from a JSONL file; {"text": ...} lines need `tokenize`; every id must lie in 0..`vocab_size`
    - 1 (when given)."""
    prompts = []
    try:
        lines = read_text(path, MAX_PROMPTS_FILE_BYTES, "a prompts file").splitlines()
    except UnreadableFile as e:
        raise RequestError(f"{path}: cannot read prompts: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg})") from None
        if isinstance(item, dict) and "ids" in item and "text" in item:
            raise RequestError(f"{where}: give 'ids' or 'text', not both")
        if isinstance(item, dict) and "ids" in item:
            ids = item["ids"]
            if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
                raise RequestError(f"{where}: 'ids' must be a non-empty list of non-negative integers")
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            if tokenize is None:
                raise RequestError(f"{where}: a 'text' prompt needs a tokenizer; give token ids as {{\"ids\": [...]}}")
            try:
                ids = list(tokenize(item["text"]))
            except CascadiaError as e:
                raise RequestError(f"{where}: {e}") from None
            if not ids:
                raise RequestError(f"{where}: the text has no tokens")
        else:
            raise RequestError(f"{where}: expected an object with 'ids' (a list of token ids) or 'text'")
        if vocab_size is not None and (beyond := max(ids)) >= vocab_size:
            raise RequestError(f"{where}: token id {beyond} lies outside the model's vocabulary (0..{vocab_size - 1})")
        prompts.append(tuple(ids))
    if not prompts:
        raise RequestError(f"{path}: no prompts")
    return prompts


def describe(workload: WorkloadSpec) -> str:
    """What a table of levels measured, for the line above it: the loop and its levels, the requests a phase (the
    default said as such), prompts and outputs, how tokens are drawn."""
    if workload.rate:
        loop = f"open loop at {', '.join(f'{r:g}' for r in workload.rate)} requests/s (Poisson arrivals)"
        default = f"{OPEN_LOOP_SECONDS} s of measured arrivals, at least {OPEN_LOOP_LEAST} requests (the default)"
    else:
        clients = "clients" if workload.choices > 1 else "streams"
        loop = f"closed loop at {', '.join(map(str, workload.concurrency))} {clients}"
        default = "as many measured requests as it has streams (the default)"
    count = f"{workload.requests} measured requests" if workload.requests else default
    length = workload.prompt_tokens
    prompts = (f"prompts from {workload.prompts_file}" if workload.prompts_file else
               f"prompts of {length.low} tokens" if length.low == length.high else
               f"prompts of {length.low}-{length.high} tokens (uniform)")
    outputs = f"{'up to ' if workload.stop_at_eos else ''}{workload.output_tokens} tokens out each" + \
        (f" of {workload.choices} choices of its prompt (computed once)" if workload.choices > 1 else "")
    limits = (f", top-k {workload.top_k}" if workload.top_k else "") + \
        (f", min-p {workload.min_p:g}" if workload.min_p else "")
    drawn = "greedy" if workload.greedy else \
        f"sampled at temperature {workload.temperature:g}, top-p {workload.top_p:g}{limits}"
    return f"{loop}; each level a warm-up, then {count}; {prompts}, {outputs}, {drawn}"


def build_levels(workload: WorkloadSpec, vocab_size: int, prompts: Sequence[tuple[int, ...]] | None = None,
                 stop_ids: frozenset[int] = frozenset()) -> tuple[Level, ...]:
    """The requests of every level and phase, with ids unique over the whole workload: each a client's, its
    `workload.choices` streams of one prompt (choice c drawn with the workload's seed + c).

    `prompts` (e.g. from `load_prompts(workload.prompts_file)`) replaces random prompts; `stop_ids` (EOS) makes
    requests stop early when sampled.
    """
    levels, made, sampling = [], 0, Sampling.of(workload)  # made: client requests so far
    loads = [(None, rate) for rate in workload.rate] or [(concurrency, None) for concurrency in workload.concurrency]
    for concurrency, rate in loads:
        if rate is None:
            n_requests, key = workload.requests or concurrency, (concurrency,)
        else:
            n_requests = workload.requests or max(OPEN_LOOP_LEAST, math.ceil(OPEN_LOOP_SECONDS * rate))
            key = (1, round(rate * 1e6))  # two numbers: never a closed-loop level's seed
        phases = []
        for phase_index, name in enumerate(PHASES):
            rng = np.random.default_rng((workload.seed, *key, phase_index))
            requests = []
            for _ in range(n_requests):
                if prompts:
                    prompt = prompts[made % len(prompts)]
                else:
                    length = int(rng.integers(workload.prompt_tokens.low, workload.prompt_tokens.high + 1))
                    prompt = tuple(rng.integers(0, vocab_size, length).tolist())
                requests.append(tuple(Request(made * workload.choices + c, prompt, workload.output_tokens,
                                              stop_ids, attrs.evolve(sampling, seed=sampling.seed + c))
                                      for c in range(workload.choices)))
                made += 1
            phases.append(Phase(name, tuple(requests), int(rng.integers(2**31))))
        levels.append(Level(concurrency, rate, tuple(phases)))
    return tuple(levels)


Choices = tuple[Request, ...]  # a client's request: the streams of its choices of one prompt (one, as a rule)


class Arrivals(Protocol):
    """When a phase's requests are sent: at the start, as earlier ones are done, or at their own times."""

    def start(self, now: float) -> list[Choices]:
        """The requests sent when the phase starts at `now`."""

    def done(self, request_id: int) -> list[Choices]:
        """Called once per finished or rejected stream: the requests sent because of it."""

    def due(self, now: float) -> list[Choices]:
        """The requests whose time has come by `now`."""

    @property
    def next_time(self) -> float | None:
        """When the next request is due by the clock; None when none waits for a time."""


class ClosedLoop:
    """`clients` clients sending a phase's requests: all start at once; a request done (every stream of its choices)
    lets its client send the next."""

    next_time = None

    def __init__(self, requests: Sequence[Choices], clients: int) -> None:
        self._requests = list(requests)
        self._clients = clients
        self._sent = 0
        self._open = {request.id: choices for choices in requests for request in choices}  # streams not yet done

    def start(self, now: float) -> list[Choices]:
        first = self._requests[:self._clients]
        self._sent = len(first)
        return first

    def done(self, request_id: int) -> list[Choices]:
        choices = self._open.pop(request_id)
        if any(request.id in self._open for request in choices) or self._sent == len(self._requests):
            return []
        self._sent += 1
        return [self._requests[self._sent - 1]]

    def due(self, now: float) -> list[Choices]:
        return []


class OpenLoop:
    """A phase's requests arriving at Poisson times, `rate` per second on average (exponential gaps drawn with
    `seed`), the first at the start, whatever the server does."""

    def __init__(self, requests: Sequence[Choices], rate: float, seed: int) -> None:
        self._requests = list(requests)
        gaps = np.random.default_rng(seed).exponential(1 / rate, len(self._requests))
        gaps[0] = 0.0
        self._offsets = np.cumsum(gaps).tolist()
        self._start = 0.0
        self._sent = 0

    def start(self, now: float) -> list[Choices]:
        self._start = now
        return self.due(now)

    def done(self, request_id: int) -> list[Choices]:
        return []

    def due(self, now: float) -> list[Choices]:
        first = self._sent
        while self._sent < len(self._requests) and self._start + self._offsets[self._sent] <= now:
            self._sent += 1
        return self._requests[first:self._sent]

    @property
    def next_time(self) -> float | None:
        return self._start + self._offsets[self._sent] if self._sent < len(self._requests) else None


def stop_ids(workload: WorkloadSpec, config: ModelConfig) -> frozenset[int]:
    """The tokens that end a request early: the model's EOS ids when the workload says `stop_at_eos`, else none (a
    benchmark's requests keep their lengths)."""
    return config.eos_ids if workload.stop_at_eos else frozenset()


def misfits(workload: WorkloadSpec, runtime: RuntimeSpec) -> list[tuple[str, str]]:
    """(workload key, message) for what does not fit the stream slots and context budget the runtime sizes its state
    for. Prompts from a file are checked one by one when admitted (too long: rejected)."""
    problems = []
    streams = max(workload.concurrency) * workload.choices
    if not workload.rate and streams > runtime.max_streams:
        clients = f"{max(workload.concurrency)} clients x {workload.choices} choices = " if workload.choices > 1 else ""
        problems.append(("choices" if workload.choices > 1 else "concurrency",
                         f"{clients}{streams} streams exceed runtime.max_streams ({runtime.max_streams})"))
    elif workload.choices > runtime.max_streams:
        problems.append(("choices", f"{workload.choices} streams of one prompt exceed runtime.max_streams "
                                    f"({runtime.max_streams})"))
    longest = workload.prompt_tokens.high + workload.output_tokens
    if workload.prompts_file is None and longest > runtime.context_budget:
        problems.append(("output_tokens", f"prompt ({workload.prompt_tokens.high}) + output ({workload.output_tokens}) "
                                          f"tokens exceed runtime.context_budget ({runtime.context_budget})"))
    return problems


def prompt_length_notes(prompts: Sequence[tuple[int, ...]], workload: WorkloadSpec, runtime: RuntimeSpec) -> list[str]:
    """A note on the prompts whose requests the policy will reject, as longer than the context budget allows with
    their output tokens (none when all fit); RequestError when none fits, so that nothing would run."""
    budget, output = runtime.context_budget, workload.output_tokens
    too_long = sum(len(prompt) + output > budget for prompt in prompts)
    if not too_long:
        return []
    source = workload.prompts_file or "the prompts"
    why = f"prompt + output ({output}) tokens exceed runtime.context_budget ({budget})"
    if too_long == len(prompts):
        raise RequestError(f"{source}: none of its {len(prompts)} prompts fits: {why} (the shortest has "
                           f"{min(map(len, prompts))} tokens)")
    return [f"{source}: {too_long} of its {len(prompts)} prompts are rejected: {why}"]


def override(workload: WorkloadSpec, concurrency: tuple[int, ...] | None = None, requests: int | None = None,
             output_tokens: int | None = None, prompt_tokens: int | None = None,
             rate: tuple[float, ...] | None = None, slo: SloSpec | None = None) -> WorkloadSpec:
    """The workload with the command line's choices in place of the spec's (None keeps the spec's); a prompt length
    replaces the spec's prompts file too, closed-loop levels the spec's rates and open-loop rates its levels."""
    changes = {"concurrency": concurrency, "requests": requests, "output_tokens": output_tokens, "rate": rate,
               "slo": slo}
    if concurrency is not None and rate is None:
        changes["rate"] = ()
    workload = attrs.evolve(workload, **{k: v for k, v in changes.items() if v is not None})
    if prompt_tokens is None:
        return workload
    return attrs.evolve(workload, prompt_tokens=LengthSpec.fixed(prompt_tokens), prompts_file=None)
