"""Replay: a run's own measured compute, per node and frame, in place of the calibration's tables (`cascadia
simulate --replay-trace`), so that what is left between the replayed prediction and the run is the model's error
alone, not the machine's drift since calibrating.

A run's trace (`cascadia run --trace`) holds each frame's rows, the row count its calls were padded to, and how long
every stage computed it. The simulator's frames come from the same policy, but how the policy cuts them depends on
when tokens come back, so a simulated frame is not matched by its number: it takes the next unused traced frame of
the same rows and padding, in the order the run sent them (so the machine's drift over the run is replayed in its
order too). A frame with no such frame left is costed from the tables, and counted. A node's handling of a frame's
messages (receiving, decoding, encoding, sending: CPU work that drifts with the machine as compute does) is fitted
as a calibration fits it, on the traced frames that were alone in the pipeline (`cascadia.sim.fit.replayed_handling`).
Everything else (the policy, the links' wires, how handling adds up, the coordinator) is the model's, as in any
simulation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from cascadia.errors import CalibrationError
from cascadia.trace import FrameTiming


class ReplayTimes:
    """Each traced frame's compute per stage, queued by (rows, padded rows), to be taken in order."""

    def __init__(self, nodes: Sequence[str], frames: Sequence[FrameTiming], source: str = "the trace") -> None:
        """`nodes`: the traced run's stages' nodes, in order; `frames` as it traced them (`trace.frame_timings`);
        `source` names the trace in messages."""
        self.nodes, self.source = tuple(nodes), source
        self.frames = len(frames)
        self._left: dict[tuple[int, int], deque[tuple[float, ...]]] = {}
        # (rows, padded rows, sampled rows, seconds outside the nodes' compute) of each frame that nothing overlapped:
        # sent after every earlier frame was back, and back before the next was sent (a trace that does not say how
        # many rows were sampled: as if all were)
        self.alone: list[tuple[int, int, int, float]] = []
        ordered = sorted(frames, key=lambda frame: frame.sent)
        back = -math.inf  # when every frame sent so far was back
        for i, frame in enumerate(ordered):
            computed = tuple(stage.end - stage.start for stage in frame.stages)
            self._left.setdefault((frame.rows, frame.bucket), deque()).append(computed)
            if frame.sent >= back and (i + 1 == len(ordered) or frame.done <= ordered[i + 1].sent):
                sampled = frame.rows if frame.sampled is None else frame.sampled
                self.alone.append((frame.rows, frame.bucket, sampled, frame.done - frame.sent - sum(computed)))
            back = max(back, frame.done)
        self.replayed = 0  # simulated frames that took a traced frame's times
        self.tabled = 0  # ... that found none of their shape left, and were costed from the tables

    def take(self, rows: int, padded_rows: int) -> tuple[float, ...] | None:
        """The next traced frame's compute seconds per stage for a frame of `rows` rows padded to `padded_rows`, or
        None when none is left."""
        left = self._left.get((rows, padded_rows))
        if not left:
            self.tabled += 1
            return None
        self.replayed += 1
        return left.popleft()

    def check_nodes(self, stage_nodes: Sequence[str]) -> None:
        """Refuse a plan whose stages are not the traced run's: its times belong to those nodes, in that order."""
        if tuple(stage_nodes) != self.nodes:
            raise CalibrationError(f"{self.source}: the trace's stages ran on {', '.join(self.nodes)}, the plan's "
                                   f"on {', '.join(stage_nodes)}; replay a trace on the plan that made it")

    def notes(self) -> list[str]:
        """What the replay could not take from the trace, for the result's warnings."""
        if not self.tabled:
            return []
        return [f"replay: {self.tabled} of {self.replayed + self.tabled} simulated frames found no traced frame of "
                f"their rows and padding left, and were costed from the calibration's tables"]
