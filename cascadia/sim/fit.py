"""Fitting the simulator to what the real pipeline did: pure arithmetic over measured figures, no measuring.

- `fit_overheads`: frames that went through the pipeline alone, one after the other (`AloneFrames`). Each node's own
  count of busy seconds fits busy = a x tables + stream_s x streams: the layer tables give each kind's shape, the
  node in the pipeline (its own process, idle between frames, other processes around it) their level and what each
  stream adds. The coordinator's own CPU seconds on the frames fit its frame_s + row_s x rows. The rest of the
  round trip beyond the nodes' busy time, the coordinator's work and the links is shared evenly by the nodes as
  frame_s + row_s x rows: each receives, decodes, encodes and sends every frame outside its busy count.
- `shared_speedup`: bursts of one-row streams all in flight (`burst_streams`: 2, 3, ... then twice as many as
  stages). On a host that several nodes share they find how much work k nodes computing at once get done against
  one alone (the speedup S_k, each fitted so that the simulator, given the burst, takes as long as the pipeline
  did). On a small machine that is not min(k, processors): the nodes' messages, the coordinator and the wake-ups of
  idle processes take their share.
Least-squares fits keep every coefficient at zero or above; the speedups are bisections.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from cascadia.graph.plan import Plan
from cascadia.policy import DECODE, Frame, Row, padded_size
from cascadia.sim.calibration import Calibration, CoordinatorCalibration, Extrapolations, NodeCalibration
from cascadia.sim.model import FrameShape, PipelineModel, StageCost, message_sizes, shared_hosts, stage_kinds
from cascadia.sim.replay import ReplayTimes
from cascadia.spec.types import Spec

SPEEDUP_LOW = 0.5  # the least speedup a fit gives k nodes computing at once on a shared host

Progress = Callable[[str], None]


@attrs.frozen
class AloneFrames:
    """Frames that went through the pipeline one after the other, each alone."""

    shapes: tuple[FrameShape, ...]
    round_trips: float  # their round trips, summed
    busy: tuple[float, ...]  # the seconds each stage's node was busy on them
    coordinator: float = 0.0  # the coordinator's CPU seconds on them (its process's: its threads and ZeroMQ's)

    @classmethod
    def median(cls, passes: Sequence[AloneFrames]) -> AloneFrames:
        """The same frames as several passes found them, in the middle: the median round trip, busy seconds of
        each node and coordinator seconds (a pass that met a burst of other load moves none of them)."""
        return cls(passes[0].shapes, statistics.median(p.round_trips for p in passes),
                   tuple(map(statistics.median, zip(*(p.busy for p in passes)))),
                   statistics.median(p.coordinator for p in passes))


def fit_non_negative(columns: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares coefficients (c0, c1) >= 0 of y = c0 columns[0] + c1 columns[1]: the unconstrained fit when
    both are >= 0, else the better of the fits with one of them at zero."""
    a, b = (np.asarray(c, float) for c in columns)
    y = np.asarray(y, float)

    def one(x: np.ndarray) -> float:
        return max(0.0, float(x @ y / (x @ x))) if x @ x > 0 else 0.0

    both, *_ = np.linalg.lstsq(np.stack([a, b], axis=1), y, rcond=None)
    candidates = [(one(a), 0.0), (0.0, one(b))]
    if both.min() >= 0:
        candidates.append((float(both[0]), float(both[1])))
    return min(candidates, key=lambda c: float(((c[0] * a + c[1] * b - y) ** 2).sum()))


def fit_per_frame_and_row(frames: Sequence[Sequence[FrameShape]], seconds: Sequence[float]) -> tuple[float, float]:
    """(frame_s, row_s) >= 0 of seconds = frame_s x frames + row_s x real rows, each entry of `frames` a run of frames
    that took its entry of `seconds`."""
    return fit_non_negative([[len(shapes) for shapes in frames],
                             [sum(shape.rows for shape in shapes) for shapes in frames]], seconds)


def fit_handling(spec: Spec, plan: Plan, links: dict, frames: Sequence[tuple[Sequence[FrameShape], float]],
                 progress: Progress = lambda text: None) -> tuple[float, float]:
    """Each node's handling of a frame's messages, (frame_s, row_s): `frames` (the shapes of frames that went through
    the pipeline alone, and the seconds they spent outside the nodes' compute, summed) less the wires of `links`,
    shared evenly by the nodes."""
    config, nodes = spec.model.config, len(plan.stages)
    hops = [links.get(hop) for hop in plan.hops()]

    def wires(shape: FrameShape) -> float:
        sizes = message_sizes(shape, config.hidden_size, nodes)
        return sum(hop.latency + size / hop.bandwidth for hop, size in zip(hops, sizes) if hop is not None)

    handling = [(outside - sum(map(wires, shapes))) / nodes for shapes, outside in frames]
    frame_s, row_s = fit_per_frame_and_row([shapes for shapes, _ in frames], handling)
    progress(f"message handling: {frame_s * 1e3:.2f} ms per frame + {row_s * 1e3:.3f} ms per row, each node")
    return frame_s, row_s


def fit_overheads(spec: Spec, plan: Plan, layers: Calibration, frames: Sequence[AloneFrames],
                  progress: Progress = lambda text: None) -> Calibration:
    """`layers` (each node's tables and the links) with each node's tables scaled and its stream_s, frame_s and
    row_s, and the coordinator's work, fitted to the frames that went alone (see the module's text)."""
    config = spec.model.config
    coordinator = CoordinatorCalibration(*fit_per_frame_and_row([f.shapes for f in frames],
                                                                [f.coordinator for f in frames]))
    progress(f"the coordinator: {coordinator.frame_s * 1e3:.2f} ms per frame + {coordinator.row_s * 1e3:.3f} ms per "
             "row (its CPU time)")
    frame_s, row_s = fit_handling(spec, plan, layers.links,
                                  [(f.shapes, f.round_trips - sum(f.busy) - f.coordinator) for f in frames], progress)
    nodes = {}
    for i, stage in enumerate(plan.stages):
        cost = StageCost(f"node {stage.node}", stage_kinds(stage, config, spec.runtime), layers.nodes[stage.node],
                         config, layers, Extrapolations(), spec.runtime.row_buckets, spec.runtime.max_draft)
        scale, stream_s = fit_non_negative([[sum(map(cost, f.shapes)) for f in frames],
                                            [sum(s.streams for s in f.shapes) for f in frames]],
                                           [f.busy[i] for f in frames])
        progress(f"{stage.node}: busy in the pipeline {scale:.2f} x its tables + {stream_s * 1e3:.3f} ms per stream")
        tables = {kind: table.scaled(scale) for kind, table in layers.nodes[stage.node].tables.items()}
        nodes[stage.node] = NodeCalibration(tables, frame_s, row_s, stream_s)
    return attrs.evolve(layers, nodes=nodes, coordinator=coordinator)


def replayed_handling(spec: Spec, plan: Plan, calibration: Calibration, replay: ReplayTimes) -> Calibration:
    """`calibration` with each node's handling fitted as `fit_overheads` fits it, on the frames a replayed run's
    trace shows alone in its pipeline (`ReplayTimes.alone`), where it has two or more: a node's handling is CPU work
    that drifts with the machine as its compute does. The coordinator's part stays the calibration's (a trace does
    not tell it from the nodes')."""
    if len(replay.alone) < 2:
        return calibration
    coordinator = calibration.coordinator or CoordinatorCalibration()
    # a shape for its messages' sizes, which only its rows and sampled rows set
    frames = [((FrameShape(padded, rows, 0.0, 0.0, 1, sampled),), outside - coordinator.seconds(rows))
              for rows, padded, sampled, outside in replay.alone]
    frame_s, row_s = fit_handling(spec, plan, calibration.links, frames)
    return attrs.evolve(calibration, nodes={name: attrs.evolve(node, frame_s=frame_s, row_s=row_s)
                                            for name, node in calibration.nodes.items()})


def burst_streams(spec: Spec, plan: Plan) -> list[int]:
    """One-row streams in flight in each burst: k for k = 2 ... up to the most nodes a host shares, to find how fast
    k of them compute at once; with every node of a host busy, twice as many streams as stages (a full pipeline).
    None without a shared host, or when one stream at a time is all the runtime allows (nodes never compute at
    once)."""
    most = max(shared_hosts(spec, plan).values(), default=1)
    limit = spec.runtime.max_streams
    if most < 2 or limit < 2:
        return []
    return [min(k, limit) for k in range(2, most)] + [min(2 * len(plan.stages), limit)]


def shared_speedup(spec: Spec, plan: Plan, calibration: Calibration, bursts: Sequence[Sequence[list[float]]],
                   progress: Progress = lambda text: None) -> dict[str, tuple[float, ...]]:
    """The speedup of the hosts that several stages share (one list for all of them): S_1 = 1 (the frames alone
    measured a node computing by itself), then each S_k in turn, from the burst of `burst_streams`' k-th size (its
    passes: when each frame's tokens came back), is the one with which the simulator takes as long as the pipeline
    took (the median over the passes), counted from every stream's first frame back to the start of the last round
    (a full pipeline). Each S_k lies in [SPEEDUP_LOW, k]."""
    shared = shared_hosts(spec, plan)
    speedup = [1.0]
    for k, (streams, passes) in enumerate(zip(burst_streams(spec, plan), bursts, strict=True), start=2):
        measured = statistics.median(done[-streams] - done[streams - 1] for done in passes)
        steps = len(passes[0]) // streams

        def simulated(value: float) -> float:
            hosts = {h: (*speedup, value) for h in shared}
            done = simulate_burst(spec, plan, attrs.evolve(calibration, hosts=hosts), streams, steps)
            return done[-streams] - done[streams - 1]

        low, high = SPEEDUP_LOW, float(k)
        if simulated(high) >= measured:
            speedup.append(high)
        elif simulated(low) <= measured:
            speedup.append(low)
        else:
            for _ in range(30):  # bisection: the simulated time falls as the speedup grows
                middle = (low + high) / 2
                low, high = (middle, high) if simulated(middle) > measured else (low, middle)
            speedup.append((low + high) / 2)
    if shared:
        rates = ", ".join(f"{k} at once {value:.2f}x" for k, value in enumerate(speedup, start=1))
        progress(f"shared hosts: the work of one node alone done by its nodes computing {rates}")
    return {h: tuple(speedup) for h in shared}


def simulate_burst(spec: Spec, plan: Plan, calibration: Calibration, groups: int, steps: int) -> list[float]:
    """A burst in the simulator: `groups` one-row streams (slot = group) of `steps` frames each, all in flight at
    once; when each frame's tokens come back, in order."""
    model = PipelineModel(spec, plan, calibration)
    padded = padded_size(1, spec.runtime.row_buckets)
    done: list[float] = []

    def stream(group: int):
        for position in range(steps):
            row = Row(group, group, position, DECODE, 0, True)
            yield from model.carry(Frame(group * steps + position, group, (row,), padded))
            done.append(model.env.now)

    for group in range(groups):
        model.env.process(stream(group))
    model.env.run()
    return done
