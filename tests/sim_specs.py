"""Small specs, plans and hand-made calibrations for the simulator's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cascadia.graph.plan import Plan, Stage, ring_pairs
from cascadia.graph.planner import stage_roles
from cascadia.models import read_config
from cascadia.models.base import LayerKind
from cascadia.sim.calibration import KIND_AXES, MEASURED, Calibration, NodeCalibration, Table, make_meta
from cascadia.spec.types import ClusterSpec, LinkSpec, ModelSpec, NodeSpec, RuntimeSpec, Spec, WorkloadSpec

TINY_CONFIG = Path(__file__).parent.parent / "specs" / "tiny" / "config.json"  # 6 layers: S S G S S G, layer 0 dense
GIB = 2**30


def tiny_spec_yaml(memory: str = "1GiB", concurrency: str = "[1, 2]", prompt_tokens: int = 8,
                   output_tokens: int = 4) -> str:
    """The tiny model on 3 nodes with hardware figures, as a spec file's text (for the command-line tests)."""
    return f"""
model:
  name: tiny
  hf_config: {TINY_CONFIG}
  formats: f32
cluster:
  reserve: 64MiB
  nodes:
    - {{name: node, count: 3, memory: {memory}, memory_bandwidth: 1GB/s, compute: 1TFLOPS}}
runtime:
  context_budget: 64
  max_streams: 8
  row_buckets: [2, 4, 8]
  prefill_window: 4
workload:
  concurrency: {concurrency}
  prompt_tokens: {prompt_tokens}
  output_tokens: {output_tokens}
"""


def tiny_spec(n_nodes: int = 3, host: str | None = None, runtime: RuntimeSpec | None = None,
              workload: WorkloadSpec | None = None, bandwidth: float | None = 1e9) -> Spec:
    nodes = tuple(NodeSpec(f"n{i}", memory_bytes=GIB, memory_bandwidth=bandwidth, compute_flops=1e12, host=host)
                  for i in range(n_nodes))
    return Spec(ModelSpec(read_config(TINY_CONFIG), name="tiny"),
                ClusterSpec(nodes, default_link=LinkSpec(bandwidth=1e8, latency=1e-4)),
                runtime or RuntimeSpec(context_budget=64, max_streams=8, row_buckets=(2, 4, 8), prefill_window=4),
                workload or WorkloadSpec())


def even_plan(spec: Spec) -> Plan:
    """Consecutive layers split evenly over the nodes, in order (sizes and estimates are not needed here)."""
    nodes, n_layers = spec.cluster.nodes, spec.model.config.num_hidden_layers
    bounds = [round(i * n_layers / len(nodes)) for i in range(len(nodes) + 1)]
    stages = tuple(Stage(node.name, bounds[i], bounds[i + 1] - 1, stage_roles(i, len(nodes)), 0, 0, 0, None, 0.0)
                   for i, node in enumerate(nodes))
    return Plan(stages, total_params=0, active_params=0, bottleneck_s=0.0, cost_source="test")


def calibration(spec: Spec, time: Callable[[str, float, float], float], rows=(1, 64), context=(1, 64),
                experts=(1, 8), frame_s: float = 0.0, row_s: float = 0.0, stream_s: float = 0.0,
                links: dict[tuple[str, str], LinkSpec] | None = None) -> Calibration:
    """Every node's tables from time(kind, rows, x) on the given grids (those of a model without an MTP layer)."""
    grids = {"context": context, "experts": experts, None: (0,)}
    tables = {kind: Table(tuple(rows), tuple(grids[axis]) if axis else (),
                          tuple(tuple(time(kind, r, x) for x in grids[axis]) for r in rows))
              for kind, axis in KIND_AXES.items() if kind != LayerKind.MTP}
    nodes = {node.name: NodeCalibration(tables, frame_s, row_s, stream_s) for node in spec.cluster.nodes}
    if links is None:
        names = [node.name for node in spec.cluster.nodes]
        links = {(a, b): spec.cluster.default_link for a, b in ring_pairs(names) if a != b}
    return Calibration(make_meta(spec, MEASURED, device="test", openvino=None), nodes, links)
