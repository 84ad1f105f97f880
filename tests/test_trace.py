"""Timelines in the Chrome trace event format: the layout of `cascadia.trace.chrome_trace`, and `cascadia run --trace`
on the tiny model's three local nodes (one compute event per frame per node, in an order a pipeline allows)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.metrics import RequestRecord
from cascadia.trace import FrameTiming, StageTiming, chrome_trace, frame_times

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"


def test_a_frame_becomes_a_compute_event_per_node_and_a_link_event_per_hop():
    frame = FrameTiming(7, 1, 3, 4, sent=1.0, stages=(StageTiming(1.1, 1.2, 1.5), StageTiming(1.6, 1.7, 2.0)),
                        done=2.25)
    record = RequestRecord(4, None, "measured", 9, 5, 2, 0.5, 1.5, 2.25, (1.5, 2.25))
    events = chrome_trace([frame], [record], ["a", "b"], "run")["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {(0, None): "coordinator", (0, 1): "link to a", (0, 2): "requests", (1, None): "a",
                     (1, 1): "compute", (1, 2): "link to b", (2, None): "b", (2, 1): "compute",
                     (2, 2): "link to coordinator"}
    spans = {(e["pid"], e["tid"]): (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e["ph"] == "X"}
    expected = {(0, 1): (1.0, 1.1), (1, 1): (1.2, 1.5), (1, 2): (1.5, 1.6), (2, 1): (1.7, 2.0), (2, 2): (2.0, 2.25)}
    assert spans.keys() == expected.keys()
    assert all(abs(spans[k][0] - v[0]) < 1e-9 and abs(spans[k][1] - v[1]) < 1e-9 for k, v in expected.items())
    assert all(e["name"] == "group 1, 3 rows" for e in events if e["ph"] == "X")
    begin, end = (e for e in events if e["ph"] in "be")
    assert (begin["id"], begin["ts"], end["ts"]) == (9, 0.5e6, 2.25e6)
    times = frame_times([frame], ["a", "b"])  # a's link reaches b's compute: b's decoding of the frame is in it
    assert {node: {part: t.tolist() for part, t in parts.items()} for node, parts in times.items()} == {
        "a": {"compute": pytest.approx([0.3]), "link": pytest.approx([0.2]), "between": []},
        "b": {"compute": pytest.approx([0.3]), "link": pytest.approx([0.25]), "between": []}}  # no frame after it


def test_run_trace_holds_every_frame_once_per_node_in_pipeline_order(tmp_path, checkpoint):
    out, trace = tmp_path / "run.json", tmp_path / "trace.json"
    result = CliRunner().invoke(cli, ["run", str(SPEC), "--checkpoint", str(checkpoint), "--concurrency", "1,4",
                                      "--max-new-tokens", "6", "--json", str(out), "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    document, report = json.loads(trace.read_text()), json.loads(out.read_text())
    events = document["traceEvents"]
    assert {k: v for k, v in document["otherData"].items() if k != "clock_error_s"} == {
        "source": "run", "nodes": ["node0", "node1", "node2"]}
    # a node's clock is placed on the coordinator's to within half a stats round trip: two nodes' events may look
    # out of order by the sum of their bounds, no more
    errors = document["otherData"]["clock_error_s"]
    assert set(errors) == {"node0", "node1", "node2"} and all(0 < e < 0.1 for e in errors.values())
    slack_us = 2 * max(errors.values()) * 1e6 + 1
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 1 and e["pid"] > 0]
    per_node = Counter(e["pid"] for e in compute)
    frames = {e["args"]["frame"] for e in compute}
    assert set(per_node) == {1, 2, 3} and set(per_node.values()) == {len(frames)}  # each frame once on each node
    assert Counter(e["ph"] for e in events)["b"] == len(report["requests"])
    by_frame = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_frame[e["args"]["frame"]].append(e)
    for spans in by_frame.values():  # link in, compute, link out, ... in order along the pipeline
        ordered = sorted(spans, key=lambda e: (e["pid"], -e["tid"] if e["pid"] == 0 else e["tid"]))
        assert all(a["ts"] + a["dur"] <= b["ts"] + slack_us for a, b in zip(ordered, ordered[1:]))
    for pid in (1, 2, 3):  # a node computes one frame at a time
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in compute if e["pid"] == pid)
        assert all(end <= start + 1 for (_, end), (start, _) in zip(spans, spans[1:]))
