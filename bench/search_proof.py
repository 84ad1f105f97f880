"""Whether `cascadia search`'s answer holds: the capacity it predicts from measured times, served for real.

Scenario: the tiny model (specs/tiny-pinned.yaml's model, runtime and workload) with this machine's cores as the
machines to buy. One core is measured with the whole model on it (`cascadia calibrate` of a one-node spec pinned to
CPU 0), and the link between two cores is what `cascadia calibrate` of the two-node pinned plan measures; a
catalogue lists that core (`calibration: {file, node}`, price 1: a unit, not money). `cascadia search` then bisects
the capacity of one and of two cores under a loose objective (--slo) and writes each frontier fleet's spec and
calibration. Each is served for real, its nodes pinned to CPUs 0 and 1 as the calibration's were (`validate`: the
simulation and the run of the same requests), at the capacity found and at 1.5 times it, ROUNDS times, rounds
alternating which rate goes first. Per fleet and rate:
  met           runs that met the objective (its percentiles, over the measured phase, within their bounds)
  goodput       the share of requests that met both bounds themselves, measured (median, range) and predicted
  TTFT, TPOT    the objective's percentiles, measured and predicted
The claim (the search issue's proof): at the capacity the objective is met with goodput >= 90%, at 1.5 times it is
not. Not a test (it measures this machine's speed); writes bench/results/search_proof.json.

    python bench/search_proof.py [--slo ttft_p90=100ms,tpot_p99=60ms] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
from record import ROOT, Table, calibrate, now, spread, write

from cascadia.graph.planner import plan as make_plan
from cascadia.measure.validate import validate
from cascadia.metrics import RequestRecord
from cascadia.search.capacity import probe_requests
from cascadia.search.slo import LatencySlo
from cascadia.sim.calibration import Calibration
from cascadia.spec.dump import write_spec
from cascadia.spec.load import load_spec
from cascadia.workload import MEASURED

SPEC = ROOT / "specs" / "tiny-pinned.yaml"
FACTORS = (0.75, 1.0, 1.5)


def pinned(spec):
    """`spec` with its node i on CPU i, as tiny-pinned's nodes are."""
    nodes = tuple(attrs.evolve(node, cpus=(i,)) for i, node in enumerate(spec.cluster.nodes))
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))


def catalogue(folder: Path) -> Path:
    """A catalogue of one machine, a core of this one: measured alone holding the whole model, linked as two
    pinned nodes measure their link."""
    spec = load_spec(SPEC)
    one = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=spec.cluster.nodes[:1]))
    (folder / "one").mkdir()
    (folder / "two").mkdir()
    core = calibrate(write_spec(one, folder / "one" / "spec.yaml"), folder / "one")
    link = Calibration.load(calibrate(SPEC, folder / "two")).links[("node0", "node1")]
    (node,) = Calibration.load(core).nodes
    path = folder / "cores.yaml"
    path.write_text(f"""\
machines:
  - name: core
    source: one core of this machine, measured alone with the whole model; its link as two pinned nodes measure it
    memory: 1GiB
    link: {{bandwidth: {link.bandwidth / 1e9:.4g}GB/s, latency: {link.latency * 1e6:.4g}us}}
    price: 1
    calibration: {{file: {core}, node: {node}}}
""")
    return path


def judged(result: dict, slo: LatencySlo):
    """The objective's verdict on one backend's result (its measured phase)."""
    records = [RequestRecord(**r) for r in result["requests"] if r["phase"] == MEASURED]
    return slo.judge(records, result["levels"][0]["rejected"])


def said(verdict) -> str:
    """A verdict in words: met or missed, goodput and each bound's percentile."""
    seen = ", ".join(f"{metric} {1e3 * (seconds or 0):.1f} ms" for metric, seconds in verdict.quantiles.items())
    return f"{'met' if verdict.met else 'missed'} (goodput {verdict.goodput:.0%}, {seen})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slo", default="ttft_p90=100ms,tpot_p99=60ms")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default bench/results/search_proof.json")
    args = parser.parse_args()
    started, slo = now(), LatencySlo.parse(args.slo)
    folder = Path(tempfile.mkdtemp(prefix="cascadia-search-proof-"))
    cores = catalogue(folder)
    found = folder / "found"
    done = subprocess.run([sys.executable, "-m", "cascadia", "search", str(SPEC), "--catalogue", str(cores), "--slo",
                           args.slo, "--most", "2", "--jobs", "1", "--out", str(found)], capture_output=True, text=True)
    print(done.stdout)
    if done.returncode:
        sys.exit(f"cascadia search failed with status {done.returncode}:\n{done.stderr[-3000:]}")
    answer = json.loads((found / "search.json").read_text())
    fleets = [answer["candidates"][i] for i in answer["frontier"]]
    runs: dict[tuple[int, float], list] = {}
    for round_ in range(args.rounds):
        for i, fleet in enumerate(fleets):
            spec = pinned(load_spec(found / f"frontier-{i}.yaml"))
            calibration = Calibration.load(found / f"frontier-{i}.calibration.json")
            for factor in FACTORS if round_ % 2 == 0 else FACTORS[::-1]:
                rate = fleet["capacity_rps"] * factor
                workload = attrs.evolve(spec.workload, rate=(rate,),
                                        requests=probe_requests(rate, slo, answer["tolerance"]))
                at = attrs.evolve(spec, workload=workload)
                result = validate(at, make_plan(at), calibration)
                measured, predicted = judged(result["measured"][0], slo), judged(result["predicted"], slo)
                runs.setdefault((i, factor), []).append((measured, predicted))
                print(f"round {round_ + 1}: {fleet['count']} x core at {rate:.4g}/s: measured {said(measured)}; "
                      f"predicted {said(predicted)}", flush=True)
    metrics = [f"{b.metric.upper()} p{b.percentile:g} ms" for b in slo.bounds]
    table = Table(f"The search's capacity of this machine's cores served for real, {args.slo} (tiny model)",
                  ["fleet", "rate x capacity", "rate /s", "met", "met predicted", "goodput %", "goodput predicted %",
                   *(f"{m} {side}" for m in metrics for side in ("measured", "predicted"))],
                  note="met: runs of the rounds that met the objective. Measured figures are the median (range) of "
                       "the rounds; predicted ones the simulation of the same requests. Claimed: met with goodput "
                       ">= 90% at the capacity, missed at 1.5 times it.")
    for (i, factor), pairs in sorted(runs.items()):
        fleet = fleets[i]
        table.add(f"{fleet['count']} x core", factor, fleet["capacity_rps"] * factor,
                  f"{sum(m.met for m, _ in pairs)}/{len(pairs)}", f"{sum(p.met for _, p in pairs)}/{len(pairs)}",
                  spread(100 * m.goodput for m, _ in pairs),
                  spread(100 * p.goodput for _, p in pairs),
                  *(spread(1e3 * (side.quantiles[b.metric] or 0) for side in sides)
                    for b in slo.bounds for sides in ([m for m, _ in pairs], [p for _, p in pairs])))
    print(table.text())
    write("search_proof", "Whether the search's capacity holds when served for real", started, [table], args.out,
          slo=args.slo, search=answer)


if __name__ == "__main__":
    main()
