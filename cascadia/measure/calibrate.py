"""`cascadia calibrate`: what the simulator needs, measured with the real engine and transport on the plan's nodes,
under the settings `cascadia run` uses (the same stage construction, thread counts, node processes, coordinator):

1. layer tables, node by node, each alone on the host (`cascadia.measure.tables`);
2. the links' latency and bandwidth on the real transport (`cascadia.measure.links`);
3. the real pipeline: each node's level there and what each stream adds, the message overheads, and the speedup
   of hosts that several nodes share (`cascadia.measure.pipeline_probe`, fitted by `cascadia.sim.fit`);
4. asked to, the machine's speed watched for a while longer, so that the spread of the calibration's rounds
   (`Calibration.spread`, what `simulate --interval` draws from) spans more than its own minute.

With `layers_only`, 1 and 2 alone: overheads zero and every host one core, as in an analytic calibration. The
pipeline's frames alone run every shape 40 times at short contexts, which with a large prefill bucket (a long-context
spec's 256 rows) takes most of an hour, while the tables reach the context budget at one frame per point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import attrs
import openvino as ov

from cascadia.errors import CheckpointError, SpecError
from cascadia.graph.plan import Plan
from cascadia.measure.links import describe_link, measure_link
from cascadia.measure.pipeline_probe import measure_pipeline
from cascadia.measure.tables import ROUNDS, Grid, measure_tables
from cascadia.sim.calibration import KIND_AXES, MEASURED, Calibration, NodeCalibration, Spread, make_meta
from cascadia.spec.types import Spec
from cascadia.table import format_rows

Progress = Callable[[str], None]


def calibrate(spec: Spec, plan: Plan, checkpoint: Path | None = None, rounds: int = ROUNDS,
              progress: Progress = lambda text: None, layers_only: bool = False, watch_s: float = 0.0) -> Calibration:
    """Measure every node of `plan` (all local), their links and overheads (not with `layers_only`), and watch the
    machine's speed `watch_s` seconds more on the pipeline; see the module's description."""
    checkpoint = checkpoint or spec.model.checkpoint
    if checkpoint is None:
        raise CheckpointError("no checkpoint: the spec's model names none; give one (--checkpoint DIR)")
    if spec.runtime.stage_graph:
        raise SpecError("calibrate times a stage's layers one by one; with runtime.stage_graph they run as one graph, "
                        "which it cannot time yet: calibrate the spec without it")
    nodes = {node.name: node for node in spec.cluster.nodes}
    if remote := [s.node for s in plan.stages if not nodes[s.node].is_local]:
        raise SpecError(f"calibrate measures local nodes only; {', '.join(remote)} have tcp addresses")
    if layers_only and watch_s:
        raise ValueError("watching the machine's speed needs the pipeline, which a calibration of the layers alone "
                         "does not start")
    started = time.monotonic()
    grid = Grid.of(spec, rounds)
    tables, levels, devices = {}, {}, []
    for stage in plan.stages:
        tables[stage.node], levels[stage.node], device = measure_tables(spec, plan, stage.node, Path(checkpoint),
                                                                        grid, progress)
        devices.append(f"{stage.node} {device} ({nodes[stage.node].threads or 'all'} threads)")
    loopback = measure_link(spec.model.config.hidden_size, progress)
    links = {(a, b): loopback for a, b in plan.hops() if a != b}
    meta = make_meta(spec, MEASURED, device="; ".join(devices), openvino=ov.get_version())
    layers = Calibration(meta, {name: NodeCalibration(t) for name, t in tables.items()}, links, spread=Spread(levels))
    measured = layers if layers_only else measure_pipeline(spec, plan, Path(checkpoint), layers, progress, watch_s)
    return attrs.evolve(measured, spread=attrs.evolve(measured.spread, seconds=time.monotonic() - started))


def format_calibration(calibration: Calibration) -> str:
    """Each node's times in ms (a kind's range over its grid: one layer), its overheads, the links and hosts."""
    kinds = [kind for kind in KIND_AXES if any(kind in node.tables for node in calibration.nodes.values())]
    rows = [("node", *kinds, "per stream", "per frame", "per row", "restart s")]
    for name, node in calibration.nodes.items():
        ranges = []
        for kind in kinds:
            times = [t for line in node.tables[kind].time_s for t in line] if kind in node.tables else []
            ranges.append(f"{min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}" if times else "-")
        rows.append((name, *ranges, *(f"{t * 1e3:.3f}" for t in (node.stream_s, node.frame_s, node.row_s)),
                     "-" if node.restart_s is None else f"{node.restart_s:.2f}"))
    return "\n".join([
        format_rows(rows, left={0}),
        *([f"the coordinator: {c.frame_s * 1e3:.3f} ms per frame + {c.row_s * 1e3:.3f} ms per row (its own work)"]
          if (c := calibration.coordinator) else []),
        *(f"link {a} -> {b}: {describe_link(link)}" for (a, b), link in calibration.links.items()),
        *(f"host {host}: speedup {', '.join(f'{s:.2f}' for s in speedup)} with 1, 2, ... nodes computing at once"
          for host, speedup in calibration.hosts.items()),
        *([f"rounds: each took {levels[0]:.2f}-{levels[-1]:.2f}x the median round's time ({len(levels)} rounds over "
           f"{calibration.spread.seconds:.0f} s)"] if calibration.spread and (levels := calibration.spread.levels())
          else []),
    ])
