"""Speculation in the simulator, which computes no tokens: drafts that are accepted as often as an acceptance rate.

Every token the simulator samples is PLACEHOLDER_TOKEN, so a draft is accepted exactly when it is PLACEHOLDER_TOKEN
and the drafts before it were. `RateDrafter` proposes each draft as PLACEHOLDER_TOKEN with probability `acceptance`
(seeded, so a simulation is the same every time), and the policy verifies them as it verifies real ones: a step
accepts a drafts with probability acceptance^a (1 - acceptance), the last draft aside.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cascadia.sim.model import PLACEHOLDER_TOKEN

REJECTED_TOKEN = PLACEHOLDER_TOKEN + 1
DEFAULT_ACCEPTANCE = 0.5


class RateDrafter:
    def __init__(self, acceptance: float, seed: int = 0) -> None:
        if not 0 <= acceptance <= 1:
            raise ValueError(f"an acceptance rate lies in 0..1, got {acceptance}")
        self.acceptance = acceptance
        self._rng = np.random.default_rng(seed)

    def propose(self, request_id: int, prompt: Sequence[int], output: Sequence[int], limit: int) -> list[int]:
        accepted = self._rng.random(limit) < self.acceptance
        return np.where(accepted, PLACEHOLDER_TOKEN, REJECTED_TOKEN).tolist()

    def finish(self, request_id: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        pass
