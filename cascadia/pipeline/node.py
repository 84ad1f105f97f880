"""A node process: the server loop around one pipeline stage.

The node binds its input (PULL), connects to its successor (PUSH) and to the coordinator's control socket (DEALER
named after the node), waits until the coordinator accepts that connection, says HELLO, loads its stage while
reporting PROGRESS, says READY, then serves: every FRAME goes through `stage.process` and the result (a FRAME for
the next node, or TOKENS from the last) goes to the successor. Its input takes only FRAMEs from the previous
stage's node (the coordinator, for the first), over a connection made with that node's Curve key when keys are in
use; its control socket only the coordinator's messages. Any other message, one that fails to decode, and a frame
whose content cannot belong to the run (the stage raises `ForeignFrame`: an unknown slot, a position its stream is
not at) are logged with their reason, counted, and dropped; the node keeps serving. So are refused handshakes and
closed connections on its input logged, which ZeroMQ handles without a message (it drops a message over the size
limit with its connection).

A node holds no stage of its own when it is a spare (the plan leaves it out): it loads nothing and waits. An
ASSIGN from the coordinator gives any node its place in the pipeline (`NodeSettings.assigned` says where, from the
plan it carries): a spare takes a lost node's stage, every survivor its stage of a new plan, a neighbour of a moved
stage its new peers. The node rewires its input and successor, loads the stage unless it already holds it, and says
READY again.

It stops on SHUTDOWN, when the process that started it is gone, or when it loses the coordinator (the control
connection closes, or ZeroMQ's heartbeats go unanswered: `cascadia.pipeline.transport`), so no node outlives its run;
it watches for all three even while it waits on a successor that takes nothing (a killed coordinator's token socket).
With `keep_serving` it serves run after run instead: when a run ends (SHUTDOWN, a lost coordinator, an unreachable
successor) it keeps its compiled stage, waits for the last coordinator's connection to close and the next one's to
open, and says HELLO and READY to that. A new run's streams start at position 0, which frees their slots
(`EngineStage.process`); message sequence numbers start afresh with each coordinator, and the node goes back to the
stage it was started with (a new coordinator knows nothing of the last one's ASSIGNs).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from cascadia.errors import CascadiaError, NodeError
from cascadia.pipeline.transport import Transport, TransportError, receive_waiting, send, send_watching
from cascadia.pipeline.wire import (COORDINATOR_SENDER, DEFAULT_MAX_MESSAGE_BYTES, Assign, Decoder, Encoder, Error,
                                    Frame, Hello, Message, Progress, Ready, Received, Shutdown, Stats, StatsRequest,
                                    Tokens, WireError)

log = logging.getLogger(__name__)


class Stage(Protocol):
    """What a node serves: the real one wraps the OpenVINO stage engine (embedding when first, decoder layers,
    logits and sampling when last)."""

    def process(self, frame: Frame) -> Frame | Tokens:
        """The frame's rows after this stage. The input arrays are read-only views of the received message; the
        returned arrays are handed to ZeroMQ without a copy, so the stage must not write into them afterwards.
        Raises ForeignFrame, before changing any state, for a frame that cannot belong to the run."""


class ForeignFrame(Exception):
    """A well-formed frame whose content cannot belong to the run (a stray or forged one): it is dropped like a
    message that fails to decode, and never reported to the coordinator as a failure of the stage."""


ProgressFn = Callable[[int, int], None]  # (done, total), called by a stage loader as it goes


@attrs.frozen
class Peer:
    name: str  # whose Curve public key to expect there
    address: str  # tcp://HOST:PORT


@attrs.frozen
class NodeSettings:
    name: str
    sender: int = attrs.field(validator=attrs.validators.gt(COORDINATOR_SENDER))  # its stage's: `wire.node_sender`
    first_layer: int
    last_layer: int  # inclusive; below first_layer: no stage (a spare)
    listen: str  # tcp://HOST:PORT of this node's input
    successor: Peer | None  # the next node, or the coordinator's token socket for the last node; None: a spare
    control: Peer  # the coordinator's control socket
    input_peer: str | None  # whose Curve key may connect to the input: the previous stage's node, or the coordinator
    curve_keys: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    send_timeout_s: float = 10.0  # a successor that accepts nothing for this long is unreachable
    parent_pid: int | None = None  # stop when this process is no longer our parent
    poll_s: float = 0.1  # how often an idle node checks on its parent
    digest: str = ""  # of the settings it was started with, said in HELLO (`pipeline.settings.settings_digest`)
    keep_serving: bool = False  # serve run after run, each with its own coordinator (see the module's text)
    coordinator_wait_s: float | None = 120.0  # how long a starting node waits for a coordinator (None: no limit)
    cpus: tuple[int, ...] = ()  # the CPUs its process may run on, said in HELLO
    # its sender id on the control channel (its place among the cluster's members); default: its stage's
    control_sender: int = attrs.field(default=attrs.Factory(lambda self: self.sender, takes_self=True))
    stage: Any = None  # the plan's stage it serves, for its loader (None: a spare, or a test's node)
    stage_key: tuple = ()  # what its loaded stage depends on beyond its layers: a change means a reload
    # the settings for this node's stage of an assigned plan (`Assign`); None: the node cannot be assigned one
    assigned: Callable[[NodeSettings, Assign], NodeSettings] | None = attrs.field(default=None, eq=False)
    # told what the node now does (one of STATES), for its announcement to a fleet (`cascadia.fleet.announce`)
    on_state: Callable[[str], None] | None = attrs.field(default=None, eq=False)

    @property
    def predecessor(self) -> int:
        """The sender id of whoever sends this node its frames: the previous stage's node, or the coordinator."""
        return self.sender - 1

    @property
    def holds_stage(self) -> bool:
        return self.last_layer >= self.first_layer

    @property
    def stage_identity(self) -> tuple:
        """What decides whether a stage already loaded serves these settings."""
        return self.first_layer, self.last_layer, self.stage_key


# What a node does: stands by with no stage; serves a run with its stage; holds its stage between runs
STANDBY, SERVING, WAITING = "standby", "serving", "waiting"
STATES = (STANDBY, SERVING, WAITING)
CONTROL_SEND_TIMEOUT_S = 10.0
MAX_FRAME_TIMES = 100_000  # frame times kept for the next Stats (a trace's); older ones go


class NodeStopped(Exception):
    """Raised inside the node to end it cleanly: shutdown requested, or its parent gone."""


class CoordinatorLost(NodeError):
    """The control connection closed during a run without a SHUTDOWN: the coordinator stopped, or its machine
    became unreachable."""


# What the monitor of the control connection reports: accepted, closed, refused during the handshake.
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_CONTROL_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
# ... and of the input's connections: the ones it refused or lost
_INPUT_EVENTS = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
_HANDSHAKE_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its Curve key is not the previous stage's",
                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it broke the handshake's protocol (no Curve keys?)",
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed"}


StageLoader = Callable[[NodeSettings, ProgressFn], Stage]  # the stage of a node's settings, loaded


def run_node(settings: NodeSettings, load_stage: StageLoader) -> None:
    """Serve one stage (or stand by, a spare, until assigned one) until told to shut down or orphaned, or (without
    `keep_serving`) until the coordinator is lost. Raises TransportError (naming the address) when the input address
    is taken, the successor is unreachable or no coordinator accepts the node in time, and CoordinatorLost; a
    failure while the coordinator is there is first reported to it."""
    with Transport(settings.name, settings.curve_keys, settings.max_message_bytes,
                   settings.send_timeout_s) as transport:
        node = _Node(settings, transport, load_stage)
        try:
            node.join(settings.coordinator_wait_s)  # first, so that a failure to open is reported to it
            node.open()
            while True:
                node.load()
                node.serve()
                node.join(None)
        except NodeStopped as e:
            log.info("%s: stopping: %s", settings.name, e)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`cascadia.errors.Terminated`)
            log.info("%s: stopping: %s", settings.name, str(e) or "interrupted")
            raise
        except CoordinatorLost as e:
            log.error("%s: %s", settings.name, e)  # nobody to report it to
            raise
        except Exception as e:
            node.report_failure(f"{type(e).__name__}: {e}")
            raise


class _Node:
    def __init__(self, settings: NodeSettings, transport: Transport, load_stage: StageLoader):
        self.settings = self.started_with = settings
        self.transport = transport
        self.load_stage = load_stage
        self.stage: Stage | None = None
        self.loaded: tuple | None = None  # the `stage_identity` of the settings `stage` was loaded for
        self.assignment: Assign | None = None  # an ASSIGN not yet taken
        # The control channel comes first, so that a failure to open the others can be reported on it. A node only
        # speaks on it once the coordinator has accepted it (`join`): a send that waits there waits for a busy
        # machine, not for an absent peer, so it gets longer than the successor's timeout.
        self.control, self.control_events = transport.connect_watched(
            zmq.DEALER, settings.control.address, settings.control.name, _CONTROL_EVENTS,
            max(settings.send_timeout_s, CONTROL_SEND_TIMEOUT_S))
        self.connected = False  # a coordinator holds the control connection
        self.in_run = False  # from HELLO to the end of the run
        self.stale_connection = False  # keep-serving, after SHUTDOWN: the connection is still the last run's
        self.refused = False  # a handshake with the coordinator failed (ZeroMQ tries again)
        self.data: zmq.Socket | None = None
        self.data_events: zmq.Socket | None = None
        self.successor: zmq.Socket | None = None
        self.control_encoder = Encoder(settings.control_sender)
        self.encoder = Encoder(settings.sender)  # of the frames and tokens it sends on
        self._new_decoders()
        self.busy_s = 0.0
        self.frames = 0
        self.rejected = 0
        self.frame_times: deque[tuple[int, float, float, float]] = deque(maxlen=MAX_FRAME_TIMES)

    def open(self) -> None:
        s = self.settings
        self.data, self.data_events = self.transport.bind_watched(zmq.PULL, s.listen, _peers(s), _INPUT_EVENTS)
        if s.successor is not None:
            self.successor = self.transport.connect(zmq.PUSH, s.successor.address, s.successor.name)

    def rewire(self, settings: NodeSettings) -> None:
        """Take its place in the pipeline as `settings` say: the predecessor it takes frames from, the successor it
        sends to, its sender id. Its stage follows (`load`)."""
        old, self.settings = self.settings, settings
        if settings.sender != old.sender:  # numbered from now, above anything an earlier holder of the id sent
            self.encoder = Encoder(settings.sender)
            self.data_decoder = Decoder(settings.predecessor, (Frame,), settings.max_message_bytes)
        if self.data is not None and settings.input_peer != old.input_peer:
            self.transport.allow(settings.listen, _peers(settings))
        if self.data is not None and settings.successor != old.successor:
            if self.successor is not None:
                self.successor.close(linger=0)  # what it held were frames of streams the pipeline replays
            self.successor = None if settings.successor is None else self.transport.connect(
                zmq.PUSH, settings.successor.address, settings.successor.name)

    def load(self) -> None:
        """Hold the stage of its settings: loaded (reporting PROGRESS) unless already held; a spare holds none."""
        s = self.settings
        if self.loaded == s.stage_identity:
            return
        self.stage = self.loaded = None  # the old stage's memory goes before the new one's comes
        if s.holds_stage:
            self.stage = self.load_stage(s, self.progress)
        self.loaded = s.stage_identity

    def tell(self, message: Message) -> None:
        send(self.control, self.control_encoder.encode(message))

    def report_failure(self, text: str) -> None:
        log.error("%s: %s", self.settings.name, text)
        if not self.connected:
            return  # a send would only wait out its timeout
        try:
            self.tell(Error(self.settings.name, text))
        except Exception as e:  # the coordinator may be what failed; the raised error still tells the story
            log.error("%s: could not report the failure to the coordinator: %s", self.settings.name, e)

    def join(self, wait_s: float | None) -> None:
        """Wait (up to `wait_s` seconds, or for as long as it takes) until a coordinator accepts the control
        connection (after a run, a new connection: the last coordinator's must close first), then start a run
        with it: fresh sequence numbers, stale frames dropped, HELLO."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.control_events, zmq.POLLIN)
        while self.stale_connection or not self.connected:
            if deadline is not None and time.monotonic() > deadline:
                why = " (it refused the handshake: do the Curve keys match?)" if self.refused else ""
                raise TransportError(f"no coordinator accepted this node at {self.settings.control.address} "
                                     f"within {wait_s:g} s{why}")
            poller.poll(self.settings.poll_s * 1000)
            self._check_parent()
            self._take_control()
        self.rewire(self.started_with)  # a new coordinator knows nothing of the last one's ASSIGNs
        self._new_decoders()
        self.assignment = None
        while self.data is not None and receive_waiting(self.data) is not None:
            pass  # a frame of the last run
        self.in_run = True
        s = self.settings
        self.tell(Hello(s.name, s.first_layer, s.last_layer, s.digest, s.cpus))

    def _new_decoders(self) -> None:
        """Decoders for a new coordinator's run, whose messages are numbered afresh."""
        s = self.settings
        self.control_decoder = Decoder(COORDINATOR_SENDER, (Shutdown, StatsRequest, Assign), s.max_message_bytes)
        self.data_decoder = Decoder(s.predecessor, (Frame,), s.max_message_bytes)

    def progress(self, done: int, total: int) -> None:
        """Report loading progress, and stop loading if told to or orphaned."""
        self._take_control()
        if self.in_run:
            self.tell(Progress(self.settings.name, done, total))
        self._check_parent()

    def serve(self) -> None:
        """Say READY, then serve frames, and take the stages assigned meanwhile, until the run ends (`keep_serving`;
        otherwise the end of the run raises)."""
        self._ready()
        poller = zmq.Poller()
        for sock in (self.control, self.data, self.control_events, self.data_events):
            poller.register(sock, zmq.POLLIN)
        while self.in_run:
            ready = dict(poller.poll(self.settings.poll_s * 1000))
            self._check_parent()
            self._take_control()
            self._watch_input()
            if self.assignment is not None and self.in_run:
                self._take_assignment()
            elif self.data in ready and self.in_run and (frames := receive_waiting(self.data)) is not None:
                try:
                    self._on_data(frames)
                except TransportError as e:  # the successor is gone: the coordinator will end the run
                    if not self.settings.keep_serving:
                        raise
                    self._end_run(str(e))

    def _ready(self) -> None:
        """Say READY, unless the run ended while the stage loaded."""
        s = self.settings
        if not self.in_run:
            return
        self.tell(Ready(s.name, s.first_layer, s.last_layer))
        what = f"layers {s.first_layer}..{s.last_layer}" if s.holds_stage else "no stage: a spare standing by"
        log.info("%s: ready on %s, %s", s.name, s.listen, what)
        self._say_state(SERVING if s.holds_stage else STANDBY)

    def _take_assignment(self) -> None:
        """Serve the stage an ASSIGN gave: rewired, loaded, READY. One it cannot take is reported, and the node
        serves on as it was."""
        assign, self.assignment = self.assignment, None
        try:
            if self.settings.assigned is None:
                raise NodeError("this node cannot be assigned a stage")
            settings = self.settings.assigned(self.settings, assign)
        except CascadiaError as e:
            self.tell(Error(self.settings.name, f"cannot take the assigned stage: {e}"))
            return
        log.info("%s: assigned layers %d..%d, sending to %s", settings.name, settings.first_layer,
                 settings.last_layer, settings.successor.address if settings.successor else "nobody")
        self.rewire(settings)
        self.load()
        self._ready()

    def _end_run(self, reason: str, lost: bool = False) -> None:
        """The run is over: stop the node, or (`keep_serving`) go back to waiting for a coordinator."""
        if not self.settings.keep_serving:
            if lost:
                raise CoordinatorLost(f"lost the coordinator at {self.settings.control.address}: {reason}")
            raise NodeStopped(reason)
        self.in_run = False
        self.stale_connection = self.connected
        self._say_state(WAITING if self.started_with.holds_stage else STANDBY)  # the stage it goes back to
        # Logged here, before any later control message is answered: a coordinator that hears back has its log line.
        log.info("%s: run ended (%s); waiting for the next coordinator", self.settings.name, reason)

    def _say_state(self, state: str) -> None:
        if self.settings.on_state is not None:
            self.settings.on_state(state)

    def _take_control(self) -> None:
        """Every waiting control message, then every event of the control connection: a connection's messages
        arrive before its end, so a SHUTDOWN is always read before the close that follows it."""
        while (frames := receive_waiting(self.control)) is not None:
            self._on_control(frames)
        while self.control_events.poll(0):
            self._on_control_event()

    def _on_control_event(self) -> None:
        event = recv_monitor_message(self.control_events)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = self.stale_connection = False
            if self.in_run:
                self._end_run("its connection closed, or it stopped answering heartbeats", lost=True)
        else:  # also seen while a starting coordinator's authenticator is not yet configured
            self.refused = True
            log.warning("%s: the handshake with the coordinator at %s failed; trying again", self.settings.name,
                        self.settings.control.address)

    def _watch_input(self) -> None:
        """Log what happened to the input's connections: ZeroMQ refuses a handshake, or drops a connection whose
        peer sent a message over the size limit, without a message to show for it."""
        while self.data_events is not None and self.data_events.poll(0):
            event = recv_monitor_message(self.data_events)["event"]
            if event in _HANDSHAKE_FAILURES:
                log.warning("%s: refused a connection to its input %s: %s", self.settings.name, self.settings.listen,
                            _HANDSHAKE_FAILURES[event])
            elif event == zmq.EVENT_DISCONNECTED:
                log.info("%s: a connection to its input %s closed: its peer went away, or sent a message over the "
                         "limit of %d bytes, which ZeroMQ drops with the connection", self.settings.name,
                         self.settings.listen, self.settings.max_message_bytes)

    def _still_in_run(self) -> bool:
        """What a wait on the successor checks: the parent, the control channel (a SHUTDOWN, a lost coordinator:
        both end the run or the node), the input's connections; whether the run goes on with this successor (an
        ASSIGN gives the message up: the successor it waits on is lost, and its streams are replayed)."""
        self._check_parent()
        self._take_control()
        self._watch_input()
        return self.in_run and self.assignment is None

    def _check_parent(self) -> None:
        parent = self.settings.parent_pid
        if parent is not None and os.getppid() != parent:
            raise NodeStopped(f"parent process {parent} is gone")

    def _decode(self, frames: list, where: str, decoder: Decoder, accept: bool = True) -> Received | None:
        """The message in `frames` (received on the `where` socket), accepted unless told not to yet, or None after
        logging why it was rejected."""
        try:
            return decoder.decode(frames) if accept else decoder.check(frames)
        except WireError as e:
            self._reject(where, str(e))
            return None

    def _reject(self, where: str, reason: str) -> None:
        self.rejected += 1
        log.warning("%s: rejected a message on its %s socket: %s", self.settings.name, where, reason)

    def _on_control(self, frames: list) -> None:
        received = self._decode(frames, "control", self.control_decoder)
        match received and received.message:
            case Shutdown() if self.in_run or not self.settings.keep_serving:  # else: the last run's, late
                self._end_run("shutdown requested")
            case Assign() if self.in_run:
                self.assignment = received.message  # taken by the serve loop: loading takes a while
            case StatsRequest():
                self.tell(Stats(self.settings.name, self.busy_s, self.frames, self.rejected, time.monotonic(),
                                tuple(self.frame_times)))
                self.frame_times.clear()

    def _on_data(self, frames: list) -> None:
        """A frame through the stage to the successor. Its sequence number is accepted once the stage has taken its
        content: a frame that cannot belong to the run moves nothing on."""
        taken_in = time.monotonic()
        received = self._decode(frames, "input", self.data_decoder, accept=False)
        if received is None:
            return
        frame = received.message
        if self.stage is None:
            self._reject("input", f"frame {frame.frame_id}: this node holds no stage")
            return
        start = time.monotonic()
        try:
            result = self._process(self.stage, frame)
        except ForeignFrame as e:
            self._reject("input", f"frame {frame.frame_id} cannot belong to this run: {e}")
            return
        finally:
            end = time.monotonic()
            self.busy_s += end - start
        self.data_decoder.accept(received)
        if result is not None:
            self.frames += 1
            self.frame_times.append((frame.frame_id, taken_in, start, end))
            send_watching(self.successor, self.encoder.encode(result), self._still_in_run, self.settings.poll_s)

    def _process(self, stage: Stage, frame: Frame) -> Frame | Tokens | None:
        """The stage's result, or None after a failure. A failure is the stage's (a bad slot, an engine error), not
        the node's: report it to the coordinator, which decides whether the run goes on, and keep serving."""
        try:
            return stage.process(frame)
        except ForeignFrame:
            raise
        except Exception as e:
            log.exception("%s: frame %d failed", self.settings.name, frame.frame_id)
            self.tell(Error(self.settings.name, f"frame {frame.frame_id}: {type(e).__name__}: {e}"))
            return None


def _peers(settings: NodeSettings) -> list[str]:
    """Whose Curve key may connect to the node's input: its predecessor's (a spare's: nobody's)."""
    return [] if settings.input_peer is None else [settings.input_peer]
