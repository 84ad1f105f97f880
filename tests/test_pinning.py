"""Nodes pinned to CPUs (`cpus:` in a node's spec, `cluster.coordinator_cpus`): the spec's forms and defaults, the
error for a CPU the machine lacks, and real node processes that run where they were told and say so in HELLO."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

from cascadia import host_cpus
from cascadia.errors import SpecError
from cascadia.graph.planner import plan as make_plan
from cascadia.pipeline.run import Pipeline
from cascadia.spec.dump import write_spec
from cascadia.spec.load import load_spec

SPECS = Path(__file__).parent.parent / "specs"
TWO_CPUS = pytest.mark.skipif(not {0, 1} <= set(host_cpus.available()), reason="needs CPUs 0 and 1")


def spec_with(tmp_path: Path, cluster: str) -> Path:
    path = tmp_path / "pinned.yaml"
    path.write_text(f"include: {SPECS / 'tiny-local.yaml'}\ncluster:\n{cluster}")
    return path


@pytest.mark.parametrize("cpus, expected", [("[0, 2]", (0, 2)), ("'0-3'", (0, 1, 2, 3)), ("'0,2-3'", (0, 2, 3)),
                                            ("1", (1,))])
def test_cpus_take_lists_and_ranges_and_give_a_thread_each(tmp_path, cpus, expected):
    spec = load_spec(spec_with(tmp_path, f"  coordinator_cpus: {cpus}\n  nodes: [{{name: n, memory: 1GiB, "
                                         f"cpus: {cpus}}}]\n"))
    node = spec.cluster.node("n")
    assert node.cpus == expected and node.threads == len(expected) and spec.cluster.coordinator_cpus == expected
    assert load_spec(write_spec(spec, tmp_path / "again.yaml")).cluster == spec.cluster


def test_threads_given_beside_cpus_stay_as_given(tmp_path):
    spec = load_spec(spec_with(tmp_path, "  nodes: [{name: n, memory: 1GiB, cpus: [0, 1], threads: 1}]\n"))
    assert spec.cluster.node("n").threads == 1


@pytest.mark.parametrize("cpus, message", [("[0, 0]", "CPU ids repeat"), ("'3-1'", "expected CPU ids"),
                                           ("[-1]", "expected CPU ids"), ("[]", "at least one"),
                                           ("[1.5]", "expected CPU ids")])
def test_bad_cpus_are_spec_errors_naming_the_key(tmp_path, cpus, message):
    with pytest.raises(SpecError, match=rf"cluster\.nodes\[0\]\.cpus.*{message}"):
        load_spec(spec_with(tmp_path, f"  nodes: [{{name: n, memory: 1GiB, cpus: {cpus}}}]\n"))


def test_a_cpu_the_machine_lacks_stops_the_run_before_any_node_starts(spec):
    absent = max(host_cpus.online()) + 1
    nodes = tuple(attrs.evolve(node, cpus=(absent,)) if node.name == "node1" else node for node in spec.cluster.nodes)
    pinned = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, nodes=nodes))
    have = host_cpus.format_cpus(host_cpus.online())
    with pytest.raises(SpecError, match=rf"^node1: cpus {absent} are not on this machine, which has {have}$"):
        Pipeline.start(pinned, make_plan(pinned))


def test_format_cpus_writes_runs_as_proc_does():
    assert host_cpus.format_cpus([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and host_cpus.format_cpus([3]) == "3"


@TWO_CPUS
def test_pinned_nodes_run_on_their_cpus_and_say_so(checkpoint):
    spec = attrs.evolve(load_spec(SPECS / "tiny-pinned.yaml"))
    spec = attrs.evolve(spec, cluster=attrs.evolve(spec.cluster, coordinator_cpus=(1,)))
    before = host_cpus.available()
    with Pipeline.start(spec, make_plan(spec), checkpoint=checkpoint) as pipeline:
        assert pipeline.coordinator.node_cpus == {"node0": (0,), "node1": (1,)}
        assert host_cpus.available() == (1,)  # this thread, the coordinator's, while the pipeline runs
        for process in pipeline.local.processes:  # as the kernel holds it, for the process and all its threads
            for task in Path(f"/proc/{process.pid}/task").iterdir():
                allowed = (task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
                assert allowed == ("0" if process is pipeline.local.processes[0] else "1")
        result = pipeline.run(attrs.evolve(spec.workload, concurrency=(2,), output_tokens=4))
    assert result.result["levels"][0]["requests"] == 2
    assert host_cpus.available() == before and os.sched_getaffinity(0) == set(before)
