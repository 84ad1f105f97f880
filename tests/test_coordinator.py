"""The coordinator against a stub node: a DEALER that says what a node says, and then nothing more."""

import pytest
import zmq

from cascadia.exec.coordinator import Coordinator, PipelineError
from cascadia.exec.transport import COORDINATOR, Transport, free_port, send, tcp_address
from cascadia.exec.wire import Encoder, Hello, Ready

STALL_S = 0.5


def test_a_node_that_stops_answering_stats_requests_is_named():
    control = tcp_address("127.0.0.1", free_port())
    coordinator = Coordinator(["mute"], control, tcp_address("127.0.0.1", free_port()), stall_s=STALL_S)
    with Transport("mute") as node:
        sock = node.connect(zmq.DEALER, control, COORDINATOR)
        encoder = Encoder(1)
        for message in (Hello("mute", 0, 1), Ready("mute", 0, 1)):
            send(sock, encoder.encode(message))
        try:
            coordinator.wait_ready(tcp_address("127.0.0.1", free_port()), timeout_s=10)
            with pytest.raises(PipelineError, match=f"^mute: no answer to a stats request within {STALL_S:g} s$"):
                coordinator.stats()
        finally:
            coordinator.close()
