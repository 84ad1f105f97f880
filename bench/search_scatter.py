"""How far a searched capacity moves with the workload's random draw, by the requests a probe simulates.

Scenario: one fleet, the README's answer for 0.1 requests a second of Inkling 975B (6 x ryzen-ai-max-395-128gb from
specs/catalogues/ai-pcs.yaml, int4 weights), under ttft_p90=10s,tpot_p90=500ms. Its capacity is bisected as
`cascadia search` does, once per workload seed (SEEDS of them), with probes of at least 64, 250 (the default for a
p90 bound) and 1024 requests (`--probe-requests`). At these rates a probe is its least number of requests, so that
number is how many first tokens its 90th percentile is taken over. Per probe size:
  capacity      requests/s found (median, range over the seeds)
  cv            the seeds' standard deviation over their mean
  max/min       the largest capacity found over the smallest
  seconds       one bisection's time (median over the seeds)
Not a test: it prints its table and writes it to bench/results/search_scatter.json.

    python bench/search_scatter.py [--seeds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
from record import ROOT, Table, now, spread, write

from cascadia.graph.planner import plan as make_plan
from cascadia.search.capacity import capacity
from cascadia.search.slo import LatencySlo
from cascadia.search.space import Candidate
from cascadia.spec.load import load_catalogue, load_spec

SPEC = ROOT / "specs" / "inkling-975b-11pc.yaml"
CATALOGUE = ROOT / "specs" / "catalogues" / "ai-pcs.yaml"
SLO = "ttft_p90=10s,tpot_p90=500ms"
PROBES = (64, 250, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    started, slo = now(), LatencySlo.parse(SLO)
    fleet = Candidate(load_catalogue(CATALOGUE).machine("ryzen-ai-max-395-128gb"), 6, "int4")
    base = fleet.spec(load_spec(SPEC))
    plan, calibration = make_plan(base), fleet.calibration(base)
    found: dict[int, list[tuple[float, float]]] = {}
    for seed in range(args.seeds):
        spec = attrs.evolve(base, workload=attrs.evolve(base.workload, seed=seed))
        for least in PROBES:
            start = time.perf_counter()
            rate = capacity(spec, plan, calibration, slo, least_requests=least).rate
            found.setdefault(least, []).append((rate, time.perf_counter() - start))
            print(f"seed {seed}, probes of {least}: {rate:.4g} requests/s", flush=True)
    table = Table(f"The capacity of {fleet.describe()} (Inkling 975B) under {SLO}, over {args.seeds} workload seeds",
                  ["probe requests", "capacity req/s", "cv", "max/min", "seconds"],
                  note="cv: the seeds' standard deviation over their mean. A probe at these rates is its least "
                       "number of requests; seconds: one bisection, median over the seeds.")
    for least, runs in found.items():
        rates = [rate for rate, _ in runs]
        table.add(least, spread(rates), statistics.stdev(rates) / statistics.mean(rates), max(rates) / min(rates),
                  statistics.median(seconds for _, seconds in runs))
    print(table.text())
    write("search_scatter", "How far a searched capacity moves with the workload's draw", started, [table],
          seeds=args.seeds, fleet=fleet.describe(), slo=SLO)


if __name__ == "__main__":
    main()
