"""Speculation in the simulator, which computes no tokens: drafts accepted as often as an acceptance rate, or as a
run's were.

Every token the simulator samples is PLACEHOLDER_TOKEN, so a draft is accepted exactly when it is PLACEHOLDER_TOKEN
and the drafts before it were. `RateDrafter` proposes drafts at a share of steps (`proposing`), each draft as
PLACEHOLDER_TOKEN with probability `acceptance` (seeded, so a simulation is the same every time), and the policy
verifies them as it verifies real ones: a step accepts a drafts with probability acceptance^a (1 - acceptance), the
last draft aside. `TraceDrafter` replays a run's acceptance trace (`cascadia run --outputs` with speculation: each
request's [proposed, accepted] at every step its drafter was asked, 0 proposed where it found nothing): the same
request's steps, in order. `fitted_rates` gives a trace's two rates, so that one run's (one stream's, say) predicts
what the same drafts do at any concurrency: how often the policy asks for drafts, and how many rows it has for them,
the simulator plays out as it does in a run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cascadia.sim.model import PLACEHOLDER_TOKEN
from cascadia.speculation import Drafter

REJECTED_TOKEN = PLACEHOLDER_TOKEN + 1
DEFAULT_ACCEPTANCE = 0.5


class RateDrafter(Drafter):
    def __init__(self, acceptance: float, seed: int = 0, proposing: float = 1.0) -> None:
        for name, rate in (("an acceptance rate", acceptance), ("a share of steps proposing", proposing)):
            if not 0 <= rate <= 1:
                raise ValueError(f"{name} lies in 0..1, got {rate}")
        self.acceptance, self.proposing = acceptance, proposing
        self._rng = np.random.default_rng(seed)

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        if self.proposing < 1 and self._rng.random() >= self.proposing:
            return []
        accepted = self._rng.random(limit) < self.acceptance
        return np.where(accepted, PLACEHOLDER_TOKEN, REJECTED_TOKEN).tolist()


Step = tuple[int, int]  # drafts proposed at one step of a stream, and how many of them were accepted


class TraceDrafter(Drafter):
    """Each request proposes what the traced run's request of the same id proposed at the same step, as many
    accepted as there (cut to the policy's limit); a request beyond its trace, or absent from it, proposes none."""

    def __init__(self, steps: dict[int, Sequence[Step]]) -> None:
        self._steps = {request_id: list(reversed(trace)) for request_id, trace in steps.items()}

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        trace = self._steps.get(request_id)
        if not trace:
            return []
        proposed, accepted = trace.pop()
        proposed = min(proposed, limit)
        accepted = min(accepted, proposed)
        return [PLACEHOLDER_TOKEN] * accepted + [REJECTED_TOKEN] * (proposed - accepted)

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._steps.pop(request_id, None)


def fitted_rates(steps: dict[int, Sequence[Step]]) -> tuple[float, float]:
    """The acceptance rate and the share of steps proposing drafts that make a trace likeliest under
    `RateDrafter`'s model: each draft accepted with the same chance while those before it were (a step of k
    drafts, a accepted, counts a acceptances and, where a < k, one rejection). Its steps without drafts count
    only towards the share."""
    taken = [step for trace in steps.values() for step in trace]
    proposing = [(proposed, accepted) for proposed, accepted in taken if proposed]
    if not proposing:
        raise ValueError("the trace proposes no drafts: there is no acceptance rate to fit")
    accepted = sum(a for _, a in proposing)
    rejected = sum(a < k for k, a in proposing)
    return accepted / (accepted + rejected), len(proposing) / len(taken)


def acceptance_trace(lines: Iterable[dict], where: str) -> dict[int, list[Step]]:
    """The steps of each request of a run's outputs (`cascadia run --outputs` lines); ValueError naming `where` and
    the line when a line is no such record or none holds drafts (a run without speculation)."""
    steps: dict[int, list[Step]] = {}
    for number, line in enumerate(lines, 1):
        drafts = line.get("drafts") if isinstance(line, dict) else None
        if drafts is None:
            continue
        if not (isinstance(line.get("request_id"), int) and isinstance(drafts, list) and all(
                isinstance(step, list) and len(step) == 2 and all(isinstance(n, int) and n >= 0 for n in step)
                and step[1] <= step[0] for step in drafts)):
            raise ValueError(f"{where}: line {number}: expected a request_id and drafts [[proposed, accepted], ...]")
        steps[line["request_id"]] = [tuple(step) for step in drafts]
    if not steps:
        raise ValueError(f"{where}: no request holds drafts (was the run made with --speculate?)")
    return steps
