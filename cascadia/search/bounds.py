"""What a fleet can at best do, from its simulator's frame costs without simulating: the soonest first token, the
fastest later tokens and the most requests a second it could carry. A search drops a fleet these bounds rule out
before it simulates it (`cascadia.search.search`).

Each bound holds for any run the simulator can produce, given frame costs that do not fall as a frame gains rows or
context, and per row do not rise as it gains rows (a roofline's, as `cascadia.sim.analytic` makes):
- first token: a prompt of P tokens (the workload's shortest) goes round the ring in frames of at most
  `prefill_window` of its rows W, one after another (a group has one frame in flight), so it takes at least
  ceil(P / W) trips of a one-row frame, and at least P rows at the per-row cost of a full window's frame; the last
  frame also samples;
- later tokens: each needs the token before it to come round the ring (a one-row frame's trip), unless speculation
  may accept several a trip;
- requests a second: every request puts at least its prompt's and its later tokens' rows through every stage, and a
  stage computes one frame at a time, at best at the rows a second of its most efficient frame size.
"""

from __future__ import annotations

import math

import attrs

from cascadia.graph.plan import Plan
from cascadia.policy import padded_size
from cascadia.sim.analytic import row_grid
from cascadia.sim.calibration import Calibration
from cascadia.sim.model import FrameShape, PipelineModel
from cascadia.spec.types import Spec
from cascadia.tokenizer import workload_prompts


@attrs.frozen
class Bounds:
    ttft_s: float  # no request's first token comes sooner
    tpot_s: float | None  # no request's later tokens come faster on average (None: speculation could)
    capacity_rps: float  # no more requests a second can be carried for good


def _shape(rows: int, padded: int, sampled: int) -> FrameShape:
    """A frame of `rows` rows of one stream at the first position, `sampled` of them sampled: the cheapest frame of
    that many rows."""
    return FrameShape(padded, rows, 1.0, 1.0, 1, sampled)


def bounds(spec: Spec, plan: Plan, calibration: Calibration) -> Bounds:
    model = PipelineModel(spec, plan, calibration)
    runtime, workload = spec.runtime, spec.workload
    prompts = workload_prompts(workload, spec.model.checkpoint, spec.model.config)
    prompt = min(map(len, prompts)) if prompts else workload.prompt_tokens.low
    buckets, window = runtime.row_buckets, runtime.prefill_window
    one = model.alone_s(_shape(1, padded_size(1, buckets), 0))[1]
    sampling = model.alone_s(_shape(1, padded_size(1, buckets), 1))[1] - one  # the head, on the last frame
    full_window = padded_size(window, buckets)
    per_prompt_row = model.alone_s(_shape(window, full_window, 0))[1] / full_window
    ttft = max(math.ceil(prompt / window) * one, prompt * per_prompt_row) + sampling
    tpot = None if runtime.speculate else one + sampling
    later = 0 if workload.stop_at_eos else workload.choices * (workload.output_tokens - 1)
    rows_per_second = min(max(rows / model.alone_s(_shape(rows, rows, 0))[0][stage] for rows in row_grid(spec))
                          for stage in range(len(plan.stages)))
    return Bounds(ttft, tpot, rows_per_second / (prompt + later))
