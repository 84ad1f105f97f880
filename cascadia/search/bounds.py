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
  stage computes one frame at a time, at best at the rows a second of its most efficient frame size;
- within an objective that bounds the time per later token (without speculation): a later token's row rides a frame
  that must come round before the next can follow it, so a request's time per later token is at least the mean
  trip, alone, of the frames its rows rode. Frames of many rows are cheaper per row but slower round: of the frame
  sizes B (each a trip t_B alone, the least a frame of that padded size carrying a sampled row takes, and a stage
  cost c_B per row, the least per row any frame of that size costs), a request within the bound rode a mix whose
  mean t is at most the bound, so its rows cost each stage at least the least mean c of such a mix (the lower
  convex hull of the points (t_B, c_B) at the bound). The objective's percentile over a probe's n requests (at
  least `fewest_requests`) holds only if more than q (1 - 1/n) of them (q the percentile's fraction) were within
  it; the others cost at least the cheapest c_B;
- and a request holds a slot (`max_streams` of them; one per choice) from its admission to its last token, at least
  its soonest first token and its later tokens' soonest trips, so no more requests a second can be served than the
  slots over that time (Little's law).
As a probe's arrivals span only so long (`cascadia.search.capacity`), a rate up to its tolerance above a bound may
still pass one: a search compares them with that margin.
"""

from __future__ import annotations

import math

import attrs

from cascadia.graph.plan import Plan
from cascadia.policy import padded_size
from cascadia.search.capacity import fewest_requests
from cascadia.search.slo import LatencySlo
from cascadia.sim.analytic import row_grid
from cascadia.sim.calibration import Calibration
from cascadia.sim.model import FrameShape, PipelineModel
from cascadia.spec.types import Spec
from cascadia.tokenizer import workload_prompts


@attrs.frozen
class Bounds:
    ttft_s: float  # no request's first token comes sooner
    tpot_s: float | None  # no request's later tokens come faster on average (None: speculation could)
    capacity_rps: float  # no more requests a second can be carried for good (within the objective, where given)


def _shape(rows: int, padded: int, sampled: int) -> FrameShape:
    """A frame of `rows` rows of one stream at the first position, `sampled` of them sampled: the cheapest frame of
    that many rows."""
    return FrameShape(padded, rows, 1.0, 1.0, 1, sampled)


def bounds(spec: Spec, plan: Plan, calibration: Calibration, slo: LatencySlo | None = None,
           least_requests: int | None = None) -> Bounds:
    """The bounds of `plan`; its capacity within `slo` where it bounds the time per later token, for probes of at
    least `fewest_requests(slo, least_requests)` requests (`cascadia.search.capacity`)."""
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
    grid = row_grid(spec)
    per_row = [[seconds / rows for seconds in model.alone_s(_shape(rows, rows, 0))[0]] for rows in grid]  # [B][stage]
    cheapest = [min(costs) for costs in zip(*per_row)]  # per stage
    later_row = cheapest
    if tpot is not None and later and slo is not None and any(b.metric == "tpot" for b in slo.bounds):
        bound = slo.bound("tpot")
        trips = [model.alone_s(_shape(1, rows, 1))[1] for rows in grid]
        within = bound.percentile / 100 * (1 - 1 / fewest_requests(slo, least_requests))
        later_row = [within * least_mean_cost(trips, costs, bound.seconds) + (1 - within) * low
                     for costs, low in zip(zip(*per_row), cheapest)]
    throughput = 1 / max(prompt * low + later * row for low, row in zip(cheapest, later_row))
    held_s = ttft + (0 if workload.stop_at_eos else (workload.output_tokens - 1) * (tpot or 0))
    return Bounds(ttft, tpot, min(throughput, runtime.max_streams / (workload.choices * held_s)))


def least_mean_cost(trips, costs, bound: float) -> float:
    """The least mean cost of a mix of frame sizes (size B: trip `trips[B]`, cost `costs[B]`) whose mean trip is at
    most `bound` (infinite where no size's is): a size within it, or two sizes either side of it mixed to meet it."""
    points = list(zip(trips, costs))
    least = min((cost for trip, cost in points if trip <= bound), default=math.inf)
    for trip, cost in points:
        for far_trip, far_cost in points:
            if trip <= bound < far_trip:
                share = (bound - trip) / (far_trip - trip)
                least = min(least, cost + share * (far_cost - cost))
    return least
