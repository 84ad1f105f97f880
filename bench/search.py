"""How fast `cascadia search` answers: the paper's model over the shipped catalogue, one process against a pool.

Scenario: specs/inkling-975b-11pc.yaml (Inkling 975B, its runtime and workload: 64-token prompts, 128 tokens out)
against specs/catalogues/ai-pcs.yaml in the four weight-format presets, each machine type from the fewest that hold
the model to twice as many, under ttft_p90=10s,tpot_p99=500ms; the whole search (space, plans, bounds, every
capacity's bisection) run ROUNDS times with one fleet at a time in this process and with a pool of a process per
CPU, alternately. Per run:
  fleets            the space's fleets (machine type, count and formats), before any pruning
  by bounds         the share ruled out by their bounds without a simulation, and by a cheaper fleet's capacity
  simulated         fleets whose capacity was bisected
  seconds           the search's wall time (median, range)
  fleets/s          fleets of the space decided a second
  simulated req/s   requests the simulator served a second, over the whole search (every probe's warm-up and
                    measured requests)
Every run must find the same frontier; the bench stops if one does not. Not a test: it prints its table and writes
it to bench/results/search.json.

    python bench/search.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from record import ROOT, Table, now, spread, write

from cascadia.host_cpus import available
from cascadia.search.fanout import InProcess, Processes
from cascadia.search.search import BOUNDS, DOMINATED, frontier, search
from cascadia.search.slo import LatencySlo
from cascadia.search.space import PRESETS, space
from cascadia.spec.load import load_catalogue, load_spec

SPEC = ROOT / "specs" / "inkling-975b-11pc.yaml"
CATALOGUE = ROOT / "specs" / "catalogues" / "ai-pcs.yaml"
SLO = "ttft_p90=10s,tpot_p99=500ms"


def simulated_requests(evaluated) -> int:
    """Requests the simulator served for these fleets: each probe's measured phase and its warm-up alike."""
    return sum(2 * probe.verdict.requests for e in evaluated if e.capacity for probe in e.capacity.probes)


def one_search(pool) -> tuple[float, list]:
    spec, slo = load_spec(SPEC), LatencySlo.parse(SLO)
    start = time.perf_counter()
    fleets = list(space(spec, load_catalogue(CATALOGUE), presets=list(PRESETS)))
    evaluated = list(search(spec, fleets, slo, pool=pool))
    return time.perf_counter() - start, evaluated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default bench/results/search.json")
    args = parser.parse_args()
    started, cpus = now(), len(available())
    ways = {"one at a time": lambda: InProcess(), f"{cpus} processes": lambda: Processes(cpus)}
    runs: dict[str, list[tuple[float, list]]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, pool in ways.items():
            runs[way].append(one_search(pool()))
            print(f"{way}: {runs[way][-1][0]:.1f} s", flush=True)
    fronts = {tuple((e.candidate, e.rate) for e in frontier(found)) for way in runs for _, found in runs[way]}
    if len(fronts) != 1:
        raise SystemExit("the runs found different frontiers")
    table = Table(f"`cascadia search` of Inkling 975B over the catalogue's AI PCs in four formats, {SLO}",
                  ["way", "fleets", "by bounds %", "by a cheaper fleet %", "simulated", "seconds", "fleets/s",
                   "simulated req/s"],
                  note="Each run found the same frontier. With a pool, each fleet starts knowing the fleets done by "
                       "then, so a pool may rule out fewer by a cheaper fleet's capacity than one at a time.")
    for way, done in runs.items():
        fleets = sum(e.candidate is not None for e in done[0][1])

        def share(pruned: str) -> dict:
            return spread(100 * sum(e.pruned == pruned for e in found) / fleets for _, found in done)
        table.add(way, fleets, share(BOUNDS), share(DOMINATED),
                  spread(sum(e.capacity is not None for e in found) for _, found in done),
                  spread(s for s, _ in done), spread(fleets / s for s, _ in done),
                  spread(simulated_requests(found) / s for s, found in done))
    print(table.text())
    write("search", "How fast `cascadia search` answers", started, [table], args.out)


if __name__ == "__main__":
    main()
