"""A workload's levels and phases, and one closed-loop phase's bookkeeping, shared by the coordinator and the
simulator so that the run and the simulation are the same system: they differ only in how a frame is carried and
in their clocks.

The driver sends the clients' requests to the policy, records arrivals and the policy's events with the phase's
`Recorder`, lets a client send its next request as soon as its last one is done (finished or rejected), and hands
back the next frame of every group with none in flight. It keeps no clock and does no I/O: the backend passes the
time in with each call, launches the frames it gets back, and completes each one once its sampled tokens are known.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from cascadia.metrics import Recorder, RequestRecord, summarize_level
from cascadia.policy import Event, Finished, Frame, Policy, Rejected, Request
from cascadia.spec.types import Spec, WorkloadSpec
from cascadia.workload import MEASURED, ClosedLoop, Level, Phase, build_levels, stop_ids

# (level, phase, its recorder) -> each node's busy seconds in the phase; the backend serves the phase's requests
RunPhase = Callable[[Level, Phase, Recorder], Mapping[str, float]]


@attrs.define
class Served:
    """What a workload's phases produced so far: each level's summary (of its measured phase), every request's
    record (both phases), in order."""

    levels: list[dict] = attrs.Factory(list)
    records: list[RequestRecord] = attrs.Factory(list)


def serve_workload(spec: Spec, workload: WorkloadSpec, prompts: Sequence[tuple[int, ...]] | None,
                   run_phase: RunPhase, served: Served,
                   on_phase: Callable[[int, str, list], None] = lambda level, phase, records: None) -> Served:
    """Every level's warm-up and measured phase of `workload` in turn, each served by `run_phase`, into `served`
    (which keeps what finished if a phase raises). `prompts` replace random ones (`build_levels`); a request stops
    early at EOS when the workload says `stop_at_eos`."""
    config = spec.model.config
    for level in build_levels(workload, config.output_vocab_size, prompts, stop_ids(workload, config)):
        for phase in level.phases:
            recorder = Recorder(level.concurrency, phase.name)
            try:
                busy = run_phase(level, phase, recorder)
            finally:
                served.records.extend(recorder.records)
            if phase.name == MEASURED:
                served.levels.append(summarize_level(level.concurrency, recorder.records, busy,
                                                     rejected=len(recorder.rejected)))
            on_phase(level.concurrency, phase.name, recorder.records)
    return served


class PhaseDriver:
    def __init__(self, policy: Policy, requests: Sequence[Request], clients: int, recorder: Recorder,
                 on_arrived: Callable[[Request], None] = lambda request: None,
                 on_events: Callable[[list[Event]], None] = lambda events: None) -> None:
        """`requests` are sent by `clients` closed-loop clients. `on_arrived` and `on_events` see each request as it
        is sent and the policy's events after the recorder (e.g. to keep the generated tokens)."""
        self._policy, self._recorder = policy, recorder
        self._loop = ClosedLoop(requests, clients)
        self._left = len(requests)
        self._on_arrived, self._on_events = on_arrived, on_events

    @property
    def done(self) -> bool:
        """Every request of the phase has finished or was rejected."""
        return self._left == 0

    def start(self, now: float) -> list[Frame]:
        """The clients send their first requests at `now`; returns the frames to launch."""
        return self._submit(self._loop.start(), now)

    def complete(self, frame: Frame, sampled: Mapping[int, int], now: float) -> list[Frame]:
        """A frame's sampled tokens ({request id: token}) came back at `now`; returns the frames to launch."""
        return self._submit(self._observe(self._policy.complete_frame(frame, sampled), now), now)

    def _observe(self, events: list[Event], now: float) -> list[Request]:
        """Record events; the requests the clients whose requests are done send next."""
        self._recorder.observe(events, now)
        self._on_events(events)
        follow_ups = []
        for event in events:
            if isinstance(event, (Finished, Rejected)):
                self._left -= 1
                if (request := self._loop.next()) is not None:
                    follow_ups.append(request)
        return follow_ups

    def _submit(self, requests: Iterable[Request], now: float) -> list[Frame]:
        """Send requests (and the follow-ups of any rejected at once); the next frame of every idle group."""
        queue = deque(requests)
        while queue:
            request = queue.popleft()
            self._recorder.arrived(request, now)
            self._on_arrived(request)
            queue.extend(self._observe(self._policy.add_request(request), now))
        frames = (self._policy.next_frame(group) for group in range(self._policy.n_groups))
        return [frame for frame in frames if frame is not None]
