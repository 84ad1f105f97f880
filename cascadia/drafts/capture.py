"""Capturing the deployed path: greedy generation on the single-process engine, as `cascadia generate` runs it,
keeping the rows its head reads (the final hidden states after the final norm and the muP division)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from cascadia.engine.engine import Engine
from cascadia.engine.generate import generate
from cascadia.sampling import Sampling


@attrs.frozen(eq=False)
class Captured:
    """One prompt's generation: at each position that produced a token, the head's input and that token."""

    prompt_ids: tuple[int, ...]
    head_inputs: np.ndarray  # [n, H] float32
    tokens: np.ndarray  # [n] the deployed tokens: the argmax of the deployed logits of each row

    def to_json(self) -> dict:
        return {"prompt_ids": list(self.prompt_ids), "ids": self.tokens.tolist()}


def capture(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()) -> Captured:
    """Generate greedily from `prompt_ids` (up to `max_new_tokens`, ending early on a stop token), capturing what
    the head reads: the prompt's last row, then each decoded row."""
    rows: list[np.ndarray] = []
    engine.stage.head_input_observer = rows.append
    try:
        result = generate(engine, prompt_ids, max_new_tokens, Sampling(), stop_ids)
    finally:
        engine.stage.head_input_observer = None
    head_inputs = np.concatenate(rows)
    if len(head_inputs) != len(result.ids):
        raise RuntimeError(f"the head read {len(head_inputs)} rows for {len(result.ids)} tokens")
    return Captured(result.prompt_ids, head_inputs, np.array(result.ids, np.int64))
