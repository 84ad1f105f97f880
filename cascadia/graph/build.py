"""The dataflow graph of a model: one node per op with its costs, edges carrying the tensors between ops.

Nodes: "embedding"; per layer "L{i}.{kind}" for the kinds in `costs.LAYER_KINDS` that the layer has; "final_norm",
"head", "sampler". Small ops are folded into their neighbours, as the family says (its `layer_flows`: Inkling's
attention node holds the q/k/v/r/o projections, the k/v short convolutions, the q/k norms and the relative-position
bias). Activations between ops travel in FP32. The sampled token's way back to the embedding is left out, so the
graph is acyclic.
"""

from __future__ import annotations

import json
import math

import attrs
import networkx as nx

from cascadia.graph import costs
from cascadia.graph.costs import ACTIVATION_BYTES, EMBEDDING, FINAL_NORM, HEAD, SAMPLER, OpCost
from cascadia.models import family
from cascadia.spec.types import ModelSpec, RuntimeSpec

FORMATS = ("json", "dot")


def _add_op(g: nx.DiGraph, node: str, op: OpCost, layer: int | None, state_per_position: int = 0,
            state_per_stream: int = 0, kv_window: int | None = None) -> None:
    g.add_node(node, kind=op.kind, layer=layer, params=op.params, active_params=op.active_params,
               weight_bytes=op.weight_bytes, bytes_per_row=op.bytes_per_row, flops_per_row=op.flops_per_row,
               state_bytes_per_position=state_per_position, state_bytes_per_stream=state_per_stream,
               kv_window=kv_window)


def build_graph(model: ModelSpec, runtime: RuntimeSpec) -> nx.DiGraph:
    cfg = model.config
    g = nx.DiGraph(name=model.name)
    hidden = cfg.hidden_size * ACTIVATION_BYTES

    def flow(src: str, dst: str, tensor: str, bytes_per_row: int = hidden) -> None:
        g.add_edge(src, dst, tensor=tensor, bytes_per_row=bytes_per_row)

    ends = costs.end_ops(model)
    _add_op(g, EMBEDDING, ends[EMBEDDING], layer=None)
    residual = EMBEDDING
    for layer in range(cfg.num_hidden_layers):
        convs = costs.conv_state_bytes(model, layer, runtime.kv_precision, runtime.max_draft)
        for kind, op in costs.layer_ops(model, layer).items():
            is_attention = kind == "attention"
            _add_op(g, f"L{layer}.{kind}", op, layer,
                    state_per_position=costs.kv_bytes_per_position(model, layer, runtime.kv_precision)
                    if is_attention else 0,
                    state_per_stream=convs.get(kind, 0),
                    kv_window=cfg.kv_entries(layer, math.inf, runtime.largest_bucket)
                    if is_attention and cfg.is_sliding(layer) else None)

        def n(kind: str) -> str:
            return residual if kind == "in" else f"L{layer}.{kind}"

        flows, output = family(cfg).layer_flows(cfg, layer)
        for src, dst, tensor, size in flows:
            flow(n(src), n(dst), tensor, hidden if size is None else size)
        residual = n(output)

    _add_op(g, FINAL_NORM, ends[FINAL_NORM], layer=None)
    _add_op(g, HEAD, ends[HEAD], layer=None)
    _add_op(g, SAMPLER, OpCost(SAMPLER, 0, 0, 0, 0, 0.0), layer=None)
    flow(residual, FINAL_NORM, "residual")
    flow(FINAL_NORM, HEAD, "hidden")
    flow(HEAD, SAMPLER, "logits", cfg.output_vocab_size * ACTIVATION_BYTES)
    return g


@attrs.frozen
class GraphTotals:
    params: int
    active_params: int
    weight_bytes: int
    bytes_per_row: int  # weight bytes one decode row reads through the whole model
    params_by_kind: dict[str, int]
    weight_bytes_by_kind: dict[str, int]
    bytes_per_row_by_kind: dict[str, int]


def graph_totals(g: nx.DiGraph) -> GraphTotals:
    by_kind: dict[str, dict[str, int]] = {"params": {}, "weight_bytes": {}, "bytes_per_row": {}}
    for _, attrs_ in g.nodes(data=True):
        for field, totals in by_kind.items():
            totals[attrs_["kind"]] = totals.get(attrs_["kind"], 0) + attrs_[field]
    return GraphTotals(
        params=sum(by_kind["params"].values()),
        active_params=sum(a["active_params"] for _, a in g.nodes(data=True)),
        weight_bytes=sum(by_kind["weight_bytes"].values()),
        bytes_per_row=sum(by_kind["bytes_per_row"].values()),
        params_by_kind=by_kind["params"],
        weight_bytes_by_kind=by_kind["weight_bytes"],
        bytes_per_row_by_kind=by_kind["bytes_per_row"],
    )


_PREFIXES = ("", "k", "M", "G", "T")


def _size(n: float, unit: str) -> str:
    """3 significant digits with a decimal prefix: "24.6 kB", "132 M params", "64 params"."""
    step = 0
    while abs(n) >= 1000 and step < len(_PREFIXES) - 1:
        n, step = n / 1000, step + 1
    return " ".join(part for part in (f"{n:.3g}", _PREFIXES[step] + unit) if part)


def to_dot(g: nx.DiGraph) -> str:
    """Graphviz text: each node labelled with its parameters and stored bytes, each edge with its tensor."""
    q = json.dumps  # a JSON string is a valid DOT string, and its "\\n" is a line break in a label
    lines = [f"digraph {q(g.graph.get('name', 'model'))} {{", "  node [shape=box, fontname=monospace];"]
    for node, a in g.nodes(data=True):
        label = f"{node}\n{_size(a['params'], '')} params, {_size(a['weight_bytes'], 'B')}"
        lines.append(f"  {q(node)} [label={q(label)}];")
    for src, dst, a in g.edges(data=True):
        lines.append(f"  {q(src)} -> {q(dst)} [label={q(a['tensor'] + ' ' + _size(a['bytes_per_row'], 'B'))}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(g: nx.DiGraph, format: str) -> str:
    """The graph as node-link JSON (networkx) or Graphviz DOT text."""
    if format == "json":
        return json.dumps(nx.node_link_data(g, edges="edges"), indent=1) + "\n"
    if format == "dot":
        return to_dot(g)
    raise ValueError(f"unknown graph format {format!r}; choose one of {', '.join(FORMATS)}")

