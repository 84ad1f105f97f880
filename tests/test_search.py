"""`cascadia search`: the catalogue, the latency objective, the capacity bisection, and the command end to end on the
tiny spec (simulated from the catalogue's figures: no weights, no processes but one)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.errors import PlanError, SpecError
from cascadia.graph.planner import plan as make_plan
from cascadia.metrics import RequestRecord
from cascadia.search.bounds import bounds, least_mean_cost
from cascadia.search.capacity import arrival_seconds, fewest_requests, highest_rate, probe_requests, serves_users
from cascadia.search.fanout import Processes, RayCluster
from cascadia.search.search import BOUNDS, DOMINATED, cheapest, cheapest_for_users, evaluate, frontier, search
from cascadia.search.space import Candidate, Settings, Unfit, settings_grid, space
from cascadia.search.slo import LatencySlo
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import Calibration
from cascadia.sim.simulate import simulate
from cascadia.spec.load import load_catalogue, load_spec
from cascadia.spec.dump import write_spec
from cascadia.spec.types import Catalogue, LinkSpec, MachineType
from cascadia.workload import MEASURED

ROOT = Path(__file__).parent.parent
TINY = ROOT / "specs" / "tiny-local.yaml"
CATALOGUE = """\
machines:
  - {name: small, memory: 1GiB, memory_bandwidth: 2GB/s, compute: 200GFLOPS, device: CPU, price: 300, power: 15}
  - {name: big, memory: 4GiB, memory_bandwidth: 8GB/s, compute: 1TFLOPS, price: 900,
     link: {bandwidth: 10gbit, latency: 20us}}
  - {name: slow, memory: 1GiB, memory_bandwidth: 1GB/s, price: 100}
"""
SLO = "ttft_p90=20ms,tpot_p99=5ms"


@pytest.fixture
def catalogue(tmp_path) -> Path:
    path = tmp_path / "catalogue.yaml"
    path.write_text(CATALOGUE)
    return path


# ---- the bisection --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("boundary, start", [(1.0, 1.0), (37.5, 0.2), (0.013, 5.0), (1234.5, 1234.5 * 1.01)])
@pytest.mark.parametrize("tolerance", [0.05, 0.01])
def test_the_bisection_lands_within_its_tolerance_below_the_boundary(boundary, start, tolerance):
    asked = []

    def meets(rate):
        asked.append(rate)
        return rate <= boundary

    rate, bounded = highest_rate(meets, start, tolerance)
    assert bounded and boundary / (1 + tolerance) <= rate <= boundary
    assert meets(rate) and not meets(rate * (1 + tolerance))  # the reported rate met it; one tolerance above did not
    assert len(asked) < 40


def test_the_bisection_says_when_it_found_no_boundary():
    assert highest_rate(lambda rate: True, 1.0, reach=64) == (64.0, False)
    assert highest_rate(lambda rate: False, 1.0, reach=64) == (0.0, True)


# ---- the objective --------------------------------------------------------------------------------------------------
def record(i: int, ttft: float, tpot: float | None) -> RequestRecord:
    tokens = 1 if tpot is None else 11
    return RequestRecord(None, 1.0, MEASURED, i, 8, tokens, 0.0, ttft, ttft + (tpot or 0) * (tokens - 1), ())


def test_an_objective_reads_its_percentiles_and_bounds():
    slo = LatencySlo.parse("ttft_p90=10s, tpot_p99.5=400ms")
    assert [(b.metric, b.percentile, b.seconds) for b in slo.bounds] == [("ttft", 90, 10.0), ("tpot", 99.5, 0.4)]
    assert str(slo) == "ttft_p90=10s,tpot_p99.5=400ms"
    assert LatencySlo.parse(str(slo)) == slo
    assert LatencySlo.parse("ttft_p50=2s").per_request().tpot == math.inf


@pytest.mark.parametrize("text, words", [
    ("tpot_p99=400ms", "bounds no first token"), ("ttft=10s", "not like ttft_p90=10s"),
    ("ttft_p0=1s", "in (0, 100]"), ("ttft_p101=1s", "in (0, 100]"), ("ttft_p90=-1s", "negative"),
    ("ttft_p90=0s", "more than zero"),
    ("ttft_p90=10 parsecs", "ttft_p90"), ("ttft_p90=1s,ttft_p99=2s", "bounded twice"), ("ttft_p90=", "not like")])
def test_a_malformed_objective_says_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=None) as caught:
        LatencySlo.parse(text)
    assert words in str(caught.value)


def test_an_objective_judges_the_quantiles_of_a_phase():
    rng = np.random.default_rng(0)
    ttfts, tpots = rng.uniform(0, 2, 200), rng.uniform(0, 0.1, 200)
    records = [record(i, t, p) for i, (t, p) in enumerate(zip(ttfts, tpots))] + [record(200, 0.5, None)]
    slo = LatencySlo.parse(f"ttft_p90={np.percentile([*ttfts, 0.5], 90) + 1e-9}s,tpot_p99=1s")
    verdict = slo.judge(records)
    assert verdict.met and verdict.quantiles["tpot"] == pytest.approx(np.percentile(tpots, 99))
    assert not LatencySlo.parse(f"ttft_p90={np.percentile([*ttfts, 0.5], 90) - 1e-6}s").judge(records).met
    assert not slo.judge(records, rejected=1).met  # a refused request misses it
    assert verdict.goodput == pytest.approx(np.mean([t <= slo.bounds[0].seconds for t in [*ttfts, 0.5]]))


def test_the_arrivals_span_long_enough_for_a_rate_over_capacity_to_show():
    # 5% over capacity for S seconds leaves the 90th-percentile request q S t / (1 + t) waiting: the bound itself
    seconds = arrival_seconds(LatencySlo.parse("ttft_p90=10s"), 0.05)
    assert 0.9 * seconds * 0.05 / 1.05 == pytest.approx(10.0)



@pytest.mark.parametrize("ttft, least", [("ttft_p90=10s", 250), ("ttft_p50=1s", 64), ("ttft_p99=1s", 2500),
                                         ("ttft_p100=1s", 2500), ("ttft_p95=1s", 500)])
def test_a_probe_holds_by_default_enough_requests_beyond_the_first_token_percentile(ttft, least):
    slo = LatencySlo.parse(ttft + ",tpot_p99=1s")
    assert fewest_requests(slo) == least and fewest_requests(slo, 32) == 32
    assert probe_requests(1e-3, slo) == least  # a low rate: the fewest

# ---- the catalogue --------------------------------------------------------------------------------------------------
def test_the_shipped_catalogue_loads_with_its_sources():
    shipped = load_catalogue(ROOT / "specs" / "catalogues" / "ai-pcs.yaml")
    assert "x7-358h-64gb" in [m.name for m in shipped.machines] and shipped.currency == "USD"
    paper = shipped.machine("x7-358h-64gb")
    cluster = load_spec(ROOT / "specs" / "inkling-975b-11pc.yaml").cluster.nodes[0]
    assert (paper.memory_bytes, paper.memory_bandwidth, paper.compute_flops) == \
        (cluster.memory_bytes, cluster.memory_bandwidth, cluster.compute_flops)  # the paper's figures, as its spec's
    assert all(m.source and m.price > 0 and m.power_w for m in shipped.machines)


@pytest.mark.parametrize("text, where", [
    ("machines:\n  - {name: a, memory: 1GiB, price: 1}\n", ":2: machines[0].memory_bandwidth: missing"),
    ("machines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s}\n", ":2: machines[0].price: missing"),
    ("machines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s, price: -5}\n", "machines[0].price: must be"),
    ("machines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s, price: 1, colour: red}\n",
     "machines[0].colour: unknown key"),
    ("machines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s, price: 1}\n"
     "  - {name: a, memory: 2GiB, memory_bandwidth: 1GB/s, price: 1}\n", ":3: machines[1].name: 'a' is machines[0]"),
    ("machines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s, price: 1, link: {bandwidth: 0}}\n",
     "machines[0].link.bandwidth"),
    ("machines: []\n", "machines: expected a list of machine types"),
    ("currency: dollars\nmachines:\n  - {name: a, memory: 1GiB, memory_bandwidth: 1GB/s, price: 1}\n",
     ":1: currency: expected a three-letter"),
    ("machines: [\n", "catalogue.yaml")])
def test_a_bad_catalogue_is_named_at_its_line_and_key(tmp_path, text, where):
    path = tmp_path / "catalogue.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_catalogue(path)
    assert where in str(caught.value) and str(path) in str(caught.value)


# ---- capacity on the tiny model -------------------------------------------------------------------------------------
def fleet(catalogue: Path, name: str, count: int = 1, formats: str = "spec") -> Candidate:
    return Candidate(load_catalogue(catalogue).machine(name), count, formats)


def test_the_capacity_found_is_met_and_a_tolerance_above_it_is_not(catalogue):
    spec, slo, tolerance = load_spec(TINY), LatencySlo.parse(SLO), 0.05
    evaluated = evaluate(spec, fleet(catalogue, "small"), slo, tolerance)
    assert evaluated.capacity.bounded and evaluated.pruned is None
    rate = evaluated.rate
    fleet_spec = evaluated.candidate.spec(spec)
    calibration = analytic_calibration(fleet_spec, open_loop=True)
    seconds = arrival_seconds(slo, tolerance)

    def judged(at: float):
        workload = attrs.evolve(spec.workload, rate=(at,), requests=probe_requests(at, slo, tolerance), slo=None)
        result = simulate(attrs.evolve(fleet_spec, workload=workload), calibration, make_plan(fleet_spec),
                          warm_up=False)
        return slo.judge([RequestRecord(**r) for r in result["requests"] if r["phase"] == MEASURED])

    assert judged(rate) == evaluated.capacity.at_rate and judged(rate).met
    # the lowest rate above it that the bisection tried was within the tolerance, and missed (simulated again)
    above = min(p.rate for p in evaluated.capacity.probes if p.rate and p.rate > rate)
    assert above <= rate * (1 + tolerance) and not judged(above).met
    # one request at a time was the first probe; each later probe's requests kept arriving for `seconds`
    assert evaluated.capacity.probes[0].rate is None
    assert all(p.verdict.requests >= p.rate * seconds for p in evaluated.capacity.probes[1:])


def test_an_objective_missed_even_alone_carries_nothing_and_says_why(catalogue):
    spec, slo = load_spec(TINY), LatencySlo.parse("ttft_p90=1ms")
    pruned = evaluate(spec, fleet(catalogue, "slow"), slo)
    assert pruned.pruned == BOUNDS and pruned.capacity is None and "misses it even alone: ttft at least" in pruned.why
    simulated = evaluate(spec, fleet(catalogue, "slow"), slo, prune=False)
    assert simulated.rate == 0 and "misses it with one request at a time (ttft p90 " in simulated.capacity.reason
    assert len(simulated.capacity.probes) == 1


@pytest.mark.parametrize("name, count, formats", [("small", 1, "spec"), ("slow", 2, "spec"), ("slow", 3, "int8")])
def test_the_bounds_hold_for_what_the_simulator_finds(catalogue, name, count, formats):
    spec, candidate = load_spec(TINY), fleet(catalogue, name, count, formats)
    simulated = evaluate(spec, candidate, LatencySlo.parse(SLO), prune=False)
    found, fleet_spec = simulated.bounds, candidate.spec(spec)
    alone = attrs.evolve(fleet_spec, workload=attrs.evolve(spec.workload, concurrency=(1,), requests=8))
    records = [RequestRecord(**r) for r in simulate(alone, analytic_calibration(fleet_spec, open_loop=True),
                                                    simulated.plan)["requests"] if r["phase"] == MEASURED]
    soonest, fastest = min(r.ttft for r in records), min(r.tpot for r in records)
    assert found.ttft_s <= soonest and found.tpot_s <= fastest
    assert found.ttft_s > 0.5 * soonest and found.tpot_s > 0.5 * fastest  # close enough to rule fleets out
    assert 0 < simulated.rate <= found.capacity_rps


def test_the_least_mean_cost_mixes_the_frame_sizes_either_side_of_the_bound():
    trips, costs = [1.0, 2.0, 4.0], [10.0, 6.0, 1.0]
    assert least_mean_cost(trips, costs, 0.5) == math.inf  # no frame comes round that soon
    assert least_mean_cost(trips, costs, 1.0) == 10.0
    # at 3: half of 2 and half of 4 (3.5) beats a third of 1 and two thirds of 4 (4.0) and 2 alone (6.0)
    assert least_mean_cost(trips, costs, 3.0) == pytest.approx(3.5)
    assert least_mean_cost(trips, costs, 9.0) == 1.0


WEAK_SLO = "ttft_p90=5ms,tpot_p99=0.17ms"
WEAK = "machines:\n  - {name: weak, memory: 1GiB, memory_bandwidth: 8GB/s, compute: 20GFLOPS, price: 100}\n"


def test_a_bound_on_later_tokens_limits_the_rows_a_frame_may_carry_and_the_capacity_bound_still_holds(tmp_path):
    """On a machine whose frames of many rows go round slower than the objective allows a later token, the capacity
    bound within it is lower than the bound on throughput alone, and no lower than what the simulator finds."""
    path = tmp_path / "weak.yaml"
    path.write_text(WEAK)
    spec = load_spec(TINY)
    candidate = Candidate(load_catalogue(path).machine("weak"), 1, "spec")
    fleet_spec = candidate.spec(spec)
    plan, calibration = make_plan(fleet_spec), candidate.calibration(fleet_spec)
    slo = LatencySlo.parse(WEAK_SLO)
    within = bounds(fleet_spec, plan, calibration, slo)
    throughput = bounds(fleet_spec, plan, calibration, LatencySlo.parse(WEAK_SLO.split(",")[0]))
    assert within.capacity_rps < 0.8 * throughput.capacity_rps
    simulated = evaluate(spec, candidate, slo, prune=False)
    assert 0 < simulated.rate <= within.capacity_rps


def test_the_slots_bound_the_requests_a_second(catalogue):
    """Each request holds a slot from its admission to its last token, at least its soonest first token and later
    tokens: with one slot, no more requests a second than one over that time (Little's law)."""
    spec = load_spec(TINY)
    spec = attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, max_streams=1))
    candidate = fleet(catalogue, "small")
    fleet_spec = candidate.spec(spec)
    found = bounds(fleet_spec, make_plan(fleet_spec), candidate.calibration(fleet_spec))
    assert found.capacity_rps == pytest.approx(1 / (found.ttft_s + (spec.workload.output_tokens - 1) * found.tpot_s))
    assert 0 < evaluate(spec, candidate, LatencySlo.parse(SLO), prune=False).rate <= found.capacity_rps


def test_the_space_runs_from_the_fewest_machines_to_twice_as_many_in_each_preset(catalogue, tmp_path):
    spec, machines = load_spec(TINY), load_catalogue(catalogue)
    fleets = list(space(spec, machines, ["small", "big"], ["spec", "int8"]))
    assert [(c.machine.name, c.formats, c.count) for c in fleets] == [
        ("small", "spec", 1), ("small", "spec", 2), ("big", "spec", 1), ("big", "spec", 2),
        ("small", "int8", 1), ("small", "int8", 2), ("big", "int8", 1), ("big", "int8", 2)]
    assert [c.count for c in space(spec, machines, ["small"], most=5)] == [1, 2, 3, 4, 5]
    assert [c.count for c in space(spec, machines, ["small"], most=9)] == [1, 2, 3, 4, 5, 6]  # one layer each at most
    fleet_spec = fleets[4].spec(spec)
    assert fleet_spec.model.formats.attention.dtype == "int8"
    assert [node.name for node in fleet_spec.cluster.nodes] == ["small0"]
    path = tmp_path / "small.yaml"
    path.write_text("machines:\n  - {name: tiny, memory: 64.1MiB, memory_bandwidth: 1GB/s, price: 1}\n")
    assert list(space(spec, load_catalogue(path))) == [Unfit(load_catalogue(path).machines[0], "spec")]


LADDER = """\
machines:
  - {name: crawl, memory: 1GiB, memory_bandwidth: 0.1GB/s, price: 10}
  - {name: slow, memory: 1GiB, memory_bandwidth: 1GB/s, price: 40}
  - {name: fast, memory: 1GiB, memory_bandwidth: 8GB/s, price: 45}
"""


@pytest.mark.parametrize("settings", [(Settings(),), settings_grid(max_streams=(4, 16))], ids=["spec's", "streams"])
def test_pruning_never_drops_a_fleet_that_simulation_would_keep(tmp_path, settings):
    """On a small exhaustive grid: what the bounds rule out carries nothing when simulated, what a cheaper fleet's
    capacity rules out carries no more than it, and the frontier and the cheapest for each load are the same."""
    path = tmp_path / "ladder.yaml"
    path.write_text(LADDER)
    spec, slo = load_spec(TINY), LatencySlo.parse("ttft_p90=20ms,tpot_p99=8ms")
    fleets = list(space(spec, load_catalogue(path), most=3, settings=settings))
    pruned, every = list(search(spec, fleets, slo)), list(search(spec, fleets, slo, prune=False))
    assert [e.candidate for e in pruned] == [e.candidate for e in every]
    kinds = {e.pruned for e in pruned}
    assert {BOUNDS, DOMINATED, None} <= kinds  # the grid exercises both kinds of pruning
    for cut, whole in zip(pruned, every):
        assert whole.pruned is None
        if cut.pruned == BOUNDS:
            assert whole.rate == 0
        elif cut.pruned == DOMINATED:
            cheaper = [e for e in every if e.candidate.price <= cut.candidate.price and e is not whole]
            assert whole.rate <= max(e.rate for e in cheaper)
        else:
            assert cut.rate == whole.rate
    assert [e.candidate for e in frontier(pruned)] == [e.candidate for e in frontier(every)]
    for load in sorted({e.rate for e in every if e.rate}):
        assert cheapest(pruned, load).candidate == cheapest(every, load).candidate


def test_the_cheapest_fleet_for_some_users_serves_them_and_no_cheaper_fleet_does(tmp_path):
    path = tmp_path / "ladder.yaml"
    path.write_text(LADDER)
    spec, slo = load_spec(TINY), LatencySlo.parse("ttft_p90=20ms,tpot_p99=8ms")
    evaluated = list(search(spec, list(space(spec, load_catalogue(path), most=3)), slo))
    found = cheapest_for_users(spec, evaluated, slo, users=12)
    answer = found.fleet
    assert answer is not None and found.tried[-1][1].met and not any(v.met for _, v in found.tried[:-1])
    assert [e.candidate.price for e, _ in found.tried] == sorted(e.candidate.price for e, _ in found.tried)
    assert len(found.tried) > 1  # some cheaper fleet carries requests, yet not twelve users at once
    for each in evaluated:  # every cheaper fleet, tried or not, fails them in a closed loop of its own
        if each.candidate and each.candidate.price < answer.candidate.price:
            fleet_spec = each.candidate.spec(spec)
            calibration = each.candidate.calibration(fleet_spec)
            assert not serves_users(fleet_spec, each.plan or make_plan(fleet_spec), calibration, slo, 12).met
    assert cheapest_for_users(spec, evaluated, slo, users=200).fleet is None  # 16 slots: the rest wait


def test_the_frontier_is_what_no_cheaper_fleet_beats(catalogue):
    spec, slo = load_spec(TINY), LatencySlo.parse(SLO)
    evaluated = [evaluate(spec, fleet(catalogue, name), slo) for name in ("small", "big", "slow")]
    small, big, slow = evaluated
    assert 0 < slow.rate < small.rate < big.rate  # bandwidth decides on this memory-bound model
    assert frontier(evaluated) == [slow, small, big]
    assert cheapest(evaluated, slow.rate) is slow
    assert cheapest(evaluated, small.rate) is small and cheapest(evaluated, big.rate) is big
    assert cheapest(evaluated, big.rate * 2) is None
    assert frontier([small, big, evaluate(spec, fleet(catalogue, "small", 2), slo)])[:1] == [small]


# ---- runtime settings -----------------------------------------------------------------------------------------------
def test_each_setting_is_weighed_from_the_fewest_machines_that_hold_it(tmp_path):
    """max_streams sizes the K/V pool: on machines with little room, more streams need more of them."""
    path = tmp_path / "tight.yaml"
    path.write_text("machines:\n  - {name: tight, memory: 67MiB, memory_bandwidth: 2GB/s, price: 100}\n")
    spec = load_spec(TINY)
    fleets = list(space(spec, load_catalogue(path), settings=settings_grid((4, 16, 64), (4,))))
    counts = {}
    for fleet in fleets:
        counts.setdefault(fleet.settings.max_streams, []).append(fleet.count)
        fleet_spec = fleet.spec(spec)
        assert (fleet_spec.runtime.max_streams, fleet_spec.runtime.prefill_window) == (fleet.settings.max_streams, 4)
    assert counts == {4: [1, 2], 16: [2, 3, 4], 64: [3, 4, 5, 6]}  # twice the fewest, at most a machine a layer
    assert fleets[2].describe() == "2 x tight, max_streams 16, prefill_window 4"
    with pytest.raises(SpecError, match="max_streams 1, prefill_window 100: 100 prompt rows exceed what max_streams "
                                        r"\(1\) x context_budget \(64\) positions hold"):
        list(space(spec, load_catalogue(path), settings=settings_grid((1,), (100,))))


def test_search_weighs_runtime_settings_and_writes_them_into_the_frontier_specs(catalogue, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO, "--machines",
                                      "slow", "--max-streams", "2,16", "--prefill-window", "4,8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"fleet +formats +settings +price USD", result.output), result.output
    written = json.loads((out / "search.json").read_text())
    weighed = {(c["count"], c["max_streams"], c["prefill_window"]) for c in written["candidates"]}
    assert weighed == {(count, streams, window) for count in (1, 2) for streams in (2, 16) for window in (4, 8)}
    for i, index in enumerate(written["frontier"]):
        runtime = load_spec(out / f"frontier-{i}.yaml").runtime
        assert (runtime.max_streams, runtime.prefill_window) == \
            (written["candidates"][index]["max_streams"], written["candidates"][index]["prefill_window"])
    # more slots carry more here (the frames grow), so the frontier's dearest fleet has the most
    assert written["candidates"][written["frontier"][-1]]["max_streams"] == 16


def test_row_buckets_and_pipeline_groups_are_weighed_and_written_into_the_frontier_specs(catalogue, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO, "--machines",
                                      "slow", "--most", "3", "--row-buckets", "1,8", "--row-buckets", "1,2,4,8",
                                      "--groups", "1,3", "--no-prune", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "search.json").read_text())
    weighed = {(c["count"], tuple(c["row_buckets"]), c["pipeline_groups"]) for c in written["candidates"]}
    assert weighed == {(count, buckets, groups) for count in (1, 2, 3) for buckets in ((1, 8), (1, 2, 4, 8))
                       for groups in (1, 3)}
    rates = {(c["count"], tuple(c["row_buckets"]), c["pipeline_groups"]): c["capacity_rps"]
             for c in written["candidates"]}
    for buckets in ((1, 8), (1, 2, 4, 8)):  # one group on three machines keeps two of them idle at any time
        assert rates[3, buckets, 1] < rates[3, buckets, 3] / 2
    for i, index in enumerate(written["frontier"]):
        runtime, chosen = load_spec(out / f"frontier-{i}.yaml").runtime, written["candidates"][index]
        assert list(runtime.row_buckets) == chosen["row_buckets"]
        assert runtime.pipeline_groups == chosen["pipeline_groups"]
    assert re.search(r"3 x slow +spec +row_buckets [\d,]+, pipeline_groups 3 ", result.output), result.output


def test_speculation_is_weighed_with_the_acceptance_given(catalogue, tmp_path):
    """Three slow machines make a token every 1.4 ms alone; n-gram drafts accepted 9 times in 10 bring it under 1.2 ms
    (a stage idle between frames verifies them), never accepted they do not."""
    spec, slo = load_spec(TINY), LatencySlo.parse("ttft_p90=20ms,tpot_p99=1.2ms")
    slow = load_catalogue(catalogue).machine("slow")
    drafting = Candidate(slow, 3, settings=Settings(speculate="ngram:4"))
    assert evaluate(spec, attrs.evolve(drafting, settings=Settings(speculate="off")), slo).rate == 0
    assert evaluate(spec, drafting, slo, acceptance=0.0).rate == 0
    assert evaluate(spec, drafting, slo, acceptance=0.9).rate > 0
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo",
                                      "ttft_p90=20ms,tpot_p99=1.2ms", "--machines", "slow", "--most", "3",
                                      "--speculate", "off,ngram:4", "--acceptance", "0.9", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "search.json").read_text())
    assert written["acceptance"] == 0.9
    assert {c["speculate"] for c in written["candidates"]} == {"off", "ngram:4"}
    for i, index in enumerate(written["frontier"]):
        assert written["candidates"][index]["speculate"] == "ngram:4"
        assert load_spec(out / f"frontier-{i}.yaml").runtime.speculate == "ngram:4"


@pytest.mark.parametrize("arguments, words", [
    (["--acceptance", "0.9"], "--acceptance is the simulated drafts' acceptance: weigh speculation"),
    (["--speculate", "off,ngram:0"], "speculate must be ngram, mtp, ngram+mtp, each optionally :MAX_DRAFT"),
    (["--row-buckets", "8,2"], "'8,2': must be increasing"),
    (["--groups", "0"], "every value must be at least 1"),
])
def test_search_refuses_settings_it_cannot_weigh(catalogue, arguments, words):
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO, *arguments])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output


# ---- mixes of two types --------------------------------------------------------------------------------------------
MIX = """\
machines:
  - {name: narrow, memory: 66MiB, memory_bandwidth: 1GB/s, price: 50, power: 10}
  - {name: wide, memory: 68MiB, memory_bandwidth: 4GB/s, price: 150, power: 20,
     link: {bandwidth: 10gbit, latency: 20us}}
"""


def test_mixes_of_two_types_just_hold_the_model(tmp_path):
    """At 64 streams the tiny model's K/V pool needs 5 narrow machines or 2 wide ones: a mix is k of one type short
    of its fewest and the fewest of the other that make up the rest, no fewer."""
    path = tmp_path / "mix.yaml"
    path.write_text(MIX)
    machines, base = load_catalogue(path), load_spec(TINY)
    spec = Settings(max_streams=64).apply(base)
    fleets = list(space(base, machines, settings=[Settings(max_streams=64)], mixes=True))
    assert [f.fleet() for f in fleets if not f.mix] == ["5 x narrow", "6 x narrow", "2 x wide", "3 x wide", "4 x wide"]
    mixes = [f for f in fleets if f.mix]
    assert [f.fleet() for f in mixes] == ["1 x narrow + 2 x wide", "2 x narrow + 1 x wide", "3 x narrow + 1 x wide",
                                          "4 x narrow + 1 x wide", "1 x wide + 3 x narrow"]
    for fleet in fleets:  # each holds the model; the fewest of a type, or of a mix's second, do so just
        make_plan(fleet.spec(base))
        second, rest = fleet.mix or (fleet.machine, fleet.count)
        short = attrs.evolve(fleet, mix=(second, rest - 1) if rest > 1 else None) if fleet.mix else \
            attrs.evolve(fleet, count=fleet.count - 1)
        if fleet.mix or fleet.count in (5, 2):
            with pytest.raises((PlanError, ValueError)):
                make_plan(short.spec(base))
    mix = mixes[0]
    assert (mix.price, mix.power_w, mix.size, mix.types) == (350, 50, 3, "narrow + wide")
    fleet_spec = mix.spec(base)
    assert [n.name for n in fleet_spec.cluster.nodes] == ["narrow0", "wide0", "wide1"]
    gigabit, ten = LinkSpec(125e6, 100e-6), LinkSpec(1.25e9, 20e-6)
    assert fleet_spec.cluster.link("narrow0", "wide0") == gigabit  # the slower port between the types
    assert fleet_spec.cluster.link("wide0", "wide1") == ten and fleet_spec.cluster.link("wide1", "narrow0") == gigabit
    assert load_spec(write_spec(fleet_spec, tmp_path / "mix-spec.yaml")).cluster == fleet_spec.cluster
    assert fleet_spec.runtime.max_streams == spec.runtime.max_streams
    # a mix is simulated as any fleet: each node from its own type's figures
    calibration = mix.calibration(fleet_spec)
    assert calibration.nodes["narrow0"] != calibration.nodes["wide0"] == calibration.nodes["wide1"]
    assert evaluate(base, mix, LatencySlo.parse("ttft_p90=40ms,tpot_p99=10ms")).rate > 0


def test_a_mix_of_measured_machines_takes_each_ones_times_and_none_mixes_measured_with_estimated(tmp_path):
    measured_catalogue(tmp_path)
    path = tmp_path / "measured-mix.yaml"
    path.write_text("""\
machines:
  - {name: mine, memory: 66MiB, price: 50, calibration: {file: mine.json, node: pc0}}
  - {name: mine-wide, memory: 68MiB, price: 150, calibration: {file: mine.json, node: pc1}}
  - {name: wide, memory: 68MiB, memory_bandwidth: 4GB/s, price: 150}
""")
    base, machines = load_spec(TINY), load_catalogue(path)
    mixes = [f for f in space(base, machines, settings=[Settings(max_streams=64)], mixes=True) if f.mix]
    assert mixes and all({f.machine.name, f.mix[0].name} == {"mine", "mine-wide"} for f in mixes)
    mix = next(f for f in mixes if f.machine.name == "mine")
    calibration = mix.calibration(mix.spec(base))
    pc0, pc1 = (machines.machine(name).calibration.nodes for name in ("mine", "mine-wide"))
    assert [calibration.nodes[name] for name in ("mine0", "mine-wide0")] == [pc0["pc0"], pc1["pc1"]]


def test_search_with_mixes_names_them_and_writes_their_specs(tmp_path):
    """A machine with room for the whole model but slow memory, and a fast one with little room: one of each
    carries about four times what the first carries alone (the slow one holds a layer or two), for less than two of
    the fast one (a margin that no byte more on the wire turns)."""
    path, out = tmp_path / "mix.yaml", tmp_path / "out"
    path.write_text("""\
machines:
  - {name: narrow, memory: 70MiB, memory_bandwidth: 4GB/s, price: 100}
  - {name: deep, memory: 1GiB, memory_bandwidth: 0.5GB/s, price: 90, link: {bandwidth: 10gbit, latency: 20us}}
""")
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(path), "--slo",
                                      "ttft_p90=40ms,tpot_p99=10ms", "--max-streams", "64", "--mixes", "--most", "4",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"\n1 x narrow \+ 1 x deep +spec +max_streams 64 +190 ", result.output), result.output
    written = json.loads((out / "search.json").read_text())
    front = [written["candidates"][index] for index in written["frontier"]]
    mix = next(i for i, fleet in enumerate(front) if fleet["mix"])
    assert (front[mix]["machine"], front[mix]["count"], front[mix]["mix"]) == ("narrow", 1, {"machine": "deep",
                                                                                             "count": 1})
    assert [node.name for node in load_spec(out / f"frontier-{mix}.yaml").cluster.nodes] == ["narrow0", "deep0"]


def test_spares_are_priced_and_listed_but_carry_nothing_more(catalogue, tmp_path):
    spec, slo = load_spec(TINY), LatencySlo.parse(SLO)
    (spared,) = [f for f in space(spec, load_catalogue(catalogue), ["small"], most=1, spares=2)]
    assert (spared.fleet(), spared.price, spared.power_w) == ("1 x small + 2 spares", 900, 15)
    fleet_spec = spared.spec(spec)
    assert [n.name for n in fleet_spec.cluster.spares] == ["small-spare0", "small-spare1"]
    assert load_spec(write_spec(fleet_spec, tmp_path / "spared.yaml")).cluster.spares == fleet_spec.cluster.spares
    assert evaluate(spec, spared, slo).capacity == evaluate(spec, attrs.evolve(spared, spares=0), slo).capacity
    # a mix's spares are of its type with the most memory: any stage fits them
    narrow, wide = (MachineType(name, memory, 1e9, price=price) for name, memory, price in
                    (("narrow", 66 * 2**20, 50), ("wide", 68 * 2**20, 150)))
    mix = Candidate(narrow, 1, mix=(wide, 2), spares=1)
    assert (mix.spare, mix.price, mix.fleet()) == (wide, 500, "1 x narrow + 2 x wide + 1 spare")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO, "--machines",
                                      "slow", "--most", "1", "--spares", "1", "--load", "10", "--out", str(out)])
    assert "cheapest carrying 10 requests/s: 1 x slow + 1 spare, 200 USD" in result.output, result.output
    assert [n.name for n in load_spec(out / "frontier-0.yaml").cluster.spares] == ["slow-spare0"]


# ---- machines measured ----------------------------------------------------------------------------------------------
def measured_catalogue(tmp_path: Path, slower: float = 2.0) -> Path:
    """A catalogue of `small` (a roofline of its figures) and `mine`, measured: a calibration file of two nodes, pc0
    with the times small's roofline gives, pc1 with them `slower` times over; `mine` is pc0, `mine-slow` pc1."""
    spec = load_spec(TINY)
    (tmp_path / "catalogue.yaml").write_text(CATALOGUE)
    small = load_catalogue(tmp_path / "catalogue.yaml").machine("small")
    roofline = analytic_calibration(Candidate(small, 1).spec(spec), open_loop=True)
    (node,) = roofline.nodes.values()
    slow = attrs.evolve(node, tables={kind: attrs.evolve(t, time_s=tuple(tuple(x * slower for x in row)
                                                                        for row in t.time_s))
                                      for kind, t in node.tables.items()})
    measured = attrs.evolve(roofline, meta=attrs.evolve(roofline.meta, kind="measured"),
                            nodes={"pc0": node, "pc1": slow}, links={})
    measured.save(tmp_path / "mine.json")
    path = tmp_path / "measured.yaml"
    path.write_text(CATALOGUE + """\
  - {name: mine, memory: 1GiB, price: 300, calibration: {file: mine.json, node: pc0}}
  - {name: mine-slow, memory: 1GiB, price: 200, calibration: {file: mine.json, node: pc1}}
""")
    return path


def test_a_measured_machine_is_simulated_from_its_measured_times(catalogue, tmp_path):
    spec, slo = load_spec(TINY), LatencySlo.parse(SLO)
    machines = load_catalogue(measured_catalogue(tmp_path))
    mine, slow = machines.machine("mine"), machines.machine("mine-slow")
    assert mine.memory_bandwidth is None and mine.times == f"measured: node pc0 of {tmp_path / 'mine.json'}"
    for count in (1, 2):
        fleet_spec = Candidate(mine, count).spec(spec)
        calibration = Candidate(mine, count).calibration(fleet_spec)
        assert list(calibration.nodes) == [f"mine{i}" for i in range(count)] and not calibration.is_analytic
        assert set(calibration.links) == ({("mine0", "mine1"), ("mine1", "mine0")} if count == 2 else set())
    # pc0's times are small's roofline: the same capacity to the last probe; pc1's are twice as slow
    assert evaluate(spec, Candidate(mine, 2), slo).capacity == evaluate(spec, fleet(catalogue, "small", 2),
                                                                         slo).capacity
    fast, slower = (evaluate(spec, Candidate(machine, 1), slo).rate for machine in (mine, slow))
    assert 0 < slower < 0.6 * fast


def test_search_writes_a_measured_fleets_calibration_beside_its_spec(tmp_path):
    path, out = measured_catalogue(tmp_path), tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(path), "--slo", SLO, "--machines",
                                      "mine", "--most", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "16 out; times measured on mine\n" in result.output
    written = json.loads((out / "search.json").read_text())
    (found,) = written["candidates"]
    assert found["times"].startswith("measured: node pc0 of ") and found["capacity_rps"] > 0
    # `simulate --calibration` of what it wrote reproduces the probe at the capacity
    frontier_spec = load_spec(out / "frontier-0.yaml")
    calibration = Calibration.load(out / "frontier-0.calibration.json")
    simulated = simulate(frontier_spec, calibration, make_plan(frontier_spec))
    verdict = LatencySlo.parse(SLO).judge([RequestRecord(**r) for r in simulated["requests"]
                                           if r["phase"] == MEASURED])
    assert verdict.met and verdict.quantiles["ttft"] == pytest.approx(found["at_capacity"]["ttft_s"], rel=1e-9)


@pytest.mark.parametrize("entry, where", [
    ("calibration: {file: gone.json}", "machines[3].calibration.file: no such file"),
    ("calibration: {file: mine.json}", "machines[3].calibration.node: missing: "),
    ("calibration: {file: mine.json, node: pc7}", "machines[3].calibration.node: 'pc7' is not a node of"),
    ("calibration: {file: catalogue.yaml, node: pc0}", "machines[3].calibration.file: "),
    ("calibration: {node: pc0}", "machines[3].calibration.file: missing"),
    ("calibration: {file: mine.json, node: pc0, rounds: 3}", "machines[3].calibration.rounds: unknown key"),
    ("calibration: {file: mine.json, node: pc0, nodes: [pc1]}", "machines[3].calibration.nodes: give node or nodes, "
                                                               "not both"),
    ("calibration: {file: mine.json, nodes: [pc0, pc7, pc8]}", "machines[3].calibration.nodes: 'pc7', 'pc8' are "
                                                              "not nodes of"),
    ("calibration: {file: mine.json, nodes: [pc0, pc0]}", "machines[3].calibration.nodes: names repeat"),
    ("calibration: {file: mine.json, nodes: []}", "machines[3].calibration.nodes: expected a list of node names"),
    ("calibration: mine.json", "machines[3].calibration: expected a mapping"),
    ("price: 1", "machines[3].memory_bandwidth: missing"),
])
def test_a_bad_measured_machine_is_named_at_its_line_and_key(tmp_path, entry, where):
    measured_catalogue(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(CATALOGUE + "  - {name: mine, memory: 1GiB, %s%s}\n"
                    % (entry, "" if entry.startswith("price") else ", price: 1"))
    with pytest.raises(SpecError) as caught:
        load_catalogue(path)
    assert f"bad.yaml:6: {where}" in str(caught.value), str(caught.value)


@pytest.mark.parametrize("change, formats, words", [
    (lambda spec: spec, "int4", "was measured with routed_experts"),
    (lambda spec: attrs.evolve(spec, runtime=attrs.evolve(spec.runtime, precision="bf16")), "spec",
     "was measured at precision f32; the spec runs bf16"),
    (lambda spec: attrs.evolve(spec, model=attrs.evolve(spec.model, config=attrs.evolve(
        spec.model.config, hidden_size=2 * spec.model.config.hidden_size))), "spec", "made for another model"),
])
def test_a_measured_machine_is_weighed_only_as_it_was_measured(tmp_path, change, formats, words):
    machines = load_catalogue(measured_catalogue(tmp_path))
    with pytest.raises(SpecError) as caught:
        list(space(change(load_spec(TINY)), machines, ["mine"], [formats]))
    assert str(caught.value).startswith("machine mine: ") and words in str(caught.value), str(caught.value)


def test_a_machine_measured_as_a_pipeline_takes_each_kind_from_the_node_that_measured_it(tmp_path):
    """A PC that cannot hold the model alone is measured as a pipeline of its kind: here pcA held every layer and
    the embedding, pcB the head. Named together they are its whole measurement, and weigh as the same times measured
    on one node do; pcA alone lacks the head."""
    path = measured_catalogue(tmp_path)
    mine = load_catalogue(path).machine("mine")
    (node,) = mine.calibration.nodes.values()
    pipeline = {"pcA": attrs.evolve(node, tables={k: t for k, t in node.tables.items() if k != "head"}),
                "pcB": attrs.evolve(node, tables={"head": node.tables["head"]}, frame_s=1.0)}
    attrs.evolve(mine.calibration, nodes=pipeline).save(tmp_path / "pipeline.json")
    path.write_text(path.read_text() + """\
  - {name: split, memory: 1GiB, price: 300, calibration: {file: pipeline.json, nodes: [pcA, pcB]}}
  - {name: part, memory: 1GiB, price: 300, calibration: {file: pipeline.json, nodes: [pcA]}}
""")
    machines, spec, slo = load_catalogue(path), load_spec(TINY), LatencySlo.parse(SLO)
    split = machines.machine("split")
    assert list(split.calibration.nodes) == ["pcA+pcB"]  # pcA's host overheads, not pcB's
    assert evaluate(spec, Candidate(split, 2), slo).rate == evaluate(spec, Candidate(mine, 2), slo).rate > 0
    with pytest.raises(SpecError, match=r"node pcA of .*pipeline.json has no times for head, .* or name the nodes "
                                        r"of a pipeline of this type that together hold it"):
        list(space(spec, Catalogue((machines.machine("part"),))))


def test_a_machine_measured_without_some_layer_kind_is_refused_by_name(tmp_path):
    """A node of a pipeline holds some kinds only (the last one the head): not a machine's whole measurement."""
    machine = load_catalogue(measured_catalogue(tmp_path)).machine("mine")
    (node,) = machine.calibration.nodes.values()
    headless = attrs.evolve(node, tables={k: t for k, t in node.tables.items() if k != "head"})
    machine = attrs.evolve(machine, calibration=attrs.evolve(machine.calibration, nodes={"pc0": headless}))
    with pytest.raises(SpecError, match="node pc0 of .*mine.json has no times for head, which a node of its fleets "
                                        "may hold"):
        list(space(load_spec(TINY), Catalogue((machine,))))


# ---- the command ----------------------------------------------------------------------------------------------------
def test_search_prints_the_fleets_names_the_cheapest_and_writes_what_it_found(catalogue, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO,
                                      "--machines", "small,slow", "--load", "10", "--users", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "cheapest carrying 10 requests/s: 1 x slow, 100 USD" in result.output
    assert re.search(r"cheapest serving 4 users: \d x \w+, [\d,]+ USD \(TTFT p90 \d+ ms, TPOT p99 \d+ ms; the \d+ "
                     r"cheaper fleets tried did not\)", result.output), result.output
    written = json.loads((out / "search.json").read_text())
    assert written["schema"] == "cascadia.search/1" and written["complete"]
    candidates = written["candidates"]
    assert [(c["machine"], c["count"]) for c in candidates] == [("slow", 1), ("slow", 2), ("small", 1), ("small", 2)]
    assert candidates[written["cheapest"]]["machine"] == "slow"
    users = written["users"]
    assert users["users"] == 4 and users["tried"][-1]["met"] and users["cheapest"] == users["tried"][-1]["fleet"]
    small = candidates[2]
    assert small["count"] == 1 and small["price"] == 300 and small["power_w"] == 15 and small["pruned"] is None
    assert small["at_capacity"]["met"] and small["at_capacity"]["ttft_s"] <= 0.02
    assert small["capacity_rps"] == max(p["rate"] for p in small["probes"] if p["met"] and p["rate"])
    assert small["bounds"]["capacity_rps"] >= small["capacity_rps"]
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each frontier fleet's spec: `simulate` takes it as it is, at the capacity found, with the same verdict
    for i, index in enumerate(written["frontier"]):
        frontier_spec = load_spec(out / f"frontier-{i}.yaml")
        assert frontier_spec.workload.rate == (candidates[index]["capacity_rps"],)
        simulated = simulate(frontier_spec, analytic_calibration(frontier_spec), make_plan(frontier_spec))
        verdict = LatencySlo.parse(SLO).judge([RequestRecord(**r) for r in simulated["requests"]
                                               if r["phase"] == MEASURED])
        # the same probe, its warm-up simulated before it this time: the same to the clock's rounding
        assert verdict.met and verdict.quantiles["ttft"] == pytest.approx(candidates[index]["at_capacity"]["ttft_s"],
                                                                          rel=1e-9)
        assert f"wrote {out / f'frontier-{i}.yaml'}" in result.output


def test_a_search_with_longer_probes_keeps_them_longer_and_says_so(catalogue, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO, "--machines",
                                      "slow", "--most", "1", "--probe-requests", "2000", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "search.json").read_text())
    (fleet,) = written["candidates"]
    assert written["probe_requests"] == 2000
    assert all(probe["requests"] >= 2000 for probe in fleet["probes"] if probe["rate"] is not None)
    assert load_spec(out / "frontier-0.yaml").workload.requests >= 2000  # the rate times its span is a few hundred


@pytest.mark.parametrize("arguments, status, words", [
    (["--slo", "ttft_p90=1us"], 1, "no fleet meets ttft_p90=1000ns at any load"),
    (["--slo", "tpot_p99=1s"], 2, "bounds no first token"),
    (["--slo", SLO, "--machines", "small,huge"], 2, "huge: not one of small, big, slow"),
    (["--slo", SLO, "--formats", "int3"], 2, "int3: not one of spec, paper, int8, int4"),
])
def test_search_refuses_what_it_cannot_answer_in_one_line(catalogue, arguments, status, words):
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), *arguments])
    assert result.exit_code == status and words in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("address, words", [("127.0.0.1:{port}", "nothing answers there"),
                                            ("no-port", "expected HOST:PORT")])
def test_search_on_a_ray_cluster_it_cannot_reach_says_so_and_writes_nothing(catalogue, tmp_path, address, words):
    with socket.socket() as unused:  # a port of this machine nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(catalogue), "--slo", SLO,
                                      "--ray", address.format(port=port), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and f"--ray {address.format(port=port)}: {words}" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out" / "search.json").exists()


def test_search_with_a_bad_catalogue_names_it(tmp_path):
    path = tmp_path / "catalogue.yaml"
    path.write_text("machines:\n  - {name: a, memory: 1GiB}\n")
    result = CliRunner().invoke(cli, ["search", str(TINY), "--catalogue", str(path), "--slo", SLO])
    assert result.exit_code == 2 and f"{path}:2: machines[0].memory_bandwidth: missing" in result.output


def test_a_search_stopped_part_way_writes_what_it_evaluated(tmp_path):
    path = tmp_path / "catalogue.yaml"
    path.write_text("machines:\n" + "".join(f"  - {{name: m{i}, memory: 1GiB, memory_bandwidth: {i + 1}GB/s, "
                                            f"price: {100 + i}}}\n" for i in range(25)))
    out = tmp_path / "out"
    search = subprocess.Popen([sys.executable, "-m", "cascadia", "search", str(TINY), "--catalogue", str(path),
                               "--slo", SLO, "--out", str(out)], stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        first = search.stderr.readline()
        assert re.match(r"\[1/50] 1 x m\d+: ", first), first
        search.send_signal(signal.SIGTERM)
        rest = search.stderr.read()
        assert search.wait(timeout=60) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # the search and its pool, whatever happened
            os.killpg(search.pid, signal.SIGKILL)
    written = json.loads((out / "search.json").read_text())
    assert not written["complete"] and 1 <= len(written["candidates"]) < 50
    assert f"interrupted: wrote the {len(written['candidates'])} of 50 fleets" in rest
    assert "terminated by SIGTERM" in rest


# ---- the fan-out ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_pool_of_processes_and_a_local_ray_instance_find_what_one_process_finds(tmp_path):
    path = tmp_path / "ladder.yaml"
    path.write_text(LADDER)
    spec, slo = load_spec(TINY), LatencySlo.parse("ttft_p90=20ms,tpot_p99=8ms")
    fleets = list(space(spec, load_catalogue(path), most=3))
    alone = {e.candidate: e for e in search(spec, fleets, slo)}
    for pool in (Processes(2), RayCluster("local")):
        found = {e.candidate: e for e in search(spec, fleets, slo, pool=pool)}
        assert found.keys() == alone.keys()
        assert [e.candidate for e in frontier(list(found.values()))] == \
            [e.candidate for e in frontier(list(alone.values()))]
        for candidate, each in found.items():  # simulated in both: the same capacity, probe for probe
            if each.capacity and alone[candidate].capacity:
                assert each.capacity == alone[candidate].capacity
            assert (each.pruned == BOUNDS) == (alone[candidate].pruned == BOUNDS)


def test_a_probe_without_its_warm_up_measures_what_it_measures_with_one(catalogue):
    spec = fleet(catalogue, "small").spec(load_spec(TINY))
    spec = attrs.evolve(spec, workload=attrs.evolve(spec.workload, rate=(150.0,), requests=64))
    calibration, plan = analytic_calibration(spec, open_loop=True), make_plan(spec)
    with_it, without = (simulate(spec, calibration, plan, warm_up=warm_up) for warm_up in (True, False))
    assert [r["phase"] for r in without["requests"]] == [MEASURED] * 64
    measured = [r for r in with_it["requests"] if r["phase"] == MEASURED]
    for kept, alone in zip(measured, without["requests"]):
        assert kept["request_id"] == alone["request_id"] and kept["output_tokens"] == alone["output_tokens"]
        start, first = kept["t_arrival"], measured[0]["t_arrival"]  # the measured phase's own clock
        assert start - first == pytest.approx(alone["t_arrival"] - without["requests"][0]["t_arrival"], abs=1e-9)
        assert kept["t_finish"] - start == pytest.approx(alone["t_finish"] - alone["t_arrival"], abs=1e-9)


def test_a_killed_search_leaves_no_pool_process_behind(tmp_path):
    path = tmp_path / "catalogue.yaml"
    path.write_text("machines:\n" + "".join(f"  - {{name: m{i}, memory: 1GiB, memory_bandwidth: {i + 1}GB/s, "
                                            f"price: {100 + i}}}\n" for i in range(25)))
    search = subprocess.Popen([sys.executable, "-m", "cascadia", "search", str(TINY), "--catalogue", str(path),
                               "--slo", SLO, "--jobs", "2"], stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert search.stderr.readline().startswith("[1/50]")  # the pool is up and working
        children = Path(f"/proc/{search.pid}/task/{search.pid}/children").read_text().split()
        pool = [pid for pid in children if "multiprocessing" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(pool) == 3  # two workers and their resource tracker
        search.kill()  # SIGKILL: no chance to close its pool
        search.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive := [pid for pid in pool if _running(pid)]:
            assert time.monotonic() < deadline, f"pool processes {alive} outlived the search"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(search.pid, signal.SIGKILL)


def _running(pid: str) -> bool:
    """Whether process `pid` still runs (a zombie has ended: its parent, gone, cannot reap it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
