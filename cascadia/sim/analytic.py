"""An analytic calibration: a roofline estimate of each layer kind on each node from the spec's hardware figures.

Each table entry is max(bytes read / memory_bandwidth, FLOPs / compute_flops) for one layer and a frame of R rows
(no compute term on a node without compute_flops):
- attention (sliding, global) over C attended positions: its weights once, plus one stream's K/V over C positions,
  read once by the frame's rows (a table row is R rows of one stream, as a measured table's is; the simulator
  charges rows of distinct streams, such as decode rows, each its own K/V: `cascadia.sim.model`); FLOPs per row for
  the projections and the relative bias (over its bank of rel_extent distances, whatever the context), plus
  attention FLOPs per row and position;
- moe over D distinct experts touched: router, shared experts and D routed experts' weights, once per frame;
  FLOPs per row for the router, top-k routed and shared experts;
- dense: the dense MLP's weights once; its FLOPs per row;
- embedding: each row reads its own table row; head: final norm and head weights once, FLOPs per row, plus reading the
  R x vocabulary logits to sample;
- mtp (a model with a multi-token-prediction layer), over C attended positions: the layer's weights once, each row's
  embedding row, and one stream's K/V over C positions; FLOPs per row for its projections and MLP, plus attention
  FLOPs per row and position.
Links come from the spec; host overheads are not estimated (zero). Every output labels it kind "analytic".
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cascadia.graph.costs import ACTIVATION_BYTES, embedding_cost, head_cost, layer_costs, layer_ops, mtp_cost
from cascadia.graph.plan import ring_pairs
from cascadia.models import mtp_layers
from cascadia.models.base import LayerKind
from cascadia.policy import padded_size
from cascadia.sim.calibration import ANALYTIC, Calibration, CalibrationError, NodeCalibration, Table, make_meta
from cascadia.spec.types import NodeSpec, Spec

ATTENTION_OPS = ("input_norm", "attention", "attn_sconv")  # the attention half of a decoder layer
ROUTED_OPS = ("routed_experts",)  # read as distinct experts; the rest of an MLP is read whatever the routing


def _doubling(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... up to and including high."""
    points, x = [], low
    while x < high:
        points.append(x)
        x *= 2
    return (*points, high)


def row_grid(spec: Spec, streams: int | None = None) -> tuple[int, ...]:
    """Every padded frame size the policy can produce with `streams` in one group (default: `max_streams`): the
    buckets, and multiples of the largest up to a full group: a decode row of every stream but one, which is
    prefilling (a stream in its prompt has no decode row)."""
    runtime = spec.runtime
    largest_frame = padded_size((streams or runtime.max_streams) - 1 + runtime.prefill_window, runtime.row_buckets)
    step = runtime.row_buckets[-1]
    return tuple(sorted(set(runtime.row_buckets) | set(range(step, largest_frame + 1, step))))


class _Roofline:
    def __init__(self, node: NodeSpec) -> None:
        if node.memory_bandwidth is None:
            raise CalibrationError(f"node {node.name}: no memory_bandwidth in the spec, which an analytic estimate "
                                   f"needs (or simulate with a measured calibration)")
        self.bandwidth, self.flops = node.memory_bandwidth, node.compute_flops

    def __call__(self, bytes_read: float, flops: float) -> float:
        return max(bytes_read / self.bandwidth, flops / self.flops if self.flops else 0.0)


# (rows, point on the second axis) -> (bytes read, FLOPs) of one layer of a kind
Cost = Callable[[int, int], tuple[float, float]]


def kind_costs(spec: Spec) -> dict[str, tuple[tuple[int, ...], Cost]]:
    """Each layer kind the model has: the grid of its second axis (() for none) and its bytes and FLOPs (attention's
    K/V read once: one stream's rows)."""
    cfg, runtime = spec.model.config, spec.runtime
    costs = layer_costs(spec.model, runtime)
    out: dict[str, tuple[tuple[int, ...], Cost]] = {}

    def ops_of(layer: int, attention_half: bool) -> list:
        return [op for kind, op in layer_ops(spec.model, layer).items() if (kind in ATTENTION_OPS) == attention_half]

    for attention in (LayerKind.SLIDING, LayerKind.GLOBAL):
        if (layer := next((c for c in costs if c.attention == attention), None)) is None:
            continue
        ops = ops_of(layer.layer, attention_half=True)
        weights, flops = sum(op.weight_bytes for op in ops), sum(op.flops_per_row for op in ops)
        attended = min(runtime.context_budget, cfg.sliding_window if attention == LayerKind.SLIDING else math.inf)
        out[attention] = (_doubling(1, attended),
                          lambda r, c, layer=layer, weights=weights, flops=flops: (
                              weights + c * layer.kv_bytes_per_position,
                              r * (flops + c * layer.attn_flops_per_position)))
    for mlp in (LayerKind.MOE, LayerKind.DENSE):
        if (layer := next((c for c in costs if c.mlp == mlp), None)) is None:
            continue
        ops = ops_of(layer.layer, attention_half=False)
        flops = sum(op.flops_per_row for op in ops)
        unrouted = sum(op.weight_bytes for op in ops if op.kind not in ROUTED_OPS)
        if mlp == LayerKind.DENSE:
            out[LayerKind.DENSE] = ((), lambda r, _, unrouted=unrouted, flops=flops: (unrouted, r * flops))
        else:
            out[LayerKind.MOE] = (_doubling(cfg.routed_experts[1], cfg.routed_experts[0]),
                                  lambda r, d, unrouted=unrouted, flops=flops, expert=layer.expert_bytes: (
                                      unrouted + d * expert, r * flops))
    embed, head = embedding_cost(spec.model), head_cost(spec.model)
    logits_bytes = cfg.output_vocab_size * ACTIVATION_BYTES
    out[LayerKind.EMBEDDING] = ((), lambda r, _: (r * embed.bytes_per_row, 0.0))
    out[LayerKind.HEAD] = ((), lambda r, _: (head.weight_bytes + r * logits_bytes, r * head.flops_per_row))
    if mtp_layers(cfg):
        mtp = mtp_cost(spec.model, runtime)
        out[LayerKind.MTP] = (_doubling(1, runtime.context_budget), lambda r, c: (
            mtp.bytes_per_row + r * embed.bytes_per_row + c * mtp.kv_bytes_per_position,
            r * (mtp.flops_per_row + c * mtp.attn_flops_per_position)))
    return out


def _table(rows: tuple[int, ...], points: tuple[int, ...], time: Callable[[int, int], float]) -> Table:
    return Table(rows, points, tuple(tuple(time(r, p) for p in points or (0,)) for r in rows))


def analytic_calibration(spec: Spec, open_loop: bool = False) -> Calibration:
    """Roofline tables for every node of the spec, and its links between consecutive nodes (the ring of stages).
    The tables reach the largest frame of the spec's workload: its most concurrent streams in one group (a grid for
    every slot of a huge `max_streams` would take longer to build than the simulation). Open-loop arrivals (the
    workload's, or any, with `open_loop`) may fill every slot."""
    workload = spec.workload
    streams = spec.runtime.max_streams if workload.rate or open_loop else \
        min(spec.runtime.max_streams, max(workload.concurrency))
    rows = row_grid(spec, streams)
    nodes = spec.cluster.nodes
    kinds = kind_costs(spec)
    per_node = {}
    for node in nodes:
        roofline = _Roofline(node)
        per_node[node.name] = NodeCalibration({kind: _table(rows, points, lambda r, p, cost=cost: roofline(*cost(r, p)))
                                               for kind, (points, cost) in kinds.items()})
    links = {(a, b): spec.cluster.link(a, b) for a, b in ring_pairs([node.name for node in nodes]) if a != b}
    meta = make_meta(spec, ANALYTIC, device="roofline of the spec's memory_bandwidth and compute_flops", openvino=None)
    return Calibration(meta, per_node, links)
