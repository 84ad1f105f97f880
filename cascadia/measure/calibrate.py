"""`cascadia calibrate`: what the simulator needs, measured with the real engine and transport on the plan's nodes.

Everything is measured under the settings `cascadia run` uses: the same stage construction, thread counts, node
processes and coordinator.

1. Layer tables, node by node, each alone on the host. A process with the node's thread settings builds its stage
   as the node process does (`load_stage`) and sends frames through the same stage wrapper, on the analytic
   calibration's grid: rows = every padded frame size the policy produces; attended positions 1, 2, 4, ... up to the
   context budget (a sliding layer's window); for MoE, distinct experts top_k ... n_routed_experts. A frame is one
   stream's consecutive rows, their mean attended positions on the grid point where the context budget allows
   (what each further stream in a frame costs is measured in step 3). Timers around each layer's forward and its
   MLP give the MLP's kind (dense or moe) and the attention's (the rest of the layer: norms, attention,
   convolutions, residuals); timers around the embedding and the head (final norm, head, sampling) give theirs. A
   point is the median over `rounds` sweeps of the grid, interleaved so that a burst of other load touches every
   point alike. The stream's length is set where its rows start (the time does not depend on the cached values).
   Distinct experts D: the layer's own router runs, then row i's experts are rewritten to i*k ... i*k + k - 1 modulo
   D, so that the frame touches exactly D; R rows touch at most R*k, and a point beyond that holds the time at R*k.
2. Links: pipeline messages bounced off a process at the other end of the real ZeroMQ transport (loopback: the
   nodes are local), round trip = 2 x (latency + bytes / bandwidth), fitted over sizes from one row to 4 MiB.
3. The real pipeline (`Pipeline.start`), in passes that interleave two kinds of traffic (a figure is the median over
   the passes):
   - frames alone in the pipeline, of decode rows (one stream each) and of prompt windows (one stream), of 1 ... the
     largest bucket rows. Each node's own count of busy seconds fits busy = a x tables + stream_s x streams: the
     tables give each kind's shape, the node in the pipeline (its own process, idle between frames, other
     processes around it) their level and what each stream adds. The rest of the round trip beyond the nodes'
     busy time and the links is shared evenly by the nodes as frame_s + row_s x rows: each receives, decodes,
     encodes and sends every frame outside its busy count (the coordinator's part comes with it);
   - bursts of one-row streams all in flight (`burst_streams`: 2, 3, ... then twice as many as stages): on a host
     that several nodes share, they find how much work k nodes computing at once get done, against one alone (the
     speedup S_k, each fitted so that the simulator, given the burst, takes as long as the pipeline did). On a small
     machine that is not min(k, processors): the nodes' messages, the coordinator and the wake-ups of idle
     processes take their share (2 processors here, three node processes: 0.9-1.15 with 2 busy, 1.0-1.07 with 3).
   Least-squares fits, no coefficient below zero; bisections for the speedups.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np
import openvino as ov
import yaml
import zmq

from cascadia.engine.device import core
from cascadia.errors import CalibrationError, CheckpointError, SpecError
from cascadia.graph.build import ACTIVATION_BYTES
from cascadia.graph.plan import Plan
from cascadia.graph.planner import TOKEN_ID_BYTES, load_plan
from cascadia.pipeline.launch import thread_env
from cascadia.pipeline.places import LOCALHOST
from cascadia.pipeline.run import Pipeline, describe
from cascadia.pipeline.stage import EngineStage, find_stage, load_stage
from cascadia.pipeline.transport import Transport, free_port, receive, send, tcp_address
from cascadia.pipeline.wire import Encoder, Frame
from cascadia.policy import DECODE, Row, padded_size
from cascadia.policy import Frame as PolicyFrame
from cascadia.sampling import Sampling
from cascadia.sim.analytic import kind_costs, row_grid
from cascadia.sim.calibration import (
    DENSE,
    EMBEDDING,
    GLOBAL,
    HEAD,
    KIND_AXES,
    MEASURED,
    MOE,
    SLIDING,
    Calibration,
    Extrapolations,
    NodeCalibration,
    Table,
    make_meta,
)
from cascadia.sim.model import FrameShape, PipelineModel, StageCost, shared_hosts, stage_kinds
from cascadia.spec.dump import dump_spec
from cascadia.spec.load import load_spec
from cascadia.spec.types import LinkSpec, Spec
from cascadia.table import format_rows
from cascadia.units import format_duration, format_rate

ROUNDS = 10  # sweeps of the layer grid; each point is their median
STEPS = 8  # frames of one shape alone through the pipeline, one after the other (at most)
PASSES = 5  # passes over the pipeline's traffic; each figure is their median
BURST_STEPS = 16  # frames per stream in a burst of streams all in flight
SPEEDUP_LOW = 0.5  # the least speedup a fit gives k nodes computing at once on a shared host
PINGS = 30  # round trips per message size on a link
LARGEST_MESSAGE_BYTES = 4 * 2**20

Progress = Callable[[str], None]


class CalibrationFailed(CalibrationError):
    """A measurement could not be made; the text says which and why."""


@attrs.frozen
class Grid:
    rows: tuple[int, ...]  # padded frame sizes
    points: dict[str, tuple[int, ...]]  # each kind's second axis: attended positions, distinct experts
    rounds: int = ROUNDS

    @classmethod
    def of(cls, spec: Spec, rounds: int = ROUNDS) -> Grid:
        """The analytic calibration's grid, so a measured calibration has the same shape."""
        return cls(row_grid(spec), {kind: points for kind, (points, _) in kind_costs(spec).items() if points}, rounds)


def calibrate(spec: Spec, plan: Plan, checkpoint: Path | None = None, rounds: int = ROUNDS,
              progress: Progress = lambda text: None) -> Calibration:
    """Measure every node of `plan` (all local), their links and overheads; see the module's description."""
    checkpoint = checkpoint or spec.model.checkpoint
    if checkpoint is None:
        raise CheckpointError("no checkpoint: the spec's model names none; give one (--checkpoint DIR)")
    nodes = {node.name: node for node in spec.cluster.nodes}
    if remote := [s.node for s in plan.stages if not nodes[s.node].is_local]:
        raise SpecError(f"calibrate measures local nodes only; {', '.join(remote)} have tcp addresses")
    grid = Grid.of(spec, rounds)
    tables, devices = {}, []
    for stage in plan.stages:
        tables[stage.node], device = measure_tables(spec, plan, stage.node, Path(checkpoint), grid, progress)
        devices.append(f"{stage.node} {device} ({nodes[stage.node].threads or 'all'} threads)")
    loopback = measure_link(spec.model.config.hidden_size, progress)
    links = {(a, b): loopback for a, b in plan.hops() if a != b}
    meta = make_meta(spec, MEASURED, device="; ".join(devices), openvino=ov.get_version())
    layers = Calibration(meta, {name: NodeCalibration(t) for name, t in tables.items()}, links)
    return measure_pipeline(spec, plan, Path(checkpoint), layers, progress)


def format_calibration(calibration: Calibration) -> str:
    """Each node's times in ms (a kind's range over its grid: one layer), its overheads, the links and hosts."""
    kinds = [kind for kind in KIND_AXES if any(kind in node.tables for node in calibration.nodes.values())]
    rows = [("node", *kinds, "per stream", "per frame", "per row")]
    for name, node in calibration.nodes.items():
        ranges = []
        for kind in kinds:
            times = [t for line in node.tables[kind].time_s for t in line] if kind in node.tables else []
            ranges.append(f"{min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}" if times else "-")
        rows.append((name, *ranges, *(f"{t * 1e3:.3f}" for t in (node.stream_s, node.frame_s, node.row_s))))
    return "\n".join([
        format_rows(rows, left={0}),
        *(f"link {a} -> {b}: {_describe_link(link)}" for (a, b), link in calibration.links.items()),
        *(f"host {host}: speedup {', '.join(f'{s:.2f}' for s in speedup)} with 1, 2, ... nodes computing at once"
          for host, speedup in calibration.hosts.items()),
    ])


def _describe_link(link: LinkSpec) -> str:
    """"latency 85.3 us, bandwidth 21.3 Gbit/s": the bandwidth in bits, as specs give links."""
    return (f"latency {format_duration(link.latency, digits=3)}, "
            f"bandwidth {format_rate(link.bandwidth, bits=True, digits=3)}")


# ---- 1. layer tables, in a process of the node's own --------------------------------------------------------------
def measure_tables(spec: Spec, plan: Plan, name: str, checkpoint: Path, grid: Grid,
                   progress: Progress) -> tuple[dict[str, Table], str]:
    """Node `name`'s tables and its device, measured in a process with the node's thread settings."""
    threads = next(node.threads for node in spec.cluster.nodes if node.name == name)
    with tempfile.TemporaryDirectory(prefix="cascadia-calibrate-") as folder:
        spec_path, plan_path = Path(folder) / "spec.yaml", Path(folder) / "plan.json"
        spec_path.write_text(yaml.safe_dump(dump_spec(spec), sort_keys=False))
        plan.save(plan_path)
        args = [str(spec_path), str(plan_path), name, str(checkpoint), str(grid.rounds)]
        with _Worker("tables_worker", args, thread_env(threads), Path(folder) / "worker.log") as worker:
            for message in worker.messages():
                if "progress" in message:
                    progress(f"{name}: {message['progress']}")
                elif "error" in message:
                    raise CalibrationFailed(f"{name}: {message['error']}")
                else:
                    tables = {kind: Table(tuple(t["rows"]), tuple(t["points"]), tuple(map(tuple, t["time_s"])))
                              for kind, t in message["tables"].items()}
                    return tables, message["device"]
    raise CalibrationFailed(f"{name}: the measuring process ended without a result")


class _Worker:
    """A Python process running `function(args)` of this module, which prints JSON lines."""

    def __init__(self, function: str, args: Sequence[str], env: dict[str, str], log: Path) -> None:
        code = f"import sys; from cascadia.measure.calibrate import {function}; {function}(sys.argv[1:])"
        self.log = log
        with log.open("w") as errors:
            self.process = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=errors, text=True, env=env)

    def messages(self) -> Iterator[dict]:
        """Its lines until it ends; one that fails without saying why is an error quoting its stderr."""
        for line in self.process.stdout:
            if line.startswith("{"):  # anything else is some library talking
                yield json.loads(line)
        if self.process.wait() != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise CalibrationFailed(f"a measuring process exited with status {self.process.returncode}: "
                                    + " / ".join(tail))

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()


def _say(**message) -> None:
    print(json.dumps(message), flush=True)


def tables_worker(argv: Sequence[str]) -> None:
    """The measuring process of one node: SPEC PLAN NODE CHECKPOINT ROUNDS; prints JSON lines."""
    spec_path, plan_path, name, checkpoint, rounds = argv
    try:
        spec = load_spec(spec_path)
        plan = load_plan(plan_path, spec)
        _, stage = find_stage(plan, name)
        loaded = load_stage(spec, stage, Path(checkpoint), None, Sampling(), False,
                            lambda done, total: _say(progress=f"compiled {done}/{total} blocks"))
        engine = loaded.engine
        device = f"{engine.device} {core().get_property(engine.device, 'FULL_DEVICE_NAME')}"
        probe = StageProbe(loaded, stage_kinds(stage, spec.model.config))
        tables = probe.tables(Grid.of(spec, int(rounds)), lambda text: _say(progress=text))
        _say(tables={kind: attrs.asdict(table) for kind, table in tables.items()}, device=device)
    except Exception as e:  # reported by the parent, naming the node
        _say(error=f"{type(e).__name__}: {e}")


class _Stopwatch:
    """Seconds spent in wrapped methods since the last `take`, by key."""

    def __init__(self) -> None:
        self.seconds: dict[object, float] = defaultdict(float)

    def wrap(self, owner: object, method: str, key: object) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        setattr(owner, method, timed)  # an instance attribute: shadows the method for this object only

    def take(self) -> dict[object, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


@attrs.define
class SteeredRouter:
    """A layer's router, followed by rewriting each row's experts so that a frame touches exactly `distinct` of
    them (None: the router's own choice). Row i takes experts i*k ... i*k + k - 1 modulo `distinct`."""

    router: Callable
    distinct: int | None = None

    def __call__(self, h: np.ndarray):
        routing = self.router(h)
        if self.distinct is None:
            return routing
        k = routing.index.shape[1]
        index = (np.arange(len(h))[:, None] * k + np.arange(k)) % self.distinct
        return attrs.evolve(routing, index=index.astype(np.int32))


class StageProbe:
    """Times a stage's parts on frames of a chosen shape, through the stage wrapper the node serves."""

    def __init__(self, stage: EngineStage, kinds: Sequence[str]) -> None:
        self.stage, self.engine = stage, stage.engine
        self.kinds = set(kinds)
        self.watch = _Stopwatch()
        self.attention_kinds, self.mlp_kinds, self.routers = [], [], []
        config = self.engine.config
        for index, layer in zip(self.engine.layer_ids, self.engine.layers):
            self.watch.wrap(layer, "forward", ("layer", index))
            self.watch.wrap(layer, "feed_forward", ("mlp", index))
            self.attention_kinds.append(SLIDING if config.is_sliding(index) else GLOBAL)
            self.mlp_kinds.append(DENSE if config.is_dense(index) else MOE)
            if layer.router is not None:
                layer.router = SteeredRouter(layer.router)
                self.routers.append(layer.router)
        if self.engine.embedding is not None:
            self.watch.wrap(self.engine, "embed", EMBEDDING)
        if self.engine.head is not None:
            self.watch.wrap(self.engine, "logits", HEAD)
            self.watch.wrap(stage.sampler, "sample", HEAD)
        self._rng = np.random.default_rng(0)
        self._frames = 0

    def frame(self, rows: int, context: int) -> Frame:
        """`rows` consecutive rows of one stream (slot 0) whose mean attended positions are `context`, where the
        context budget allows; the slot's length is set where they start."""
        engine = self.engine
        start = min(max(0, context - (rows + 1) // 2), engine.context_budget - rows)
        engine.lengths[0] = start
        self._frames += 1
        tokens = self._rng.integers(0, engine.config.vocab_size, rows)
        residual = None if engine.embedding is not None else \
            self._rng.standard_normal((rows, engine.config.hidden_size), dtype=np.float32)
        return Frame(self._frames, 0, [0] * rows, range(start, start + rows), tokens, [True] * rows, residual)

    def run(self, rows: int, context: int, experts: int | None) -> dict[str, list[float]]:
        """Seconds of each layer kind's layers (one entry per layer), the embedding and the head on one frame."""
        for router in self.routers:
            router.distinct = experts
        frame = self.frame(rows, context)
        self.watch.take()
        self.stage.process(frame)
        seconds = self.watch.take()
        out: dict[str, list[float]] = defaultdict(list)
        for index, attention, mlp in zip(self.engine.layer_ids, self.attention_kinds, self.mlp_kinds):
            out[attention].append(seconds[("layer", index)] - seconds[("mlp", index)])
            out[mlp].append(seconds[("mlp", index)])
        for kind in (EMBEDDING, HEAD):
            if kind in seconds:
                out[kind].append(seconds[kind])
        return out

    def tables(self, grid: Grid, progress: Progress) -> dict[str, Table]:
        """This stage's kinds on the grid: medians over the rounds (and over the stage's layers of a kind)."""
        top_k = self.engine.config.num_experts_per_tok
        contexts = sorted({c for kind in (SLIDING, GLOBAL) if kind in self.kinds for c in grid.points[kind]} or {1})
        experts = grid.points[MOE] if MOE in self.kinds else ()
        samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)  # (kind, rows, point) -> seconds
        for done in range(grid.rounds):
            for rows in grid.rows:
                for context in contexts:
                    for kind, seconds in self.run(rows, context, None).items():
                        if kind in (SLIDING, GLOBAL):
                            samples[kind, rows, context] += seconds
                        elif kind != MOE:  # rows alone
                            samples[kind, rows, 0] += seconds
                for distinct in experts:
                    samples[MOE, rows, distinct] += self.run(rows, 1, min(distinct, rows * top_k))[MOE]
            progress(f"measured round {done + 1}/{grid.rounds} of {len(grid.rows)} row counts")
        out = {}
        for kind in self.kinds:
            points = grid.points[kind] if KIND_AXES[kind] else (0,)
            times = tuple(tuple(statistics.median(samples[kind, rows, p]) for p in points) for rows in grid.rows)
            out[kind] = Table(grid.rows, points if KIND_AXES[kind] else (), times)
        return out


# ---- 2. links ----------------------------------------------------------------------------------------------------
def measure_link(hidden_size: int, progress: Progress) -> LinkSpec:
    """Loopback latency and bandwidth of the pipeline's ZeroMQ transport between two processes."""
    listen, reply = tcp_address(LOCALHOST, free_port()), tcp_address(LOCALHOST, free_port())
    sizes, round_trips = [], []
    with contextlib.ExitStack() as stack:
        transport = stack.enter_context(Transport("calibrate"))
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="cascadia-calibrate-"))
        inbox = transport.bind(zmq.PULL, reply)
        echo = stack.enter_context(_Worker("echo_worker", [listen, reply], dict(os.environ),
                                           Path(folder) / "echo.log"))
        outbox = transport.connect(zmq.PUSH, listen, "echo")
        encoder = Encoder(0)
        rows = 1
        while rows * hidden_size * ACTIVATION_BYTES <= LARGEST_MESSAGE_BYTES:
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
    progress(f"loopback link: {_describe_link(link)}")
    return link


def echo_worker(argv: Sequence[str]) -> None:
    """The far end of a link: LISTEN REPLY; sends every message straight back, until an empty one."""
    listen, reply = argv
    with Transport("echo") as transport:
        inbox = transport.bind(zmq.PULL, listen)
        outbox = transport.connect(zmq.PUSH, reply, "calibrate")
        while len(message := receive(inbox)) > 1:
            send(outbox, message)


# ---- 3. the real pipeline: each node's level and per-stream time, the overheads, shared cores ---------------------
@attrs.frozen
class _Alone:
    """Frames that went through the pipeline one after the other, each alone."""

    shapes: tuple[FrameShape, ...]
    round_trips: float  # their round trips, summed
    busy: tuple[float, ...]  # the seconds each stage's node was busy on them


def measure_pipeline(spec: Spec, plan: Plan, checkpoint: Path, layers: Calibration, progress: Progress) -> Calibration:
    """`layers` (tables and links) completed on the plan's real pipeline: tables at the nodes' level there, the
    per-stream and overhead times, and the cores of shared hosts."""
    runtime = spec.runtime
    largest = max(runtime.row_buckets)
    rows = sorted(set(range(1, largest + 1, max(1, largest // 8))) | set(runtime.row_buckets))
    alone = [(_decode_rows, r) for r in rows if r <= runtime.max_streams] + [(_prompt_window, r) for r in rows if r > 1]
    streams = burst_streams(spec, plan)
    frames: list[list[_Alone]] = []  # by pass, each shape's frames in order
    bursts: list[list[list[float]]] = [[] for _ in streams]  # per burst size, each pass's
    progress("starting the pipeline")
    with Pipeline.start(spec, plan, checkpoint=checkpoint, sampling=Sampling(),
                        on_message=lambda node, message: progress(describe(node, message))) as pipeline:
        probe = PipelineProbe(pipeline, spec)
        probe.alone([_decode_rows(1, step) for step in range(STEPS)])  # the first frames pay for first use
        for sweep in range(PASSES):  # passes, so that load elsewhere touches both kinds of traffic alike
            frames.append([probe.alone([make(n, step) for step in range(min(STEPS, runtime.context_budget // n))])
                           for make, n in alone])
            for n, passes in zip(streams, bursts):
                passes.append(probe.saturate(n, min(BURST_STEPS, runtime.context_budget)))
            progress(f"pipeline: pass {sweep + 1}/{PASSES}: {len(alone)} frame shapes alone, bursts of "
                     f"{', '.join(map(str, streams))} streams at once")
    calibration = _fitted(spec, plan, layers, [_median(passes) for passes in zip(*frames)], progress)
    return attrs.evolve(calibration, hosts=shared_speedup(spec, plan, calibration, bursts, progress))


class PipelineProbe:
    """Frames sent straight to a started pipeline's coordinator, their tokens taken straight back."""

    def __init__(self, pipeline: Pipeline, spec: Spec) -> None:
        self.coordinator = pipeline.coordinator
        self.spec = spec
        self.rng = np.random.default_rng(0)
        self.frame_id = 0

    def send(self, group: int, slots: Sequence[int], positions: Sequence[int]) -> FrameShape:
        """A frame of rows at these slots and positions (0 starts a stream afresh), every row sampled; its shape
        for the simulator."""
        self.frame_id += 1
        self.coordinator.send_frame(Frame(self.frame_id, group, slots, positions,
                                          self.rng.integers(0, self.spec.model.config.vocab_size, len(slots)),
                                          [True] * len(slots)))
        window, attended = self.spec.model.config.sliding_window_size, [p + 1 for p in positions]
        return FrameShape(padded_size(len(slots), self.spec.runtime.row_buckets), len(slots),
                          statistics.fmean(min(a, window) for a in attended), statistics.fmean(attended),
                          len(set(slots)))

    def alone(self, frames: Sequence[tuple[Sequence[int], Sequence[int]]]) -> _Alone:
        """Frames (slots, positions) one after the other, each sent as soon as the one before is back, as a single
        stream's are: their round trips and each node's busy seconds on them."""
        before = self.coordinator.stats()
        shapes, round_trips = [], 0.0
        for slots, positions in frames:
            start = time.perf_counter()
            shapes.append(self.send(0, slots, positions))
            self.coordinator.next_tokens()
            round_trips += time.perf_counter() - start
        after = self.coordinator.stats()
        return _Alone(tuple(shapes), round_trips, tuple(after[name].busy_s - before[name].busy_s for name in after))

    def saturate(self, groups: int, steps: int) -> list[float]:
        """`groups` one-row streams (slot = group) of `steps` frames each, all in flight at once: seconds since the
        start at which each frame's tokens came back, in order."""
        position = [0] * groups
        for group in range(groups):
            self.send(group, [group], [0])
        done: list[float] = []
        start = time.perf_counter()
        while len(done) < groups * steps:
            group = self.coordinator.next_tokens().group
            done.append(time.perf_counter() - start)
            position[group] += 1
            if position[group] < steps:
                self.send(group, [group], [position[group]])
        return done


def _median(passes: Sequence[_Alone]) -> _Alone:
    """One shape's frames as the passes found them in the middle: the median round trip and busy seconds of each
    node (a pass that met a burst of other load on this machine moves neither)."""
    return _Alone(passes[0].shapes, statistics.median(p.round_trips for p in passes),
                  tuple(map(statistics.median, zip(*(p.busy for p in passes)))))


def _decode_rows(n: int, step: int) -> tuple[list[int], list[int]]:
    """Slots and positions of n streams' decode rows at step `step`."""
    return list(range(n)), [step] * n


def _prompt_window(n: int, step: int) -> tuple[list[int], list[int]]:
    """Slots and positions of the `step`-th window of n prompt rows of one stream."""
    return [0] * n, list(range(step * n, (step + 1) * n))


def _stage_costs(spec: Spec, plan: Plan, calibration: Calibration) -> list[StageCost]:
    """The simulator's own cost of each stage."""
    config = spec.model.config
    return [StageCost(f"node {s.node}", stage_kinds(s, config), calibration.nodes[s.node], config, calibration,
                      Extrapolations()) for s in plan.stages]


def _fitted(spec: Spec, plan: Plan, layers: Calibration, frames: Sequence[_Alone], progress: Progress) -> Calibration:
    """Each node's tables scaled and its stream_s, frame_s and row_s, fitted to the frames that went alone."""
    config = spec.model.config
    names = [stage.node for stage in plan.stages]
    hops = [layers.links.get(hop) for hop in plan.hops()]

    def wires(shape: FrameShape) -> float:
        sizes = [shape.rows * config.hidden_size * ACTIVATION_BYTES] * (len(names) - 1) + [shape.rows * TOKEN_ID_BYTES]
        return sum(hop.latency + size / hop.bandwidth for hop, size in zip(hops, sizes) if hop is not None)

    handling = [(f.round_trips - sum(f.busy) - sum(map(wires, f.shapes))) / len(names) for f in frames]
    frame_s, row_s = fit_non_negative([[len(f.shapes) for f in frames],
                                       [sum(shape.rows for shape in f.shapes) for f in frames]], handling)
    progress(f"message handling: {frame_s * 1e3:.2f} ms per frame + {row_s * 1e3:.3f} ms per row, each node")
    nodes = {}
    for i, (name, cost) in enumerate(zip(names, _stage_costs(spec, plan, layers))):
        scale, stream_s = fit_non_negative([[sum(map(cost, f.shapes)) for f in frames],
                                            [sum(s.streams for s in f.shapes) for f in frames]],
                                           [f.busy[i] for f in frames])
        progress(f"{name}: busy in the pipeline {scale:.2f} x its tables + {stream_s * 1e3:.3f} ms per stream")
        tables = {kind: attrs.evolve(table, time_s=tuple(tuple(t * scale for t in line) for line in table.time_s))
                  for kind, table in layers.nodes[name].tables.items()}
        nodes[name] = NodeCalibration(tables, frame_s, row_s, stream_s)
    return attrs.evolve(layers, nodes=nodes)


def burst_streams(spec: Spec, plan: Plan) -> list[int]:
    """One-row streams in flight in each burst: k for k = 2 ... up to the most nodes a host shares, to find how fast
    k of them compute at once; with every node of a host busy, twice as many streams as stages (a full pipeline).
    None without a shared host, or when one stream at a time is all the runtime allows (nodes never compute at
    once)."""
    most = max(shared_hosts(spec, plan).values(), default=1)
    limit = spec.runtime.max_streams
    if most < 2 or limit < 2:
        return []
    return [min(k, limit) for k in range(2, most)] + [min(2 * len(plan.stages), limit)]


def shared_speedup(spec: Spec, plan: Plan, calibration: Calibration, bursts: Sequence[Sequence[list[float]]],
                   progress: Progress = lambda text: None) -> dict[str, tuple[float, ...]]:
    """The speedup of the hosts that several stages share (one list for all of them): S_1 = 1 (the frames alone
    measured a node computing by itself), then each S_k in turn, from the burst of `burst_streams`' k-th size, is
    the one with which the simulator takes as long as the pipeline took (the median over the passes), counted from
    every stream's first frame back to the start of the last round (a full pipeline). Each S_k lies in
    [SPEEDUP_LOW, k]."""
    shared = shared_hosts(spec, plan)
    speedup = [1.0]
    for k, (streams, passes) in enumerate(zip(burst_streams(spec, plan), bursts, strict=True), start=2):
        measured = statistics.median(done[-streams] - done[streams - 1] for done in passes)
        steps = len(passes[0]) // streams

        def simulated(value: float) -> float:
            hosts = {h: (*speedup, value) for h in shared}
            done = simulate_burst(spec, plan, attrs.evolve(calibration, hosts=hosts), streams, steps)
            return done[-streams] - done[streams - 1]

        low, high = SPEEDUP_LOW, float(k)
        if simulated(high) >= measured:
            speedup.append(high)
        elif simulated(low) <= measured:
            speedup.append(low)
        else:
            for _ in range(30):  # bisection: the simulated time falls as the speedup grows
                middle = (low + high) / 2
                low, high = (middle, high) if simulated(middle) > measured else (low, middle)
            speedup.append((low + high) / 2)
    if shared:
        rates = ", ".join(f"{k} at once {value:.2f}x" for k, value in enumerate(speedup, start=1))
        progress(f"shared hosts: the work of one node alone done by its nodes computing {rates}")
    return {h: tuple(speedup) for h in shared}


def simulate_burst(spec: Spec, plan: Plan, calibration: Calibration, groups: int, steps: int) -> list[float]:
    """The simulator's `PipelineProbe.saturate`: when each frame's tokens come back, in order."""
    model = PipelineModel(spec, plan, calibration)
    padded = padded_size(1, spec.runtime.row_buckets)
    done: list[float] = []

    def stream(group: int):
        for position in range(steps):
            row = Row(group, group, position, DECODE, 0, True)
            yield from model.carry(PolicyFrame(group * steps + position, group, (row,), padded))
            done.append(model.env.now)

    for group in range(groups):
        model.env.process(stream(group))
    model.env.run()
    return done


def fit_non_negative(columns: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares coefficients (c0, c1) >= 0 of y = c0 columns[0] + c1 columns[1]: the unconstrained fit when
    both are >= 0, else the better of the fits with one of them at zero."""
    a, b = (np.asarray(c, float) for c in columns)
    y = np.asarray(y, float)

    def one(x: np.ndarray) -> float:
        return max(0.0, float(x @ y / (x @ x))) if x @ x > 0 else 0.0

    both, *_ = np.linalg.lstsq(np.stack([a, b], axis=1), y, rcond=None)
    candidates = [(one(a), 0.0), (0.0, one(b))]
    if both.min() >= 0:
        candidates.append((float(both[0]), float(both[1])))
    return min(candidates, key=lambda c: float(((c[0] * a + c[1] * b - y) ** 2).sum()))
