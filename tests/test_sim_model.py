import json
from collections import Counter
from pathlib import Path

import attrs
import numpy as np
import pytest
import simpy
from sim_specs import calibration, even_plan, tiny_spec

from cascadia.metrics import Recorder, format_table, summarize_level
from cascadia.policy import Policy, Request
from cascadia.sampling import Sampling
from cascadia.sim.analytic import analytic_calibration
from cascadia.sim.calibration import CalibrationError, CoordinatorCalibration, Extrapolations
from cascadia.sim.model import (FrameShape, PipelineModel, SharedHost, StageCost, coordinator_shares, shared_hosts,
                                stage_hosts)
from cascadia.sim.simulate import simulate
from cascadia.spec.types import LengthSpec, LinkSpec, RuntimeSpec, SloSpec, WorkloadSpec
from cascadia.workload import ClosedLoop, OpenLoop

# Seconds per layer of each kind, chosen distinct so that a wrong count shows.
KIND_TIMES = {"sliding": 1e-3, "global": 2e-3, "moe": 3e-3, "dense": 4e-3, "embedding": 5e-4, "head": 5e-3}
HIDDEN_BYTES = 64 * 4  # the tiny model's FP32 residual row


def run(spec, cal, requests, clients=1, groups=None, traced=False):
    plan = even_plan(spec)
    model = PipelineModel(spec, plan, cal)
    model.timings = [] if traced else None
    policy = Policy.for_runtime(attrs.evolve(spec.runtime, pipeline_groups=groups), len(plan.stages))
    recorder = Recorder(clients, "measured")
    busy = model.run_phase(policy, ClosedLoop([(r,) for r in requests], clients), len(requests), recorder)
    return recorder.records, busy, model


def _three_stages_and_their_links():
    """The tiny model on three nodes, calibrated with KIND_TIMES and links of their own; what one frame of one
    row takes on each stage and on each link (the wire and the latency)."""
    spec = tiny_spec()  # layers S S G S S G, layer 0 dense; two per node
    links = {("n0", "n1"): LinkSpec(1e8, 1e-4), ("n1", "n2"): LinkSpec(2e8, 2e-4), ("n2", "n0"): LinkSpec(5e7, 3e-4)}
    cal = calibration(spec, lambda kind, r, x: KIND_TIMES[kind], frame_s=1e-5, row_s=1e-6, links=links)
    k = KIND_TIMES
    overhead = 1e-5 + 1e-6  # one frame of one row
    stages = [k["embedding"] + 2 * k["sliding"] + k["dense"] + k["moe"] + overhead,
              k["global"] + k["sliding"] + 2 * k["moe"] + overhead,
              k["sliding"] + k["global"] + 2 * k["moe"] + k["head"] + overhead]
    frame, token = 52 + 53 + HIDDEN_BYTES, 52 + 8  # header, a row's indices, flag, sampling and logprobs, residual
    wires = [1e-4 + frame / 1e8, 2e-4 + frame / 2e8, 3e-4 + token / 5e7]  # the last sends one token back
    return spec, cal, stages, wires


def test_single_stream_is_the_sum_of_stage_and_link_times():
    spec, cal, stages, wires = _three_stages_and_their_links()
    [record], busy, _ = run(spec, cal, [Request(0, (7,), 1)])
    assert record.ttft == pytest.approx(sum(stages) + sum(wires), rel=1e-12)
    assert list(busy.values()) == pytest.approx(stages, rel=1e-12)


def test_the_trace_of_a_single_stream_holds_each_stage_and_link_time():
    spec, cal, stages, wires = _three_stages_and_their_links()
    [record], _, model = run(spec, cal, [Request(0, (7,), 1)], traced=True)
    [frame] = model.timings
    assert (frame.group, frame.rows, frame.bucket) == (0, 1, 2)
    handling = 1e-5 + 1e-6  # a frame of one row: outside the compute, in the link, as a run's node handles it
    assert [s.end - s.start for s in frame.stages] == pytest.approx([t - handling for t in stages], rel=1e-12)
    arrivals = [s.received for s in frame.stages[1:]] + [frame.done]
    assert [t - s.end for s, t in zip(frame.stages, arrivals)] == pytest.approx([handling + w for w in wires],
                                                                                rel=1e-9)
    assert (frame.sent, frame.done) == (record.t_arrival, record.token_times[0])


def _pinned(spec, coordinator_cpus):
    """`spec` with its local nodes pinned to CPUs 0, 1, ... in order, and the coordinator to `coordinator_cpus`."""
    nodes = tuple(attrs.evolve(node, cpus=(i,)) for i, node in enumerate(spec.cluster.nodes))
    return attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes, coordinator_cpus=coordinator_cpus))


@pytest.mark.parametrize("coordinator_cpus, shares", [
    (None, {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}),  # unpinned: anywhere on the machine the local nodes hold
    ((0,), {0: 1.0}), ((2,), {2: 1.0}), ((1, 2), {1: 0.5, 2: 0.5}),
    ((5,), {}), ((0, 5), {}),  # a CPU no node holds: its own
])
def test_the_coordinators_work_is_in_every_round_trip_on_its_own_cpu_or_on_the_stages_it_shares(coordinator_cpus,
                                                                                                shares):
    spec, cal, stages, wires = _three_stages_and_their_links()
    spec = _pinned(spec, coordinator_cpus)
    assert coordinator_shares(spec, even_plan(spec)) == pytest.approx(shares)
    cal = attrs.evolve(cal, coordinator=CoordinatorCalibration(3e-4, 2e-5))
    [record], busy, model = run(spec, cal, [Request(0, (7,), 1)], traced=True)
    assert record.ttft == pytest.approx(sum(stages) + sum(wires) + 3e-4 + 2e-5, rel=1e-12)
    assert list(busy.values()) == pytest.approx(stages, rel=1e-12)  # its work is not the nodes'
    [frame] = model.timings
    handling = 1e-5 + 1e-6
    assert [s.end - s.start for s in frame.stages] == pytest.approx([t - handling for t in stages], rel=1e-12)


def test_a_coordinator_on_the_busiest_stages_core_slows_a_full_pipeline_by_its_work():
    spec, cal, stages, _ = _three_stages_and_their_links()
    work = 1e-3
    cal = attrs.evolve(cal, coordinator=CoordinatorCalibration(work, 0.0))
    busiest = max(range(3), key=stages.__getitem__)
    requests = [Request(i, (7,), 40) for i in range(6)]

    def last_token(coordinator_cpus):
        records, _, _ = run(_pinned(spec, coordinator_cpus), cal, requests, clients=6)
        return max(r.t_finish for r in records)

    # three frames in flight keep the busiest stage's core working: there it serves the coordinator's work too
    assert last_token((busiest,)) / last_token((9,)) == pytest.approx(1 + work / stages[busiest], rel=0.02)


def test_rows_and_streams_are_charged_apart():
    spec = tiny_spec()  # prefill window 4: one frame holds 4 prompt rows
    instant = LinkSpec(1e30, 0.0)
    cal = calibration(spec, lambda kind, r, x: 0.0, row_s=1e-6, stream_s=1e-3,
                      links={pair: instant for pair in (("n0", "n1"), ("n1", "n2"), ("n2", "n0"))})
    [alone], _, _ = run(spec, cal, [Request(0, (1, 2, 3, 4), 1)], groups=1)
    assert alone.ttft == pytest.approx(3 * (4e-6 + 1e-3))  # three stages: 4 rows of one stream
    pair, _, _ = run(spec, cal, [Request(0, (1, 2), 1), Request(1, (3, 4), 1)], clients=2, groups=1)
    assert [r.ttft for r in pair] == pytest.approx([3 * (4e-6 + 2e-3)] * 2)  # 4 rows of two streams


def test_the_head_costs_only_the_rows_it_samples():
    spec = tiny_spec()  # prefill window 4, row buckets 2, 4, 8
    cal = calibration(spec, lambda kind, r, x: 1e-3 * r if kind == "head" else 0.0,
                      links={pair: LinkSpec(1e30, 0.0) for pair in (("n0", "n1"), ("n1", "n2"), ("n2", "n0"))})
    [record], _, _ = run(spec, cal, [Request(0, tuple(range(1, 13)), 3)], groups=1)
    # three windows of 4 prompt rows: only the last samples a token, from its last row, padded to 2 rows; so does
    # each decode row
    assert record.ttft == pytest.approx(2e-3, rel=1e-9)
    assert np.diff(record.token_times) == pytest.approx([2e-3, 2e-3], rel=1e-9)


def test_rows_of_distinct_streams_each_read_their_own_keys():
    spec = tiny_spec()  # row buckets 2, 4, 8
    # a table row is one stream's rows: they read its keys once, so the context adds the same whatever the rows
    cal = calibration(spec, lambda kind, r, x: 1e-4 * r + 1e-5 * x if kind in ("sliding", "global") else 0.0)
    cost = StageCost("n0", Counter({"sliding": 1, "global": 1}), cal.nodes["n0"], spec.model.config, cal,
                     Extrapolations(), spec.runtime.row_buckets)
    window = FrameShape(padded_rows=4, rows=3, sliding_context=10.0, global_context=10.0, streams=1, sampled=1)
    decode = attrs.evolve(window, streams=3, sampled=3)  # three streams' decode rows at context 10 on average
    assert cost(window) == pytest.approx(2 * (1e-4 * 4 + 1e-5 * 10), rel=1e-12)
    assert cost(decode) == pytest.approx(2 * (1e-4 * 4 + 1e-5 * 10 + 2 * 1e-5 * 10), rel=1e-12)


def test_decode_slows_as_context_grows_until_the_window():
    spec = tiny_spec()  # sliding window 16
    cal = calibration(spec, lambda kind, r, x: 1e-4 * x if kind in ("sliding", "global") else 0.0,
                      links={pair: LinkSpec(1e30, 0.0) for pair in (("n0", "n1"), ("n1", "n2"), ("n2", "n0"))})
    [record], _, _ = run(spec, cal, [Request(0, (1,), 40)])
    gaps = np.diff(record.token_times)
    # the frame of position p: 4 sliding layers attend min(p + 1, 16) positions, 2 global layers p + 1
    expected = [1e-4 * (4 * min(p + 1, 16) + 2 * (p + 1)) for p in range(1, 40)]
    assert gaps == pytest.approx(expected, rel=1e-9)


def _two_groups_on_two_nodes(host, speedup=None):
    spec = tiny_spec(n_nodes=2, host=host)
    fast = LinkSpec(1e30, 0.0)
    cal = calibration(spec, lambda kind, r, x: 1e-3 if kind in ("moe", "dense", "embedding", "head") else 0.0,
                      links={("n0", "n1"): fast, ("n1", "n0"): fast})
    if speedup is not None:
        cal = attrs.evolve(cal, hosts={host: speedup})
    records, _, _ = run(spec, cal, [Request(i, (1,), 3) for i in range(2)], clients=2)
    return [r.token_times for r in records]


def test_nodes_sharing_a_host_share_its_speed():
    s = 4e-3  # each of the two stages: 4 layers (embedding and head included) of 1 ms
    # On their own hosts the groups overlap: group 1 waits one stage time for node 0, then each group gets a token
    # every two stage times.
    own_hosts = [pytest.approx([2 * s, 4 * s, 6 * s]), pytest.approx([3 * s, 5 * s, 7 * s])]
    assert _two_groups_on_two_nodes(None) == own_hosts
    # One core: group 0 computes alone on node 0 (one stage time), then the two nodes compute side by side at half
    # speed (two stage times per stage), a token every four stage times per group; the last stage is alone again.
    assert _two_groups_on_two_nodes("box") == [pytest.approx([3 * s, 7 * s, 11 * s]),
                                                pytest.approx([5 * s, 9 * s, 12 * s])]
    # Twice the work with both computing: as if on hosts of their own.
    assert _two_groups_on_two_nodes("box", speedup=(1.0, 2.0)) == own_hosts


def test_a_trace_shows_nodes_on_one_host_at_shared_speed_and_changes_nothing():
    s = 4e-3  # as above: 4 layers of 1 ms a stage, the two nodes on one core
    spec = tiny_spec(n_nodes=2, host="box")
    fast = LinkSpec(1e30, 0.0)
    cal = calibration(spec, lambda kind, r, x: 1e-3 if kind in ("moe", "dense", "embedding", "head") else 0.0,
                      links={("n0", "n1"): fast, ("n1", "n0"): fast})
    requests = [Request(i, (1,), 3) for i in range(2)]
    traced, _, model = run(spec, cal, requests, clients=2, traced=True)
    untraced, _, _ = run(spec, cal, requests, clients=2)
    assert traced == untraced
    assert len(model.timings) == 6  # 3 tokens for each of 2 streams, a frame each
    for node in (0, 1):
        spans = sorted((f.stages[node].start, f.stages[node].end) for f in model.timings)
        assert all(end <= start + 1e-12 for (_, end), (start, _) in zip(spans, spans[1:]))  # one frame at a time
    # group 0's first frame: alone on node 0 (one stage time), then beside group 1's on node 0 (two)
    first = model.timings[0]
    assert [st.end - st.start for st in first.stages] == pytest.approx([s, 2 * s])


def test_a_node_without_a_host_is_a_host_of_its_own():
    spec = tiny_spec(host="box")
    spec = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=(
        *spec.cluster.nodes[:2], attrs.evolve(spec.cluster.nodes[2], host=None))))
    assert stage_hosts(spec, even_plan(spec)) == ["box", "box", "n2"]
    assert shared_hosts(spec, even_plan(spec)) == {"box": 2}


def test_shared_host_processor_sharing():
    env = simpy.Environment()
    host = SharedHost(env, speedup=(1.0, 1.5))
    done = {}

    def job(name, start, work):
        yield env.timeout(start)
        yield host.compute(work)
        done[name] = env.now

    for name, start, work in (("a", 0.0, 1.0), ("b", 0.0, 3.0), ("c", 2.0, 0.5)):
        env.process(job(name, start, work))
    env.run()
    # a and b at 0.75 each: a done at 4/3 (b has 2 left); b alone at full speed until c comes at 2 (b has 4/3 left);
    # then both at 0.75: c done at 2 + 2/3 (b has 5/6 left), b alone again: done at 2 + 2/3 + 5/6.
    assert done == pytest.approx({"a": 4 / 3, "b": 2 + 2 / 3 + 5 / 6, "c": 2 + 2 / 3})


def test_closed_loop_keeps_littles_law():
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1e-4 * (1 + r) + 1e-6 * x)
    clients = 5
    requests = [Request(i, tuple(range(3 + i % 7)), 4 + i % 5) for i in range(120)]
    records, _, _ = run(spec, cal, requests, clients=clients)
    finishes = sorted(r.t_finish for r in records)
    start, end = finishes[20], finishes[100]  # steady state: away from the ramp and the drain
    throughput = 80 / (end - start)
    in_window = [r for r in records if start < r.t_finish <= end]
    latency = np.mean([r.t_finish - r.t_arrival for r in in_window])
    assert throughput * latency == pytest.approx(clients, rel=0.05)


def test_missing_table_or_node_is_an_error():
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1e-3)
    no_head = attrs.evolve(cal, nodes={**cal.nodes, "n2": attrs.evolve(cal.nodes["n2"], tables={
        k: t for k, t in cal.nodes["n2"].tables.items() if k != "head"})})
    with pytest.raises(CalibrationError, match=r"nodes.n2.tables: missing head \(layers 4-5, roles layers, head\)"):
        PipelineModel(spec, even_plan(spec), no_head)
    with pytest.raises(CalibrationError, match="nodes: no entry for n1"):
        PipelineModel(spec, even_plan(spec), attrs.evolve(cal, nodes={"n0": cal.nodes["n0"], "n2": cal.nodes["n2"]}))


def small_workload_spec(seed=0):
    return tiny_spec(workload=WorkloadSpec(concurrency=(1, 3), requests=4, prompt_tokens=LengthSpec(2, 9),
                                           output_tokens=5, seed=seed))


def test_simulate_is_deterministic_and_seeded():
    spec = small_workload_spec()
    cal = analytic_calibration(spec)
    first = json.dumps(simulate(spec, cal, even_plan(spec)))
    assert json.dumps(simulate(spec, cal, even_plan(spec))) == first
    assert json.dumps(simulate(small_workload_spec(seed=1), cal, even_plan(spec))) != first


def test_simulate_result():
    spec = small_workload_spec()
    result = simulate(spec, analytic_calibration(spec), even_plan(spec))
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    assert all(level["requests"] == 4 and level["output_tokens"] == 20 for level in result["levels"])
    assert [r["phase"] for r in result["requests"]] == ["warmup"] * 4 + ["measured"] * 4 + ["warmup"] * 4 + \
        ["measured"] * 4
    assert result["calibration"]["kind"] == "analytic" and result["warnings"] == []
    assert set(result["levels"][0]["busy"]) == {"n0", "n1", "n2"}
    one, three = result["levels"]
    assert three["phase_tokens_per_s"] > one["phase_tokens_per_s"]  # three streams share the pipeline


def test_extrapolation_and_link_fallback_are_reported():
    spec = tiny_spec(runtime=RuntimeSpec(context_budget=64, max_streams=8, row_buckets=(2, 4, 8), prefill_window=4),
                     workload=WorkloadSpec(concurrency=(4,), prompt_tokens=LengthSpec.fixed(6), output_tokens=3))
    cal = calibration(spec, lambda kind, r, x: 1e-4 * r, rows=(1, 2), links={})
    warnings = simulate(spec, cal, even_plan(spec))["warnings"]
    # a first frame of 4 prompt rows: padded to 4, beyond the 2 rows calibrated; 4 rows touch 5.47 of 8 experts
    assert "node n0: moe time extrapolated beyond the calibration grid (rows 4, experts 5.46875)" in warnings
    assert sum("node n0: moe" in w for w in warnings) == 1
    assert any(w.startswith("link n2->n0: not in the calibration; using the spec's figures") for w in warnings)


@pytest.mark.slow
def test_paper_deployment_at_fifteen_levels():
    """The paper's 11-PC deployment, 15 levels of 128-token requests: the speed check of the simulator."""
    from cascadia.graph.planner import plan
    from cascadia.spec.load import load_spec

    spec = load_spec(Path(__file__).parent.parent / "specs" / "inkling-975b-11pc.yaml")
    the_plan = plan(spec)
    levels = simulate(spec, analytic_calibration(spec), the_plan)["levels"]
    assert [level["concurrency"] for level in levels] == list(spec.workload.concurrency)
    assert all(level["output_tokens"] == 128 * level["concurrency"] for level in levels)
    rates = [level["decode_tokens_per_s"] for level in levels]
    assert all(b > 0.99 * a for a, b in zip(rates, rates[1:]))  # grows, or holds once the slowest node is saturated
    assert rates[-1] > 10 * rates[0]
    # one stream: the planner's own roofline (one row at the full context budget) within a few percent
    assert levels[0]["tpot_s"]["p50"] == pytest.approx(sum(s.est_time_s for s in the_plan.stages), rel=0.03)
    assert max(levels[-1]["busy"].values()) > 0.95  # 176 streams keep the slowest node busy


def test_a_phase_whose_requests_are_all_rejected_ends_at_once():
    spec = tiny_spec()
    too_long = (1,) * spec.runtime.context_budget  # no room left for an output token
    records, busy, model = run(spec, calibration(spec, lambda kind, r, x: KIND_TIMES[kind]),
                               [Request(i, too_long, 1) for i in range(3)], clients=2)
    assert records == [] and model.env.now == 0 and set(busy.values()) == {0.0}


def open_loop(spec, cal, requests, rate, seed=1):
    plan = even_plan(spec)
    model = PipelineModel(spec, plan, cal)
    recorder = Recorder(None, "measured", rate)
    model.run_phase(Policy.for_runtime(spec.runtime, len(plan.stages)), OpenLoop([(r,) for r in requests], rate, seed),
                    len(requests), recorder)
    return recorder.records


def test_open_loop_requests_arrive_at_their_own_times_whatever_the_server_does():
    """Arrivals at a low rate find an idle pipeline (each as fast as alone); at a high one they queue, and the
    arrival times are the same Poisson times either way."""
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1e-3 * (1 + r / 8))
    requests = [Request(i, (1, 2, 3), 4) for i in range(40)]
    [alone], _, _ = run(spec, cal, requests[:1])
    slow = open_loop(spec, cal, requests, rate=0.5)
    found_idle = [r.ttft for r, before in zip(slow[1:], slow) if r.t_arrival >= before.t_finish]
    assert len(found_idle) > 30 and found_idle == pytest.approx([alone.ttft] * len(found_idle), rel=1e-9)
    loop = OpenLoop([(r,) for r in requests], 0.5, seed=1)
    loop.start(0.0)
    times = [0.0]
    while (t := loop.next_time) is not None:
        times += [t] * len(loop.due(t))
    assert [r.t_arrival for r in slow] == pytest.approx(times)
    busy = open_loop(spec, cal, requests, rate=2000.0)  # far faster than the pipeline serves them
    assert np.percentile([r.ttft for r in busy], 99) > 5 * alone.ttft


def test_goodput_counts_the_requests_meeting_the_slo():
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1e-3 * (1 + r / 8))
    records = open_loop(spec, cal, [Request(i, (1, 2, 3), 4) for i in range(40)], rate=300.0)
    ttfts = sorted(r.ttft for r in records)
    slo = SloSpec(ttft=ttfts[19] + 1e-12, tpot=1.0)  # half of them are within the TTFT bound, all within TPOT
    summary = summarize_level(records, {}, rate=300.0, slo=slo)
    assert summary["goodput"]["fraction"] == 0.5 and summary["rate"] == 300.0 and summary["concurrency"] is None
    assert summary["goodput"]["requests_per_s"] == pytest.approx(20 / summary["wall_s"])
    assert summarize_level(records, {}, rate=300.0, slo=attrs.evolve(slo, tpot=1e-9))["goodput"]["fraction"] == 0
    # a rejected request misses the SLO: 20 good of 40 served and 10 turned away
    with_rejected = summarize_level(records, {}, rate=300.0, rejected=10, slo=slo)
    assert with_rejected["goodput"]["fraction"] == 20 / 50
    assert "rejected" in format_table({"levels": [with_rejected]}).splitlines()[0]


def test_simulate_sweeps_arrival_rates():
    workload = WorkloadSpec(rate=(1.0, 50.0), requests=12, prompt_tokens=LengthSpec(4, 8), output_tokens=4,
                            slo=SloSpec(ttft=0.05, tpot=0.05))
    spec = attrs.evolve(tiny_spec(), workload=workload)
    result = simulate(spec, calibration(spec, lambda kind, r, x: 1e-3 * (1 + r / 8)), even_plan(spec))
    assert [(level["rate"], level["requests"]) for level in result["levels"]] == [(1.0, 12), (50.0, 12)]
    slow, fast = result["levels"]
    assert fast["ttft_s"]["p99"] > slow["ttft_s"]["p99"] and slow["goodput"]["fraction"] == 1.0
    table = format_table(result).splitlines()
    assert table[0].split()[0] == "load" and "TTFT p99 ms" in table[0] and "goodput" in table[0]
    assert table[1].split()[0] == "1/s" and table[1].split()[-3] == "100%"


def test_the_choices_of_a_prompt_are_simulated_with_one_prefill():
    """Four choices of a 40-token prompt: the simulator computes the prompt's rows once and the other choices' first
    rows beside the first's last (the policy's forks), so every choice's first token comes with the first's, and
    the nodes are busy for less than the same four streams as requests of their own keep them."""
    spec = tiny_spec()
    cal = calibration(spec, lambda kind, r, x: 1e-3 * (1 + r / 8))
    family = tuple(Request(i, tuple(range(1, 41)), 4, sampling=Sampling(0.8, seed=i)) for i in range(4))

    def served(requests):
        plan = even_plan(spec)
        recorder = Recorder(4, "measured")
        busy = PipelineModel(spec, plan, cal).run_phase(Policy.for_runtime(spec.runtime, len(plan.stages)),
                                                        ClosedLoop(requests, 4), 4, recorder)
        return recorder.records, sum(busy.values())

    forked, forked_busy = served([family])
    alone, alone_busy = served([(r,) for r in family])
    assert [r.output_tokens for r in forked] == [4] * 4 and len({r.t_first_token for r in forked}) == 1
    assert len({r.t_first_token for r in alone}) > 1 and forked_busy < 0.6 * alone_busy
