"""Timelines of a run or a simulation in the Chrome trace event format (Perfetto and chrome://tracing open them).

Both backends describe each frame the same way (`FrameTiming`: when the coordinator sent it, when each stage took
it from its input, started and finished it, when its tokens came back), on the coordinator's clock in seconds, and
each request by its metrics record. `chrome_trace` lays that out as one process per node and one for the
coordinator: a node's "compute" track holds a complete event (`"ph": "X"`) per frame it computed, named by the
frame's group and rows; its "link to NEXT" track the frame's way to the next stage (from the end of its compute to
the next stage taking it in: the handling of its message, the wire, and any wait in the next stage's queue). The
coordinator's process holds the link into the first stage and each request as an async span from its arrival to
its last token.
`frame_times` gives each node's per-frame compute and onward link times, and its time between frames while it has
work, for comparing two timelines node by node (a link there reaches the next stage's compute, so that it holds the
whole of the message's handling: a run's node decodes a frame after taking it in). `frame_timings` reads a trace
document back into its nodes and frames (what `cascadia simulate --replay-trace` replays).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from cascadia.metrics import RequestRecord

COORDINATOR = "coordinator"
_US = 1e6  # trace timestamps are microseconds


@attrs.frozen
class StageTiming:
    received: float  # the stage took the frame from its input
    start: float  # ... began computing it
    end: float  # ... and was done (its result then goes to the next stage)


@attrs.frozen
class FrameTiming:
    frame_id: int
    group: int
    rows: int  # rows of streams (the call was padded to `bucket`)
    bucket: int
    sent: float  # the coordinator sent it into the first stage
    stages: tuple[StageTiming, ...]  # in stage order
    done: float  # its tokens reached the coordinator
    sampled: int | None = None  # its rows whose tokens came back (None: a trace that did not say)


def chrome_trace(frames: Iterable[FrameTiming], records: Iterable[RequestRecord], nodes: Sequence[str],
                 source: str, clock_error_s: dict[str, float] | None = None) -> dict:
    """The trace document: `nodes` in stage order; in its metadata `source` ("run" or "simulate") and how far each
    node's times may be off the coordinator's clock (`clock_error_s`, a run's)."""
    events = [_name("process_name", 0, None, COORDINATOR), _name("thread_name", 0, 1, f"link to {nodes[0]}"),
              _name("thread_name", 0, 2, "requests")]
    for pid, node in enumerate(nodes, 1):
        after = nodes[pid] if pid < len(nodes) else COORDINATOR
        events += [_name("process_name", pid, None, node), _name("thread_name", pid, 1, "compute"),
                   _name("thread_name", pid, 2, f"link to {after}")]
    for frame in frames:
        label = f"group {frame.group}, {frame.rows} rows"
        args = {"frame": frame.frame_id, "group": frame.group, "rows": frame.rows, "bucket": frame.bucket,
                "sampled": frame.sampled}
        left, left_place = frame.sent, (0, 1)
        for pid, stage in enumerate(frame.stages, 1):
            events.append(_span(label, *left_place, left, stage.received, args))
            events.append(_span(label, pid, 1, stage.start, stage.end, args))
            left, left_place = stage.end, (pid, 2)
        events.append(_span(label, *left_place, left, frame.done, args))
    for record in records:
        name = f"request {record.request_id}"
        args = {"phase": record.phase, "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
                "ttft_ms": record.ttft * 1e3}
        common = {"cat": "request", "id": record.request_id, "pid": 0, "tid": 2, "name": name}
        events.append(common | {"ph": "b", "ts": record.t_arrival * _US, "args": args})
        events.append(common | {"ph": "e", "ts": record.t_finish * _US})
    other = {"source": source, "nodes": list(nodes)} | ({"clock_error_s": clock_error_s} if clock_error_s else {})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def frame_timings(document) -> tuple[list[str], list[FrameTiming]]:
    """The nodes and frames of a document `chrome_trace` wrote (a run's or a simulation's), the frames in the order
    they were sent: its inverse, to the rounding of its microseconds. ValueError, saying what is wrong, for anything
    else."""
    other = document.get("otherData") if isinstance(document, dict) else None
    nodes = other.get("nodes") if isinstance(other, dict) else None
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not (isinstance(nodes, list) and nodes and all(isinstance(n, str) for n in nodes) and isinstance(events, list)):
        raise ValueError("not a Cascadia trace (`run --trace` or `simulate --trace` writes one): it needs "
                         "otherData.nodes and traceEvents")
    spans: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
    shapes: dict[int, tuple[int, int, int]] = {}
    for i, event in enumerate(events):
        if not (isinstance(event, dict) and event.get("ph") == "X"):
            continue  # names, and requests' spans
        try:
            args, place = event["args"], (int(event["pid"]), int(event["tid"]))
            frame, start = int(args["frame"]), float(event["ts"]) / _US
            spans.setdefault(frame, {})[place] = (start, start + float(event["dur"]) / _US)
            sampled = args.get("sampled")
            shapes[frame] = (int(args["group"]), int(args["rows"]), int(args["bucket"]),
                             None if sampled is None else int(sampled))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"traceEvents[{i}]: a span without a frame's pid, tid, ts, dur and args (frame, group, "
                             f"rows, bucket; sampled, if any)") from None
    frames = [_frame_timing(frame_id, shapes[frame_id], placed, nodes) for frame_id, placed in spans.items()]
    return nodes, sorted(frames, key=lambda frame: frame.sent)


def _frame_timing(frame_id: int, shape: tuple[int, int, int, int | None],
                  placed: dict[tuple[int, int], tuple[float, float]], nodes: Sequence[str]) -> FrameTiming:
    """One frame from its spans, by (pid, tid): the link into the first node, then each node's compute and link."""
    def span(pid: int, tid: int, what: str) -> tuple[float, float]:
        if (pid, tid) not in placed:
            raise ValueError(f"frame {frame_id}: no {what}")
        return placed[pid, tid]

    sent, received = span(0, 1, f"link span into {nodes[0]}")
    stages = []
    for pid, node in enumerate(nodes, 1):
        start, end = span(pid, 1, f"compute span on {node}")
        stages.append(StageTiming(received, start, end))
        received = span(pid, 2, f"link span from {node}")[1]
    group, rows, bucket, sampled = shape
    return FrameTiming(frame_id, group, rows, bucket, sent, tuple(stages), received, sampled)


def records_of(result: dict) -> list[RequestRecord]:
    """The request records of a metrics result (`cascadia.metrics.result`)."""
    return [RequestRecord(**{**record, "token_times": tuple(record["token_times"])}) for record in result["requests"]]


def frame_times(frames: Iterable[FrameTiming], nodes: Sequence[str]) -> dict[str, dict[str, np.ndarray]]:
    """Per node and frame, in seconds: its "compute" time, and its "link" time (from the end of its compute to the
    next stage starting to compute the frame, or, from the last stage, to its tokens reaching the coordinator); and
    "between" frames: from the end of a frame's compute to the start of the node's next, where the stage before
    (the coordinator, before the first) was done with the next one first, so that it was on its way: what the node
    spends between frames while it has work (sending one, taking the next in), for the frames that say it."""
    frames = list(frames)
    times = {}
    for i, node in enumerate(nodes):
        ends = np.array([frame.stages[i].end for frame in frames])
        onward = np.array([frame.stages[i + 1].start if i + 1 < len(nodes) else frame.done for frame in frames])
        ordered = sorted(frames, key=lambda frame: frame.stages[i].start)
        between = [after.stages[i].start - before.stages[i].end for before, after in zip(ordered, ordered[1:])
                   if (after.stages[i - 1].end if i else after.sent) < before.stages[i].end]
        times[node] = {"compute": ends - np.array([frame.stages[i].start for frame in frames]),
                       "link": onward - ends, "between": np.array(between)}
    return times


def _name(kind: str, pid: int, tid: int | None, name: str) -> dict:
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    return event if tid is None else event | {"tid": tid}


def _span(name: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start * _US, "dur": max(0.0, end - start) * _US,
            "args": args}
