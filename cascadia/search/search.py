"""`cascadia search`: which machines to buy for a model and a workload under a latency objective.

For each machine type of a catalogue, the fleet of the fewest that hold the model at the spec's runtime (the
planner's memory accounting), planned by the planner, and the highest arrival rate it serves within the objective
(`cascadia.search.capacity`), simulated from the catalogue's figures (`cascadia.sim.analytic`: a roofline of memory
bandwidth and compute, links as listed, no host overheads). Each fleet is costed, and the one with the lowest price
that carries a given load is named.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import attrs

from cascadia.graph.plan import Plan
from cascadia.graph.planner import fewest_nodes
from cascadia.graph.planner import plan as make_plan
from cascadia.search.capacity import TOLERANCE, Capacity, capacity
from cascadia.search.slo import LatencySlo
from cascadia.sim.analytic import analytic_calibration
from cascadia.spec.types import Catalogue, ClusterSpec, MachineType, Spec

SCHEMA = "cascadia.search/1"


@attrs.frozen
class Fleet:
    """`count` machines of one type, linked through a switch at each one's port speed."""

    machine: MachineType
    count: int

    @property
    def price(self) -> float:
        return self.machine.price * self.count

    @property
    def power_w(self) -> float | None:
        return None if self.machine.power_w is None else self.machine.power_w * self.count

    def spec(self, base: Spec) -> Spec:
        """`base` (model, runtime, workload, reserve) on this fleet: nodes NAME0..NAME{count-1}."""
        nodes = tuple(self.machine.node(f"{self.machine.name}{i}") for i in range(self.count))
        return attrs.evolve(base, cluster=ClusterSpec(nodes, default_link=self.machine.link,
                                                      reserve_bytes=base.cluster.reserve_bytes))


@attrs.frozen
class Evaluated:
    """One machine type's fleet and what it carries; `pruned` says why it was not simulated (then no capacity)."""

    machine: MachineType
    fleet: Fleet | None
    plan: Plan | None = None
    capacity: Capacity | None = None
    pruned: str = ""
    seconds: float = 0.0  # spent evaluating it

    @property
    def rate(self) -> float:
        """Requests a second it carries within the objective (0 when pruned or when it carries none)."""
        return self.capacity.rate if self.capacity else 0.0

    def to_dict(self) -> dict:
        fleet, cap = self.fleet, self.capacity
        return {
            "machine": self.machine.name,
            "count": fleet.count if fleet else None,
            "price": fleet.price if fleet else None,
            "power_w": fleet.power_w if fleet else None,
            "pruned": self.pruned or None,
            "stages": len(self.plan.stages) if self.plan else None,
            "bottleneck_s": self.plan.bottleneck_s if self.plan else None,
            "capacity_rps": cap.rate if cap else None,
            "bounded": cap.bounded if cap else None,
            "why_none": cap.reason or None if cap else None,
            "at_capacity": _verdict_dict(cap.at_rate) if cap and cap.at_rate else None,
            "probes": [{"rate": p.rate, **_verdict_dict(p.verdict)} for p in cap.probes] if cap else [],
            "seconds": self.seconds,
        }


def _verdict_dict(verdict) -> dict:
    return {"met": verdict.met, "requests": verdict.requests, "rejected": verdict.rejected,
            **{f"{metric}_s": seconds for metric, seconds in verdict.quantiles.items()}, "goodput": verdict.goodput}


def evaluate(spec: Spec, machine: MachineType, slo: LatencySlo, tolerance: float = TOLERANCE) -> Evaluated:
    """The fleet of the fewest `machine`s that hold `spec`'s model, planned and its capacity found (or why not)."""
    start = time.perf_counter()
    count = fewest_nodes(spec, machine.node(machine.name))
    if count is None:
        return Evaluated(machine, None, pruned="a layer with its state does not fit one machine's memory",
                         seconds=time.perf_counter() - start)
    fleet = Fleet(machine, count)
    fleet_spec = fleet.spec(spec)
    plan = make_plan(fleet_spec)
    found = capacity(fleet_spec, plan, analytic_calibration(fleet_spec, open_loop=True), slo, tolerance)
    return Evaluated(machine, fleet, plan, found, seconds=time.perf_counter() - start)


def search(spec: Spec, catalogue: Catalogue, slo: LatencySlo, machines: Sequence[str] = (),
           tolerance: float = TOLERANCE) -> Iterator[Evaluated]:
    """Every machine type of the catalogue (or those named in `machines`, each checked first), evaluated in turn:
    a caller stopped part way (Ctrl-C) keeps what it was given."""
    chosen = [catalogue.machine(name) for name in machines] if machines else list(catalogue.machines)
    for machine in chosen:
        yield evaluate(spec, machine, slo, tolerance)


def cheapest(evaluated: Sequence[Evaluated], load: float) -> Evaluated | None:
    """The lowest-priced fleet that carries `load` requests a second within the objective (None: none does)."""
    carrying = [e for e in evaluated if e.fleet and e.rate >= load]
    return min(carrying, key=lambda e: (e.fleet.price, -e.rate), default=None)


def report(spec: Spec, catalogue: Catalogue, slo: LatencySlo, evaluated: Sequence[Evaluated], tolerance: float,
           load: float | None = None, complete: bool = True) -> dict:
    """What `search.json` holds: the question, every fleet evaluated, and the answer to `load`."""
    from cascadia.metrics import spec_summary

    best = cheapest(evaluated, load) if load is not None else None
    return {
        "schema": SCHEMA,
        "spec": spec_summary(spec),
        "catalogue": str(catalogue.source) if catalogue.source else None,
        "currency": catalogue.currency,
        "slo": str(slo),
        "tolerance": tolerance,
        "estimate": "analytic: the catalogue's memory bandwidth and compute as a roofline, no host overheads",
        "complete": complete,
        "load_rps": load,
        "cheapest": best.machine.name if best else None,
        "candidates": [e.to_dict() for e in evaluated],
    }
