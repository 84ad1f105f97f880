"""Whether `cascadia search`'s answer holds: the capacity it predicts from measured times, served for real.

Scenario: the tiny model (specs/tiny-pinned.yaml's model, runtime and workload) with this machine's cores as the
machines to buy. Each round, one core is measured with the whole model on it (`cascadia calibrate` of a one-node spec
pinned to CPU 0) and the link between two cores as `cascadia calibrate` of the two-node pinned plan measures it; a
catalogue lists that core (`calibration: {file, node}`, price 1: a unit, not money); `cascadia search` bisects the
capacity of one and of two cores under a loose objective (--slo) and writes each frontier fleet's spec and
calibration; and each is served for real, its nodes pinned to CPUs 0 and 1 as the calibration's were (`validate`:
the simulation and the run of the same requests), at 0.75, 1 and 1.5 times the capacity found, rounds alternating
which rate goes first. A round takes about a minute: the machine's speed drifts less within it than across
rounds. Per fleet and rate factor, over the rounds:
  capacity      what the search found
  met           rounds that met the objective (its percentiles, over the measured phase, within their bounds),
                measured and predicted
  goodput       the share of requests that met both bounds themselves, measured and predicted
  TTFT, TPOT    the objective's percentiles, measured and predicted
The claim (the search's proof): at the capacity the objective is met with goodput >= 90%, at 1.5 times it is not.
Not a test (it measures this machine's speed); writes bench/results/search_proof.json.

    python bench/search_proof.py [--slo ttft_p90=100ms,tpot_p99=60ms] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def one_round(folder: Path, slo: LatencySlo, order: tuple[float, ...]) -> list[tuple]:
    """Calibrate, search, serve: per frontier fleet and rate factor, (cores, factor, capacity, measured verdict,
    predicted verdict)."""
    found = folder / "found"
    done = subprocess.run([sys.executable, "-m", "cascadia", "search", str(SPEC), "--catalogue", str(catalogue(folder)),
                           "--slo", str(slo), "--most", "2", "--jobs", "1", "--out", str(found)],
                          capture_output=True, text=True)
    print(done.stdout)
    if done.returncode:
        sys.exit(f"cascadia search failed with status {done.returncode}:\n{done.stderr[-3000:]}")
    answer = json.loads((found / "search.json").read_text())
    served = []
    for i, fleet in enumerate(answer["candidates"][j] for j in answer["frontier"]):
        spec = pinned(load_spec(found / f"frontier-{i}.yaml"))
        calibration = Calibration.load(found / f"frontier-{i}.calibration.json")
        for factor in order:
            rate = fleet["capacity_rps"] * factor
            requests = probe_requests(rate, slo, answer["tolerance"])
            workload = attrs.evolve(spec.workload, rate=(rate,), requests=requests)
            at = attrs.evolve(spec, workload=workload)
            result = validate(at, make_plan(at), calibration)
            measured, predicted = judged(result["measured"][0], slo), judged(result["predicted"], slo)
            served.append((fleet["count"], factor, fleet["capacity_rps"], measured, predicted))
            print(f"{fleet['count']} x core at {factor:g} x {fleet['capacity_rps']:.4g}/s: measured {said(measured)}; "
                  f"predicted {said(predicted)}", flush=True)
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slo", default="ttft_p90=100ms,tpot_p99=60ms")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="default bench/results/search_proof.json")
    args = parser.parse_args()
    started, slo = now(), LatencySlo.parse(args.slo)
    folder = Path(tempfile.mkdtemp(prefix="cascadia-search-proof-"))
    runs: dict[tuple[int, float], list] = {}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}: calibrating, searching, serving", flush=True)
        (folder / str(round_)).mkdir()
        for cores, factor, capacity, measured, predicted in one_round(
                folder / str(round_), slo, FACTORS if round_ % 2 == 0 else FACTORS[::-1]):
            runs.setdefault((cores, factor), []).append((capacity, measured, predicted))
    metrics = [f"{b.metric.upper()} p{b.percentile:g} ms" for b in slo.bounds]
    table = Table(f"The search's capacity of this machine's cores served for real, {args.slo} (tiny model)",
                  ["fleet", "rate x capacity", "capacity /s", "met", "met predicted", "goodput %",
                   "goodput predicted %", *(f"{m} {side}" for m in metrics for side in ("measured", "predicted"))],
                  note="Each round calibrates a core afresh, searches, and serves each frontier fleet at its capacity "
                       "times the factor. met: rounds that met the objective. Figures are the median (range) of the "
                       "rounds; predicted ones the simulation of the same requests. Claimed: met with goodput >= "
                       "90% at the capacity, missed at 1.5 times it.")
    for (cores, factor), each in sorted(runs.items()):
        measured, predicted = [m for _, m, _ in each], [p for _, _, p in each]
        table.add(f"{cores} x core", factor, spread(c for c, _, _ in each),
                  f"{sum(m.met for m in measured)}/{len(each)}", f"{sum(p.met for p in predicted)}/{len(each)}",
                  spread(100 * m.goodput for m in measured), spread(100 * p.goodput for p in predicted),
                  *(spread(1e3 * (verdict.quantiles[b.metric] or 0) for verdict in side)
                    for b in slo.bounds for side in (measured, predicted)))
    print(table.text())
    write("search_proof", "Whether the search's capacity holds when served for real", started, [table], args.out,
          slo=args.slo)
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
