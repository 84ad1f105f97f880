"""The planner: which consecutive decoder layers each node holds.

The layers are cut into one contiguous stage per node, in the cluster's node order; the first stage also holds the
embedding, the last the final norm and head. A stage fits when its weights, the state of its `runtime.max_streams`
slots (convolution states), the K/V of one stream of `runtime.context_budget` positions (its sliding layers'
rings and its global layers' blocks), and the node's reserve fit in its `memory_bytes`. What is left becomes the
node's K/V pool (`PoolLayout`), shared by its streams: each takes blocks for its rings when it starts and a block of
`runtime.kv_block` positions of the global layers as it grows. Among the partitions
that fit, the planner takes the one whose slowest stage is fastest, and among those the one whose fullest node is
least full. Both are exact dynamic programs over (stage, last layer).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

from cascadia.errors import PlanError
from cascadia.graph.costs import PoolLayout, embedding_cost, head_cost, layer_costs, mtp_memory
from cascadia.graph.plan import EMBED, HEAD, LAYERS, Plan, Stage, ring_pairs, stage_state_words
from cascadia.spec.types import NodeSpec, Spec
from cascadia.units import binary_unit
from cascadia.wire_format import frame_bytes, tokens_bytes

NOMINAL_BANDWIDTH = 100e9  # bytes/s assumed on every node when some node gives no memory_bandwidth

# (node, layers, roles) -> seconds for one decode row through that stage; a calibration can supply its own.
StageTime = Callable[[NodeSpec, range, tuple[str, ...]], float]


class InfeasiblePlan(PlanError):
    """No partition fits in memory; the message names the node short of memory, by how much, and what would fit."""


def stage_roles(index: int, n_stages: int) -> tuple[str, ...]:
    return (EMBED,) * (index == 0) + (LAYERS,) + (HEAD,) * (index == n_stages - 1)


class RooflineStageTime:
    """Time of one decode row (one stream at the full context budget) through a stage, from the nodes' figures.

    Each layer, the embedding and the head take max(bytes read / memory_bandwidth, FLOPs / compute_flops): the bytes
    are the weights the row reads plus the K/V of its context, the FLOPs its matmuls plus attention over that
    context (no compute term on a node without compute_flops). Then the row is sent on: the FP32 residual to the next
    node, or from the last node the sampled token id back to the first (link latency + bytes / bandwidth, the bytes
    of the wire's own messages, `cascadia.wire_format`). When some node gives no memory_bandwidth, every node is
    taken to read at NOMINAL_BANDWIDTH and FLOPs are ignored: the times then only rank partitions by bytes read
    ("uniform").
    """

    def __init__(self, spec: Spec) -> None:
        self._spec = spec
        self._layers = layer_costs(spec.model, spec.runtime)
        self._ends = {EMBED: embedding_cost(spec.model), HEAD: head_cost(spec.model)}
        nodes = spec.cluster.nodes
        self._next = {node.name: target for node, target in ring_pairs(nodes)}  # every node holds a stage, in order
        self.uniform = any(node.memory_bandwidth is None for node in nodes)
        self.source = (f"uniform: bytes read at an assumed {NOMINAL_BANDWIDTH / 1e9:g} GB/s on every node, plus links"
                       if self.uniform else "spec figures: roofline of node memory_bandwidth and compute, "
                                            "plus links")
        self._prefix: dict[str, list[float]] = {}  # node name -> running sum of its per-layer times

    def _roofline(self, node: NodeSpec, bytes_read: float, flops: float) -> float:
        if self.uniform:
            return bytes_read / NOMINAL_BANDWIDTH
        compute = flops / node.compute_flops if node.compute_flops else 0.0
        return max(bytes_read / node.memory_bandwidth, compute)

    def _layer_prefix(self, node: NodeSpec) -> list[float]:
        if node.name not in self._prefix:
            context = self._spec.runtime.context_budget
            times = (self._roofline(node, c.bytes_per_row + c.kv_bytes_per_position * c.kv_positions(context),
                                    c.flops_per_row + c.attn_flops_per_position * c.kv_positions(context))
                     for c in self._layers)
            self._prefix[node.name] = [0.0, *itertools.accumulate(times)]
        return self._prefix[node.name]

    def send_time(self, node: NodeSpec, roles: tuple[str, ...]) -> float:
        target = self._next[node.name]
        if target.name == node.name:
            return 0.0
        link = self._spec.cluster.link(node.name, target.name)
        sent = tokens_bytes(1) if HEAD in roles else frame_bytes(1, self._spec.model.config.hidden_size)
        return link.latency + sent / link.bandwidth

    def __call__(self, node: NodeSpec, layers: range, roles: tuple[str, ...]) -> float:
        prefix = self._layer_prefix(node)
        ends = sum(self._roofline(node, end.bytes_per_row, end.flops_per_row)
                   for role, end in self._ends.items() if role in roles)
        return prefix[layers.stop] - prefix[layers.start] + ends + self.send_time(node, roles)


class _Memory:
    """Bytes a stage needs on its node: weights, state for the streams, reserve (running sums over layers, since
    the dynamic programs ask for every stage). State is every slot's convolution states plus the K/V pool's blocks
    for every slot's rings and one stream's global K/V at the context (`PoolLayout.least_blocks`)."""

    def __init__(self, spec: Spec, nodes: tuple[NodeSpec, ...]) -> None:
        self.spec = spec
        self.costs = layer_costs(spec.model, spec.runtime)
        self._weights = [0, *itertools.accumulate(c.held_bytes for c in self.costs)]
        self._slot = [0, *itertools.accumulate(c.conv_state_bytes for c in self.costs)]
        self._pool = [0, *itertools.accumulate(c.pool_bytes_per_position for c in self.costs)]
        self._sliding = [0, *itertools.accumulate(c.kv_window is not None for c in self.costs)]
        self._sliding_cost = next((c for c in self.costs if c.kv_window is not None), None)  # all alike
        self._ends = {EMBED: embedding_cost(spec.model).weight_bytes, HEAD: head_cost(spec.model).weight_bytes}
        # the MTP layer that drafts at the head's stage (nothing without mtp drafts), by whether the stage embeds
        self._mtp = {embed: mtp_memory(spec.model, spec.runtime, embed) for embed in (False, True)}
        self._all_weights = self._weights[-1] + sum(self._ends.values()) + self._mtp[True][0]
        self._pools: dict[tuple[int, int, int, int], int] = {}
        self._place(nodes)

    def _place(self, nodes: tuple[NodeSpec, ...]) -> None:
        self.nodes = nodes
        roles = [stage_roles(j, len(nodes)) for j in range(len(nodes))]
        self._end_weights = [sum(size for role, size in self._ends.items() if role in roles[j])
                             for j in range(len(nodes))]
        self._end_states = [0] * len(nodes)  # fixed state of a stage beside its layers'
        if nodes:
            mtp_weights, self._end_states[-1] = self._mtp[EMBED in roles[-1]]
            self._end_weights[-1] += mtp_weights

        self._reserves = [self.spec.cluster.reserve(node) for node in nodes]

    def with_nodes(self, nodes: tuple[NodeSpec, ...]) -> _Memory:
        """The same model and runtime on other nodes: the layers' sums and the pools' sizes shared, not worked out
        again (a search for the fewest nodes asks about many fleets)."""
        other = copy.copy(self)
        other._place(nodes)
        return other

    def all_weights(self) -> int:
        return self._all_weights

    def weights(self, stage: int, first: int, last: int) -> int:
        return self._weights[last + 1] - self._weights[first] + self._end_weights[stage]

    def slot_state(self, first: int, last: int) -> int:
        """Of one slot: its convolution states."""
        return self._slot[last + 1] - self._slot[first]

    def layout(self, first: int, last: int, context: int) -> PoolLayout | None:
        """The stage's K/V pool, for a context budget of `context` (None: no attention state)."""
        sliding = self._sliding_cost
        return PoolLayout.of(self._pool[last + 1] - self._pool[first], sliding.ring_bytes_per_entry if sliding else 0,
                             self._sliding[last + 1] - self._sliding[first],
                             sliding.kv_positions(context) if sliding else 0, self.spec.runtime.kv_block)

    def least_pool(self, first: int, last: int, streams: int, context: int) -> int:
        """Pool bytes for `streams` streams' rings, one of which reaches `context` positions (kept: the splits ask
        for each stage many times over)."""
        key = (first, last, streams, context)
        if key not in self._pools:
            layout = self.layout(first, last, context)
            self._pools[key] = layout.least_blocks(streams, context) * layout.block_bytes if layout else 0
        return self._pools[key]

    def state(self, first: int, last: int, streams: int, context: int) -> int:
        """Slots for `streams` streams, pool blocks for their rings and one of `context` positions."""
        return streams * self.slot_state(first, last) + self.least_pool(first, last, streams, context)

    def reserve(self, stage: int) -> int:
        return self._reserves[stage]

    def end_state(self, stage: int) -> int:
        """State a stage holds beside its layers' (the MTP layer's, at the head's)."""
        return self._end_states[stage]

    def need(self, stage: int, first: int, last: int, streams: int, context: int) -> int:
        return self.weights(stage, first, last) + self.state(first, last, streams, context) + \
            self._end_states[stage] + self._reserves[stage]

    def shortfall(self, streams: int, context: int) -> Callable[[int, int, int], float]:
        """Score of a stage for `min_max_split`: bytes it needs beyond its node's memory (<= 0 when it fits);
        math.inf for a stage whose length breaks its node's `layers` pin."""
        fixed = [ends + end_state + reserve - node.memory_bytes for ends, end_state, reserve, node
                 in zip(self._end_weights, self._end_states, self._reserves, self.nodes)]
        pins = [node.layers for node in self.nodes]

        def score(j: int, a: int, b: int) -> float:
            if pins[j] is not None and b - a + 1 != pins[j]:
                return math.inf
            return (self._weights[b + 1] - self._weights[a] + streams * (self._slot[b + 1] - self._slot[a])
                    + self.least_pool(a, b, streams, context) + fixed[j])
        return score

    def fits(self, streams: int, context: int) -> bool:
        return min_max_split(len(self.nodes), len(self.costs), self.shortfall(streams, context))[0] <= 0


def min_max_split(n_stages: int, n_layers: int, score: Callable[[int, int, int], float]) -> tuple[float, list[int]]:
    """Cut layers 0..n_layers-1 into n_stages contiguous non-empty stages so that the largest
    score(stage, first, last) is smallest. Returns that score and each stage's first layer; a score of math.inf
    forbids a stage, and the result is math.inf when every cut has a forbidden stage."""
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]  # best[j][end]: layers < end on j stages
    start = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = -math.inf
    for j in range(1, n_stages + 1):
        for end in range(j, n_layers - (n_stages - j) + 1):  # every later stage still needs a layer
            for first in range(j - 1, end):
                before = best[j - 1][first]
                if before >= best[j][end]:
                    continue  # cannot improve: the max only grows
                value = max(before, score(j - 1, first, end - 1))
                if value < best[j][end]:
                    best[j][end], start[j][end] = value, first
    firsts, end = [], n_layers
    for j in range(n_stages, 0, -1):
        end = start[j][end]
        firsts.append(end)
    return best[n_stages][n_layers], firsts[::-1]


def _gib(n: float) -> str:
    """Binary units with 2 decimals, GiB for the sizes that matter, smaller ones for toy models: "61.20 GiB",
    "3.50 KiB". Not units.format_bytes: its shortest exact text ("65.712999631 GB") or rounding to significant digits
    in whichever of decimal and binary units is shorter would not let a message's sizes be compared at a glance."""
    unit, size = binary_unit(n)
    return f"{n / size:.2f} {unit}" if size > 1 else f"{n:.0f} B"


def _largest_fitting(limit: int, fits: Callable[[int], bool]) -> int | None:
    """Largest n in 1..limit with fits(n), for a monotone `fits`; None if not even 1 fits."""
    if not fits(1):
        return None
    lo, hi = 1, limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _extra_nodes_needed(spec: Spec, memory: _Memory, like: NodeSpec) -> int | None:
    """Fewest copies of `like` that, appended to the fleet, make the plan fit; None if no number does."""
    streams, context, n_layers = spec.runtime.max_streams, spec.runtime.context_budget, len(memory.costs)
    room = like.memory_bytes - spec.cluster.reserve(like)
    if room <= 0 or any(c.held_bytes + memory.state(c.layer, c.layer, streams, context) > room for c in memory.costs):
        return None  # some layer does not fit even alone
    # start from what the weights alone demand, then check the cuts themselves: the state is no lower bound, as a
    # stage's K/V pool rounds its rings up to whole blocks of all its layers (fewer layers, smaller blocks)
    nodes = memory.nodes
    shortage = memory.all_weights() + sum(spec.cluster.reserve(n) for n in nodes) - sum(n.memory_bytes for n in nodes)
    for extra in range(max(1, math.ceil(shortage / room)), n_layers - len(nodes) + 1):
        if memory.with_nodes(nodes + (like,) * extra).fits(streams, context):
            return extra
    return None


def fewest_nodes(spec: Spec, like: NodeSpec, beside: tuple[NodeSpec, ...] = ()) -> int | None:
    """Fewest nodes like `like` that, after the nodes `beside`, hold the spec's model and runtime between them
    (their cluster's reserve kept free on each), or None if no number does: a layer that does not fit one alone."""
    return _extra_nodes_needed(spec, _Memory(spec, beside), like)


def _infeasible_message(spec: Spec, memory: _Memory, firsts: list[int]) -> str:
    nodes, runtime = spec.cluster.nodes, spec.runtime
    streams, context, n_layers = runtime.max_streams, runtime.context_budget, len(memory.costs)
    score = memory.shortfall(streams, context)
    stages = [(j, first, end - 1) for j, (first, end) in enumerate(zip(firsts, [*firsts[1:], n_layers]))]
    j, first, last = max(stages, key=lambda s: score(*s))
    node = nodes[j]
    weights, state = memory.weights(j, first, last), memory.state(first, last, streams, context)
    extras = "".join(f" + {role}" for role in stage_roles(j, len(nodes)) if role != LAYERS)
    message = (f"node {node.name} is short of memory by {_gib(score(j, first, last))}: in the split that fits best, "
               f"layers {first}-{last}{extras} need {_gib(memory.need(j, first, last, streams, context))} (weights "
               f"{_gib(weights)}, state {_gib(state)}: {_state_words(streams, context)}, reserve "
               f"{_gib(memory.reserve(j))}) but it has {_gib(node.memory_bytes)}.")
    options = []
    if streams > 1 and (s := _largest_fitting(streams - 1, lambda s: memory.fits(s, context))):
        options.append(f"max_streams {s}")
    if context > 1 and (c := _largest_fitting(context - 1, lambda c: memory.fits(streams, c))):
        options.append(f"context_budget {c}")
    largest = max(nodes, key=lambda n: n.memory_bytes)
    if extra := _extra_nodes_needed(spec, memory, largest):
        options.append(f"{extra} more nodes like {largest.name} ({_gib(largest.memory_bytes)} each, "
                       f"{len(nodes) + extra} in all)")
    if not options:
        return message + " Neither fewer streams, a smaller context budget nor more such nodes would make it fit."
    return message + " It would fit with " + ", or ".join(options) + "."


def _state_words(streams: int, context: int) -> str:
    return f"{streams} streams' slots and rings, and one stream's K/V at {context} positions"


def _check_pins(nodes: tuple[NodeSpec, ...], n_layers: int) -> None:
    """Layer pins that no split can honour: together they must leave every unpinned node at least one layer."""
    pinned = {node.name: node.layers for node in nodes if node.layers is not None}
    if not pinned:
        return
    free_nodes, pinned_layers = len(nodes) - len(pinned), sum(pinned.values())
    if pinned_layers + free_nodes > n_layers or (free_nodes == 0 and pinned_layers != n_layers):
        pins = ", ".join(f"{name} {count}" for name, count in pinned.items())
        raise InfeasiblePlan(f"the nodes' `layers` pins ({pins}: {pinned_layers} layers) cannot split the model's "
                             f"{n_layers} layers with {free_nodes} unpinned node(s) taking at least one each")


def plan(spec: Spec, stage_time: StageTime | None = None, cost_source: str = "custom") -> Plan:
    """The fastest partition that fits (then the least full); `stage_time` defaults to `RooflineStageTime`."""
    nodes, runtime = spec.cluster.nodes, spec.runtime
    n_layers, n_nodes = spec.model.config.num_hidden_layers, len(spec.cluster.nodes)
    if not nodes:
        raise InfeasiblePlan("the cluster names no nodes: its fleet forms itself when served (cluster.discover; "
                             "`cascadia serve SPEC` finds the nodes that announce themselves and plans over them)")
    if n_nodes > n_layers:
        raise InfeasiblePlan(f"{n_nodes} nodes but only {n_layers} layers: every node must hold at least one "
                             f"layer, so use at most {n_layers} nodes")
    _check_pins(nodes, n_layers)
    streams, context = runtime.max_streams, runtime.context_budget
    memory = _Memory(spec, nodes)
    short = memory.shortfall(streams, context)
    worst, firsts = min_max_split(n_nodes, n_layers, short)
    if worst > 0:
        raise InfeasiblePlan(_infeasible_message(spec, memory, firsts))
    if stage_time is None:
        stage_time = RooflineStageTime(spec)
        cost_source = stage_time.source

    times: dict[tuple[int, int, int], float] = {}

    def time_of(j: int, first: int, last: int) -> float:
        if (j, first, last) not in times:
            times[j, first, last] = stage_time(nodes[j], range(first, last + 1), stage_roles(j, n_nodes))
        return times[j, first, last]

    bottleneck, _ = min_max_split(n_nodes, n_layers,
                                  lambda j, a, b: time_of(j, a, b) if short(j, a, b) <= 0 else math.inf)
    _, firsts = min_max_split(n_nodes, n_layers, lambda j, a, b: (
        memory.need(j, a, b, streams, context) / nodes[j].memory_bytes
        if short(j, a, b) <= 0 and time_of(j, a, b) <= bottleneck else math.inf))

    stages = []
    for j, (first, end) in enumerate(zip(firsts, [*firsts[1:], n_layers])):
        last, node = end - 1, nodes[j]
        # every slot's convolution states, and the state beside the layers'
        weights, slots = memory.weights(j, first, last), streams * memory.slot_state(first, last) + memory.end_state(j)
        room_for_pool = node.memory_bytes - weights - memory.reserve(j) - slots
        layout = memory.layout(first, last, context)
        blocks = room_for_pool // layout.block_bytes if layout else None  # None: no attention layer, no pool
        state = slots + (blocks * layout.block_bytes if layout else 0)
        each = None if layout is None or not layout.paged else \
            max(0, blocks // streams - layout.ring_blocks) * runtime.kv_block
        stages.append(Stage(node=node.name, first_layer=first, last_layer=last, roles=stage_roles(j, n_nodes),
                            weight_bytes=weights, state_bytes=state, free_bytes=room_for_pool + slots - state,
                            kv_blocks=blocks, kv_block=runtime.kv_block,
                            ring_blocks=layout.ring_blocks if layout else 0, paged=bool(layout and layout.paged),
                            max_positions_per_stream=each,
                            est_time_s=time_of(j, first, last)))
    ends = embedding_cost(spec.model).params + head_cost(spec.model).params
    return Plan(stages=tuple(stages), total_params=sum(c.params for c in memory.costs) + ends,
                active_params=sum(c.active_params for c in memory.costs) + ends,
                bottleneck_s=max(s.est_time_s for s in stages), cost_source=cost_source)


def load_plan(path: str | Path, spec: Spec) -> Plan:
    """A plan saved by `cascadia plan -o`, checked against the spec it is to run: every layer of its model once, in
    order; the embedding on the first stage and the head on the last; each stage on its own node of the cluster, with
    the memory the planner asks for it. A ValueError names the file and the stage at fault."""
    return checked_plan(Plan.load(path), spec, str(path))


def plan_from_dict(d: object, spec: Spec, where: str) -> Plan:
    """The plan `Plan.to_dict` wrote (one sent to a node), checked as `load_plan` checks a file; errors name
    `where`."""
    return checked_plan(Plan.from_dict(d, where), spec, where)


def checked_plan(plan: Plan, spec: Spec, where: str) -> Plan:
    """`plan`, once checked against `spec` (see `load_plan`)."""
    _check_layers(plan.stages, spec.model.config.num_hidden_layers, where)
    _check_roles(plan.stages, where)
    _check_nodes(plan.stages, spec, where)
    _check_memory(plan.stages, spec, where)
    return plan


# ---- a plan against its spec: what a run relies on -----------------------------------------------------------------

def _check_layers(stages: tuple[Stage, ...], n_layers: int, where: str) -> None:
    """Layers 0..n_layers-1, each on one stage, the stages in order."""
    start = 0  # the layer the next stage must start at
    for i, stage in enumerate(stages):
        at = f"{where}: stages[{i}].layers"
        if stage.first_layer != start:
            raise PlanError(f"{at}: the first stage must start at layer 0, not {stage.first_layer}" if i == 0 else
                             f"{at}: starts at layer {stage.first_layer}, but stages[{i - 1}] ends at layer "
                             f"{start - 1}: each stage must start right after the one before")
        if stage.last_layer < stage.first_layer:
            raise PlanError(f"{at}: ends at layer {stage.last_layer}, before it starts")
        if stage.last_layer >= n_layers:
            raise PlanError(f"{at}: ends at layer {stage.last_layer}, but the model's last layer is {n_layers - 1}")
        start = stage.last_layer + 1
    if start != n_layers:
        raise PlanError(f"{where}: the last stage ends at layer {start - 1}, but the model's last layer is "
                         f"{n_layers - 1}: layers {start}-{n_layers - 1} are on no stage")


def _check_roles(stages: tuple[Stage, ...], where: str) -> None:
    for i, stage in enumerate(stages):
        if stage.roles != (expected := stage_roles(i, len(stages))):
            raise PlanError(f"{where}: stages[{i}].roles must be {json.dumps(expected)}, not "
                             f"{json.dumps(stage.roles)} (the first stage holds the embedding, the last the head)")


def _check_nodes(stages: tuple[Stage, ...], spec: Spec, where: str) -> None:
    names = [node.name for node in spec.cluster.members]  # a spare may take a stage
    holder: dict[str, int] = {}  # node -> its stage
    for i, stage in enumerate(stages):
        if stage.node not in names:
            raise PlanError(f"{where}: stages[{i}].node: {stage.node!r} is not a node of the spec's cluster "
                             f"({', '.join(names)})")
        if stage.node in holder:
            raise PlanError(f"{where}: stages[{i}].node: {stage.node!r} already holds stages[{holder[stage.node]}]; "
                             "a node holds one stage")
        holder[stage.node] = i


def _check_memory(stages: tuple[Stage, ...], spec: Spec, where: str) -> None:
    """Each stage's weights, the spec's slots, the stage's K/V pool and its node's reserve, counted as the planner
    counts them, fit in the node's memory; the pool holds a stream at the context budget, in the spec's blocks."""
    by_name = {node.name: node for node in spec.cluster.members}
    nodes = tuple(by_name[stage.node] for stage in stages)
    runtime = spec.runtime
    memory, streams, context = _Memory(spec, nodes), runtime.max_streams, runtime.context_budget
    again = "plan again for this spec (`cascadia plan SPEC -o FILE`)"
    for i, (stage, node) in enumerate(zip(stages, nodes)):
        first, last = stage.first_layer, stage.last_layer
        layout = memory.layout(first, last, context)
        expected = None if layout is None else (layout.ring_blocks, layout.paged)
        if (None if stage.kv_blocks is None else (stage.ring_blocks, stage.paged)) != expected \
                or (layout and (stage.kv_block != runtime.kv_block
                                or stage.kv_blocks < layout.least_blocks(streams, context))):
            pool = ("no K/V pool" if stage.kv_blocks is None else
                    f"a K/V pool of {stage.kv_blocks} blocks of {stage.kv_block} positions ({stage.ring_blocks} a "
                    f"stream's rings)")
            wanted = ("no K/V pool" if layout is None else
                      f"blocks of {runtime.kv_block} positions ({layout.ring_blocks} a stream's rings), at least "
                      f"{layout.least_blocks(streams, context)} ({streams} streams' rings, one stream at {context} "
                      "positions)")
            raise PlanError(f"{where}: stages[{i}] has {pool}, where the spec needs {wanted}: {again}")
        state = streams * memory.slot_state(first, last) + (stage.kv_blocks * layout.block_bytes if layout else 0)
        need = memory.weights(i, first, last) + state + memory.reserve(i)
        if need > node.memory_bytes:
            raise PlanError(
                f"{where}: stages[{i}] needs {_gib(need)} on node {node.name} (weights "
                f"{_gib(memory.weights(i, first, last))}, state {_gib(state)}: "
                f"{stage_state_words(streams, stage)}, reserve {_gib(memory.reserve(i))}) but it has "
                f"{_gib(node.memory_bytes)}: {again}")
