"""`cascadia search`: which machines to buy for a model and a workload under a latency objective.

The space (`cascadia.search.space`) is every machine type of a catalogue, from the fewest that hold the model at the
spec's runtime up to a most, in each weight-format preset and with each runtime setting asked for. Fleets are taken
cheapest first. Each is planned by the planner; one whose bounds (`cascadia.search.bounds`) miss the objective even
alone, or whose most requests a second within it, less the probes' tolerance, no more than a cheaper fleet already
carries (it cannot be on the frontier, nor the cheapest for any load), is dropped without a simulation. The rest get
their capacity (`cascadia.search.capacity`), simulated from the catalogue's figures (`cascadia.sim.analytic`: a
roofline of memory bandwidth and compute, links as listed, no host overheads), or from the times measured on one of
its machines where the catalogue names a calibration. The frontier is the fleets no cheaper (or equally priced)
fleet carries as much as.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import attrs

from cascadia.graph.plan import Plan
from cascadia.graph.planner import plan as make_plan
from cascadia.search.bounds import Bounds, bounds
from cascadia.search.capacity import TOLERANCE, Capacity, capacity, fewest_requests, serves_users
from cascadia.search.fanout import InProcess, Pool
from cascadia.search.slo import LatencySlo, Verdict
from cascadia.search.space import Candidate, Settings, Unfit
from cascadia.sim.drafts import DEFAULT_ACCEPTANCE
from cascadia.spec.types import Catalogue, MachineType, Spec

SCHEMA = "cascadia.search/1"
MEMORY, BOUNDS, DOMINATED = "memory", "bounds", "dominated"  # why a fleet was not simulated


@attrs.frozen
class Evaluated:
    """One fleet and what it carries; `pruned` says why it was not simulated (then no capacity), `why` in words."""

    machine: MachineType
    formats: str
    candidate: Candidate | None  # None: no number of these machines holds the model
    settings: Settings = Settings()
    plan: Plan | None = None
    bounds: Bounds | None = None
    capacity: Capacity | None = None
    pruned: str | None = None  # MEMORY, BOUNDS or DOMINATED
    why: str = ""
    seconds: float = 0.0  # spent evaluating it

    @property
    def rate(self) -> float:
        """Requests a second it carries within the objective (0 when pruned or when it carries none)."""
        return self.capacity.rate if self.capacity else 0.0

    def to_dict(self) -> dict:
        fleet, cap, bound = self.candidate, self.capacity, self.bounds
        return {
            "machine": self.machine.name,
            "formats": self.formats,
            **{key: value for key, value in attrs.asdict(self.settings).items() if value is not None},
            "times": self.machine.times,
            "count": fleet.count if fleet else None,
            "mix": {"machine": fleet.mix[0].name, "count": fleet.mix[1]} if fleet and fleet.mix else None,
            "spares": fleet.spares if fleet else None,
            "price": fleet.price if fleet else None,
            "power_w": fleet.power_w if fleet else None,
            "pruned": self.pruned,
            "why": self.why or None,
            "stages": len(self.plan.stages) if self.plan else None,
            "bottleneck_s": self.plan.bottleneck_s if self.plan else None,
            "bounds": attrs.asdict(bound) if bound else None,
            "capacity_rps": cap.rate if cap else None,
            "bounded": cap.bounded if cap else None,
            "at_capacity": _verdict_dict(cap.at_rate) if cap and cap.at_rate else None,
            "probes": [{"rate": p.rate, **_verdict_dict(p.verdict)} for p in cap.probes] if cap else [],
            "seconds": self.seconds,
        }


def _verdict_dict(verdict) -> dict:
    return {"met": verdict.met, "requests": verdict.requests, "rejected": verdict.rejected,
            **{f"{metric}_s": seconds for metric, seconds in verdict.quantiles.items()}, "goodput": verdict.goodput}


def missed_alone(slo: LatencySlo, found: Bounds) -> str:
    """Which bounds of the objective a fleet misses however lightly loaded ("" for none)."""
    soonest = {"ttft": found.ttft_s, "tpot": found.tpot_s}
    return ", ".join(f"{b.metric} at least {soonest[b.metric]:.3g} s > {b.seconds:.3g} s" for b in slo.bounds
                     if soonest[b.metric] is not None and soonest[b.metric] > b.seconds)


@attrs.frozen
class Carried:
    """What ruling a dearer fleet out needs of one simulated before it."""

    fleet: str
    price: float
    rate: float


def evaluate(spec: Spec, candidate: Candidate, slo: LatencySlo, tolerance: float = TOLERANCE,
             better: Carried | None = None, prune: bool = True, acceptance: float = DEFAULT_ACCEPTANCE,
             least_requests: int | None = None) -> Evaluated:
    """`candidate` planned, its bounds taken and, unless (with `prune`) they rule it out against `slo` or against
    what `better`, a fleet no dearer, carries, its capacity found (probes of at least `least_requests` requests;
    drafts, where it speculates, accepted at `acceptance`)."""
    start = time.perf_counter()
    fleet_spec = candidate.spec(spec)
    plan = make_plan(fleet_spec)
    calibration = candidate.calibration(fleet_spec)
    found = bounds(fleet_spec, plan, calibration, slo, least_requests)
    common = dict(machine=candidate.machine, formats=candidate.formats, candidate=candidate,
                  settings=candidate.settings, plan=plan, bounds=found)
    if prune and (missed := missed_alone(slo, found)):
        return Evaluated(**common, pruned=BOUNDS, why=f"misses it even alone: {missed}",
                         seconds=time.perf_counter() - start)
    if (prune and better is not None and better.price <= candidate.price
            and better.rate >= found.capacity_rps * (1 + tolerance)):
        return Evaluated(**common, pruned=DOMINATED,
                         why=f"carries at most {found.capacity_rps:.3g}/s; {better.fleet} carries {better.rate:.3g}/s "
                             f"for {better.price:,.0f}", seconds=time.perf_counter() - start)
    found_capacity = capacity(fleet_spec, plan, calibration, slo, tolerance, least_requests, acceptance)
    return Evaluated(**common, capacity=found_capacity, why=found_capacity.reason,
                     seconds=time.perf_counter() - start)


def search(spec: Spec, fleets: Sequence[Candidate | Unfit], slo: LatencySlo, tolerance: float = TOLERANCE,
           prune: bool = True, pool: Pool | None = None, acceptance: float = DEFAULT_ACCEPTANCE,
           least_requests: int | None = None) -> Iterator[Evaluated]:
    """The fleets of a space (`cascadia.search.space.space`) evaluated on `pool` (default: here, one at a time),
    machine types that hold no layer first, then the fleets, started cheapest first and given as they finish
    (`prune`: dropping what the bounds rule out). Each fleet starts with the best capacity known by then of the
    fleets no dearer (all those done: they started before it), so a pool rules out fewer than one at a time, never
    others. A caller stopped part way (Ctrl-C) keeps what it was given; the pool is closed either way."""
    for unfit in (each for each in fleets if isinstance(each, Unfit)):
        yield Evaluated(unfit.machine, unfit.formats, None, unfit.settings, pruned=MEMORY,
                        why="a layer with its state does not fit one machine's memory")
    pool = pool or InProcess()
    waiting = iter(sorted((each for each in fleets if isinstance(each, Candidate)), key=lambda c: (c.price, c.size)))
    running: dict = {}
    best: Carried | None = None

    def start_next() -> None:
        if (candidate := next(waiting, None)) is not None:
            running[pool.submit(evaluate, spec, candidate, slo, tolerance, best, prune, acceptance,
                                least_requests)] = candidate

    try:
        for _ in range(pool.width):
            start_next()
        while running:
            handle, evaluated = pool.done(running)
            del running[handle]
            if evaluated.rate > (best.rate if best else 0):
                fleet = evaluated.candidate
                best = Carried(fleet.describe(), fleet.price, evaluated.rate)
            start_next()
            yield evaluated
    finally:
        pool.close()


def frontier(evaluated: Sequence[Evaluated]) -> list[Evaluated]:
    """The fleets that carry more than every cheaper one (of equal price, the one that carries most), cheapest
    first: price against capacity, the Pareto frontier."""
    carrying = sorted((e for e in evaluated if e.rate > 0), key=lambda e: (e.candidate.price, -e.rate))
    front: list[Evaluated] = []
    for each in carrying:
        if not front or each.rate > front[-1].rate:
            front.append(each)
    return front


def cheapest(evaluated: Sequence[Evaluated], load: float) -> Evaluated | None:
    """The lowest-priced fleet that carries `load` requests a second within the objective (None: none does)."""
    return next((e for e in frontier(evaluated) if e.rate >= load), None)


@attrs.frozen
class ForUsers:
    """The fleets tried for `users` clients in a closed loop, cheapest first, each with its verdict; the last met
    the objective, unless none did."""

    users: int
    tried: tuple[tuple[Evaluated, Verdict], ...]

    @property
    def fleet(self) -> Evaluated | None:
        """The cheapest fleet that serves them (None: none of the space does)."""
        return self.tried[-1][0] if self.tried and self.tried[-1][1].met else None


def cheapest_for_users(spec: Spec, evaluated: Sequence[Evaluated], slo: LatencySlo, users: int,
                       acceptance: float = DEFAULT_ACCEPTANCE) -> ForUsers:
    """The cheapest fleet that serves `users` clients within `slo`, each sending its next request when its last is
    done: the fleets that carry anything, or that a cheaper fleet ruled out (it may still serve them), tried
    cheapest first until one does."""
    tried = []
    for each in sorted((e for e in evaluated if e.rate > 0 or e.pruned == DOMINATED),
                       key=lambda e: (e.candidate.price, -e.rate)):
        fleet_spec = each.candidate.spec(spec)
        verdict = serves_users(fleet_spec, each.plan, each.candidate.calibration(fleet_spec), slo, users, acceptance)
        tried.append((each, verdict))
        if verdict.met:
            break
    return ForUsers(users, tuple(tried))


def report(spec: Spec, catalogue: Catalogue, slo: LatencySlo, evaluated: Sequence[Evaluated], tolerance: float,
           load: float | None = None, complete: bool = True, for_users: ForUsers | None = None,
           acceptance: float | None = None, least_requests: int | None = None) -> dict:
    """What `search.json` holds: the question (with `acceptance`, the drafts' where fleets speculate), every fleet
    evaluated (those that hold no layer first, then by price), the frontier and the answer to `load` (indexes into
    the fleets)."""
    from cascadia.metrics import spec_summary

    evaluated = sorted(evaluated, key=lambda e: (e.candidate is not None, *(
        (e.candidate.price, e.candidate.size) if e.candidate else ()), e.machine.name, e.formats,
        e.settings.describe()))
    best = cheapest(evaluated, load) if load is not None else None
    front = frontier(evaluated)
    return {
        "schema": SCHEMA,
        "spec": spec_summary(spec),
        "catalogue": str(catalogue.source) if catalogue.source else None,
        "currency": catalogue.currency,
        "slo": str(slo),
        "tolerance": tolerance,
        "probe_requests": fewest_requests(slo, least_requests),
        "acceptance": acceptance,
        "complete": complete,
        "load_rps": load,
        "cheapest": evaluated.index(best) if best else None,
        "frontier": [evaluated.index(e) for e in front],
        "users": None if for_users is None else {
            "users": for_users.users,
            "cheapest": evaluated.index(for_users.fleet) if for_users.fleet else None,
            "tried": [{"fleet": evaluated.index(each), **_verdict_dict(verdict)} for each, verdict in for_users.tried]},
        "candidates": [e.to_dict() for e in evaluated],
    }
