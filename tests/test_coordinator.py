"""The coordinator against stub nodes: DEALERs that say what a node says, and a PUSH playing the last node."""

import logging

import pytest
import zmq

from cascadia.pipeline.coordinator import Coordinator, PipelineError
from cascadia.pipeline.transport import COORDINATOR, Transport, free_port, send, tcp_address
from cascadia.pipeline.wire import (VERSION, Encoder, Error, Frame, Hello, Progress, Ready, Stats, Tokens, encode,
                                    node_sender)

STALL_S = 0.5
TIMEOUT_S = 10  # generous bound on any single wait; the tests never measure time
FAR_AHEAD = 2**62  # a sequence number that would shut out every later message, were it recorded


def local_address() -> str:
    return tcp_address("127.0.0.1", free_port())


class StubNode:
    """The control connection of a node named `name`, sending as wire sender `sender`."""

    def __init__(self, transports, name: str, control: str, sender: int):
        self.name = name
        self.sock = transports(name).connect(zmq.DEALER, control, COORDINATOR)
        self.encoder = Encoder(sender)

    def say(self, *messages) -> None:
        for message in messages:
            send(self.sock, self.encoder.encode(message))

    def start(self) -> None:
        self.say(Hello(self.name, 0, 1), Ready(self.name, 0, 1))


@pytest.fixture
def transports():
    """Make Transports that are closed when the test ends, however it ends."""
    made = []

    def make(name: str) -> Transport:
        made.append(Transport(name))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture
def pipeline(transports):
    """A coordinator for nodes a and b, and their stubs (not yet started)."""
    coordinator = Coordinator(["a", "b"], local_address(), local_address(), stall_s=STALL_S)
    stubs = [StubNode(transports, name, coordinator.control_address, node_sender(i)) for i, name in
             enumerate(coordinator.nodes)]
    yield coordinator, stubs
    coordinator.close()


def started(pipeline) -> Coordinator:
    coordinator, stubs = pipeline
    for stub in stubs:
        stub.start()
    coordinator.wait_ready(local_address(), timeout_s=TIMEOUT_S)
    return coordinator


def test_a_node_that_stops_answering_stats_requests_is_named(pipeline):
    coordinator = started(pipeline)
    with pytest.raises(PipelineError, match=f"^a, b: no answer to a stats request within {STALL_S:g} s$"):
        coordinator.stats()


def test_control_messages_from_strangers_are_dropped_and_the_start_goes_on(pipeline, transports, caplog):
    """A stranger's DEALER, and an ERROR that a sends as b, are logged and dropped: no false accusation, no end."""
    coordinator, (a, b) = pipeline
    stranger = StubNode(transports, "evil", coordinator.control_address, node_sender(0))
    stranger.say(Hello("evil", 0, 1))
    assert coordinator.control.poll(TIMEOUT_S * 1000)  # queued ahead of every node's message
    a.say(Hello("a", 0, 1))
    send(a.sock, encode(Error("b", "forged"), b.encoder.sender, FAR_AHEAD))

    def on_message(node: str, message) -> None:
        if node == "a" and isinstance(message, Progress):  # a's ERROR as b came before it: it has been dropped
            b.start()
            a.say(Ready("a", 0, 1))

    a.say(Progress("a", 1, 1))
    with caplog.at_level(logging.WARNING, "cascadia.pipeline.coordinator"):
        coordinator.wait_ready(local_address(), timeout_s=TIMEOUT_S, on_message=on_message)
    assert coordinator.dropped == 2
    assert caplog.messages == [
        "coordinator: dropped a message on its control socket: from 'evil', which is not a node of the plan",
        "coordinator: dropped a message on its control socket from a: Error from sender 2; only sender 1 sends here"]


def test_stray_messages_on_the_token_socket_are_dropped_and_the_tokens_go_through(pipeline, transports, caplog):
    coordinator = started(pipeline)
    last = node_sender(1)
    tokens = transports("b").connect(zmq.PUSH, coordinator.tokens_address, COORDINATOR)
    for message in ([b"garbage"], encode(Tokens(1, 0, [0], [7]), 77, FAR_AHEAD),
                    encode(Frame(1, 0, [0], [0], [7], [True]), last, FAR_AHEAD),
                    encode(Tokens(1, 0, [0], [7]), last, 1)):
        send(tokens, message)
    with caplog.at_level(logging.WARNING, "cascadia.pipeline.coordinator"):
        received = coordinator.next_tokens()
    assert (received.frame_id, received.token_ids.tolist()) == (1, [7])
    assert coordinator.dropped == 3
    assert [m.removeprefix("coordinator: dropped a message on its token socket: ") for m in caplog.messages] == [
        "header of 7 bytes, expected 44", "Tokens from sender 77; only sender 2 sends here",
        "unexpected Frame from sender 2"]


def test_a_stall_names_each_nodes_counters_and_the_coordinators_drops(pipeline, transports):
    coordinator = started(pipeline)
    a, b = pipeline[1]
    a.say(Stats("a", 1.5, 4, 0))
    b.say(Stats("b", 0.5, 2, 3))
    coordinator.stats()  # takes the two answers in
    send(transports("b").connect(zmq.PUSH, coordinator.tokens_address, COORDINATOR), [b"garbage"])
    assert coordinator.tokens.poll(TIMEOUT_S * 1000)
    with pytest.raises(PipelineError, match=f"^no tokens came back for {STALL_S:g} s; frames handled per node: a 4, "
                                            "b 2; messages rejected per node: a 0, b 3; messages dropped by the "
                                            "coordinator: 1$"):
        coordinator.next_tokens()


def test_an_error_from_a_node_still_ends_the_run_naming_it(pipeline):
    coordinator = started(pipeline)
    a, b = pipeline[1]
    b.say(Error("b", "frame 3: ValueError: bad slot"))
    with pytest.raises(PipelineError, match="^b: frame 3: ValueError: bad slot$"):
        coordinator.next_tokens()


def test_a_starting_node_whose_messages_are_dropped_is_named_with_the_reason(pipeline):
    coordinator, (a, _) = pipeline
    a.encoder = Encoder(7)  # a's name, another node's sender id
    a.say(Hello("a", 0, 1))
    assert coordinator.control.poll(TIMEOUT_S * 1000)
    with pytest.raises(PipelineError, match=f"^a, b: no word within {STALL_S:g} s while starting .*; a's last message "
                                            "was dropped: .*sender 7"):
        coordinator.wait_ready(local_address(), timeout_s=STALL_S)


def test_a_node_of_another_version_stops_the_start_at_once(pipeline):
    coordinator, (a, _) = pipeline
    hello = a.encoder.encode(Hello("a", 0, 1))
    send(a.sock, [hello[0][:4] + (VERSION + 1).to_bytes(2, "little") + hello[0][6:], *hello[1:]])
    with pytest.raises(PipelineError, match=f"^a: runs another version of Cascadia \\(protocol version {VERSION + 1}, "
                                            f"this build speaks version {VERSION}\\); run the same version on every "
                                            "machine$"):
        coordinator.wait_ready(local_address(), timeout_s=TIMEOUT_S)
