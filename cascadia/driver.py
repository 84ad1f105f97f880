"""A workload's levels and phases, and one phase's bookkeeping, shared by the coordinator and the simulator so that
the run and the simulation are the same system: they differ only in how a frame is carried and in their clocks.

The driver sends the phase's requests to the policy as its `Arrivals` say (closed loop: a client's next request as
soon as its last one is done; open loop: at each request's own time), records arrivals and the policy's events with
the phase's `Recorder`, and hands back the next frame of every group with none in flight. It keeps no clock and does
no I/O: the backend passes the time in with each call, calls `arrive` when `next_arrival` comes, launches the frames
it gets back, and completes each one once its sampled tokens are known.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from cascadia.metrics import Recorder, RequestRecord, summarize_level
from cascadia.policy import Event, Frame, Policy, Request
from cascadia.spec.types import Spec, WorkloadSpec
from cascadia.workload import MEASURED, Arrivals, Choices, Level, Phase, build_levels, stop_ids

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
                   on_phase: Callable[[str, str, list], None] = lambda level, phase, records: None) -> Served:
    """Every level's warm-up and measured phase of `workload` in turn, each served by `run_phase`, into `served`
    (which keeps what finished if a phase raises). `prompts` replace random ones (`build_levels`); a request stops
    early at EOS when the workload says `stop_at_eos`."""
    config = spec.model.config
    for level in build_levels(workload, config.output_vocab_size, prompts, stop_ids(workload, config)):
        for phase in level.phases:
            recorder = Recorder(level.concurrency, phase.name, level.rate)
            try:
                busy = run_phase(level, phase, recorder)
            finally:
                served.records.extend(recorder.records)
            if phase.name == MEASURED:
                served.levels.append(summarize_level(
                    recorder.records, busy, concurrency=level.concurrency, rate=level.rate,
                    rejected=len(recorder.rejected), cancelled=len(recorder.cancelled), slo=workload.slo,
                    speculation=recorder.speculation))
            on_phase(level.describe, phase.name, recorder.records)
    return served


class PhaseDriver:
    def __init__(self, policy: Policy, arrivals: Arrivals, requests: int, recorder: Recorder,
                 on_arrived: Callable[[Request], None] = lambda request: None,
                 on_events: Callable[[list[Event]], None] | None = None) -> None:
        """A phase of `requests` requests, sent as `arrivals` says (`Level.arrivals`). `on_arrived` and `on_events`
        see each request as it is sent and the policy's events after the recorder (e.g. to keep the tokens)."""
        self._policy, self._recorder = policy, recorder
        self._arrivals = arrivals
        self._left = requests
        self._on_arrived, self._on_events = on_arrived, on_events

    @property
    def done(self) -> bool:
        """Every request of the phase has finished or was rejected."""
        return self._left == 0

    @property
    def next_arrival(self) -> float | None:
        """When the next request arrives by the clock (open loop; None: none waits for a time). The backend calls
        `arrive` then."""
        return self._arrivals.next_time

    def start(self, now: float) -> list[Frame]:
        """The phase starts at `now`; returns the frames to launch."""
        return self._submit(self._arrivals.start(now), now)

    def arrive(self, now: float) -> list[Frame]:
        """The requests due by `now` are sent; returns the frames to launch."""
        return self._submit(self._arrivals.due(now), now)

    def complete(self, frame: Frame, tokens: Sequence[int], now: float,
                 proposed: Mapping[int, tuple[int, Sequence[int]]] | None = None) -> list[Frame]:
        """A frame's sampled tokens (one per sampled row, in row order) came back at `now`, maybe with the drafts
        the last stage proposed (`Policy.complete_frame`); returns the frames to launch."""
        return self._submit(self._observe(self._policy.complete_frame(frame, tokens, proposed), now), now)

    def replay(self, now: float) -> list[Frame]:
        """The nodes lost every stream's state at `now`: the policy rebuilds them (`Policy.replay`); returns the
        frames to launch."""
        return self._submit(self._observe(self._policy.replay(), now), now)

    def _observe(self, events: list[Event], now: float) -> list[Request]:
        """Record events; the requests sent because requests are done (closed loop)."""
        ended = self._recorder.observe(events, now)  # the recorder tells them apart: no second look at each event
        if self._on_events is not None:
            self._on_events(events)
        follow_ups = []
        for request_id in ended:
            self._left -= 1
            follow_ups += self._arrivals.done(request_id)
        return follow_ups

    def _submit(self, requests: Iterable[Choices], now: float) -> list[Frame]:
        """Send requests (each its choices' streams; and the follow-ups of any rejected at once); the next frame of
        every idle group."""
        queue = deque(requests)
        while queue:
            choices = queue.popleft()
            for request in choices:
                self._recorder.arrived(request, now)
                self._on_arrived(request)
            queue.extend(self._observe(self._policy.add_choices(choices), now))
        return self._policy.next_frames()
