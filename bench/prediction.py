"""How close the simulator comes, cycle after cycle: calibrate, then validate, CYCLES times in a row.

Scenario: a spec's local plan (default specs/tiny-pinned.yaml: two nodes pinned to a core each). Each cycle measures
a fresh calibration (`cascadia calibrate`), then simulates and serves the workload REPEATS times (`cascadia validate
--repeats`) at the given concurrency levels. Printed per cycle: the median absolute error over the levels of decode
tokens/s and of TTFT p50 (the targets: 5% and 10%), and beside each the median spread of the repeated runs, (largest
- smallest) / median: an error within the spread says little about the model. Not a test: it prints figures.

    python bench/prediction.py [SPEC] [--cycles 3] [--repeats 3] [--concurrency 1,2,4,8,16] [--requests 32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from cascadia.graph.planner import plan as make_plan
from cascadia.host_cpus import describe, identity
from cascadia.measure.calibrate import calibrate
from cascadia.measure.validate import validate
from cascadia.spec.load import load_spec
from cascadia.table import format_rows

METRICS = ("decode tok/s", "TTFT p50")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(Path(__file__).parent.parent / "specs" / "tiny-pinned.yaml"))
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=32, help="requests per phase")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    levels = tuple(int(c) for c in args.concurrency.split(","))
    spec = attrs.evolve(spec, workload=attrs.evolve(spec.workload, concurrency=levels, rate=(),
                                                    requests=args.requests))
    plan = make_plan(spec)
    rows = [("cycle", *(f"{name} |error|" for name in METRICS), *(f"{name} spread" for name in METRICS))]
    for cycle in range(1, args.cycles + 1):
        calibration = calibrate(spec, plan)
        result = validate(spec, plan, calibration, repeats=args.repeats)
        errors, spreads = result["median_abs_error"], result["median_spread"]
        rows.append((str(cycle), *(f"{errors[name]:.1%}" for name in METRICS),
                     *(f"{spreads[name]:.1%}" if spreads[name] is not None else "-" for name in METRICS)))
        print(f"cycle {cycle} done", flush=True)
    print(f"{args.spec}: concurrency {args.concurrency}, {args.requests} requests a phase, {args.repeats} runs a "
          f"cycle; {describe(identity())}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
