"""Node processes on 127.0.0.1 with a tiny test stage; the test plays the coordinator."""

import json
import logging
import multiprocessing
import os
import signal
import time

import attrs
import numpy as np
import pytest
import zmq

from cascadia.pipeline.node import ForeignFrame, NodeSettings, Peer, run_node
from cascadia.pipeline.transport import (COORDINATOR, Transport, TransportError, free_port, generate_keys, receive,
                                         send, tcp_address)
from cascadia.pipeline.wire import (COORDINATOR_SENDER, VERSION, Assign, Encoder, Error, Frame, Hello, Progress, Ready,
                                    Shutdown, Stats, StatsRequest, Tokens, decode, encode, node_sender)

HIDDEN = 8
MAX_MESSAGE_BYTES = 256 * 1024
POISON = 666  # a token id the test stage fails on
FOREIGN = 999  # a token id the test stage finds cannot belong to the run
TIMEOUT_S = 10  # generous bound on any single wait; the tests never measure time
FAR_AHEAD = 2**62  # a sequence number that would shut out every later message, were it recorded
SPAWN = multiprocessing.get_context("spawn")


class AddOne:
    """Test stage: embeds token t as a row of t's, adds 1 per stage, and when last samples round(row[0])."""

    def __init__(self, last: bool):
        self.last = last

    def process(self, frame: Frame) -> Frame | Tokens:
        if POISON in frame.token_ids:
            raise ValueError("poisoned token")
        if FOREIGN in frame.token_ids:
            raise ForeignFrame(f"token {FOREIGN} is foreign here")
        if frame.residual is None:
            residual = np.repeat(frame.token_ids[:, None].astype(np.float32), HIDDEN, axis=1)
        else:
            residual = frame.residual
        residual = residual + 1
        if not self.last:
            return Frame(frame.frame_id, frame.group, frame.slots, frame.positions, frame.token_ids, frame.sample,
                         residual)
        rows = frame.sample
        return Tokens(frame.frame_id, frame.group, frame.slots[rows], np.rint(residual[rows, 0]))


def load_stage(progress, last: bool) -> AddOne:
    for done in (1, 2):
        progress(done, 2)
    return AddOne(last)


def node_main(settings: NodeSettings, last: bool, log_path: str) -> None:
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(levelname)s %(message)s")
    run_node(settings, lambda settings, progress: load_stage(progress, last))


def log_state(state: str) -> None:
    logging.info("state now %s", state)


def node_via_middleman(settings: NodeSettings, log_path: str, pids) -> None:
    """Start a node whose parent is this process, report its pid, and wait to be killed."""
    node = SPAWN.Process(target=node_main, args=(attrs.evolve(settings, parent_pid=os.getpid()), True, log_path))
    node.start()
    pids.put(node.pid)
    node.join()


class Coordinator:
    """The test's side of a pipeline: control ROUTER, token PULL, and a PUSH into the first node."""

    def __init__(self, transport: Transport, control_address: str | None = None, token_address: str | None = None,
                 nodes: tuple[str, ...] = ()):
        """`nodes`: whose Curve keys may connect (all to control, the last to tokens); without keys, anyone's."""
        self.transport = transport
        self.control_address = control_address or tcp_address("127.0.0.1", free_port())
        self.token_address = token_address or tcp_address("127.0.0.1", free_port())
        self.control = transport.bind(zmq.ROUTER, self.control_address, nodes)
        self.tokens = transport.bind(zmq.PULL, self.token_address, nodes[-1:])
        self.encoder = Encoder(COORDINATOR_SENDER)
        self.first: zmq.Socket | None = None
        self.routes: dict[str, bytes] = {}  # each node's control connection, as the ROUTER knows it

    def settings(self, names: list[str], **extra) -> list[NodeSettings]:
        listens = [tcp_address("127.0.0.1", free_port()) for _ in names]
        successors = [Peer(name, listen) for name, listen in zip(names[1:], listens[1:])]
        successors.append(Peer(COORDINATOR, self.token_address))
        return [NodeSettings(name, sender=node_sender(i), first_layer=2 * i, last_layer=2 * i + 1, listen=listen,
                             successor=succ, control=Peer(COORDINATOR, self.control_address),
                             input_peer=before, max_message_bytes=MAX_MESSAGE_BYTES, poll_s=0.05, **extra)
                for i, (name, listen, succ, before) in enumerate(zip(names, listens, successors,
                                                                     [COORDINATOR, *names[:-1]]))]

    def connect_first(self, settings: NodeSettings) -> None:
        self.first = self.transport.connect(zmq.PUSH, settings.listen, settings.name)

    def next_control(self) -> tuple[str, object]:
        """The sender (with Curve keys the owner of its connection's key: its DEALER gives no name) and message."""
        assert self.control.poll(TIMEOUT_S * 1000), "no control message"
        route, *frames = receive(self.control)
        node = self.transport.key_owner(frames[0]) or route.bytes.decode()
        self.routes[node] = route.bytes
        return node, decode(frames).message

    def tell(self, node: str, message) -> None:
        send(self.control, [self.routes.get(node, node.encode()), *self.encoder.encode(message)])

    def push(self, frame: Frame) -> None:
        send(self.first, self.encoder.encode(frame))

    def next_tokens(self) -> Tokens:
        assert self.tokens.poll(TIMEOUT_S * 1000), "no tokens came back"
        return decode(receive(self.tokens)).message

    def wait_ready(self, settings: list[NodeSettings]) -> None:
        """Each node says HELLO, reports its loading, then READY, with its name and layers."""
        seen = {s.name: [] for s in settings}
        while any(not events or not isinstance(events[-1], Ready) for events in seen.values()):
            node, message = self.next_control()
            seen[node].append(message)
        for s in settings:
            assert seen[s.name] == [Hello(s.name, s.first_layer, s.last_layer), Progress(s.name, 1, 2),
                                    Progress(s.name, 2, 2), Ready(s.name, s.first_layer, s.last_layer)]

    def stats(self, node: str) -> Stats:
        self.tell(node, StatsRequest())
        sender, stats = self.next_control()
        assert sender == node and isinstance(stats, Stats)
        return stats


def start_nodes(settings: list[NodeSettings], tmp_path) -> list:
    """Node processes that stop if this process dies."""
    processes = []
    for i, s in enumerate(settings):
        s = attrs.evolve(s, parent_pid=os.getpid())
        p = SPAWN.Process(target=node_main, args=(s, i == len(settings) - 1, str(tmp_path / f"{s.name}.log")))
        p.start()
        processes.append(p)
    return processes


def stop(processes) -> None:
    for p in processes:
        p.join(TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()


def frame(frame_id: int, tokens: list[int], sample: list[bool] | None = None) -> Frame:
    n = len(tokens)
    return Frame(frame_id, 0, list(range(n)), [0] * n, tokens, [True] * n if sample is None else sample)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Three Curve-authenticated nodes a -> b -> c -> coordinator, shut down after the module's tests."""
    tmp_path = tmp_path_factory.mktemp("pipeline")
    keys = tmp_path / "keys"
    generate_keys(keys, ["a", "b", "c", COORDINATOR])
    transport = Transport(COORDINATOR, keys, send_timeout_s=TIMEOUT_S)
    coordinator = Coordinator(transport, nodes=("a", "b", "c"))
    settings = coordinator.settings(["a", "b", "c"], curve_keys=keys)
    processes = start_nodes(settings, tmp_path)
    try:
        coordinator.wait_ready(settings)
        coordinator.connect_first(settings[0])
        yield coordinator, settings, tmp_path
        for s in settings:
            coordinator.tell(s.name, Shutdown())
    finally:
        stop(processes)
        transport.close()
    assert [p.exitcode for p in processes] == [0, 0, 0]


def test_frames_flow_through_three_nodes_and_tokens_come_back(pipeline):
    coordinator, settings, _ = pipeline
    coordinator.push(frame(1, [10, 20, 30], [True, False, True]))
    tokens = coordinator.next_tokens()
    assert (tokens.frame_id, tokens.slots.tolist(), tokens.token_ids.tolist()) == (1, [0, 2], [13, 33])
    before = [coordinator.stats(s.name) for s in settings]
    for i in range(2, 12):  # frames in flight arrive whole and in order
        coordinator.push(frame(i, [i]))
    assert [(t.frame_id, t.token_ids.tolist()) for t in (coordinator.next_tokens() for _ in range(10))] == \
        [(i, [i + 3]) for i in range(2, 12)]
    for s, old in zip(settings, before):
        new = coordinator.stats(s.name)
        assert new.frames == old.frames + 10 and new.busy_s > old.busy_s


def rejected_by(coordinator: Coordinator, node: str, count: int) -> int:
    """The node's count of rejected messages, once it reaches `count` (or after TIMEOUT_S)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (rejected := coordinator.stats(node).rejected) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return rejected


def test_bad_and_stray_messages_are_rejected_logged_and_the_node_keeps_serving(pipeline):
    """Nothing sent to b's input over a connection made with a's key (the one key b accepts there) reaches b's stage
    or shuts out a, b's predecessor: not even a STATS_REQUEST that claims a's sender id with a sequence number far
    ahead of a's, nor a frame whose content cannot belong to the run."""
    coordinator, settings, tmp_path = pipeline
    b = settings[1]
    coordinator.push(frame(50, [1]))
    assert coordinator.next_tokens().frame_id == 50  # b has accepted a frame from a, numbered after 1
    rejected_before = coordinator.stats("b").rejected
    with Transport("a", tmp_path / "keys") as insider:
        intruder = insider.connect(zmq.PUSH, b.listen, "b")
        replayed = encode(frame(51, [1]), b.predecessor, 1)
        wrong_version = [replayed[0][:4] + (VERSION + 1).to_bytes(2, "little") + replayed[0][6:], *replayed[1:]]
        oversized = [*replayed, *[np.zeros(MAX_MESSAGE_BYTES // 4, np.uint8)] * 5]
        oversized_bytes = sum(memoryview(f).nbytes for f in oversized)
        foreign = encode(frame(999999, [FOREIGN]), b.predecessor, FAR_AHEAD)
        stray = [wrong_version, [b"not a message"], oversized, replayed, encode(frame(52, [1]), 77, FAR_AHEAD),
                 encode(StatsRequest(), b.predecessor, FAR_AHEAD), foreign]
        for message in stray:
            send(intruder, message)
        assert rejected_by(coordinator, "b", rejected_before + len(stray)) == rejected_before + len(stray)
    coordinator.push(frame(53, [5]))
    tokens = coordinator.next_tokens()
    assert (tokens.frame_id, tokens.token_ids.tolist()) == (53, [8])
    log = (tmp_path / "b.log").read_text()
    for reason in (f"protocol version {VERSION + 1}, this build speaks version {VERSION}", "header of 13 bytes",
                   f"message of {oversized_bytes} bytes exceeds the limit of {MAX_MESSAGE_BYTES}",
                   f"sequence number 1 from sender {b.predecessor} is out of order",
                   f"Frame from sender 77; only sender {b.predecessor} sends here",
                   f"unexpected StatsRequest from sender {b.predecessor}",
                   "frame 999999 cannot belong to this run: token 999 is foreign here"):
        assert f"b: rejected a message on its input socket: {reason}" in log


@pytest.mark.parametrize("who", [COORDINATOR, "c"])
def test_a_key_of_the_folder_that_does_not_send_there_is_refused_and_logged(pipeline, who):
    """b's input accepts a's key only: the coordinator's key, or c's, is refused in the handshake, with a line in
    b's log, and nothing it sends reaches b."""
    coordinator, settings, tmp_path = pipeline
    b = settings[1]
    frames_before = coordinator.stats("b").frames
    with Transport(who, tmp_path / "keys", send_timeout_s=0.5) as outsider:
        with pytest.raises(TransportError, match=f"{b.listen} unreachable"):
            send(outsider.connect(zmq.PUSH, b.listen, "b"), encode(frame(54, [1]), b.predecessor, FAR_AHEAD))
    assert coordinator.stats("b").frames == frames_before
    assert (f"b: refused a connection to its input {b.listen}: its Curve key is not the previous stage's"
            in (tmp_path / "b.log").read_text())
    coordinator.push(frame(55, [5]))
    assert coordinator.next_tokens().frame_id == 55


def test_a_control_message_from_another_sender_is_rejected(pipeline):
    coordinator, _, tmp_path = pipeline
    rejected_before = coordinator.stats("b").rejected
    send(coordinator.control, [coordinator.routes["b"], *encode(Shutdown(), 5, FAR_AHEAD)])
    assert coordinator.stats("b").rejected == rejected_before + 1  # b is still serving, and still hears us
    assert (f"b: rejected a message on its control socket: Shutdown from sender 5; only sender {COORDINATOR_SENDER} "
            "sends here") in (tmp_path / "b.log").read_text()


def test_a_frame_over_the_socket_limit_is_dropped_and_the_node_keeps_serving(pipeline):
    coordinator, settings, _ = pipeline
    intruder = coordinator.transport.connect(zmq.PUSH, settings[0].listen, "a")
    send(intruder, [np.zeros(MAX_MESSAGE_BYTES + 1, np.uint8)])
    coordinator.push(frame(60, [1]))
    assert coordinator.next_tokens().frame_id == 60


def test_stage_failures_are_reported_and_the_node_keeps_serving(pipeline):
    coordinator, _, _ = pipeline
    coordinator.push(frame(70, [POISON]))
    assert coordinator.next_control() == ("a", Error("a", "frame 70: ValueError: poisoned token"))
    coordinator.push(frame(71, [2]))
    assert coordinator.next_tokens().token_ids.tolist() == [5]


@pytest.fixture
def coordinator():
    transport = Transport(COORDINATOR, send_timeout_s=TIMEOUT_S)
    yield Coordinator(transport)
    transport.close()


def test_shutdown_ends_the_process(coordinator, tmp_path):
    settings = coordinator.settings(["solo"])
    processes = start_nodes(settings, tmp_path)
    try:
        coordinator.wait_ready(settings)
        coordinator.tell("solo", Shutdown())
        processes[0].join(TIMEOUT_S)
        assert processes[0].exitcode == 0
    finally:
        stop(processes)
    assert "INFO solo: stopping: shutdown requested" in (tmp_path / "solo.log").read_text()


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # an exited orphan nobody has reaped yet
    except FileNotFoundError:
        return True


def kill_and_see_the_node_go(parent, node_pid: int) -> None:
    """Kill a node's parent (a middleman process), then wait (up to TIMEOUT_S) for the node to end."""
    os.kill(parent.pid, signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT_S
    while not process_gone(node_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(node_pid)


def test_node_stops_when_its_parent_dies(coordinator, tmp_path):
    settings = coordinator.settings(["orphan"])
    pids = SPAWN.Queue()
    middleman = SPAWN.Process(target=node_via_middleman, args=(settings[0], str(tmp_path / "orphan.log"), pids))
    middleman.start()
    try:
        node_pid = pids.get(timeout=TIMEOUT_S)
        coordinator.wait_ready(settings)
        kill_and_see_the_node_go(middleman, node_pid)
    finally:
        stop([middleman])
    assert f"orphan: stopping: parent process {middleman.pid} is gone" in (tmp_path / "orphan.log").read_text()


@pytest.mark.parametrize("gone", ["coordinator", "parent"])
def test_a_node_waiting_on_a_successor_that_takes_nothing_still_stops_when_its_run_is_gone(tmp_path, gone):
    """The last node of a killed coordinator sends its tokens to a socket nobody holds. Its send would wait out the
    send timeout (here 600 s) before the node saw anything else; it sees its coordinator or its parent go instead."""
    transport = Transport(COORDINATOR)
    coordinator = Coordinator(transport)
    (settings,) = coordinator.settings(["waiter"])
    settings = attrs.evolve(settings, successor=Peer(COORDINATOR, tcp_address("127.0.0.1", free_port())),
                            send_timeout_s=600)
    log = tmp_path / "waiter.log"
    if gone == "parent":
        pids = SPAWN.Queue()
        parent = SPAWN.Process(target=node_via_middleman, args=(settings, str(log), pids))
        parent.start()
        node_pid = pids.get(timeout=TIMEOUT_S)
    else:
        (node,) = start_nodes([settings], tmp_path)
    try:
        coordinator.wait_ready([settings])
        coordinator.connect_first(settings)
        coordinator.push(frame(1, [4]))
        deadline = time.monotonic() + TIMEOUT_S
        while coordinator.stats("waiter").frames < 1:  # computed: it waits on its successor now, and still answers
            assert time.monotonic() < deadline, "the frame was never computed"
            time.sleep(0.05)
        if gone == "parent":
            kill_and_see_the_node_go(parent, node_pid)
        else:
            transport.close()  # the coordinator dies without a word
            node.join(TIMEOUT_S)
            assert node.exitcode == 1
    finally:
        stop([parent] if gone == "parent" else [node])
        transport.close()
    expected = (f"stopping: parent process {parent.pid} is gone" if gone == "parent"
                else f"ERROR waiter: lost the coordinator at {settings.control.address}: its connection closed")
    assert expected in log.read_text()


def test_a_node_that_loses_its_coordinator_stops_with_a_clear_error(tmp_path):
    transport = Transport(COORDINATOR)
    coordinator = Coordinator(transport)
    settings = coordinator.settings(["stray"])
    processes = start_nodes(settings, tmp_path)
    try:
        coordinator.wait_ready(settings)
        transport.close()  # the coordinator dies without a word
        processes[0].join(TIMEOUT_S)
        assert processes[0].exitcode == 1
    finally:
        stop(processes)
    assert (f"ERROR stray: lost the coordinator at {settings[0].control.address}: its connection closed"
            in (tmp_path / "stray.log").read_text())


def shut_down(coordinator: Coordinator, node: str) -> Stats:
    """SHUTDOWN, then a probe, as `Coordinator.shutdown` does: a node that answers it has read the SHUTDOWN."""
    coordinator.tell(node, Shutdown())
    coordinator.tell(node, StatsRequest())
    sender, reply = coordinator.next_control()
    assert sender == node and isinstance(reply, Stats)
    coordinator.transport.close()
    return reply


def test_a_keep_serving_node_serves_the_next_coordinator(tmp_path):
    """After SHUTDOWN, and after losing its coordinator, the node says HELLO and READY to the next one at the same
    address, without loading again, and serves it with fresh sequence numbers."""
    first = Coordinator(Transport(COORDINATOR))
    settings = first.settings(["keeper"], keep_serving=True, on_state=log_state)
    processes = start_nodes(settings, tmp_path)
    hello, ready = Hello("keeper", 0, 1), Ready("keeper", 0, 1)
    try:
        first.wait_ready(settings)
        first.connect_first(settings[0])
        first.push(frame(1, [4]))
        assert first.next_tokens().token_ids.tolist() == [5]
        assert shut_down(first, "keeper").frames == 1
        for ending in ("shutdown", "lost"):
            later = Coordinator(Transport(COORDINATOR), first.control_address, first.token_address)
            assert [later.next_control()[1] for _ in range(2)] == [hello, ready]
            later.connect_first(settings[0])
            later.push(frame(1, [7]))
            assert later.next_tokens().token_ids.tolist() == [8]
            if ending == "shutdown":
                shut_down(later, "keeper")
            else:
                later.transport.close()  # without a word
        last = Coordinator(Transport(COORDINATOR), first.control_address, first.token_address)
        assert [last.next_control()[1] for _ in range(2)] == [hello, ready]
        shut_down(last, "keeper")
        assert processes[0].is_alive()
    finally:
        for process in processes:
            process.terminate()  # a keep-serving node stops when told by a signal (or when its parent goes)
        stop(processes)
    log = (tmp_path / "keeper.log").read_text()
    assert log.count("run ended (shutdown requested)") == 3
    assert log.count("run ended (its connection closed") == 1
    assert log.count("ready on") == 4
    assert [line.split()[-1] for line in log.splitlines() if "state now" in line] == ["serving", "waiting"] * 4


def test_a_node_whose_curve_keys_the_coordinator_refuses_gives_up_naming_it(tmp_path):
    generate_keys(tmp_path / "theirs", ["x", COORDINATOR])
    generate_keys(tmp_path / "ours", ["x", COORDINATOR])  # other key pairs under the same names
    coordinator = Coordinator(Transport(COORDINATOR, tmp_path / "theirs"), nodes=("x",))
    (settings,) = coordinator.settings(["x"], curve_keys=tmp_path / "ours", coordinator_wait_s=1.0)
    try:
        with pytest.raises(TransportError, match="no coordinator accepted this node .* within 1 s .*refused the "
                                                 "handshake: do the Curve keys match"):
            run_node(settings, lambda settings, progress: pytest.fail("must not load a stage"))
    finally:
        coordinator.transport.close()


def test_port_in_use_is_a_clear_error_and_reported(coordinator):
    (settings,) = coordinator.settings(["late"])
    squatter = coordinator.transport.bind(zmq.PULL, settings.listen, [])
    with pytest.raises(TransportError, match=f"cannot listen on {settings.listen}: address already in use"):
        run_node(settings, lambda settings, progress: pytest.fail("must not load a stage"))
    assert coordinator.next_control() == ("late", Hello("late", 0, 1))  # said once the coordinator took it
    node, error = coordinator.next_control()
    assert node == "late" and f"cannot listen on {settings.listen}" in error.text
    squatter.close()


def test_unreachable_successor_is_a_clear_error_and_reported(coordinator):
    (settings,) = coordinator.settings(["lonely"])
    settings = attrs.evolve(settings, successor=Peer("nobody", tcp_address("127.0.0.1", free_port())),
                            send_timeout_s=0.3)
    # A plain PUSH queues the frame until the node binds, so it is waiting when the node starts serving.
    early = coordinator.transport.context.socket(zmq.PUSH)
    early.connect(settings.listen)
    early.send_multipart(coordinator.encoder.encode(frame(1, [1])))
    with pytest.raises(TransportError, match=f"{settings.successor.address} unreachable"):
        run_node(settings, lambda settings, progress: load_stage(progress, last=False))
    messages = [coordinator.next_control()[1] for _ in range(5)]
    assert isinstance(messages[-1], Error) and f"{settings.successor.address} unreachable" in messages[-1].text
    early.close(linger=0)


def placed_as_told(settings: NodeSettings, assign: Assign) -> NodeSettings:
    """The test's ASSIGN: its plan is the JSON of the settings' fields that place a node."""
    place = json.loads(assign.plan)
    return attrs.evolve(settings, sender=node_sender(place["stage"]), first_layer=place["layers"][0],
                        last_layer=place["layers"][1], successor=Peer(place["next"], assign.successor),
                        input_peer=place["previous"])


def test_a_spare_stands_by_then_takes_the_stage_it_is_assigned_and_its_neighbours_rewire(tmp_path):
    """a -> b, then b is lost: spare s (no stage, no successor) takes b's stage, a sends to s, s to us; Curve keys
    in use, so each input accepts only its new predecessor."""
    keys = tmp_path / "keys"
    generate_keys(keys, ["a", "b", "s", COORDINATOR])
    transport = Transport(COORDINATOR, keys, send_timeout_s=TIMEOUT_S)
    coordinator = Coordinator(transport, nodes=("a", "s", "b"))  # tokens from b, the last, at first
    a, b = (attrs.evolve(s, assigned=placed_as_told) for s in coordinator.settings(["a", "b"], curve_keys=keys))
    spare = NodeSettings("s", sender=node_sender(2), first_layer=0, last_layer=-1,
                         listen=tcp_address("127.0.0.1", free_port()), successor=None,
                         control=Peer(COORDINATOR, coordinator.control_address), input_peer=None, curve_keys=keys,
                         poll_s=0.05, assigned=placed_as_told)
    processes = start_nodes([a, b], tmp_path)
    try:
        coordinator.wait_ready([a, b])
        processes += start_nodes([spare], tmp_path)
        assert [coordinator.next_control() for _ in range(2)] == [("s", Hello("s", 0, -1)), ("s", Ready("s", 0, -1))]
        coordinator.connect_first(a)
        coordinator.push(frame(1, [10]))
        assert coordinator.next_tokens().token_ids.tolist() == [12]
        processes[1].kill()
        transport.allow(coordinator.token_address, ["s"])
        coordinator.tell("s", Assign(json.dumps({"stage": 1, "layers": [2, 3], "next": COORDINATOR,
                                                 "previous": "a"}), coordinator.token_address))
        assert [coordinator.next_control() for _ in range(3)] == [
            ("s", Progress("s", 1, 2)), ("s", Progress("s", 2, 2)), ("s", Ready("s", 2, 3))]
        coordinator.tell("a", Assign(json.dumps({"stage": 0, "layers": [0, 1], "next": "s",
                                                 "previous": COORDINATOR}), spare.listen))
        assert coordinator.next_control() == ("a", Ready("a", 0, 1))  # its stage kept: nothing loaded
        coordinator.push(frame(2, [20, 30]))
        tokens = coordinator.next_tokens()
        assert (tokens.frame_id, tokens.token_ids.tolist()) == (2, [22, 32])
        for node in ("a", "s"):
            coordinator.tell(node, Shutdown())
    finally:
        stop(processes)
        transport.close()
    assert "s: assigned layers 2..3" in (tmp_path / "s.log").read_text()
