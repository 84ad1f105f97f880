"""The coordinator: drives the shared scheduling policy over the real pipeline, as the simulator drives it over SimPy.

It binds the control socket (every node's DEALER connects to it) and the token socket (the last node sends there),
waits for every node to say READY, then serves workload phases: closed-loop clients add requests to the policy,
every group with nothing in flight gets its next frame sent to the first node at once, and each frame's sampled
tokens coming back from the last node complete it. Events are timestamped on arrival with one monotonic clock, and
recorded with the same `Recorder` as the simulator's.

A failure stops the phase within about a second, naming the node: an ERROR from it (one from a node still loading
its stage is the node's loss: `serve` may give the stage to another), a local node process that exited (`watch`), a
node whose control connection dropped (its heartbeats unanswered for `stall_s`: a stopped process or a vanished
machine; found by pinging silent pipelines), or no frame back within `hung_s` while every node answers heartbeats
(a node computes between the stats requests it answers, so one frame may take that long). A
stray message is no failure: the control socket takes only the messages a node of the cluster sends as itself, the
token socket only the last node's TOKENS for a frame in flight; anything else is logged, counted in `dropped`, and
dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import attrs
import zmq

from cascadia.driver import PhaseDriver
from cascadia.errors import NodeError
from cascadia.metrics import Recorder
from cascadia.pipeline.frame_log import FrameLog, NodeClock
from cascadia.pipeline.transport import COORDINATOR, Transport, TransportError, receive_waiting, send, send_watching
from cascadia.pipeline.wire import (COORDINATOR_SENDER, Assign, Decoder, Encoder, Error, Frame, Hello, Message,
                                    Progress, Ready, Shutdown, Stats, StatsRequest, Tokens, VersionMismatch, WireError,
                                    node_sender)
from cascadia.policy import Event, Finished
from cascadia.policy import Frame as PolicyFrame
from cascadia.policy import Policy, Rejected, Request, Row, Token, Verified
from cascadia.speculation import RecordedDrafter
from cascadia.workload import Arrivals

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often a waiting coordinator checks that every node is still there
HUNG_S = 60.0  # the longest a frame may keep a node that answers heartbeats from answering a stats request
WATCH_S = 0.1  # how often a waiting coordinator checks its local nodes' processes (`watch`)
CLOCK_EXCHANGES = 5  # stats exchanges with idle nodes that place their clocks on the coordinator's


class PipelineError(NodeError):
    """The pipeline cannot go on; the text names the node at fault when one is known."""


class NodeLost(PipelineError):
    """A node is gone (its process ended, its connection closed, or it stopped answering): the pipeline can go on
    once a node takes its stage again."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"{node}: {reason}")
        self.node, self.reason = node, reason


class Outputs:
    """Each request's prompt and generated tokens, for `--outputs`: what the pipeline computed, request by request.
    With `drafts` (the policy's drafter, counted), also each step's drafts: [proposed, accepted] at every step the
    stream was asked for some, in order (an acceptance trace for `simulate --acceptance-trace`)."""

    def __init__(self, drafts: RecordedDrafter | None = None) -> None:
        self.lines: list[dict] = []
        self._open: dict[int, tuple[dict, list[int]]] = {}
        self._drafts = drafts
        self._accepted: dict[int, list[int]] = {}  # by request id: each verified step's accepted drafts

    def arrived(self, request: Request, recorder: Recorder) -> None:
        line = {"concurrency": recorder.level, "rate": recorder.rate, "phase": recorder.phase, "request_id": request.id,
                "prompt_ids": list(request.prompt_ids)}
        self._open[request.id] = (line, [])

    def observe(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, Token):
                self._open[event.request_id][1].append(event.token)
            elif isinstance(event, Verified):
                self._accepted.setdefault(event.request_id, []).append(event.accepted)
            elif isinstance(event, Finished):
                line, ids = self._open.pop(event.request_id)
                self.lines.append({**line, "output_ids": ids, "finish_reason": event.reason,
                                   **self._steps(event.request_id)})
            elif isinstance(event, Rejected):
                line, _ = self._open.pop(event.request_id)
                self.lines.append({**line, "output_ids": [], "finish_reason": "rejected", "error": event.reason})


    def _steps(self, request_id: int) -> dict:
        """{"drafts": [[proposed, accepted], ...]} of a finished request (nothing without speculation); a step
        whose frame never came back (the request was cancelled) is left out."""
        if self._drafts is None:
            return {}
        accepted = iter(self._accepted.pop(request_id, []))
        steps = []
        for proposed in self._drafts.proposed.pop(request_id, []):
            if not proposed:
                steps.append([0, 0])
            elif (kept := next(accepted, None)) is not None:
                steps.append([proposed, kept])
        return {"drafts": steps}


class Coordinator:
    def __init__(self, nodes: Sequence[str], control: str, tokens: str, curve_keys=None, stall_s: float = 60.0,
                 digest: str | None = None, members: Sequence[str] | None = None, hung_s: float = HUNG_S):
        """`nodes`: the plan's node names in stage order. `control`, `tokens`: the addresses to bind.
        `digest`: the settings digest every node's HELLO must carry (`cascadia.pipeline.settings.settings_digest`).
        `members`: every node that may join, in the spec's order (`ClusterSpec.members`, which gives each its control
        sender id); default: `nodes`. Those outside the plan stand by (`standing_by`) until assigned a stage.
        `stall_s`: a node whose heartbeats go unanswered this long is lost; `hung_s` (at least `stall_s`): one that
        answers them but no stats request for this long, while no tokens come back, is lost too."""
        self.nodes = list(nodes)
        self.members = list(members or nodes)
        self.digests = dict.fromkeys(self.members, digest)  # what each node's HELLO must say (None: unchecked)
        self.stall_s, self.hung_s = stall_s, max(stall_s, hung_s)
        # Called while waiting; raises PipelineError when it sees a node gone. Set once the node processes it
        # watches are started, which is after this binds the addresses they connect to.
        self.watch: Callable[[], None] = lambda: None
        self.transport = Transport(COORDINATOR, curve_keys)
        try:
            self.control = self.transport.bind(zmq.ROUTER, control, self.members, heartbeat_timeout_s=stall_s)
            self.tokens = self.transport.bind(zmq.PULL, tokens, self.nodes[-1:])
        except TransportError:
            self.transport.close()
            raise
        self.control_address, self.tokens_address = control, tokens
        self.first: zmq.Socket | None = None
        self.encoder = Encoder(COORDINATOR_SENDER)
        # A decoder per node: a control message is a node's only when it comes under the node's name and sender id.
        self.control_decoders = {node: Decoder(node_sender(i), (Hello, Progress, Ready, Stats, Error))
                                 for i, node in enumerate(self.members)}
        self.token_decoder = Decoder(node_sender(len(self.nodes) - 1), (Tokens,))
        self.dropped = 0  # stray or unreadable messages
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.tokens, zmq.POLLIN)
        self._stats: dict[str, Stats] = {}
        self._stats_owed = dict.fromkeys(self.members, 0)  # stats requests not yet answered, by node
        self._answers = dict.fromkeys(self.members, 0)  # stats answers received, by node
        self._stats_asked: dict[str, deque[float]] = {node: deque() for node in self.members}  # ... when each was sent
        self.clocks = {node: NodeClock() for node in self.members}
        self.frame_log: FrameLog | None = None  # set to keep what `cascadia run --trace` writes
        self._ready: set[str] = set()  # nodes whose last word was READY (those outside the plan stand by)
        self._last_heard: dict[str, float] = {}  # monotonic time of each starting node's last message
        self.node_cpus: dict[str, tuple[int, ...]] = {}  # the CPUs each node's process runs on, from its HELLO
        self._last_dropped: dict[str, str] = {}  # why each node's last dropped control message was dropped
        self._routes: dict[str, bytes] = {}  # each node's control connection: the ROUTER's id of its latest
        self.standby_losses: Counter[str] = Counter()  # nodes lost while they stood by
        self._on_message: Callable[[str, Message], None] = lambda node, message: None
        self._clock0 = time.perf_counter()
        self._last_ping = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._clock0

    # ---- start-up -------------------------------------------------------------------------------------------
    def wait_ready(self, first_address: str, timeout_s: float,
                   on_message: Callable[[str, Message], None] = lambda node, message: None,
                   stop: threading.Event | None = None) -> None:
        """Wait for every node's READY, passing each HELLO, PROGRESS and READY to `on_message`. A node silent for
        `timeout_s` (from the start, or from its last message) is an error naming it, and so is `stop` set by
        another thread. Then connect to the first."""
        self._on_message = on_message
        self._await_ready(timeout_s, stop)
        self.first = self.transport.connect(zmq.PUSH, first_address, self.nodes[0])

    def rejoin(self, node: str, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Take `node` back after its loss: forget what its earlier life owed us, and wait for the node started in
        its place (by us, or on its machine) to say HELLO and READY, as at the start; then place its clock."""
        self._forget(node)
        self._ready.discard(node)
        self._await_ready(timeout_s, stop)
        self.sync_clocks()

    def standing_by(self) -> list[str]:
        """Members outside the plan that said READY (spares, or lost nodes back), in the spec's order."""
        return [node for node in self.members if node in self._ready and node not in self.nodes]

    def add_member(self, node: str) -> None:
        """A node that joins after the start, to stand by (a late one of a fleet that formed itself): the next
        control sender id, its key let in on the control socket. Its HELLO's digest is not checked: it was invited
        with the spec and plan of the moment, which may change before it says HELLO."""
        self.members.append(node)
        self.digests[node] = None
        self.transport.allow(self.control_address, self.members)
        self.control_decoders[node] = Decoder(node_sender(len(self.members) - 1), (Hello, Progress, Ready, Stats,
                                                                                   Error))
        self._answers[node] = 0
        self._stats_asked[node] = deque()
        self._forget(node)

    def stand_down(self, node: str, reason: str) -> None:
        """A node standing by is gone (`reason`: how it was found so): logged and counted, it stands by no more,
        until it says READY again, started anew."""
        log.warning("%s, standing by, was lost: %s", node, reason)
        self.standby_losses[node] += 1
        self._ready.discard(node)
        self._forget(node)

    def assign(self, nodes: Sequence[str], plan_json: str, addresses: dict[str, str], timeout_s: float,
               stop: threading.Event | None = None, spec_text: str = "") -> None:
        """Serve a plan whose stages are on `nodes` (in stage order): each gets an ASSIGN with the plan and its
        successor's address (`addresses`: where each node's predecessor reaches it; the last sends to our token
        socket: `tokens_for_nodes`), and we wait for every READY as at the start; then the first node's input is
        ours, from the moment they are told (a loss during the wait must not leave our frames going to the stage's
        previous holder). A node keeps a stage it holds and only rewires, so the survivors of a loss answer at
        once. `spec_text` goes with each ASSIGN (`wire.Assign.spec`)."""
        self._ready -= set(self.nodes) - set(nodes)  # lost: one that comes back stands by
        first_before, self.nodes = self.nodes[0], list(nodes)
        self.token_decoder = Decoder(node_sender(len(nodes) - 1), (Tokens,))
        self.transport.allow(self.tokens_address, nodes[-1:])
        for node in self.members:  # those left out of the plan owe nothing any more either
            self._forget(node)
        if nodes[0] != first_before:
            self.first.close(linger=0)
            self.first = self.transport.connect(zmq.PUSH, addresses[nodes[0]], nodes[0])
        for node, after in zip(nodes, [*nodes[1:], None]):
            self._ready.discard(node)
            self._tell(node, Assign(plan_json, self.tokens_for_nodes if after is None else addresses[after],
                                    spec_text))
        self._await_ready(timeout_s, stop)
        self.sync_clocks()

    @property
    def tokens_for_nodes(self) -> str:
        """Our token socket's address as an ASSIGN says it: `*` for our host as the node reaches our control socket
        (we may have bound every interface)."""
        return f"tcp://*:{self.tokens_address.rsplit(':', 1)[1]}"

    def _forget(self, node: str) -> None:
        """What a node's earlier life (or place) owed us: stats requests, its clock."""
        self._last_heard.pop(node, None)
        self._stats_owed[node] = 0
        self._stats_asked[node].clear()
        self.clocks[node] = NodeClock()

    def _await_ready(self, timeout_s: float, stop: threading.Event | None) -> None:
        start = time.monotonic()
        while not self._ready.issuperset(self.nodes):
            self._poll()
            if stop is not None and stop.is_set():
                raise PipelineError("stopped before every node was ready")
            silent = [n for n in self.nodes
                      if n not in self._ready and time.monotonic() - self._last_heard.get(n, start) > timeout_s]
            if silent:
                dropped = "".join(f"; {node}'s last message was dropped: {self._last_dropped[node]}"
                                  for node in silent if node in self._last_dropped)
                raise PipelineError(f"{', '.join(silent)}: no word within {timeout_s:g} s while starting (not "
                                    f"started, or started without --control {self.control_address}?){dropped}")

    # ---- serving --------------------------------------------------------------------------------------------
    def run_phase(self, policy: Policy, arrivals: Arrivals, requests: int, recorder: Recorder,
                  outputs: Outputs) -> dict[str, float]:
        """Serve a phase of `requests` requests sent as `arrivals` says; returns each node's busy seconds in it.
        The phase's bookkeeping is the simulator's `PhaseDriver`; here its frames go through the real pipeline."""
        driver = PhaseDriver(policy, arrivals, requests, recorder,
                             on_arrived=lambda request: outputs.arrived(request, recorder),
                             on_events=outputs.observe)
        busy_before = {node: stats.busy_s for node, stats in self.stats().items()}
        flight = Flight(self)
        flight.launch(driver.start(self.now()))
        while not driver.done:
            completed = flight.wait(until=driver.next_arrival)
            if completed is None:  # an open-loop request is due
                flight.launch(driver.arrive(self.now()))
            else:
                flight.launch(driver.complete(completed.frame, completed.tokens, self.now(), completed.proposed))
        return {node: stats.busy_s - busy_before[node] for node, stats in self.stats().items()}

    def send_frame(self, frame: Frame) -> None:
        """Send a frame into the first node."""
        def still_there() -> bool:  # while the first node takes nothing: a local one may have died
            self.watch()
            return True

        try:
            send_watching(self.first, self.encoder.encode(frame), still_there, WATCH_S)
        except TransportError as e:
            raise NodeLost(self.nodes[0], str(e)) from None

    def next_tokens(self) -> Tokens:
        """The next TOKENS from the last node, watching the pipeline while waiting (`check_stall`)."""
        since = time.monotonic()
        while (tokens := self.poll_tokens(HEARTBEAT_S)) is None:
            self.check_stall(time.monotonic() - since)
        return tokens

    def check_stall(self, stalled_s: float) -> None:
        """No tokens have come back for `stalled_s` with frames in flight: a node whose control connection dropped
        is lost (the pings find it); past `hung_s`, the stall is an error (`_stall_error`)."""
        if stalled_s > self.stall_s and time.monotonic() - self._last_ping >= HEARTBEAT_S:
            self._ping()
        if stalled_s > self.hung_s:
            raise self._stall_error()

    def poll_tokens(self, timeout_s: float, wake: Sequence = ()) -> Tokens | None:
        """TOKENS from the last node if some come within `timeout_s`, taking in control messages and checking on the
        nodes meanwhile; None sooner when one of `wake` (sockets or file descriptors) becomes readable."""
        ready = self._poll(timeout_s, wake)
        if self.tokens in ready and (frames := receive_waiting(self.tokens)) is not None:
            try:
                return self.token_decoder.decode(frames).message
            except WireError as e:
                self._drop("token socket", str(e))
        if not ready and time.monotonic() - self._last_ping >= HEARTBEAT_S:
            self._ping()
        return None

    def _stall_error(self) -> PipelineError:
        """A stall: the loss of the first node that no longer answers, when one does not; else the report."""
        report = self._stall_report()
        silent = [node for node, owed in self._stats_owed.items() if owed > 1]
        return NodeLost(silent[0], report) if silent else PipelineError(report)

    def _stall_report(self) -> str:
        """Why a stall is an error: first the nodes that no longer answer (a stopped or frozen process; a node
        answers a stats request however busy its stage), then each node's last counters, so that a silent or
        poisoned node stands out."""
        silent = [f"{node} has not answered its last {owed} stats requests" for node, owed in self._stats_owed.items()
                  if owed > 1]  # one may be on its way
        stopped = f"; {', '.join(silent)} (stopped or frozen?)" if silent else ""
        known = [(node, self._stats[node]) for node in self.nodes if node in self._stats]  # in stage order
        frames = ", ".join(f"{node} {stats.frames}" for node, stats in known)
        rejected = ", ".join(f"{node} {stats.rejected}" for node, stats in known)
        return (f"no tokens came back for {self.hung_s:g} s{stopped}; frames handled per node: {frames}; messages "
                f"rejected per node: {rejected}; messages dropped by the coordinator: {self.dropped}")

    def sync_clocks(self, exchanges: int = CLOCK_EXCHANGES) -> None:
        """Place each node's clock on ours (`clocks`) from a few stats exchanges while the nodes are idle, when the
        round trips are shortest."""
        for _ in range(exchanges):
            self.stats()

    def stats(self) -> dict[str, Stats]:
        """Every node's current counters. A node that leaves a request unanswered for `hung_s` is an error: a node
        answers requests in order, so waiting on for a lost one would wait for ever."""
        self._ping()
        since, answered_before = time.monotonic(), dict(self._answers)
        while owing := [node for node, owed in self._stats_owed.items() if owed]:
            if time.monotonic() - since > self.hung_s:
                silent = [node for node in owing if self._answers[node] == answered_before[node]]
                if silent:
                    raise NodeLost(silent[0], f"no answer to a stats request within {self.hung_s:g} s (stopped "
                                              "or frozen?)")
                raise PipelineError(f"{', '.join(owing)}: no answer to a stats request within {self.hung_s:g} s")
            if not self._poll():
                self._ping()
        return {node: self._stats[node] for node in self.nodes}

    def latest_stats(self) -> dict[str, Stats]:
        """The counters each node of the plan last sent, asking for new ones without waiting for them (a node
        answers between frames)."""
        latest = {node: self._stats[node] for node in self.nodes if node in self._stats}
        self._ping()
        return latest

    # ---- control channel --------------------------------------------------------------------------------------
    def _tell(self, node: str, message: Message) -> None:
        try:
            send(self.control, [self._routes.get(node, node.encode()), *self.encoder.encode(message)])
        except TransportError:
            raise NodeLost(node, "lost its control connection (the node stopped or its machine is unreachable)") \
                from None

    def _ping(self) -> None:
        """Ask every node for its stats: sending to a node whose control connection dropped fails at once. Those
        standing by are asked too, owing nothing: one whose connection dropped stands by no more (`stand_down`)."""
        self._last_ping = time.monotonic()
        for node in self.nodes:
            self._stats_asked[node].append(self.now())  # before it goes: the node answers after this
            self._tell(node, StatsRequest())
            self._stats_owed[node] += 1
        for node in self.standing_by():
            try:
                self._tell(node, StatsRequest())
            except NodeLost as lost:
                self.stand_down(node, lost.reason)

    def _poll(self, timeout_s: float = HEARTBEAT_S, wake: Sequence = ()) -> dict:
        """Wait up to `timeout_s` (at most WATCH_S) for input (or one of `wake` to be readable) and take in one
        control message, then check on the nodes."""
        for waker in wake:
            self.poller.register(waker, zmq.POLLIN)
        try:
            ready = dict(self.poller.poll(max(0, round(min(timeout_s, WATCH_S) * 1000))))
        finally:
            for waker in wake:
                self.poller.unregister(waker)
        if self.control in ready:
            self._next_control()
        self.watch()
        return ready

    def _drop(self, where: str, reason: str) -> None:
        self.dropped += 1
        log.warning("coordinator: dropped a message on its %s: %s", where, reason)

    def _control_message(self, message_frames: list) -> tuple[str, Message] | None:
        """The node that sent a control message, and the message; None after dropping it. A plan node's message in
        another protocol version is no stray message: VersionMismatch is raised.

        Without Curve keys a node is the name its connection gives; with them, the owner of the key its connection
        was made with: our nodes give no name then (the ROUTER numbers their connections, from a zero byte, which no
        chosen name may start with), so a connection that names itself is an impostor's, whatever name it takes."""
        identity, *frames = message_frames
        if self.transport.curve is None:
            node = identity.bytes.decode(errors="replace")
        else:
            node = self.transport.key_owner(frames[0]) if frames else None
            if not identity.bytes.startswith(b"\0"):
                claimed = identity.bytes.decode(errors="replace")
                self._drop("control socket", f"refused a connection naming itself {claimed!r} with {node}'s Curve key")
                return None
        if node not in self.control_decoders:
            self._drop("control socket", f"from {node!r}, which is not a node of the plan")
            return None
        self._routes[node] = identity.bytes
        try:
            return node, self.control_decoders[node].decode(frames).message
        except VersionMismatch:
            raise
        except WireError as e:
            self._drop(f"control socket from {node}", str(e))
            self._last_dropped[node] = str(e)  # for the error, should the node seem silent
            return None

    def _next_control(self) -> None:
        """Take in one control message, if one is waiting; an ERROR stops the run."""
        if (message_frames := receive_waiting(self.control)) is None:
            return
        try:
            received = self._control_message(message_frames)
        except VersionMismatch as e:
            node = message_frames[0].bytes.decode(errors="replace")
            raise PipelineError(f"{node}: runs another version of Cascadia ({e}); run the same version on every "
                                "machine") from None
        if received is None:
            return
        node, message = received
        match message:
            case Error() if node not in self.nodes:  # a node standing by: it no longer does
                log.warning("%s, standing by, failed: %s", node, message.text)
                self._ready.discard(node)
            case Error() if node not in self._ready:  # it failed to load its stage: another node may take it
                raise NodeLost(node, message.text)
            case Error():
                raise PipelineError(f"{node}: {message.text}")
            case Stats():
                self._stats[node] = message
                self._stats_owed[node] = max(0, self._stats_owed[node] - 1)
                self._answers[node] += 1
                if self._stats_asked[node]:  # answers come in order
                    self.clocks[node].observe(self._stats_asked[node].popleft(), self.now(), message.clock)
                if self.frame_log is not None:
                    self.frame_log.node_times(node, message.frame_times)
            case Hello() if self.digests[node] is not None and message.settings != self.digests[node]:
                raise PipelineError(f"{node}: started with other settings than this run (digest {message.settings}, "
                                    f"expected {self.digests[node]}): start it with the same spec and plan as "
                                    "`cascadia run`, and --logits only for `cascadia score`")
            case Hello() | Progress() | Ready():
                self._last_heard[node] = time.monotonic()
                if isinstance(message, Hello):
                    self.node_cpus[node] = message.cpus
                if isinstance(message, Ready):
                    self._ready.add(node)
                self._on_message(node, message)

    # ---- the end ----------------------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float) -> None:
        """Ask every node to stop, and wait up to `timeout_s` until each has either closed its control connection
        or answered a probe sent after SHUTDOWN (a keep-serving node stays for the next run; replies come in order,
        so it has read the SHUTDOWN): closing our sockets at once was seen to drop a queued SHUTDOWN despite the
        linger, leaving a remote node running."""
        remaining = list(self.members)
        deadline = time.monotonic() + timeout_s
        message: Message = Shutdown()
        while remaining and time.monotonic() < deadline:
            for node in list(remaining):
                try:
                    self._tell(node, message)
                except PipelineError:  # gone
                    remaining.remove(node)
            message = StatsRequest()  # from now on only a probe: a node still there drops it as it stops
            while self.control.poll(50) and (message_frames := receive_waiting(self.control)) is not None:
                try:
                    received = self._control_message(message_frames)
                except VersionMismatch:
                    continue  # a node of another version never joined this run
                if received is None:
                    continue
                node, reply = received
                if not isinstance(reply, Stats) or node not in remaining:
                    continue
                if self._stats_owed[node]:  # a reply to a request sent before SHUTDOWN (the probes are not counted)
                    self._stats_owed[node] -= 1
                else:
                    remaining.remove(node)

    def close(self) -> None:
        self.transport.close()


@attrs.frozen
class Logprobs:
    """What the model gave a request's next token: its log-probability, and the likeliest tokens there (id,
    log-probability), most likely first, as many as the request asked for. Goes to the request just before its
    Token."""

    request_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class PromptLogprobs:
    """What the model gave a request's prompt token at `position` (from 1) after those before it: its
    log-probability and the likeliest tokens there, as for `Logprobs`."""

    request_id: int
    position: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Completed(NamedTuple):
    """A frame back from the pipeline: its sampled rows' tokens, in row order, and their log-probabilities where
    their stream asked for them (None: no row did); and those of the prompt tokens its rows reported."""

    frame: PolicyFrame
    tokens: list[int]
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    proposed: dict[int, tuple[int, list[int]]] | None = None  # the last stage's drafts (`frame_drafts`)


def with_logprobs(events: Iterable[Event], logprobs: Sequence[Logprobs | None] | None,
                  prompt_logprobs: Iterable[PromptLogprobs] = ()) -> Iterator[Event | Logprobs | PromptLogprobs]:
    """The policy's events of a completed frame, after the prompt tokens' log-probabilities it reported, each Token
    of a stream that asked preceded by its Logprobs. A stream's tokens from a frame are those of its first sampled
    rows, in order (the drafts it kept, then one more)."""
    yield from prompt_logprobs
    waiting: dict[int, deque[Logprobs]] = {}
    for reported in logprobs or ():
        if reported is not None:
            waiting.setdefault(reported.request_id, deque()).append(reported)
    for event in events:
        if isinstance(event, Token) and (mine := waiting.get(event.request_id)):
            yield mine.popleft()
        yield event


class Flight:
    """The policy's frames the pipeline is computing (at most one per group), each matched with its tokens as they
    come back. Tokens that cannot be a frame's in flight are logged, counted and dropped. `prompts`: the prompts of
    the requests whose prompt tokens' log-probabilities are reported, by request id (kept by the caller)."""

    def __init__(self, coordinator: Coordinator, prompts: Mapping[int, Sequence[int]] | None = None) -> None:
        self.coordinator = coordinator
        self.prompts = {} if prompts is None else prompts
        self.frames: dict[int, PolicyFrame] = {}  # by group
        self._targets: dict[int, list[int] | None] = {}  # by group: the frame's prompt targets (`prompt_targets`)
        self._progress = time.monotonic()  # when the last tokens came back, or the pipeline went busy

    def launch(self, frames: Iterable[PolicyFrame]) -> None:
        for frame in frames:
            if not self.frames:
                self._progress = time.monotonic()
            self.frames[frame.group] = frame
            if (log := self.coordinator.frame_log) is not None:  # before it goes: the first node takes it after
                log.sent(frame.seq, frame.group, len(frame.rows), frame.padded_rows, len(frame.sampled_ids),
                         self.coordinator.now())
            self._targets[frame.group] = targets = prompt_targets(frame, self.prompts)
            self.coordinator.send_frame(wire_frame(frame, targets))

    def wait(self, until: float | None = None, wake: Sequence = ()) -> Completed | None:
        """The next frame to come back, with its sampled rows' tokens; None once the coordinator's
        clock passes `until`, or sooner when one of `wake` becomes readable. A stall while frames are in flight is
        checked (`Coordinator.check_stall`)."""
        coordinator = self.coordinator
        while True:
            timeout = HEARTBEAT_S if until is None else min(HEARTBEAT_S, until - coordinator.now())
            tokens = coordinator.poll_tokens(max(timeout, 0.0), wake)
            if tokens is not None and (matched := self._match(tokens)) is not None:
                self._progress = time.monotonic()
                return matched
            if until is not None and coordinator.now() >= until:
                return None
            if wake and _readable(wake):
                return None
            if self.frames:
                coordinator.check_stall(time.monotonic() - self._progress)

    def _match(self, tokens: Tokens) -> Completed | None:
        """The frame in flight the tokens complete; None after dropping tokens that cannot be a frame's in flight (a
        stray or forged message: the frame's own may still come)."""
        frame = self.frames.get(tokens.group)
        sampled_slots = None if frame is None else [row.slot for row in frame.rows if row.sampled]
        targets = self._targets.get(tokens.group)
        if frame is None or frame.seq != tokens.frame_id:
            stray = f"tokens for frame {tokens.frame_id} of group {tokens.group}, which is not in flight"
        elif tokens.slots.tolist() != sampled_slots:
            stray = f"frame {frame.seq}: tokens for slots {tokens.slots.tolist()}, expected {sampled_slots}"
        elif tokens.logprobs is not None and len(tokens.logprobs) != len(reporting := _reporting(frame, targets)):
            stray = f"frame {frame.seq}: {len(tokens.logprobs)} rows' log-probabilities, expected {len(reporting)}"
        else:
            del self.frames[tokens.group]
            if (log := self.coordinator.frame_log) is not None:
                log.done(frame.seq, self.coordinator.now())
            return Completed(frame, tokens.token_ids.tolist(), *frame_logprobs(frame, tokens, targets),
                             frame_drafts(frame, tokens))
        self.coordinator._drop("token socket", stray)
        return None


def frame_drafts(frame: PolicyFrame, tokens: Tokens) -> dict[int, tuple[int, list[int]]] | None:
    """The drafts the last stage proposed with a frame's tokens (its MTP layer's), by request id: the length of the
    stream's tokens they follow (those up to the drafting row's sampled token) and themselves. None: none."""
    if tokens.drafts is None:
        return None
    sampled = [row for row in frame.rows if row.sampled]
    return {row.request_id: (row.position + 2, [int(d) for d in drafts if d >= 0])
            for row, drafts in zip(sampled, tokens.drafts) if drafts[0] >= 0}


def prompt_targets(frame: PolicyFrame, prompts: Mapping[int, Sequence[int]]) -> list[int] | None:
    """For each row of the frame, the prompt token after it, where its request's prompt log-probabilities are
    reported (`prompts`) and the row is a prompt row not sampled (the last prompt row's is the first token's);
    -1 elsewhere. None when no row has one."""
    if not prompts:
        return None
    targets = [-1] * len(frame.rows)
    for i, row in enumerate(frame.rows):
        if (prompt := prompts.get(row.request_id)) is not None and not row.sampled and row.position + 1 < len(prompt):
            targets[i] = prompt[row.position + 1]
    return targets if max(targets) >= 0 else None


def _reporting(frame: PolicyFrame, targets: list[int] | None) -> list[tuple[Row, int]]:
    """The frame's rows whose log-probabilities TOKENS carries (as `Frame.reporting`), each with its target."""
    targets = targets or [-1] * len(frame.rows)
    return [(row, target) for row, target in zip(frame.rows, targets) if row.sampled or target >= 0]


def frame_logprobs(frame: PolicyFrame, tokens: Tokens, targets: list[int] | None = None
                   ) -> tuple[list[Logprobs | None] | None, tuple[PromptLogprobs, ...]]:
    """Each sampled row's Logprobs where its stream asked for them, and the PromptLogprobs of the rows with a
    target, each cut to the number of likeliest tokens its request asked for."""
    if tokens.logprobs is None:
        return None, ()
    sampled, prompt = [], []
    for (row, target), chosen, ids, values in zip(_reporting(frame, targets), tokens.logprobs.tolist(),
                                                  tokens.top_ids, tokens.top_logprobs):
        k = row.sampling.logprobs
        top = tuple(zip(ids[:k].tolist(), values[:k].tolist())) if k >= 0 else ()
        if row.sampled:
            sampled.append(Logprobs(row.request_id, chosen, top) if k >= 0 else None)
        else:
            prompt.append(PromptLogprobs(row.request_id, row.position + 1, target, chosen, top))
    return sampled, tuple(prompt)


def _readable(wake: Sequence) -> bool:
    return bool(zmq.select(list(wake), [], [], 0)[0])


def wire_frame(frame: PolicyFrame, targets: list[int] | None = None) -> Frame:
    """The policy's frame as the pipeline carries it, with the rows' prompt targets (`prompt_targets`)."""
    rows = frame.rows
    return Frame(frame.seq, frame.group, [r.slot for r in rows], [r.position for r in rows],
                 [r.token for r in rows], [r.sampled for r in rows], bucket=frame.padded_rows,
                 temperature=[r.sampling.temperature for r in rows], top_p=[r.sampling.top_p for r in rows],
                 seed=[r.sampling.seed for r in rows], top_k=[r.sampling.top_k for r in rows],
                 min_p=[r.sampling.min_p for r in rows], logprobs=[r.sampling.logprobs for r in rows],
                 adjustments={r.slot: r.sampling.adjust for r in rows
                              if (r.position == 0 or r.fork >= 0) and r.sampling.adjust is not None}, targets=targets,
                 forks=[r.fork for r in rows] if any(r.fork >= 0 for r in rows) else None,
                 propose=[r.sampled for r in rows] if frame.propose else None)
