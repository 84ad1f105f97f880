"""What a traced run keeps of each frame, for `cascadia run --trace`: when the coordinator sent it and got its tokens
back (its own clock), and when each node took it in, started and finished it (the node's clock, reported with its
stats). `NodeClock` places a node's clock on the coordinator's; `FrameLog.timings` gives `trace.FrameTiming`s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from cascadia.trace import FrameTiming, StageTiming


class NodeClock:
    """A node's clock against the coordinator's, from stats requests and their answers: the node read its clock
    between our sending and our receiving, so it is ahead by its reading less the midpoint, give or take half the
    round trip; the exchange with the shortest round trip bounds that best."""

    def __init__(self) -> None:
        self.offset = 0.0  # node clock - coordinator clock
        self.round_trip = math.inf

    @property
    def error_bound(self) -> float:
        """How far `offset` may be off: half the shortest round trip (the node read its clock within it)."""
        return self.round_trip / 2

    def observe(self, sent: float, received: float, node_clock: float) -> None:
        if received - sent < self.round_trip:
            self.round_trip = received - sent
            self.offset = node_clock - (sent + received) / 2


class FrameLog:
    def __init__(self, nodes: Sequence[str]) -> None:
        self.nodes = list(nodes)
        self._sent: dict[int, tuple[int, int, int, int, float]] = {}  # frame id -> group, rows, bucket, sampled, sent
        self._done: dict[int, float] = {}
        self._stages: dict[str, dict[int, tuple[float, float, float]]] = {node: {} for node in nodes}

    def sent(self, frame_id: int, group: int, rows: int, bucket: int, sampled: int, t: float) -> None:
        self._sent[frame_id] = (group, rows, bucket, sampled, t)

    def done(self, frame_id: int, t: float) -> None:
        self._done[frame_id] = t

    def node_times(self, node: str, times: Iterable[tuple[int, float, float, float]]) -> None:
        """A node's (frame id, taken in, started, done) on its own clock."""
        for frame_id, *moments in times:
            self._stages[node][frame_id] = tuple(moments)

    def timings(self, clocks: dict[str, NodeClock]) -> list[FrameTiming]:
        """Every frame known end to end (sent, computed on every node, its tokens back), on the coordinator's clock,
        in the order sent."""
        out = []
        for frame_id, (group, rows, bucket, sampled, sent) in self._sent.items():
            if frame_id not in self._done or any(frame_id not in self._stages[node] for node in self.nodes):
                continue
            stages = tuple(StageTiming(*(t - clocks[node].offset for t in self._stages[node][frame_id]))
                           for node in self.nodes)
            out.append(FrameTiming(frame_id, group, rows, bucket, sent, stages, self._done[frame_id], sampled))
        return out
