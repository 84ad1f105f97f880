"""Layer tables: what each layer kind costs on a node, measured with the real engine in a process of the node's own.

A process with the node's thread settings builds its stage as the node process does (`load_stage`) and sends frames
through the same stage wrapper, on the analytic calibration's grid: rows = every padded frame size the policy
produces; attended positions 1, 2, 4, ... up to the context budget (a sliding layer's window); for MoE, distinct
experts top_k ... n_routed_experts. A frame is one stream's consecutive rows, their mean attended positions on the grid
point where the context budget allows (what each further stream in a frame costs is measured on the pipeline,
`cascadia.measure.pipeline_probe`). Timers around each layer's forward and its MLP give the MLP's kind (dense or moe)
and the attention's (the rest of the layer: norms, attention, convolutions, residuals); timers around the embedding and
the head (final norm, head, sampling) give theirs; where the stage drafts with the MTP layer, one call of it over the
frame's rows (its rows alone: what a frame's drafts add is the simulator's to count) gives its. A point is the median
over `rounds` sweeps of the grid, interleaved so that a burst of other load touches every point alike. The stream's
length is set where its rows start (the time does not depend on the cached values). Distinct experts D: the layer's own
router runs, then row i's experts are rewritten to i*k ... i*k + k - 1 modulo D, so that the frame touches exactly D; R
rows touch at most R*k, and a point beyond that holds the time at R*k.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from cascadia.engine.device import core
from cascadia.engine.moe_choice import paths_text
from cascadia.graph.plan import Plan
from cascadia.graph.planner import load_plan
from cascadia.host_cpus import pin
from cascadia.measure.workers import CalibrationFailed, Worker, say
from cascadia.models.base import LayerKind
from cascadia.pipeline.launch import thread_env
from cascadia.pipeline.stage import EngineStage, find_stage, load_stage
from cascadia.pipeline.wire import Frame
from cascadia.policy import padded_size
from cascadia.sim.analytic import kind_costs, row_grid
from cascadia.sim.calibration import KIND_AXES, Table, relative_levels
from cascadia.sim.model import stage_kinds
from cascadia.spec.dump import write_spec
from cascadia.spec.load import load_spec
from cascadia.spec.types import Spec

ROUNDS = 10  # sweeps of the layer grid; each point is their median

Progress = Callable[[str], None]


@attrs.frozen
class Grid:
    rows: tuple[int, ...]  # padded frame sizes
    points: dict[str, tuple[int, ...]]  # each kind's second axis: attended positions, distinct experts
    rounds: int = ROUNDS

    @classmethod
    def of(cls, spec: Spec, rounds: int = ROUNDS) -> Grid:
        """The analytic calibration's grid, so a measured calibration has the same shape."""
        return cls(row_grid(spec), {kind: points for kind, (points, _) in kind_costs(spec).items() if points}, rounds)


def measure_tables(spec: Spec, plan: Plan, name: str, checkpoint: Path, grid: Grid,
                   progress: Progress) -> tuple[dict[str, Table], tuple[float, ...], str]:
    """Node `name`'s tables, each round's level (`StageProbe.tables`) and its device, measured in a process with the
    node's thread settings."""
    threads = spec.cluster.node(name).threads
    with tempfile.TemporaryDirectory(prefix="cascadia-calibrate-") as folder:
        spec_path, plan_path = write_spec(spec, Path(folder) / "spec.yaml"), plan.save(Path(folder) / "plan.json")
        args = [str(spec_path), str(plan_path), name, str(checkpoint), str(grid.rounds)]
        with Worker(__name__, "tables_worker", args, thread_env(threads), Path(folder) / "worker.log") as worker:
            for message in worker.messages():
                if "progress" in message:
                    progress(f"{name}: {message['progress']}")
                elif "error" in message:
                    raise CalibrationFailed(f"{name}: {message['error']}")
                else:
                    tables = {kind: Table(tuple(t["rows"]), tuple(t["points"]), tuple(map(tuple, t["time_s"])))
                              for kind, t in message["tables"].items()}
                    return tables, tuple(message["levels"]), message["device"]
    raise CalibrationFailed(f"{name}: the measuring process ended without a result")


def tables_worker(argv: Sequence[str]) -> None:
    """The measuring process of one node: SPEC PLAN NODE CHECKPOINT ROUNDS; prints JSON lines."""
    spec_path, plan_path, name, checkpoint, rounds = argv
    try:
        spec = load_spec(spec_path)
        plan = load_plan(plan_path, spec)
        _, stage = find_stage(plan, name)
        pin(spec.cluster.node(name).cpus, name, whole_process=True)  # measured as the node will run: on its CPUs
        loaded = load_stage(spec, stage, Path(checkpoint), None, False,
                            lambda done, total: say(progress=f"compiled {done}/{total} blocks"))
        engine = loaded.engine
        device = f"{engine.device} {core().get_property(engine.device, 'FULL_DEVICE_NAME')}"
        say(progress=f"MoE {paths_text(engine.moe_grouped_from, engine.row_buckets)}")
        probe = StageProbe(loaded, stage_kinds(stage, spec.model.config, spec.runtime))
        tables, levels = probe.tables(Grid.of(spec, int(rounds)), lambda text: say(progress=text))
        say(tables={kind: attrs.asdict(table) for kind, table in tables.items()}, levels=levels, device=device)
    except Exception as e:  # reported by the parent, naming the node
        say(error=f"{type(e).__name__}: {e}")


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
            self.attention_kinds.append(config.attention_kind(index))
            self.mlp_kinds.append(config.mlp_kind(index))
            if layer.router is not None:
                layer.router = SteeredRouter(layer.router)
                self.routers.append(layer.router)
        if self.engine.embedding is not None:
            self.watch.wrap(self.engine, "embed", LayerKind.EMBEDDING)
        if self.engine.head is not None:
            self.watch.wrap(self.engine, "logits", LayerKind.HEAD)
            self.watch.wrap(stage.sampler, "sample", LayerKind.HEAD)
        self._rng = np.random.default_rng(0)
        self._frames = 0

    def frame(self, rows: int, context: int) -> Frame:
        """`rows` consecutive rows of one stream (slot 0) whose mean attended positions are `context`, where the
        context budget allows; the slot's length is set where they start."""
        engine = self.engine
        start = min(max(0, context - (rows + 1) // 2), engine.context_budget - rows)
        engine.lengths[0] = start
        if engine.mtp is not None:
            engine.mtp.lengths[0] = start
        self._frames += 1
        tokens = self._rng.integers(0, engine.config.vocab_size, rows)
        residual = None if engine.embedding is not None else \
            self._rng.standard_normal((rows, engine.config.hidden_size), dtype=np.float32)
        return Frame(self._frames, 0, [0] * rows, range(start, start + rows), tokens, [True] * rows, residual,
                     padded_size(rows, engine.row_buckets))

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
        for kind in (LayerKind.EMBEDDING, LayerKind.HEAD):
            if kind in seconds:
                out[kind].append(seconds[kind])
        if LayerKind.MTP in self.kinds:
            out[LayerKind.MTP].append(self._mtp_call(frame))
        return out

    def _mtp_call(self, frame: Frame) -> float:
        """Seconds of one call of the MTP layer over the frame's rows (random inputs), where they start."""
        mtp, rows = self.engine.mtp, len(frame.positions)
        mtp.lengths[0] = frame.positions[0]
        hidden = self._rng.standard_normal((rows, self.engine.config.hidden_size), dtype=np.float32)
        start = time.perf_counter()
        mtp.step(hidden, frame.token_ids, frame.slots, frame.positions)
        return time.perf_counter() - start

    def tables(self, grid: Grid, progress: Progress) -> tuple[dict[str, Table], tuple[float, ...]]:
        """This stage's kinds on the grid: medians over the rounds (and over the stage's layers of a kind); and each
        round's level, the seconds its sweep measured over their median (`Calibration.spread`)."""
        top_k = self.engine.config.routed_experts[1]
        attention = [kind for kind in self.kinds if KIND_AXES[kind] == "context"]  # the MTP layer's too
        contexts = sorted({c for kind in attention for c in grid.points[kind]} or {1})
        moe = LayerKind.MOE
        experts = grid.points[moe] if moe in self.kinds else ()
        samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)  # (kind, rows, point) -> seconds
        swept = []  # each round's measured seconds: the same work each time
        for done in range(grid.rounds):
            before = sum(map(sum, samples.values()))
            for rows in grid.rows:
                for context in contexts:
                    for kind, seconds in self.run(rows, context, None).items():
                        if kind in attention:
                            samples[kind, rows, context] += seconds
                        elif kind != moe:  # rows alone
                            samples[kind, rows, 0] += seconds
                for distinct in experts:
                    samples[moe, rows, distinct] += self.run(rows, 1, min(distinct, rows * top_k))[moe]
            swept.append(sum(map(sum, samples.values())) - before)
            progress(f"measured round {done + 1}/{grid.rounds} of {len(grid.rows)} row counts")
        out = {}
        for kind in self.kinds:
            points = grid.points[kind] if KIND_AXES[kind] else (0,)
            times = tuple(tuple(statistics.median(samples[kind, rows, p]) for p in points) for rows in grid.rows)
            out[kind] = Table(grid.rows, points if KIND_AXES[kind] else (), times)
        return out, relative_levels(swept)
