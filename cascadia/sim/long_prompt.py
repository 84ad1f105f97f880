"""One stream at a long prompt, simulated: its first-token time and its decode time per token.

The spec's deployment serves one request alone (one slot, whose K/V pool then holds the most positions) with a
context budget that just holds the prompt and its output. A budget beyond the model's `max_position_embeddings` raises
that too, with a note: the engine's relative bias and log-scaling have no limit of their own, and the paper's
deployment held 512k positions per stream where its model's config says 131,072.
"""

from __future__ import annotations

import attrs

from cascadia.models import config_from_hf_dict
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import Calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.types import Spec
from cascadia.workload import override


@attrs.frozen
class LongPrompt:
    prompt_tokens: int
    ttft_s: float
    decode_s: float  # per token after the first (TPOT)
    notes: tuple[str, ...]  # the simulation's warnings (extrapolated tables), and a raised max_position_embeddings


def one_stream(spec: Spec, prompt_tokens: int, output_tokens: int) -> tuple[Spec, list[str]]:
    """`spec` serving one request of `prompt_tokens` and `output_tokens` alone, and what had to change for it."""
    budget = prompt_tokens + output_tokens
    config, notes = spec.model.config, []
    if budget > config.max_position_embeddings:
        notes.append(f"max_position_embeddings raised from {config.max_position_embeddings:,} to {budget:,}")
        config = config_from_hf_dict(config.to_hf_dict() | {"max_position_embeddings": budget})
    runtime = attrs.evolve(spec.runtime, max_streams=1, context_budget=budget)
    workload = override(spec.workload, concurrency=(1,), requests=1, output_tokens=output_tokens,
                        prompt_tokens=prompt_tokens)
    return attrs.evolve(spec, model=attrs.evolve(spec.model, config=config), runtime=runtime,
                        workload=workload), notes


def simulate_long_prompt(spec: Spec, calibration: Calibration | None, prompt_tokens: int,
                         output_tokens: int = 8) -> LongPrompt:
    """The measured phase's first-token time and TPOT of one request alone on `spec`'s deployment (the planner's
    plan for one stream), with `calibration` (None: analytic, from the spec's hardware figures at this budget, its
    K/V read once per frame as the engine reads a lone stream's)."""
    alone, notes = one_stream(spec, prompt_tokens, output_tokens)
    result = simulate(alone, calibration or analytic_calibration(alone))
    [level] = result["levels"]
    return LongPrompt(prompt_tokens, level["ttft_s"]["p50"], level["tpot_s"]["p50"],
                      tuple(notes + result["warnings"]))
