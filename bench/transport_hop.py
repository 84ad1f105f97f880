"""Microseconds per message over one pipeline hop on 127.0.0.1, by payload size, with and without CurveZMQ.

Scenario: the bench sends FRAME messages (ROWS x HIDDEN f32 residual rows) to a real node process (`run_node` with a
stage that returns its input) whose successor is the bench itself, so each message makes two hops, each with the
node's full receive, decode, encode and send. Reported per hop:
  latency  one message at a time: round-trip time / 2
  stream   WINDOW messages kept in flight: elapsed time / (messages x 2)
Each figure is the median of REPEATS runs, with their range. Not a test: it prints a table and writes it to
bench/results/transport_hop.json.

    python bench/transport_hop.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from record import Table, now, spread, write

from cascadia.pipeline.node import NodeSettings, Peer, run_node
from cascadia.pipeline.transport import COORDINATOR, Transport, free_port, generate_keys, receive, send, tcp_address
from cascadia.pipeline.wire import COORDINATOR_SENDER, Decoder, Encoder, Frame, Ready, Shutdown, decode, node_sender

ROWS = (1, 8, 32, 128)
HIDDEN = (1024, 6144)
WINDOW = 4  # messages in flight when streaming
REPEATS = 3
BYTES_PER_RUN = 64 * 2**20  # how much residual each run moves, so small and large payloads take similar time
SPAWN = multiprocessing.get_context("spawn")


class PassThrough:
    def process(self, frame: Frame) -> Frame:
        return frame

    def release(self, slots) -> None:
        pass


def node_main(settings: NodeSettings) -> None:
    run_node(settings, lambda settings, progress: PassThrough())


class Bench:
    """The coordinator's side: control ROUTER, result PULL, PUSH into the node."""

    def __init__(self, keys: str | None):
        self.transport = Transport(COORDINATOR, keys, max_message_bytes=64 * 2**20)
        control, results, listen = (tcp_address("127.0.0.1", free_port()) for _ in range(3))
        self.control = self.transport.bind(zmq.ROUTER, control, ["echo"])
        self.results = self.transport.bind(zmq.PULL, results, ["echo"])
        settings = NodeSettings("echo", sender=node_sender(0), first_layer=0, last_layer=0, listen=listen,
                                successor=Peer(COORDINATOR, results), control=Peer(COORDINATOR, control),
                                input_peer=COORDINATOR,
                                curve_keys=keys, max_message_bytes=64 * 2**20, parent_pid=os.getpid())
        self.node = SPAWN.Process(target=node_main, args=(settings,))
        self.node.start()
        while True:  # the node's route: its name, or with Curve keys what the ROUTER knows its key by
            route, *frames = receive(self.control)
            if isinstance(decode(frames).message, Ready):
                self.node_route = route.bytes
                break
        self.input = self.transport.connect(zmq.PUSH, listen, "echo")
        self.encoder = Encoder(COORDINATOR_SENDER)
        self.decoder = Decoder(settings.sender, (Frame,), max_message_bytes=64 * 2**20)

    def _send(self, frame: Frame) -> None:
        send(self.input, self.encoder.encode(frame))

    def _receive(self) -> Frame:
        return self.decoder.decode(receive(self.results)).message

    def latency_us(self, frame: Frame, messages: int) -> float:
        start = time.perf_counter()
        for _ in range(messages):
            self._send(frame)
            self._receive()
        return (time.perf_counter() - start) / (2 * messages) * 1e6

    def stream_us(self, frame: Frame, messages: int) -> float:
        start = time.perf_counter()
        for _ in range(min(WINDOW, messages)):
            self._send(frame)
        for sent in range(WINDOW, messages + WINDOW):
            self._receive()
            if sent < messages:
                self._send(frame)
        return (time.perf_counter() - start) / (2 * messages) * 1e6

    def close(self) -> None:
        send(self.control, [self.node_route, *self.encoder.encode(Shutdown())])
        self.node.join(10)
        if self.node.is_alive():
            self.node.kill()
        self.transport.close()


def measure(bench: Bench, rows: int, hidden: int, repeats: int) -> tuple[dict, dict]:
    frame = Frame(0, 0, np.arange(rows), np.zeros(rows), np.ones(rows), np.ones(rows, bool),
                  np.random.default_rng(0).standard_normal((rows, hidden), dtype=np.float32))
    messages = max(20, min(2000, BYTES_PER_RUN // frame.residual.nbytes))
    bench.latency_us(frame, 10)  # warm up connections and allocator
    latency = spread(bench.latency_us(frame, messages) for _ in range(repeats))
    stream = spread(bench.stream_us(frame, messages) for _ in range(repeats))
    return latency, stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run per figure instead of the median of three")
    parser.add_argument("--out", type=Path, help="default bench/results/transport_hop.json")
    args = parser.parse_args()
    started, repeats = now(), 1 if args.quick else REPEATS
    with tempfile.TemporaryDirectory() as keys:
        generate_keys(keys, [COORDINATOR, "echo"])
        results = {}
        for curve in (False, True):
            bench = Bench(keys if curve else None)
            try:
                for hidden in HIDDEN:
                    for rows in ROWS:
                        results[curve, hidden, rows] = measure(bench, rows, hidden, repeats)
            finally:
                bench.close()
    table = Table("One hop on 127.0.0.1, µs per message",
                  ["hidden", "rows", "KiB", "plain: latency µs", "streamed µs", "streamed MB/s",
                   "CurveZMQ: latency µs", "streamed µs", "streamed MB/s"],
                  note=f"Latency: one message at a time; streamed: {WINDOW} messages in flight.")
    for hidden in HIDDEN:
        for rows in ROWS:
            size = rows * hidden * 4
            cells = []
            for curve in (False, True):
                latency, stream = results[curve, hidden, rows]
                cells += [latency, stream, size / stream["median"]]
            table.add(hidden, rows, size // 1024, *cells)
    print(table.text())
    write("transport_hop", "One pipeline hop on 127.0.0.1, by payload size, with and without CurveZMQ", started,
          [table], args.out, quick=args.quick)


if __name__ == "__main__":
    main()
