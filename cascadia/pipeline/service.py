"""The pipeline serving requests that arrive at any time, for `cascadia serve`.

One thread owns the coordinator (a ZeroMQ socket belongs to one thread) and drives the shared policy, as `run_phase`
does for a workload: every group with nothing in flight gets its next frame, each frame's tokens complete it. Other
threads talk to it only through a queue and a wake-up socket: `submit` and `cancel` put a command on the queue and
write a byte that wakes the thread's poll at once, so the pipeline never waits on HTTP, nor HTTP on the pipeline
(`busy_seconds` too, and waits for the thread's answer).
Each request's events (`policy.Event`: admitted, tokens, finished or rejected; before a token, its `Logprobs` when the
request asked for them, and its prompt's `PromptLogprobs` before its first) go to the callback it was submitted
with, called on the service thread with the coordinator's clock; the callback must hand them on and return.

The thread also starts the nodes (local ones) or waits for them (tcp ones), so the caller can answer "loading" in
the meantime; `status` says where it stands, and `start_error` what kept the pipeline from starting (a missing or
corrupt checkpoint, a taken port), for the caller to stop on. If the pipeline fails, every open request gets a
`Failed` event and the service stops (`status().error` says why).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

from cascadia.errors import CascadiaError, NodeError, PlanError
from cascadia.graph.plan import Plan
from cascadia.pipeline.coordinator import Flight, Logprobs, NodeLost, PipelineError, PromptLogprobs, with_logprobs
from cascadia.pipeline.run import NODE_TIMEOUT_S, Addresses, Pipeline, describe
from cascadia.pipeline.wire import Message
from cascadia.policy import Event, Finished, KVPool, Policy, Rejected, Request
from cascadia.spec.types import NodeSpec, Spec

log = logging.getLogger(__name__)

STATS_S = 1.0  # how often the nodes' counters are read for `status`
STALL_S = 2.0  # a node whose heartbeats go unanswered this long (stopped, its machine gone) is lost
REPLACE_TIMEOUT_S = 60.0  # how long a lost remote node may take to come back before its stage is down
DOWN_POLL_S = 1.0  # while a stage is down: how often waiting requests are refused between looks for its node
MAX_RESTARTS = 3  # a local node lost again this often while being started again: the service fails
# an event of the request, and when (the coordinator's clock, seconds)
OnEvent = Callable[[Event | Logprobs | PromptLogprobs, float], None]


@attrs.frozen
class Failed:
    """The pipeline failed while the request was open: it ends here, without a Finished."""

    request_id: int
    reason: str


@attrs.frozen
class Status:
    ready: bool  # every node is up and the service takes requests
    loading: str  # the last thing a starting node said ("" once ready)
    error: str | None  # why the service stopped, if it did
    running: int  # streams holding a slot
    waiting: int  # requests waiting for one
    busy: dict[str, float]  # each node's busy fraction since the last status
    frames_per_s: dict[str, float]  # ... and frames handled per second
    down: str | None = None  # a stage lost and what is done about it, while it is
    accepting: bool = False  # requests are taken: serving, or recovering (they wait); not while a stage is down
    failures: dict[str, int] = attrs.Factory(dict)  # losses so far, by node
    recoveries_s: tuple[float, ...] = ()  # how long each recovery took, from the loss to serving again
    standing_by: tuple[str, ...] = ()  # nodes outside the plan, ready to take a lost node's stage (spares)
    standby_losses: dict[str, int] = attrs.Factory(dict)  # nodes lost while standing by, by node


class PipelineService:
    def __init__(self, spec: Spec, plan: Plan, *, checkpoint: Path | None = None, addresses: Addresses | None = None,
                 node_timeout_s: float = NODE_TIMEOUT_S, stall_s: float = STALL_S,
                 replace_timeout_s: float = REPLACE_TIMEOUT_S) -> None:
        """Start serving `plan` on a thread of its own (see the module's text); `status().ready` says when the nodes
        are up. The arguments are `Pipeline.start`'s, and `replace_timeout_s` how long a lost remote node may take
        to come back before its stage is down."""
        self.spec, self.plan = spec, plan
        self._start = {"checkpoint": checkpoint, "addresses": addresses, "node_timeout_s": node_timeout_s,
                       "stall_s": stall_s}
        self._replace_timeout_s = replace_timeout_s
        self._policy = Policy.for_runtime(spec.runtime, len(plan.stages), plan.kv_pools)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._listeners: dict[int, OnEvent] = {}  # open requests, on the service thread only
        self._prompts: dict[int, tuple[int, ...]] = {}  # ... the prompts of those that report their log-probabilities
        self._lock = threading.Lock()  # guards what `status` reads
        self._loading, self._error, self._ready = "starting", None, False
        self._start_error: BaseException | None = None
        self._counts = (0, 0)  # streams running, requests waiting
        self._stopping = threading.Event()
        self._busy: dict[str, float] = {}
        self._frames_per_s: dict[str, float] = {}
        self._last_stats: tuple[float, dict] | None = None
        self._down: str | None = None
        self._accepting = True
        self._failures: Counter[str] = Counter()
        self._standby_losses: Counter[str] = Counter()
        self._recoveries_s: list[float] = []
        self._standing_by: tuple[str, ...] = ()
        self._thread = threading.Thread(target=self._serve, name="cascadia-pipeline", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------------------
    def submit(self, request: Request | Sequence[Request], on_event: OnEvent) -> None:
        """Add a request, or the choices of one prompt (`Policy.add_choices`); their events go to `on_event` (on
        the service thread)."""
        self._command(("submit", request, on_event))

    def cancel(self, request_id: int) -> None:
        """Stop a request (nothing for one that has ended): it ends with Finished(reason "cancelled")."""
        self._command(("cancel", request_id))

    def busy_seconds(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Each node's busy seconds since it started, read from the nodes now (so that a load generator can time a
        phase's busy share exactly); empty while the pipeline is not serving, or gives no answer in `timeout_s`."""
        if not self.status().ready or self.status().down:
            return {}
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("busy", answer))
        try:
            return answer.result(timeout_s)
        except concurrent.futures.TimeoutError:
            return {}

    def add_spare(self, node: NodeSpec, timeout_s: float = 10.0) -> tuple[Spec, Plan]:
        """Take `node` into the cluster as a spare, which it joins by saying HELLO and READY on its own (a late node
        of a fleet that formed itself, to be invited); the spec with it and the plan served now. PipelineError when
        the pipeline is not serving (starting, a stage down, stopped) or does not answer in `timeout_s`."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("join", node, answer))
        try:
            return answer.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise PipelineError(f"{node.name}: the pipeline did not take it in within {timeout_s:g} s") from None

    def status(self) -> Status:
        with self._lock:
            return Status(self._ready and not self._down, self._loading, self._error, *self._counts,
                          dict(self._busy), dict(self._frames_per_s), self._down, self._ready and self._accepting,
                          dict(self._failures), tuple(self._recoveries_s), self._standing_by,
                          dict(self._standby_losses))

    @property
    def start_error(self) -> BaseException | None:
        """What kept the pipeline from starting (a `CascadiaError`, or a bug's exception), unless it was stopped."""
        with self._lock:
            return self._start_error

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving: open requests end with Failed("the server is shutting down"), the nodes are shut down."""
        self._stopping.set()
        self._command(("stop",))
        self._thread.join(timeout_s)
        self._wake_reader.close()
        self._wake_writer.close()

    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        try:
            self._wake_writer.send(b"!")
        except OSError:  # closed: the service has stopped, and the command will not be taken
            pass

    # ---- the service thread -----------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            pipeline = Pipeline.start(self.spec, self.plan, on_message=self._on_message, stop=self._stopping,
                                      with_spares=True, **self._start)
        except CascadiaError as e:
            self._start_failed(e, f"the pipeline did not start: {e}")
            return
        except Exception as e:  # a bug: still one line for the status, and the traceback in the log
            log.exception("the pipeline did not start")
            self._start_failed(e, f"the pipeline did not start: {type(e).__name__}: {e}")
            return
        with self._lock:
            self._ready, self._loading = True, ""
        reason = "the server is shutting down"
        try:
            while not self._loop(Flight(pipeline.coordinator, self._prompts), pipeline):
                pass
        except NodeError as e:
            reason = str(e)
            log.error("the pipeline failed: %s", e)
        finally:
            pipeline.close()
            self._stop(reason)

    def _loop(self, flight: Flight, pipeline: Pipeline) -> bool:
        """Serve until told to stop (True), or until a node is lost and taken back (False: serve on, with a new
        flight)."""
        coordinator, policy = flight.coordinator, self._policy
        try:
            while True:
                while not self._commands.empty():
                    command = self._commands.get()
                    if command[0] == "stop":
                        return True
                    self._apply(command, pipeline)
                self._launch(flight)
                completed = flight.wait(until=coordinator.now() + STATS_S, wake=[self._wake_reader])
                self._drain_wake()
                if completed is not None:
                    events = policy.complete_frame(completed.frame, completed.tokens, completed.proposed)
                    try:
                        self._launch(flight)  # the pipeline busy again before the tokens go to the HTTP side
                    finally:  # ... and they go even when the launch finds a node lost: the policy counts them made
                        self._dispatch(with_logprobs(events, completed.logprobs, completed.prompt_logprobs),
                                       coordinator.now())
                self._update_stats(pipeline)
        except NodeLost as lost:
            return not self._recover(pipeline, lost)

    def _recover(self, pipeline: Pipeline, lost: NodeLost) -> bool:
        """Take a lost node's stage back (`_take_back`): True once serving again, False when told to stop
        meanwhile. Requests keep arriving and wait, unless the stage goes down: then the open ones fail, new ones
        are refused, and we wait on for a node to take it."""
        started, attempts = time.monotonic(), 0
        while True:
            stage = _stage_name(pipeline.plan, lost.node)
            self._failures[lost.node] += 1
            attempts += 1
            if attempts > MAX_RESTARTS:
                raise PipelineError(f"{stage}: lost {attempts} times while being taken back; the last time: {lost}")
            log.warning("%s lost: %s; taking it back", stage, lost)
            self._set_down(f"{stage} lost ({lost}); taking it back", accepting=True)
            try:
                kv_pools = self._take_back(pipeline, lost.node, stage)
                break
            except NodeLost as again:  # the node started in its place was lost too, or another one
                lost = again
            except PipelineError:
                if self._stopping.is_set():
                    return False
                raise
        self._last_stats = None  # a restarted node counts from zero
        self._dispatch(self._policy.replay(kv_pools), pipeline.coordinator.now())
        with self._lock:
            self._recoveries_s.append(time.monotonic() - started)
        self.plan = pipeline.plan  # the stages may have moved: what `status` readers see
        self._set_down(None, accepting=True)
        log.info("%s serves again after %.2f s", stage, self._recoveries_s[-1])
        return True

    def _take_back(self, pipeline: Pipeline, node: str, stage: str) -> tuple[KVPool, ...] | None:
        """Serve the lost node's stage again, in this order: a node standing by (a spare) takes it; a local node is
        started again here; a remote one may come back on its machine within the replace timeout (a
        `--keep-serving` node's supervisor, or someone, starts it again); the survivors take the model over, with a
        new plan, if it fits them; else the stage is down until a node for it appears. Returns the K/V pools of a new
        plan (None: the pools are as they were)."""
        wait_s = self._start["node_timeout_s"]
        if pipeline.take_over(node, wait_s, self._stopping):
            return None
        if pipeline.local is not None:
            pipeline.replace(node, wait_s, self._stopping)
            return None
        if self._replaced_within(pipeline, node, self._replace_timeout_s):
            return None
        if (plan := self._survivors_plan(pipeline, node)) is not None:
            self._set_down(f"{stage} lost; the survivors take the model over", accepting=True)
            pipeline.assign(plan, wait_s, self._stopping)
            return plan.kv_pools
        reason = (f"{stage} is down: no node took it back within {self._replace_timeout_s:g} s, and the model does "
                  "not fit the nodes left")
        self._fail_open(reason)
        self._set_down(f"{reason}; waiting for one", accepting=False)
        while True:
            self._refuse_waiting(reason)
            if pipeline.take_over(node, wait_s, self._stopping) or self._replaced_within(pipeline, node, DOWN_POLL_S):
                return None

    def _survivors_plan(self, pipeline: Pipeline, node: str) -> Plan | None:
        """A plan over the nodes left, if the model and the streams admitted so far fit them."""
        try:
            plan = pipeline.survivors_plan(node)
        except PlanError as e:
            log.warning("the nodes left cannot take the model over: %s", e)
            return None
        if not self._policy.fits(plan.kv_pools):
            log.warning("the nodes left cannot take the model over: their K/V pools (%s) are smaller than what the "
                        "streams hold", ", ".join(f"{p.blocks} blocks" for p in plan.kv_pools))
            return None
        return plan

    def _replaced_within(self, pipeline: Pipeline, node: str, timeout_s: float) -> bool:
        """Whether a node took `node`'s stage back within `timeout_s`; NodeLost when it was lost again, and the
        wait's error when we are stopping."""
        try:
            pipeline.replace(node, timeout_s, self._stopping)
            return True
        except NodeLost:
            raise
        except PipelineError:
            if self._stopping.is_set():
                raise
            return False

    def _set_down(self, down: str | None, accepting: bool) -> None:
        """What status says while a stage is lost, and whether requests are taken meanwhile."""
        with self._lock:
            self._down, self._accepting = down, accepting

    def _fail_open(self, reason: str) -> None:
        """Every open request fails with `reason`, and the policy starts afresh."""
        for request_id, on_event in list(self._listeners.items()):
            on_event(Failed(request_id, reason), 0.0)
        self._listeners.clear()
        self._prompts.clear()
        self._policy = Policy.for_runtime(self.spec.runtime, len(self.plan.stages), self._policy.kv_pools)

    def _refuse_waiting(self, reason: str) -> None:
        """While a stage is down: requests that came fail at once, and stats requests get nothing."""
        while not self._commands.empty():
            command = self._commands.get()
            if command[0] == "stop":
                self._stopping.set()
            elif command[0] == "submit":
                command[2](Failed(command[1].id, reason), 0.0)
            elif command[0] == "busy":
                command[1].set_result({})
            elif command[0] == "join":
                command[2].set_exception(PipelineError(f"a stage is down ({reason})"))

    def _launch(self, flight: Flight) -> None:
        """Every group with nothing in flight gets its next frame."""
        policy = self._policy
        flight.launch(frame for group in range(policy.n_groups) if (frame := policy.next_frame(group)))
        with self._lock:
            self._counts = (policy.active, policy.waiting)

    def _apply(self, command: tuple, pipeline: Pipeline) -> None:
        coordinator = pipeline.coordinator
        if command[0] == "join":
            self.spec = pipeline.add_spare(command[1])
            command[2].set_result((self.spec, self.plan))
        elif command[0] == "submit":
            _, requests, on_event = command
            requests = (requests,) if isinstance(requests, Request) else tuple(requests)
            self._listeners.update((request.id, on_event) for request in requests)
            first = requests[0]  # choices of one prompt: the first computes it
            if first.sampling.prompt_logprobs and first.sampling.logprobs >= 0:
                self._prompts[first.id] = first.prompt_ids
            self._dispatch(self._policy.add_choices(requests), coordinator.now())
        elif command[0] == "cancel":
            self._dispatch(self._policy.cancel(command[1]), coordinator.now())
        else:  # "busy"
            command[1].set_result({node: stats.busy_s for node, stats in coordinator.stats().items()})

    def _dispatch(self, events: Iterable[Event | Logprobs | PromptLogprobs], now: float) -> None:
        for event in events:
            on_event = self._listeners.get(event.request_id)
            if isinstance(event, (Finished, Rejected)):
                self._listeners.pop(event.request_id, None)
                self._prompts.pop(event.request_id, None)
            if on_event is not None:
                on_event(event, now)

    def _drain_wake(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _update_stats(self, pipeline: Pipeline) -> None:
        """Each node's busy fraction and frames per second, from the counters it last sent (asked for anew, not
        waited for: a node answers between frames, which may be long), the nodes standing by and those lost while
        they did, every STATS_S."""
        coordinator = pipeline.coordinator
        now = coordinator.now()
        if self._last_stats is not None and now - self._last_stats[0] < STATS_S:
            return
        stats = coordinator.latest_stats()
        with self._lock:
            self._standing_by = tuple(coordinator.standing_by())
            self._standby_losses = Counter(coordinator.standby_losses)
            if self._last_stats is not None:
                then, before = self._last_stats
                was = {n: before[n] for n in stats if n in before}
                self._busy = {n: max(0.0, stats[n].busy_s - s.busy_s) / (now - then) for n, s in was.items()}
                self._frames_per_s = {n: max(0, stats[n].frames - s.frames) / (now - then) for n, s in was.items()}
        self._last_stats = (now, stats)

    def _on_message(self, node: str, message: Message) -> None:
        text = describe(node, message)
        log.info(text)
        with self._lock:
            self._loading = text

    def _start_failed(self, error: BaseException, reason: str) -> None:
        if not self._stopping.is_set():  # else stopped while starting, as asked: no error
            with self._lock:
                self._start_error = error
        self._stop(reason)

    def _stop(self, reason: str) -> None:
        """The service has stopped: every open request fails with `reason`."""
        with self._lock:
            self._ready, self._error = False, reason
        for request_id, on_event in list(self._listeners.items()):
            on_event(Failed(request_id, reason), 0.0)
        self._listeners.clear()
        while not self._commands.empty():  # requests that came too late
            command = self._commands.get()
            if command[0] == "submit":
                command[2](Failed(command[1].id, reason), 0.0)
            elif command[0] == "busy":
                command[1].set_result({})
            elif command[0] == "join":
                command[2].set_exception(PipelineError(f"not serving ({reason})"))


def _stage_name(plan: Plan, node: str) -> str:
    """"node1 (layers 2-3)"."""
    stage = next(stage for stage in plan.stages if stage.node == node)
    return f"{node} (layers {stage.first_layer}-{stage.last_layer})"
