"""Links: the latency and bandwidth of the pipeline's real ZeroMQ transport, from messages bounced off a process at
the other end (loopback: the nodes are local). A round trip = 2 x (latency + bytes / bandwidth), fitted over sizes
from one row to 4 MiB.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import zmq

from cascadia.measure.workers import Worker
from cascadia.pipeline.places import LOCALHOST
from cascadia.pipeline.transport import Transport, free_port, receive, send, tcp_address
from cascadia.pipeline.wire import Encoder, Frame
from cascadia.sim.fit import fit_non_negative
from cascadia.spec.types import LinkSpec
from cascadia.units import format_duration, format_rate
from cascadia.wire_format import RESIDUAL_VALUE_BYTES

PINGS = 30  # round trips per message size
LARGEST_MESSAGE_BYTES = 4 * 2**20

Progress = Callable[[str], None]


def measure_link(hidden_size: int, progress: Progress) -> LinkSpec:
    """Loopback latency and bandwidth of the pipeline's ZeroMQ transport between two processes."""
    listen, reply = tcp_address(LOCALHOST, free_port()), tcp_address(LOCALHOST, free_port())
    sizes, round_trips = [], []
    with contextlib.ExitStack() as stack:
        transport = stack.enter_context(Transport("calibrate"))
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cascadia-calibrate-"))
        inbox = transport.bind(zmq.PULL, reply, ["echo"])
        echo = stack.enter_context(Worker(__name__, "echo_worker", [listen, reply], dict(os.environ),
                                           Path(folder) / "echo.log"))
        outbox = transport.connect(zmq.PUSH, listen, "echo")
        encoder = Encoder(0)
        rows = 1
        while rows * hidden_size * RESIDUAL_VALUE_BYTES <= LARGEST_MESSAGE_BYTES:
            message = encoder.encode(Frame(0, 0, [0] * rows, [0] * rows, [0] * rows, [False] * rows,
                                           np.zeros((rows, hidden_size), np.float32)))
            times = []
            for _ in range(PINGS + 1):  # the first one also waits for the connection
                start = time.perf_counter()
                send(outbox, message)
                receive(inbox)
                times.append(time.perf_counter() - start)
            sizes.append(sum(memoryview(part).nbytes for part in message))
            round_trips.append(statistics.median(times[1:]))
            rows *= 4
        send(outbox, [b""])
        for _ in echo.messages():  # until it ends
            pass
    intercept, slope = fit_non_negative([[1.0] * len(sizes), sizes], round_trips)
    link = LinkSpec(bandwidth=2 / slope if slope > 0 else float("inf"), latency=intercept / 2)
    progress(f"loopback link: {describe_link(link)}")
    return link


def echo_worker(argv: Sequence[str]) -> None:
    """The far end of a link: LISTEN REPLY; sends every message straight back, until an empty one."""
    listen, reply = argv
    with Transport("echo") as transport:
        inbox = transport.bind(zmq.PULL, listen, ["calibrate"])
        outbox = transport.connect(zmq.PUSH, reply, "calibrate")
        while len(message := receive(inbox)) > 1:
            send(outbox, message)


def describe_link(link: LinkSpec) -> str:
    """"latency 85.3 us, bandwidth 21.3 Gbit/s": the bandwidth in bits, as specs give links."""
    return (f"latency {format_duration(link.latency, digits=3)}, "
            f"bandwidth {format_rate(link.bandwidth, bits=True, digits=3)}")
