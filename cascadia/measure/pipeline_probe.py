"""The real pipeline, measured for the simulator: each node's level and what each stream costs, the message
overheads, and how fast a shared host's nodes compute together (the fits: `cascadia.sim.fit`).

The pipeline (`Pipeline.start`) serves passes that interleave two kinds of traffic (a figure is the median over the
passes): frames alone in the pipeline, of decode rows (one stream each) and of prompt windows (one stream), of
1 ... the largest bucket rows; and bursts of one-row streams all in flight (`burst_streams`). Then each node is
started again, as `cascadia serve` does after its loss, and timed until it is ready (for `simulate --fail`). Each
pass's level (its frames' round trips over the median pass's) joins the calibration's spread; so, when asked to watch
the machine for a while, does each one-row stream's frames sent once a second meanwhile (their round trips over the
passes' median for the same frames).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cascadia.graph.plan import Plan
from cascadia.pipeline.coordinator import wire_frame
from cascadia.pipeline.run import NODE_TIMEOUT_S, Pipeline, describe
from cascadia.policy import DECODE, Frame, Row, padded_size
from cascadia.sim.calibration import Calibration, Spread, relative_levels
from cascadia.sim.fit import AloneFrames, burst_streams, fit_overheads, shared_speedup
from cascadia.sim.model import FrameShape
from cascadia.spec.types import Spec

STEPS = 8  # frames of one shape alone through the pipeline, one after the other (at most)
PASSES = 5  # passes over the pipeline's traffic; each figure is their median
BURST_STEPS = 16  # frames per stream in a burst of streams all in flight
WATCH_EVERY_S = 1.0  # while watching the machine's speed: one stream's frames this often

Progress = Callable[[str], None]
Rows = tuple[list[int], list[int]]  # the slots and positions of a frame's rows


def measure_pipeline(spec: Spec, plan: Plan, checkpoint: Path, layers: Calibration, progress: Progress,
                     watch_s: float = 0.0) -> Calibration:
    """`layers` (tables and links) completed on the plan's real pipeline: tables at the nodes' level there, the
    per-stream and overhead times, and the speedups of shared hosts; the machine's speed watched `watch_s` seconds
    more (see the module's text)."""
    runtime = spec.runtime
    largest = runtime.largest_bucket
    rows = sorted(set(range(1, largest + 1, max(1, largest // 8))) | set(runtime.row_buckets))
    alone = [(decode_rows, r) for r in rows if r <= runtime.max_streams] + [(prompt_window, r) for r in rows if r > 1]
    streams = burst_streams(spec, plan)
    frames: list[list[AloneFrames]] = []  # by pass, each shape's frames in order
    bursts: list[list[list[float]]] = [[] for _ in streams]  # per burst size, each pass's
    progress("starting the pipeline")
    with Pipeline.start(spec, plan, checkpoint=checkpoint,
                        on_message=lambda node, message: progress(describe(node, message))) as pipeline:
        probe = PipelineProbe(pipeline, spec)
        probe.alone([decode_rows(1, step) for step in range(STEPS)])  # the first frames pay for first use
        for sweep in range(PASSES):  # passes, so that load elsewhere touches both kinds of traffic alike
            frames.append([probe.alone([make(n, step) for step in range(min(STEPS, runtime.context_budget // n))])
                           for make, n in alone])
            for n, passes in zip(streams, bursts):
                passes.append(probe.saturate(n, min(BURST_STEPS, runtime.context_budget)))
            bursts_of = f", bursts of {', '.join(map(str, streams))} streams at once" if streams else ""
            progress(f"pipeline: pass {sweep + 1}/{PASSES}: {len(alone)} frame shapes alone{bursts_of}")
        one_stream = alone.index((decode_rows, 1))
        watched = watch(probe, statistics.median(sweep[one_stream].round_trips for sweep in frames),
                        [decode_rows(1, step) for step in range(min(STEPS, runtime.context_budget))], watch_s,
                        progress)
        restarts = {stage.node: restart_time(pipeline, stage.node, progress) for stage in plan.stages}
    calibration = fit_overheads(spec, plan, layers, [AloneFrames.median(passes) for passes in zip(*frames)],
                                progress)
    calibration = attrs.evolve(calibration, nodes={name: attrs.evolve(node, restart_s=restarts[name])
                                                   for name, node in calibration.nodes.items()})
    levels = relative_levels([sum(shape.round_trips for shape in sweep) for sweep in frames])
    spread = attrs.evolve(layers.spread or Spread({}), pipeline=levels, watch=watched)
    return attrs.evolve(calibration, hosts=shared_speedup(spec, plan, calibration, bursts, progress), spread=spread)


def watch(probe: PipelineProbe, usual_s: float, frames: Sequence[Rows], seconds: float,
          progress: Progress) -> tuple[float, ...]:
    """`frames` sent alone once every WATCH_EVERY_S for `seconds`: each time, their round trips over `usual_s`."""
    levels: list[float] = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        levels.append(probe.alone(frames).round_trips / usual_s)
        if len(levels) % 30 == 0:
            progress(f"watching the machine's speed: {len(levels)} probes, {end - now:.0f} s left")
        time.sleep(max(0.0, min(end, now + WATCH_EVERY_S) - time.monotonic()))
    return tuple(levels)


def restart_time(pipeline: Pipeline, node: str, progress: Progress) -> float:
    """Seconds from killing `node` and starting it again until the pipeline has it back (READY, clock placed)."""
    started = time.monotonic()
    pipeline.replace(node, NODE_TIMEOUT_S)
    seconds = time.monotonic() - started
    progress(f"{node}: started again, back after {seconds:.2f} s")
    return seconds


class PipelineProbe:
    """Frames sent straight to a started pipeline's coordinator, their tokens taken straight back."""

    def __init__(self, pipeline: Pipeline, spec: Spec) -> None:
        self.coordinator = pipeline.coordinator
        self.spec = spec
        self.rng = np.random.default_rng(0)
        self.frame_id = 0

    def send(self, group: int, slots: Sequence[int], positions: Sequence[int]) -> FrameShape:
        """A frame of rows at these slots and positions (0 starts a stream afresh), of random tokens, each slot's
        last row sampled (as a policy samples a decode row, and a prompt's last) and proposing drafts (as one stream's
        frames do); its shape for the simulator."""
        self.frame_id += 1
        tokens = self.rng.integers(0, self.spec.model.config.vocab_size, len(slots)).tolist()
        last = [slots[i] != slots[i + 1] for i in range(len(slots) - 1)] + [True]
        rows = tuple(Row(slot, slot, position, DECODE, token, sampled)
                     for slot, position, token, sampled in zip(slots, positions, tokens, last))
        frame = Frame(self.frame_id, group, rows, padded_size(len(rows), self.spec.runtime.row_buckets),
                      propose=True)
        self.coordinator.send_frame(wire_frame(frame))
        return FrameShape.of(frame, self.spec.model.config.sliding_window or math.inf)

    def alone(self, frames: Sequence[Rows]) -> AloneFrames:
        """Frames one after the other, each sent as soon as the one before is back, as a single stream's are: their
        round trips, each node's busy seconds on them, and this process's CPU seconds (the coordinator's work: its
        thread's and ZeroMQ's, which wait without using any)."""
        before = self.coordinator.stats()
        shapes, round_trips, cpu = [], 0.0, 0.0
        for slots, positions in frames:
            start, cpu_start = time.perf_counter(), time.process_time()
            shapes.append(self.send(0, slots, positions))
            self.coordinator.next_tokens()
            round_trips += time.perf_counter() - start
            cpu += time.process_time() - cpu_start
        after = self.coordinator.stats()
        return AloneFrames(tuple(shapes), round_trips,
                           tuple(after[name].busy_s - before[name].busy_s for name in after), cpu)

    def saturate(self, groups: int, steps: int) -> list[float]:
        """`groups` one-row streams (slot = group) of `steps` frames each, all in flight at once (the real
        `cascadia.sim.fit.simulate_burst`): seconds since the start at which each frame's tokens came back."""
        position = [0] * groups
        for group in range(groups):
            self.send(group, [group], [0])
        done: list[float] = []
        start = time.perf_counter()
        while len(done) < groups * steps:
            group = self.coordinator.next_tokens().group
            done.append(time.perf_counter() - start)
            position[group] += 1
            if position[group] < steps:
                self.send(group, [group], [position[group]])
        return done


def decode_rows(n: int, step: int) -> Rows:
    """n streams' decode rows at step `step`."""
    return list(range(n)), [step] * n


def prompt_window(n: int, step: int) -> Rows:
    """The `step`-th window of n prompt rows of one stream."""
    return [0] * n, list(range(step * n, (step + 1) * n))
