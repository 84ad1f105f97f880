"""How close the simulator comes, cycle after cycle: calibrate, then validate, CYCLES times in a row.

Scenario: a spec's local plan (default specs/tiny-pinned.yaml: two nodes pinned to a core each). Each cycle measures
a fresh calibration (`cascadia calibrate --watch WATCH`: its rounds' spread over WATCH seconds more), then simulates
and serves the workload REPEATS times (`cascadia validate --repeats --replay --interval`) at the given concurrency
levels (closed loop), or with --rate at the given arrival rates (open loop: Poisson arrivals). Printed per cycle:
the median absolute error over the levels of decode tokens/s and of TTFT p50 (the targets: 5% and 10%), the same
replayed (each run simulated again with its own frames' compute and handling, `simulate
--replay-trace`: the model's error without the machine's drift; the target: 2%), the median spread of the repeated
runs, (largest - smallest) / median: an error within the spread says little about the model; and the share of the
runs' values (every level and figure) that the predicted 80% intervals held, and their median width (the target: at
least 75% held, over all the cycles). Not a test: it prints figures and writes them to
bench/results/prediction-SPEC.json (SPEC: the spec's file name; -open after it for arrival rates, -watchW for a
watch of W seconds other than a minute), with every cycle's errors and intervals by level.

    python bench/prediction.py [SPEC] [--cycles 3] [--repeats 3] [--concurrency 1,2,4,8,16 | --rate 20,60]
                               [--requests 32] [--interval 80] [--watch 60]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
from record import Table, now, shown, write

from cascadia.graph.planner import plan as make_plan
from cascadia.measure.calibrate import calibrate
from cascadia.measure.validate import validate
from cascadia.spec.load import load_spec
from cascadia.workload import override

METRICS = ("decode tok/s", "TTFT p50")
WATCH_S = 60.0  # each calibration's watch of the machine; another one's results are named for it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(Path(__file__).parent.parent / "specs" / "tiny-pinned.yaml"))
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1,2,4,8,16")
    load.add_argument("--rate", help="open loop instead: requests per second, e.g. 20,60")
    parser.add_argument("--requests", type=int, default=32, help="requests per phase")
    parser.add_argument("--interval", type=float, default=80.0, help="the intervals' percent")
    parser.add_argument("--watch", type=float, default=WATCH_S, help="seconds each calibration watches the machine")
    parser.add_argument("--out", type=Path, help="default bench/results/prediction-SPEC.json")
    args = parser.parse_args()
    started = now()
    spec = load_spec(args.spec)
    if args.rate:
        load = f"rates {args.rate} requests/s"
        workload = override(spec.workload, rate=tuple(float(r) for r in args.rate.split(",")), requests=args.requests)
    else:
        load = f"concurrency {args.concurrency}"
        workload = override(spec.workload, tuple(int(c) for c in args.concurrency.split(",")), args.requests)
    spec = attrs.evolve(spec, workload=workload)
    plan = make_plan(spec)
    columns = ["cycle", *(f"{name} |error| %" for name in METRICS), *(f"{name} replayed |error| %" for name in METRICS),
               *(f"{name} spread %" for name in METRICS), f"{args.interval:g}% intervals held", "interval width %"]
    table = Table(f"{shown(args.spec)}: {load}, {args.requests} requests a phase, "
                  f"{args.repeats} runs a cycle, each calibration watching {args.watch:g} s more", columns,
                  note="Median over the levels; replayed: each run against its own trace's replay (median of the "
                       "replays against median of the runs); spread: (largest - smallest) / median of the repeated "
                       f"runs; held: the runs' values (every level and figure) inside their predicted "
                       f"{args.interval:g}% interval; width: (high - low) / median, the median over the levels and "
                       "figures. The targets: decode within 5%, TTFT within 10%; replayed, 2%; at least 75% held "
                       "over all the cycles.")
    cycles, held, values = [], 0, 0
    for cycle in range(1, args.cycles + 1):
        calibration = calibrate(spec, plan, watch_s=args.watch)
        result = validate(spec, plan, calibration, repeats=args.repeats, replay=True, interval=args.interval)
        errors, replayed, spreads = (result["median_abs_error"], result["replay"]["median_abs_error"],
                                     result["median_spread"])
        interval = result["interval"]
        held, values = held + interval["held"], values + interval["values"]
        table.add(cycle, *(100 * errors[name] for name in METRICS), *(100 * replayed[name] for name in METRICS),
                  *(None if spreads[name] is None else 100 * spreads[name] for name in METRICS),
                  f"{interval['held']}/{interval['values']}", 100 * interval["median_width"])
        cycles.append({key: value for key, value in result.items() if key != "replayed"})  # its errors are kept
        print(f"cycle {cycle} done", flush=True)
    table.add("all", *[None] * 3 * len(METRICS), f"{held}/{values} ({held / values:.0%})", None)
    print(table.text())
    named = ("-open" if args.rate else "") + ("" if args.watch == WATCH_S else f"-watch{args.watch:g}")
    write(f"prediction-{Path(args.spec).stem}{named}",
          "How close the simulator comes: calibrate, then validate, cycle after cycle", started,
          [table], args.out, cycles=cycles)


if __name__ == "__main__":
    main()
