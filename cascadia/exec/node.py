"""A node process: the server loop around one pipeline stage.

The node binds its input (PULL), connects to its successor (PUSH) and to the coordinator's control socket (DEALER
named after the node), says HELLO, loads its stage while reporting PROGRESS, says READY, then serves: every FRAME
goes through `stage.process` and the result (a FRAME for the next node, or TOKENS from the last) goes to the
successor. A message that fails to decode is logged with its reason, counted, and dropped; the node keeps serving.
It stops on SHUTDOWN, or when the process that started it is gone, so no node outlives its run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np
import zmq

from cascadia.exec.transport import Transport, receive, send
from cascadia.exec.wire import (DEFAULT_MAX_MESSAGE_BYTES, Decoder, Encoder, Error, Frame, Hello, Message, Progress,
                                Ready, Release, Shutdown, Stats, StatsRequest, Tokens, WireError)

log = logging.getLogger(__name__)


class Stage(Protocol):
    """What a node serves: the real one wraps the OpenVINO stage engine (embedding when first, decoder layers,
    logits and sampling when last)."""

    def process(self, frame: Frame) -> Frame | Tokens:
        """The frame's rows after this stage. The input arrays are read-only views of the received message; the
        returned arrays are handed to ZeroMQ without a copy, so the stage must not write into them afterwards."""

    def release(self, slots: np.ndarray) -> None:
        """Forget the state of streams in these slots."""


ProgressFn = Callable[[int, int], None]  # (done, total), called by a stage loader as it goes


@attrs.frozen
class Peer:
    name: str  # whose Curve public key to expect there
    address: str  # tcp://HOST:PORT


@attrs.frozen
class NodeSettings:
    name: str
    sender: int  # this node's sender id on the wire, unique in the pipeline
    first_layer: int
    last_layer: int  # inclusive
    listen: str  # tcp://HOST:PORT of this node's input
    successor: Peer  # the next node, or the coordinator's token socket for the last node
    control: Peer  # the coordinator's control socket
    curve_keys: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    send_timeout_s: float = 10.0  # a successor that accepts nothing for this long is unreachable
    parent_pid: int | None = None  # stop when this process is no longer our parent
    poll_s: float = 0.1  # how often an idle node checks on its parent
    digest: str = ""  # of the settings it was started with, said in HELLO (`cascadia.exec.stage.settings_digest`)


class NodeStopped(Exception):
    """Raised inside the node to end it cleanly: shutdown requested, or its parent gone."""


def run_node(settings: NodeSettings, load_stage: Callable[[ProgressFn], Stage]) -> None:
    """Serve one stage until told to shut down or orphaned. Raises TransportError (naming the address) when the
    input address is taken or the successor is unreachable; any failure is first reported to the coordinator."""
    with Transport(settings.name, settings.curve_keys, settings.max_message_bytes,
                   settings.send_timeout_s) as transport:
        node = _Node(settings, transport)
        try:
            node.open()
            node.tell(Hello(settings.name, settings.first_layer, settings.last_layer, settings.digest))
            stage = load_stage(node.progress)
            node.tell(Ready(settings.name, settings.first_layer, settings.last_layer))
            log.info("%s: ready on %s, layers %d..%d", settings.name, settings.listen, settings.first_layer,
                     settings.last_layer)
            node.serve(stage)
        except NodeStopped as e:
            log.info("%s: stopping: %s", settings.name, e)
        except Exception as e:
            node.report_failure(f"{type(e).__name__}: {e}")
            raise


class _Node:
    def __init__(self, settings: NodeSettings, transport: Transport):
        self.settings = settings
        self.transport = transport
        # The control channel comes first, so that a failure to open the others can be reported on it.
        self.control = transport.connect(zmq.DEALER, settings.control.address, settings.control.name)
        self.data: zmq.Socket | None = None
        self.successor: zmq.Socket | None = None
        self.encoder = Encoder(settings.sender)
        self.data_decoder = Decoder(settings.max_message_bytes)
        self.control_decoder = Decoder(settings.max_message_bytes)
        self.busy_s = 0.0
        self.frames = 0
        self.rejected = 0

    def open(self) -> None:
        self.data = self.transport.bind(zmq.PULL, self.settings.listen)
        self.successor = self.transport.connect(zmq.PUSH, self.settings.successor.address,
                                                self.settings.successor.name)

    def tell(self, message: Message) -> None:
        send(self.control, self.encoder.encode(message))

    def report_failure(self, text: str) -> None:
        log.error("%s: %s", self.settings.name, text)
        try:
            self.tell(Error(self.settings.name, text))
        except Exception as e:  # the coordinator may be what failed; the raised error still tells the story
            log.error("%s: could not report the failure to the coordinator: %s", self.settings.name, e)

    def progress(self, done: int, total: int) -> None:
        """Report loading progress, and stop loading if told to or orphaned."""
        self.tell(Progress(self.settings.name, done, total))
        self._check_parent()
        while self.control.poll(0):
            self._on_control(stage=None)

    def serve(self, stage: Stage) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.settings.poll_s * 1000))
            self._check_parent()
            if self.control in ready:
                self._on_control(stage)
            if self.data in ready:
                self._on_data(stage)

    def _check_parent(self) -> None:
        parent = self.settings.parent_pid
        if parent is not None and os.getppid() != parent:
            raise NodeStopped(f"parent process {parent} is gone")

    def _receive(self, sock: zmq.Socket, decoder: Decoder, expected: tuple[type, ...]) -> Message | None:
        """The next message on `sock`, or None after logging why it was rejected."""
        where = "input" if sock is self.data else "control"
        try:
            message = decoder.decode(receive(sock)).message
            if not isinstance(message, expected):
                raise WireError(f"unexpected {type(message).__name__} message")
            return message
        except WireError as e:
            self.rejected += 1
            log.warning("%s: rejected a message on its %s socket: %s", self.settings.name, where, e)
            return None

    def _on_control(self, stage: Stage | None) -> None:
        accepted = (Shutdown, StatsRequest) if stage is None else (Shutdown, StatsRequest, Release)
        message = self._receive(self.control, self.control_decoder, accepted)
        match message:
            case Shutdown():
                raise NodeStopped("shutdown requested")
            case StatsRequest():
                self.tell(Stats(self.settings.name, self.busy_s, self.frames, self.rejected))
            case Release():
                self._call_stage(f"release of slots {message.slots.tolist()}", stage.release, message.slots)

    def _on_data(self, stage: Stage) -> None:
        frame = self._receive(self.data, self.data_decoder, (Frame,))
        if frame is None:
            return
        start = time.perf_counter()
        result = self._call_stage(f"frame {frame.frame_id}", stage.process, frame)
        self.busy_s += time.perf_counter() - start
        if result is not None:
            self.frames += 1
            send(self.successor, self.encoder.encode(result))

    def _call_stage(self, what: str, call, *args):
        """Run a stage call. A failure is the stage's (a bad slot, an engine error), not the node's: report it to
        the coordinator, which decides whether the run goes on, and keep serving."""
        try:
            return call(*args)
        except Exception as e:
            log.exception("%s: %s failed", self.settings.name, what)
            self.tell(Error(self.settings.name, f"{what}: {type(e).__name__}: {e}"))
            return None
