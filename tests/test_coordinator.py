"""The coordinator against stub nodes: DEALERs that say what a node says, and a PUSH playing the last node."""

import logging
import threading
import time

import pytest
import zmq

from cascadia.metrics import Recorder
from cascadia.pipeline.coordinator import Coordinator, NodeLost, Outputs, PipelineError
from cascadia.pipeline.transport import (COORDINATOR, CurveKeys, Transport, free_port, generate_keys, receive, send,
                                         tcp_address)
from cascadia.pipeline.wire import (VERSION, Encoder, Error, Frame, Hello, Progress, Ready, Stats, StatsRequest, Tokens,
                                    decode, encode, node_sender)
from cascadia.policy import Policy, Request
from cascadia.wire_format import HEADER_BYTES
from cascadia.workload import ClosedLoop

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

    def make(name: str, keys=None) -> Transport:
        made.append(Transport(name, keys))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture
def pipeline(transports):
    """A coordinator for nodes a and b, and their stubs (not yet started)."""
    coordinator = Coordinator(["a", "b"], local_address(), local_address(), stall_s=STALL_S, hung_s=STALL_S)
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
    with pytest.raises(NodeLost, match=f"^a: no answer to a stats request within {STALL_S:g} s \\(stopped or "
                                       "frozen\\?\\)$") as lost:
        coordinator.stats()
    assert lost.value.node == "a"  # the first that answered nothing: neither did b


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
        f"header of 7 bytes, expected {HEADER_BYTES}", "Tokens from sender 77; only sender 2 sends here",
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


class StubPipeline(threading.Thread):
    """The nodes' side of a phase: a and b answer stats requests (unless `silent`), the first node's input takes
    each frame, and the last node's PUSH sends back first tokens no frame in flight has (`forgeries`), then the
    frame's own tokens (each sampled row's token: its slot + 100)."""

    def __init__(self, coordinator: Coordinator, stubs, transports, first: str, silent: tuple[str, ...] = (),
                 frame_s: float = 0.0):
        """`frame_s`: how long each frame takes (the thread answers nothing meanwhile, as a computing node)."""
        super().__init__(daemon=True)
        self.coordinator, self.stubs, self.silent = coordinator, [s for s in stubs if s.name not in silent], silent
        self.frame_s = frame_s
        self.input = transports("a").bind(zmq.PULL, first, [])
        self.tokens = transports("b").connect(zmq.PUSH, coordinator.tokens_address, COORDINATOR)
        self.encoder = Encoder(node_sender(len(stubs) - 1))
        self.stop = threading.Event()

    def forgeries(self, frame: Frame) -> list[Tokens]:
        sampled = frame.slots[frame.sample]
        return [Tokens(999999, frame.group, sampled, sampled + 100),
                Tokens(frame.frame_id, frame.group + 1, sampled, sampled),
                Tokens(frame.frame_id, frame.group, sampled[:0], sampled[:0])]

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in [self.input, *(stub.sock for stub in self.stubs)]:
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                message = decode(receive(sock)).message
                if sock is self.input:
                    time.sleep(self.frame_s)
                    sampled = message.slots[message.sample]
                    for tokens in [*self.forgeries(message), Tokens(message.frame_id, message.group, sampled,
                                                                    sampled + 100)]:
                        send(self.tokens, self.encoder.encode(tokens))
                elif isinstance(message, StatsRequest):
                    stub = next(stub for stub in self.stubs if stub.sock is sock)
                    stub.say(Stats(stub.name, 0.0, 0, 0))


@pytest.fixture
def stub_pipeline(pipeline, transports):
    coordinator, stubs = pipeline
    first = local_address()
    for stub in stubs:
        stub.start()
    coordinator.wait_ready(first, timeout_s=TIMEOUT_S)
    made = []

    def make(silent: tuple[str, ...] = (), frame_s: float = 0.0) -> StubPipeline:
        made.append(StubPipeline(coordinator, stubs, transports, first, silent, frame_s))
        made[-1].start()
        return made[-1]

    yield coordinator, make
    for thread in made:
        thread.stop.set()
        thread.join(TIMEOUT_S)


def test_our_frames_go_to_the_first_stages_new_holder_even_when_the_assign_is_cut_short(transports):
    """The first stage given to a node found lost while it is told (a spare whose process died): the frames of the
    serving that follows (once a node for the stage is back in that place) go to the stage's holder as assigned,
    not to its previous one."""
    coordinator = Coordinator(["a", "b"], local_address(), local_address(), stall_s=TIMEOUT_S, hung_s=TIMEOUT_S,
                              members=["a", "b", "c"])
    try:
        for i, name in enumerate("ab"):
            StubNode(transports, name, coordinator.control_address, node_sender(i)).start()
        coordinator.wait_ready(local_address(), timeout_s=TIMEOUT_S)
        addresses = {"a": local_address(), "b": local_address(), "c": local_address()}
        with pytest.raises(NodeLost, match="^c: lost its control connection"):
            coordinator.assign(["c", "b"], "{}", addresses, timeout_s=TIMEOUT_S)
        assert coordinator.first.getsockopt(zmq.LAST_ENDPOINT).decode() == addresses["c"]
    finally:
        coordinator.close()


def test_tokens_no_frame_in_flight_has_are_dropped_and_the_phase_goes_on(stub_pipeline, caplog):
    """The forged frame's tokens (frame 999999), tokens under another group, for other slots: each is logged and
    counted, and the phase ends with every request's real tokens."""
    coordinator, make = stub_pipeline
    make()
    policy = Policy(n_groups=1, max_streams=2, prefill_window=4, row_buckets=(1, 2, 4), context_budget=16)
    requests = [Request(i, (1, 2, 3), 2) for i in range(3)]
    outputs = Outputs()
    with caplog.at_level(logging.WARNING, "cascadia.pipeline.coordinator"):
        coordinator.run_phase(policy, ClosedLoop([(r,) for r in requests], 2), len(requests), Recorder(2, "measured"),
                              outputs)
    assert sorted((line["request_id"], line["output_ids"]) for line in outputs.lines) == [
        (0, [100, 100]), (1, [101, 101]), (2, [100, 100])]
    frames = policy._seq
    assert coordinator.dropped == 3 * frames
    dropped = [m.removeprefix("coordinator: dropped a message on its token socket: ") for m in caplog.messages]
    assert dropped.count("tokens for frame 999999 of group 0, which is not in flight") == frames
    assert sum(m.endswith("of group 1, which is not in flight") for m in dropped) == frames
    assert sum(", expected [" in m and "tokens for slots []" in m for m in dropped) == frames


def test_a_frame_longer_than_the_stall_timeout_is_no_loss_while_the_nodes_answer_heartbeats(stub_pipeline):
    """Frames of 4 stall timeouts each, the stubs answering no stats request meanwhile: their heartbeats go on (the
    I/O thread answers them), so the phase ends with every token."""
    coordinator, make = stub_pipeline
    make(frame_s=4 * STALL_S)
    coordinator.hung_s = 10 * STALL_S
    policy = Policy(n_groups=1, max_streams=1, prefill_window=4, row_buckets=(1, 2, 4), context_budget=16)
    outputs = Outputs()
    coordinator.run_phase(policy, ClosedLoop([(Request(0, (1, 2, 3), 2),)], 1), 1, Recorder(1, "measured"), outputs)
    assert [line["output_ids"] for line in outputs.lines] == [[100, 100]]


def test_a_stall_names_the_node_that_stopped_answering(stub_pipeline):
    """b is frozen (it answers nothing): the coordinator's pings, one per idle heartbeat, go unanswered."""
    coordinator, make = stub_pipeline
    make(silent=("b",))
    coordinator.hung_s = 3.5  # long enough for three heartbeats' pings
    with pytest.raises(NodeLost, match=r"^b: no tokens came back for 3.5 s; b has not answered its last \d+ stats "
                                       r"requests \(stopped or frozen\?\); frames handled per node: a 0; ") as lost:
        coordinator.next_tokens()
    assert lost.value.node == "b"


def test_a_member_key_cannot_take_another_nodes_name(tmp_path, transports, caplog):
    """With Curve, a node is the owner of the key its control connection was made with. A DEALER holding b's key
    that names itself a (as ROUTER_HANDOVER would once have let it take a's connection) is refused and logged with the
    key it used; a keeps its connection and b is not made a's."""
    generate_keys(tmp_path / "keys", ["a", "b", COORDINATOR])
    coordinator = Coordinator(["a", "b"], local_address(), local_address(), curve_keys=tmp_path / "keys",
                              stall_s=TIMEOUT_S, hung_s=TIMEOUT_S)  # the stubs answer when they can
    try:
        stubs = [StubNode(transports_with_keys(transports, name, tmp_path / "keys"), name,
                          coordinator.control_address, node_sender(i)) for i, name in enumerate("ab")]
        for stub in stubs:
            stub.start()
        coordinator.wait_ready(local_address(), timeout_s=TIMEOUT_S)
        impostor = transports("b", tmp_path / "keys").context.socket(zmq.DEALER)
        impostor.curve_publickey, impostor.curve_secretkey = CurveKeys(tmp_path / "keys").keypair("b")
        impostor.curve_serverkey = CurveKeys(tmp_path / "keys").public_key(COORDINATOR)
        impostor.setsockopt(zmq.ROUTING_ID, b"a")
        impostor.connect(coordinator.control_address)
        send(impostor, stubs[0].encoder.encode(Error("a", "forged")))
        assert coordinator.control.poll(TIMEOUT_S * 1000)  # queued ahead of the answers below
        answered = threading.Thread(target=lambda: [answer_stats(stub) for stub in stubs])
        answered.start()
        with caplog.at_level(logging.WARNING, "cascadia.pipeline.coordinator"):
            assert set(coordinator.stats()) == {"a", "b"}  # each asked over its own connection, and answered
        answered.join(TIMEOUT_S)
        assert coordinator.dropped == 1
        assert caplog.messages == ["coordinator: dropped a message on its control socket: refused a connection "
                                   "naming itself 'a' with b's Curve key"]
        impostor.close(linger=0)
    finally:
        coordinator.close()


def answer_stats(stub: StubNode) -> None:
    """Answer one stats request on `stub`'s connection (the request must come to it)."""
    assert stub.sock.poll(TIMEOUT_S * 1000), f"no stats request reached {stub.name}"
    receive(stub.sock)
    stub.say(Stats(stub.name, 0.0, 0, 0))


def transports_with_keys(transports, name: str, keys):
    """A `transports` maker for StubNode whose Transport holds `keys`."""
    return lambda _: transports(name, keys)
