"""Concrete requests from a WorkloadSpec, shared by `cascadia run` and `cascadia simulate` so both serve the same ones.

Each concurrency level runs two phases back to back, as the paper measured: a warm-up phase, then a measured phase,
each of `requests` requests (default: the level's concurrency). A phase starts on an empty pipeline (the previous phase
has fully drained), so its first-token latencies include the ramp-up of admission. Both phases are recorded; level
summaries describe the measured phase only, so the real run's first-use effects (allocation, caches) stay out of them.

Closed loop: at level c, c clients each send a request and the next one as soon as theirs is done (finished or
rejected), until the phase's requests are all sent; `ClosedLoop` is that rule, for both backends.

Prompts come from the workload's JSONL file (one {"ids": [...]} object per line, or {"text": "..."} with a tokenizer),
taken in order and cycled over the whole workload; otherwise from seeded random token ids. Prompt lengths are drawn
per (seed, level, phase), so adding a level does not change the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cascadia.errors import CascadiaError, RequestError
from cascadia.files import UnreadableFile, read_text
from cascadia.model_config import InklingConfig
from cascadia.policy import Request
from cascadia.spec.types import LengthSpec, RuntimeSpec, WorkloadSpec

WARMUP, MEASURED = "warmup", "measured"
PHASES = (WARMUP, MEASURED)
MAX_PROMPTS_FILE_BYTES = 256 * 1024**2  # read whole: a million prompts of 256 bytes


@attrs.frozen
class Phase:
    name: str
    requests: tuple[Request, ...]


@attrs.frozen
class Level:
    concurrency: int
    phases: tuple[Phase, ...]


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


def build_levels(workload: WorkloadSpec, vocab_size: int, prompts: Sequence[tuple[int, ...]] | None = None,
                 stop_ids: frozenset[int] = frozenset()) -> tuple[Level, ...]:
    """The requests of every level and phase, with ids unique over the whole workload.

    `prompts` (e.g. from `load_prompts(workload.prompts_file)`) replaces random prompts; `stop_ids` (EOS) makes
    requests stop early when sampled.
    """
    levels, next_id = [], 0
    for concurrency in workload.concurrency:
        n_requests = workload.requests or concurrency
        phases = []
        for phase_index, name in enumerate(PHASES):
            rng = np.random.default_rng((workload.seed, concurrency, phase_index))
            requests = []
            for _ in range(n_requests):
                if prompts:
                    prompt = prompts[next_id % len(prompts)]
                else:
                    length = int(rng.integers(workload.prompt_tokens.low, workload.prompt_tokens.high + 1))
                    prompt = tuple(int(t) for t in rng.integers(0, vocab_size, length))
                requests.append(Request(next_id, prompt, workload.output_tokens, stop_ids))
                next_id += 1
            phases.append(Phase(name, tuple(requests)))
        levels.append(Level(concurrency, tuple(phases)))
    return tuple(levels)


class ClosedLoop:
    """`clients` clients sending a phase's requests: all start at once; a done request lets its client send the next."""

    def __init__(self, requests: Sequence[Request], clients: int) -> None:
        self._requests = list(requests)
        self._clients = clients
        self._sent = 0

    def start(self) -> list[Request]:
        first = self._requests[:self._clients]
        self._sent = len(first)
        return first

    def next(self) -> Request | None:
        """Called once per finished or rejected request: the request its client sends next, if any is left."""
        if self._sent == len(self._requests):
            return None
        self._sent += 1
        return self._requests[self._sent - 1]


def stop_ids(workload: WorkloadSpec, config: InklingConfig) -> frozenset[int]:
    """The tokens that end a request early: the model's EOS ids when the workload says `stop_at_eos`, else none (a
    benchmark's requests keep their lengths)."""
    return config.eos_ids if workload.stop_at_eos else frozenset()


def misfits(workload: WorkloadSpec, runtime: RuntimeSpec) -> list[tuple[str, str]]:
    """(workload key, message) for what does not fit the stream slots and context budget the runtime sizes its state
    for. Prompts from a file are checked one by one when admitted (too long: rejected)."""
    problems = []
    if max(workload.concurrency) > runtime.max_streams:
        problems.append(("concurrency", f"{max(workload.concurrency)} streams exceed runtime.max_streams "
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
             output_tokens: int | None = None, prompt_tokens: int | None = None) -> WorkloadSpec:
    """The workload with the command line's choices in place of the spec's (None keeps the spec's); a prompt length
    replaces the spec's prompts file too."""
    changes = {"concurrency": concurrency, "requests": requests, "output_tokens": output_tokens}
    workload = attrs.evolve(workload, **{k: v for k, v in changes.items() if v is not None})
    if prompt_tokens is None:
        return workload
    return attrs.evolve(workload, prompt_tokens=LengthSpec.fixed(prompt_tokens), prompts_file=None)
