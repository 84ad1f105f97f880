"""The highest arrival rate a fleet carries within a latency objective: a bisection over open-loop rates, as
Vidur-Search does, each rate one simulation of the spec's workload arriving at Poisson times.

The first guess is the rate at which one stream alone would serve the requests back to back (a closed loop of one
client, simulated): that run also says whether the objective can be met at all. From there the rate doubles until
it misses the objective (or halves until it meets it), then geometric midpoints narrow the boundary until the
missing rate is within `tolerance` of the meeting one. The objective is assumed to hold below the boundary and not
above; each probe is one seeded simulation, so a probe near the boundary answers for its own arrivals only.

A rate is carried only if it is carried for good, not for a burst: above capacity the queue grows for as long as
requests keep arriving, so a probe's arrivals span long enough that a rate `tolerance` too high would push the
first-token time at the objective's percentile past its bound. Arriving for S seconds at (1 + t) times capacity
leaves the request at quantile q waiting about q S t / (1 + t) seconds, so S = bound (1 + t) / (q t): 233 s of
arrivals for ttft_p90=10s at 5%. That is why the objective must bound the first token: the time per later token
stays flat while the queue grows without end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from cascadia.graph.plan import Plan
from cascadia.metrics import RequestRecord
from cascadia.search.slo import LatencySlo, Verdict
from cascadia.sim.calibration import Calibration
from cascadia.sim.drafts import DEFAULT_ACCEPTANCE
from cascadia.sim.simulate import simulate
from cascadia.spec.types import Spec
from cascadia.units import format_duration
from cascadia.workload import MEASURED

TOLERANCE = 0.05  # the boundary's relative width when the bisection stops
REACH = 2**12  # how far from the first guess the rate may go, up or down
ALONE_REQUESTS = 8  # requests of the one-client run that gives the first guess
LEAST_REQUESTS = 64  # a probe's fewest requests, however short its arrivals' span
TAIL_REQUESTS = 25  # ... and, by default, enough that this many lie beyond the first-token bound's percentile
USER_REQUESTS = 4  # requests each client of a closed loop sends in turn


@attrs.frozen
class Probe:
    """One simulated rate (requests/s; None: the one-client run) and its verdict."""

    rate: float | None
    verdict: Verdict


@attrs.frozen
class Capacity:
    """The highest rate found to meet the objective (0: none), and every probe on the way."""

    rate: float
    probes: tuple[Probe, ...]
    bounded: bool = True  # False: the highest rate tried met it still, so `rate` is only a lower bound
    reason: str = ""  # why `rate` is 0

    @property
    def at_rate(self) -> Verdict | None:
        """The verdict of the probe at `rate` (None when `rate` is 0)."""
        return next((p.verdict for p in reversed(self.probes) if p.rate == self.rate), None)


def highest_rate(meets: Callable[[float], bool], start: float, tolerance: float = TOLERANCE,
                 reach: float = REACH) -> tuple[float, bool]:
    """The highest rate at which `meets(rate)` holds, within `tolerance` (relative) below the true boundary,
    searched from `start` > 0 no further than `reach` times up or down; and whether the boundary was found
    (False: `meets` held even at start x reach, which is returned). 0 when it held nowhere down to start / reach."""
    low, high = (start, None) if meets(start) else (None, start)
    while high is None:
        if low * 2 > start * reach:
            return low, False
        low, high = (low * 2, None) if meets(low * 2) else (low, low * 2)
    while low is None:
        if high / 2 < start / reach:
            return 0.0, True
        low, high = (high / 2, high) if meets(high / 2) else (None, high / 2)
    while high > low * (1 + tolerance):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low, True


def _measured(result: dict) -> tuple[list[RequestRecord], int]:
    """A one-level simulation's measured requests, and how many it rejected."""
    records = [RequestRecord(**r) for r in result["requests"] if r["phase"] == MEASURED]
    return records, result["levels"][0]["rejected"]


def arrival_seconds(slo: LatencySlo, tolerance: float = TOLERANCE) -> float:
    """How long a probe's requests keep arriving: long enough for a rate `tolerance` above capacity to miss the
    first-token bound (see the module's text)."""
    ttft = slo.bound("ttft")
    return ttft.seconds * (1 + tolerance) / (ttft.percentile / 100 * tolerance)


def fewest_requests(slo: LatencySlo, given: int | None = None) -> int:
    """A probe's fewest requests: `given`, or enough that TAIL_REQUESTS of them lie beyond the first-token bound's
    percentile (250 for p90, 2,500 for p99 and above), at least LEAST_REQUESTS. Fewer read a capacity high: near it
    a queue takes long to grow, and in a few requests it has not (bench/search_scatter.py: at 64 requests a p90
    bound's capacity came out 22-41% above what 1,024 found, on three fleets of Inkling 975B)."""
    if given is not None:
        return given
    beyond = max(1 - slo.bound("ttft").percentile / 100, 0.01)
    return max(LEAST_REQUESTS, math.ceil(round(TAIL_REQUESTS / beyond, 6)))


def probe_requests(rate: float, slo: LatencySlo, tolerance: float = TOLERANCE,
                   least_requests: int | None = None) -> int:
    """Requests of a probe at `rate`: those arriving in `arrival_seconds`, at least `fewest_requests`."""
    return max(fewest_requests(slo, least_requests), math.ceil(rate * arrival_seconds(slo, tolerance)))


def _judged(spec: Spec, plan: Plan, calibration: Calibration, slo: LatencySlo,
            acceptance: float) -> tuple[Verdict, list[RequestRecord]]:
    """`spec`'s one-level workload simulated on `plan` (drafts, with speculation, accepted at `acceptance`) and
    judged against `slo`, with its measured requests. No warm-up: the measured phase is the same without
    (`simulate`), at half the cost."""
    records, rejected = _measured(simulate(spec, calibration, plan, acceptance=acceptance,
                                           warm_up=spec.runtime.speculate is not None))
    return slo.judge(records, rejected), records


def serves_users(spec: Spec, plan: Plan, calibration: Calibration, slo: LatencySlo, users: int,
                 acceptance: float = DEFAULT_ACCEPTANCE) -> Verdict:
    """Whether `plan` serves `users` clients within `slo`, each sending its next request of `spec.workload` when its
    last is done (a closed loop; USER_REQUESTS each, all starting at once, as a level of `cascadia run` does)."""
    workload = attrs.evolve(spec.workload, concurrency=(users,), rate=(), requests=users * USER_REQUESTS, slo=None)
    return _judged(attrs.evolve(spec, workload=workload), plan, calibration, slo, acceptance)[0]


def capacity(spec: Spec, plan: Plan, calibration: Calibration, slo: LatencySlo, tolerance: float = TOLERANCE,
             least_requests: int | None = None, acceptance: float = DEFAULT_ACCEPTANCE) -> Capacity:
    """The highest open-loop rate of `spec.workload`'s requests that `plan` serves within `slo` (which bounds the
    first token), simulated with `calibration` (drafts, with speculation, accepted at `acceptance`): each probe's
    requests arrive for `arrival_seconds`, at least `fewest_requests(slo, least_requests)` of them."""
    probes: list[Probe] = []

    def run(workload) -> tuple[Verdict, list[RequestRecord]]:
        verdict, records = _judged(attrs.evolve(spec, workload=workload), plan, calibration, slo, acceptance)
        probes.append(Probe(workload.rate[0] if workload.rate else None, verdict))
        return verdict, records

    alone, records = run(attrs.evolve(spec.workload, concurrency=(1,), rate=(), requests=ALONE_REQUESTS, slo=None))
    if not alone.met:
        missed = [f"{b.metric} p{b.percentile:g} {format_duration(alone.quantiles[b.metric], 3)} > "
                  f"{format_duration(b.seconds)}" for b in slo.bounds if (alone.quantiles[b.metric] or 0) > b.seconds]
        return Capacity(0.0, tuple(probes), reason=f"misses it with one request at a time ({', '.join(missed)})")
    one_stream = len(records) / sum(r.t_finish - r.t_arrival for r in records)  # requests/s, back to back

    def meets(rate: float) -> bool:
        requests = probe_requests(rate, slo, tolerance, least_requests)
        return run(attrs.evolve(spec.workload, rate=(rate,), requests=requests, slo=None))[0].met

    rate, bounded = highest_rate(meets, one_stream, tolerance)
    reason = "" if rate else f"misses it at every rate down to {one_stream / REACH:.3g}/s"
    return Capacity(rate, tuple(probes), bounded, reason)
