"""SimPy model of the pipeline: the shared policy's frames through the plan's stages, links and hosts.

Scenario: clients send requests to the policy (closed loop). Every group without a frame in flight gets its next
frame, which enters stage 0. Each stage computes the frame on its node (one frame at a time, first come first
served), then sends it on: the FP32 residual of its real rows to the next stage, or, from the last stage, the sampled
token ids straight back to stage 0, where the policy completes the frame. Nodes naming the same host share it as an
operating system shares its cores among busy processes: k of them computing at once each progress at S_k / k
seconds of work per second, S being the host's measured speedup (the calibration's `hosts`; one core by default,
S_k = 1). A link is a capacity-1 resource held for bytes / bandwidth, then the message travels for the link's latency
(so messages queue behind each other but overlap their latencies).

The coordinator's own work on each frame (where the calibration measured it apart from the nodes') adds to the
time of the stages whose CPUs it shares (`coordinator_shares`), in equal parts: a core that computes a stage and also
feeds the pipeline serves both in turn. Where it has a CPU of its own, it takes a hop of its own before the first
stage.

A stage's time for a frame is its node's overheads (per frame, per real row, per stream) plus its layers' calibrated
times at the frame's padded rows: attention at the mean attended positions of the frame's rows (each row attends its
position + 1, at most a sliding layer's window; a table row holds one stream's rows, which read its keys once, so
each further stream of the frame adds its own keys at the per-position slope of the table's fewest rows), MoE at the
expected distinct experts touched by the real rows; the head at the sampled rows padded to a bucket, as the last
stage computes it (none for the middle of a prompt). The
simulator computes no tokens: every sampled token is PLACEHOLDER_TOKEN and requests run to max_new_tokens. It is
deterministic: simultaneous events keep SimPy's scheduling order, which depends on nothing random.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from operator import itemgetter

import attrs
import simpy

from cascadia.driver import PhaseDriver
from cascadia.errors import PlanError
from cascadia.graph.plan import EMBED, HEAD, Plan, Stage
from cascadia.metrics import Recorder
from cascadia.models.base import LayerKind, ModelConfig
from cascadia.policy import Frame, Policy, Row, padded_size
from cascadia.sim.calibration import (KIND_AXES, Calibration, CalibrationError, Extrapolations, NodeCalibration,
                                      interpolate)
from cascadia.sim.loss import Loss, Recovery
from cascadia.sim.replay import ReplayTimes
from cascadia.spec.types import LinkSpec, RuntimeSpec, Spec
from cascadia.speculation import MTP
from cascadia.trace import FrameTiming, StageTiming
from cascadia.wire_format import frame_bytes, tokens_bytes
from cascadia.workload import Arrivals

PLACEHOLDER_TOKEN = 0


@attrs.frozen
class FrameShape:
    """What a frame's cost depends on."""

    padded_rows: int
    rows: int
    sliding_context: float  # mean attended positions of its rows on a sliding layer
    global_context: float  # ... on a global layer
    streams: int  # distinct streams among its rows: decode rows are one each, a prompt window's rows share one
    sampled: int  # rows the last stage samples a token from (their tokens go back)
    proposes: bool = False  # the last stage proposes drafts after them (`cascadia.policy.Frame.propose`)

    @classmethod
    def of(cls, frame: Frame, window: int) -> FrameShape:
        return cls(*cls.figures(frame, window))

    @staticmethod
    def figures(frame: Frame, window: int) -> tuple[int, int, float, float, int, int, bool]:
        """The shape's fields as a plain tuple: a cheap key for the costs of frames already seen."""
        rows = frame.rows
        positions = list(map(_position, rows))  # map and itemgetter: no Python call per frame, unlike a comprehension
        n = len(positions)
        total = sum(positions) + n  # a row attends its position + 1
        sliding = total if max(positions) < window else sum(min(p + 1, window) for p in positions)
        return (frame.padded_rows, n, sliding / n, total / n, len(set(map(_request_id, rows))), len(frame.sampled_ids),
                frame.propose)


# a row's fields by index (rows are named tuples): quicker than by name
_position, _request_id = (itemgetter(Row._fields.index(field)) for field in ("position", "request_id"))


@attrs.frozen
class FrameCosts:
    """What a frame of one shape takes on each stage and hop (`PipelineModel`'s hops: compute and wire times)."""

    stage_s: tuple[float, ...]
    hop_s: tuple[float, ...]


def message_sizes(shape: FrameShape, hidden: int, stages: int) -> list[int]:
    """The bytes each stage sends on for a frame: its residual rows to the next stage; from the last, the sampled
    tokens back to the first (the wire's own sizes, `cascadia.wire_format`)."""
    return [frame_bytes(shape.rows, hidden)] * (stages - 1) + [tokens_bytes(shape.sampled)]


def stage_kinds(stage: Stage, config: ModelConfig, runtime: RuntimeSpec | None = None) -> Counter[str]:
    """How many layers of each kind a stage computes per frame (embedding and head count as one each; the MTP
    layer too, at the head's stage where `runtime` drafts with it)."""
    kinds = Counter(config.attention_kind(i) for i in stage.layers)
    kinds.update(config.mlp_kind(i) for i in stage.layers)
    kinds.update(kind for role, kind in ((EMBED, LayerKind.EMBEDDING), (HEAD, LayerKind.HEAD)) if role in stage.roles)
    if runtime is not None and HEAD in stage.roles and MTP in runtime.drafters:
        kinds[LayerKind.MTP] = 1
    return kinds


class StageCost:
    """Seconds a frame spends on a stage; lookups are cached per padded size (and real rows, for MoE).

    One StageCost serves every stage with the same layer kinds on equally calibrated nodes (`nodes` names them, for
    notes: "node A" or "nodes A, B").
    """

    def __init__(self, nodes: str, kinds: Counter[str], node: NodeCalibration, config: ModelConfig,
                 calibration: Calibration, extrapolations: Extrapolations, buckets: tuple[int, ...],
                 max_draft: int = 0) -> None:
        """`max_draft`: the drafts a stream's MTP chain makes, where `kinds` has the MTP layer."""
        self._nodes, self._node, self._calibration, self._log = nodes, node, calibration, extrapolations
        self._experts, self._top_k = config.routed_experts
        self._kinds = kinds
        self._buckets = buckets
        self._chain = max_draft if LayerKind.MTP in kinds else 0
        self._fixed: dict[tuple[int, int], float] = {}
        self._head: dict[int, float] = {}  # by sampled rows
        self._attention: dict[int, list[tuple[int, str, tuple[float, ...], tuple[float, ...], float]]] = {}

    def _lookup(self, kind: str, rows: int, x: float | None = None) -> float:
        value, outside = self._node.tables[kind].lookup(rows, x)
        if outside:
            axis = f", {KIND_AXES[kind]} {x:g}" if KIND_AXES[kind] else ""
            self._log.note(self._nodes, kind, f"rows {rows}{axis}")
        return value

    def handling(self, rows: int) -> float:
        """The part of the stage's time that handles a frame's messages: per frame and per real row."""
        return self._node.frame_s + self._node.row_s * rows

    def _fixed_time(self, padded: int, rows: int) -> float:
        """Everything but attention and the head: MLPs, embedding, overheads."""
        total = self.handling(rows)
        for kind, count in self._kinds.items():
            if kind == LayerKind.MOE:
                experts, outside = self._calibration.distinct_experts(rows, self._top_k, self._experts)
                if outside:
                    self._log.note(self._nodes, "routing", f"rows {rows}")
                total += count * self._lookup(LayerKind.MOE, padded, experts)
            elif KIND_AXES[kind] is None and kind != LayerKind.HEAD:
                total += count * self._lookup(kind, padded)
        return total

    def _head_time(self, sampled: int) -> float:
        if not sampled or LayerKind.HEAD not in self._kinds:
            return 0.0
        return self._lookup(LayerKind.HEAD, padded_size(sampled, self._buckets))

    def _attention_columns(self, padded: int) -> list[tuple[int, str, tuple[float, ...], tuple[float, ...], float]]:
        """Per attention kind: its layers, its context points, its times there at `padded` rows, and one stream's
        seconds per attended position (the slope of the table's fewest rows along the context: a fit over every
        point, so that one noisy point does not make it)."""
        columns = []
        for kind in (LayerKind.SLIDING, LayerKind.GLOBAL):
            if count := self._kinds.get(kind):
                table = self._node.tables[kind]
                column, outside = table.column(padded)
                if outside:
                    self._log.note(self._nodes, kind, f"rows {padded}")
                columns.append((count, kind, table.points, column, _slope(table.points, table.time_s[0])))
        return columns

    def __call__(self, shape: FrameShape) -> float:
        key = (shape.padded_rows, shape.rows)
        if key not in self._fixed:
            self._fixed[key] = self._fixed_time(*key)
        if shape.padded_rows not in self._attention:
            self._attention[shape.padded_rows] = self._attention_columns(shape.padded_rows)
        if shape.sampled not in self._head:
            self._head[shape.sampled] = self._head_time(shape.sampled)
        total = self._fixed[key] + self._head[shape.sampled] + self._node.stream_s * shape.streams
        others = shape.streams - 1  # a table row is one stream's rows; each other stream reads its own keys too
        for count, kind, points, column, per_position in self._attention[shape.padded_rows]:
            context = shape.sliding_context if kind == LayerKind.SLIDING else shape.global_context
            value, outside = interpolate(points, column, context)
            if outside:
                self._log.note(self._nodes, kind, f"context {context:g}")
            total += count * (value + others * per_position * context)
        return total + (self._drafting(shape) if self._chain else 0.0)

    def _drafting(self, shape: FrameShape) -> float:
        """The MTP layer at the head's stage (`cascadia.engine.mtp`). In a frame that proposes drafts: every row
        through it; then, for the streams that draft (each of the frame's, at most), the rest of their chain
        through it and the head for each draft. Otherwise the layer holds the rows to run them later in calls of
        the largest bucket: their share of such a call. Every call reads the frame's mean global context (the rows
        a proposing frame runs that an earlier one held are not counted: they pile up only while no frame
        proposes)."""
        context = shape.global_context
        if not shape.proposes:
            most = self._buckets[-1]
            return shape.rows / most * self._lookup(LayerKind.MTP, most, context)
        streams = padded_size(shape.streams, self._buckets)
        return (self._lookup(LayerKind.MTP, shape.padded_rows, context)
                + (self._chain - 1) * self._lookup(LayerKind.MTP, streams, context)
                + self._chain * self._lookup(LayerKind.HEAD, streams))


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys over xs, at least zero (a table too noisy to rise gives none)."""
    if len(xs) < 2:
        return 0.0
    return max(0.0, statistics.linear_regression(xs, ys).slope)


def coordinator_shares(spec: Spec, plan: Plan) -> dict[int, float]:
    """The share of the coordinator's work each stage's host takes, by stage; empty: it has a CPU of its own. Pinned
    (`cluster.coordinator_cpus`), it shares the CPUs of the local nodes pinned to those it may run on, unless one of
    them is no such node's. Unpinned, the operating system moves it among the cores of its machine, which the local
    nodes use: it shares their stages' hosts."""
    nodes = {node.name: node for node in spec.cluster.nodes}
    local = {i: nodes[stage.node] for i, stage in enumerate(plan.stages) if nodes[stage.node].is_local}
    if (cpus := spec.cluster.coordinator_cpus) is None:
        sharing = list(local)
    else:
        held = {i: set(node.cpus) for i, node in local.items() if node.cpus}
        if set(cpus) - set().union(*held.values()):
            return {}
        sharing = [i for i, node_cpus in held.items() if node_cpus & set(cpus)]
    return {i: 1 / len(sharing) for i in sharing}


def stage_hosts(spec: Spec, plan: Plan) -> list[str]:
    """The host of each stage's node."""
    nodes = {node.name: node for node in spec.cluster.nodes}
    return [nodes[s.node].host_key for s in plan.stages]


def shared_hosts(spec: Spec, plan: Plan) -> dict[str, int]:
    """The hosts that several of the plan's stages share, by name, and how many stages each."""
    return {host: n for host, n in sorted(Counter(stage_hosts(spec, plan)).items()) if n > 1}


class SharedHost:
    """A host shared by several nodes (processor sharing): with k nodes computing, each progresses at
    speedup[k - 1] / k seconds of work per second (the last speedup beyond the list)."""

    def __init__(self, env: simpy.Environment, speedup: Sequence[float]) -> None:
        self.env, self.speedup = env, tuple(speedup)
        self._left: dict[simpy.Event, float] = {}  # seconds of work left at full speed, by the job's done event
        self._since = 0.0  # when `_left` was last brought up to date
        self._timer = 0  # the number of the current completion timer; earlier ones are stale

    def compute(self, seconds: float) -> simpy.Event:
        """An event that fires when `seconds` of work started now are done."""
        self._catch_up()
        done = self.env.event()
        self._left[done] = seconds
        self._arm()
        return done

    def _speed(self) -> float:
        busy = len(self._left)
        return self.speedup[min(busy, len(self.speedup)) - 1] / busy

    def _catch_up(self) -> None:
        if self._left:
            worked = (self.env.now - self._since) * self._speed()
            self._left = {job: left - worked for job, left in self._left.items()}
        self._since = self.env.now

    def _arm(self) -> None:
        """Set a timer for the next job to finish at the present speed."""
        self._timer += 1
        if self._left:
            timer = self.env.timeout(max(0.0, min(self._left.values())) / self._speed())
            timer.callbacks.append(lambda _, number=self._timer: self._on_timer(number))

    def _on_timer(self, number: int) -> None:
        if number != self._timer:
            return
        self._catch_up()
        first = min(self._left.values())
        for job in [job for job, left in self._left.items() if left <= first + _TIME_EPS]:
            del self._left[job]
            job.succeed()
        self._arm()


_TIME_EPS = 1e-12  # seconds: jobs this close to the first one finish with it (rounding of the work left)


@attrs.frozen
class Leg:
    """A stretch of the ring a frame passes at one go: exclusive hops, then (but for the last leg) a shared host's.

    Frames never overtake one another on exclusive hosts and wires (FIFO, fixed latencies), so these serve frames
    in the order they enter the leg, and the frame can reserve them all at once. A shared host's speed depends on
    what else computes there meanwhile, so the frame goes there when it arrives, waits for its node's turn and
    computes as fast as the host then allows.
    """

    hops: range  # its exclusive hops, in order
    charged: tuple[tuple[int, int], ...]  # (node index, stage) of the stages whose busy time counts when a frame enters
    shared: int | None  # the hop on a shared host it ends with; None: the last leg, back to stage 0


class PipelineModel:
    """The plan's stages on their hosts, joined by links in a ring; carries frames and runs workload phases.

    A frame's round trip is a list of hops: each stage's compute, then its link's wire (none from a node to itself).
    An exclusive hop (a host of its own, a wire) is a capacity-1 FIFO server kept as the time it next falls free:
    exactly simpy.Resource's service when each holder's duration is known when it asks, as here, without its seven
    events per hop. A wire's message then travels for the link's latency. A frame's costs are worked out once per
    frame shape.
    """

    def __init__(self, spec: Spec, plan: Plan, calibration: Calibration, replay: ReplayTimes | None = None) -> None:
        """`replay`: each frame's compute from a run's trace where it has one of the frame's shape
        (`cascadia.sim.replay`); a stage's handling of the frame's messages is the calibration's (which `simulate`
        fits to the trace's frames alone, `cascadia.sim.fit.replayed_handling`)."""
        self.env = simpy.Environment()
        self.extrapolations = Extrapolations()
        config = spec.model.config
        self._window, self._hidden = config.sliding_window or math.inf, config.hidden_size
        nodes = {node.name: node for node in spec.cluster.nodes}
        unknown = [s.node for s in plan.stages if s.node not in nodes]
        if unknown:
            raise PlanError(f"the plan places stages on {', '.join(unknown)}, which the spec's cluster does not have")
        missing = [s.node for s in plan.stages if s.node not in calibration.nodes]
        if missing:
            raise CalibrationError(f"{calibration.source or 'calibration'}: nodes: no entry for "
                                   f"{', '.join(missing)} (has {', '.join(calibration.nodes)})")
        self._names = [s.node for s in plan.stages]
        if replay is not None:
            replay.check_nodes(self._names)
        self._nodes = list(dict.fromkeys(self._names))  # the stages' nodes, each once
        self.costs, self._cost_index = self._stage_costs(plan, calibration, config, spec.runtime)
        self._replay = replay
        host_names = stage_hosts(spec, plan)
        # a replayed compute time was measured as the host was shared then: it is not shared out again
        shared = {} if replay else {name: SharedHost(self.env, calibration.hosts.get(name, (1.0,)))
                                    for name in shared_hosts(spec, plan)}
        self.notes: list[str] = []
        self._links = [self._link(calibration, spec, a, b) for a, b in plan.hops()]
        self._stage_hops: list[int] = []  # each stage's compute hop
        self._wire_hops: list[int | None] = []  # each stage's link's wire hop (None: no link)
        self._latency: list[float] = []  # by hop: what a message travels after the wire (0 for a compute)
        self._coordinator = calibration.coordinator  # None: the stages' handling holds its work
        shares = {} if self._coordinator is None else coordinator_shares(spec, plan)
        own_hop = self._coordinator is not None and not shares  # a CPU of its own: a hop before the first stage
        if own_hop:
            self._latency.append(0.0)
        # a stage on a shared host: the host's speed and its node's turn, by hop
        self._sharing: dict[int, tuple[SharedHost, simpy.Resource]] = {}
        for host, link in zip(host_names, self._links):
            self._stage_hops.append(len(self._latency))
            if host in shared:
                self._sharing[len(self._latency)] = (shared[host], simpy.Resource(self.env))
            self._latency.append(0.0)
            self._wire_hops.append(None if link is None else len(self._latency))
            if link is not None:
                self._latency.append(link.latency)
        # the hops whose time holds the coordinator's work, and each one's share: its own, or the stages' it shares
        self._coordinator_hops = {0: 1.0} if own_hop else {self._stage_hops[stage]: share
                                                           for stage, share in shares.items()}
        self._free_at = [0.0] * len(self._latency)  # by hop: when an exclusive hop next falls free
        self._legs = self._split_into_legs()
        self._by_shape: dict[tuple, FrameCosts] = {}  # by FrameShape.figures
        self._busy = [0.0] * len(self._nodes)  # each node's seconds of computing so far (a list: no hashing per frame)
        self.timings: list[FrameTiming] | None = None  # a list: each frame's way round the ring is kept in it
        self._flying: dict[int, list] = {}  # while a loss may come: frames in flight, by seq, as served so far
        self.losses: list[dict] = []  # each simulated loss: when it was seen, when the stage was back, ...

    def _split_into_legs(self) -> list[Leg]:
        """The ring's hops, cut after each one on a shared host."""
        legs, start, charged = [], 0, []
        stage_at = {hop: stage for stage, hop in enumerate(self._stage_hops)}
        for hop in range(len(self._latency)):
            if hop in stage_at:
                charged.append((self._nodes.index(self._names[stage_at[hop]]), stage_at[hop]))
            if hop in self._sharing:
                legs.append(Leg(range(start, hop), tuple(charged), hop))
                start, charged = hop + 1, []
        legs.append(Leg(range(start, len(self._latency)), tuple(charged), None))
        return legs

    def _stage_costs(self, plan: Plan, calibration: Calibration, config: ModelConfig,
                     runtime: RuntimeSpec) -> tuple[list[StageCost], list[int]]:
        """One StageCost per distinct (layer kinds, node calibration), and which one each stage uses."""
        where = calibration.source or "calibration"
        groups: list[tuple[Counter[str], NodeCalibration, list[str]]] = []
        index = []
        for stage in plan.stages:
            kinds, node = stage_kinds(stage, config, runtime), calibration.nodes[stage.node]
            if missing := sorted(set(kinds) - set(node.tables)):
                hint = "; a calibration measures the MTP layer where its spec's runtime.speculate drafts with it" \
                    if LayerKind.MTP in missing else ""
                raise CalibrationError(f"{where}: nodes.{stage.node}.tables: missing {', '.join(missing)} (layers "
                                       f"{stage.first_layer}-{stage.last_layer}, roles {', '.join(stage.roles)}"
                                       f"{hint})")
            same = next((i for i, (k, n, _) in enumerate(groups) if k == kinds and n == node), None)
            if same is None:
                same = len(groups)
                groups.append((kinds, node, []))
            groups[same][2].append(stage.node)
            index.append(same)
        costs = [StageCost(f"node{'s' * (len(names) > 1)} {', '.join(names)}", kinds, node, config, calibration,
                           self.extrapolations, runtime.row_buckets, runtime.max_draft)
                 for kinds, node, names in groups]
        return costs, index

    def _link(self, calibration: Calibration, spec: Spec, a: str, b: str) -> LinkSpec | None:
        if a == b:
            return None
        figures = calibration.links.get((a, b))
        if figures is None:
            figures = spec.cluster.link(a, b)
            self.notes.append(f"link {a}->{b}: not in the calibration; using the spec's figures "
                              f"({figures.bandwidth:g} B/s, {figures.latency:g} s)")
        return figures

    def frame_costs(self, frame: Frame) -> FrameCosts:
        """What `frame` takes on each hop: called once as it sets off (a replay takes its traced times then)."""
        figures = FrameShape.figures(frame, self._window)
        if (costs := self._by_shape.get(figures)) is None:
            costs = self._by_shape[figures] = self._costs_of(FrameShape(*figures))
        if self._replay is not None and (computed := self._replay.take(len(frame.rows), frame.padded_rows)):
            costs = self._replayed(costs, computed, len(frame.rows))
        return costs

    def _replayed(self, costs: FrameCosts, computed: tuple[float, ...], rows: int) -> FrameCosts:
        """`costs` with each stage's time its traced compute plus its handling of the frame's messages (which a
        trace counts in the link, as a run's node handles them outside its compute)."""
        stage_s = tuple(seconds + self.costs[cost].handling(rows) for seconds, cost in zip(computed, self._cost_index))
        hop_s = list(costs.hop_s)
        for seconds, hop in zip(stage_s, self._stage_hops):
            hop_s[hop] = seconds + self._coordinator_s(hop, rows)
        return FrameCosts(stage_s, tuple(hop_s))

    def _coordinator_s(self, hop: int, rows: int) -> float:
        """`hop`'s share of the coordinator's work on a frame of `rows` real rows."""
        share = self._coordinator_hops.get(hop)
        return 0.0 if share is None else share * self._coordinator.seconds(rows)

    def alone_s(self, shape: FrameShape) -> tuple[tuple[float, ...], float]:
        """A frame of `shape` alone in the pipeline: each stage's compute seconds, and its whole way round the ring
        (every stage, wire and link latency)."""
        costs = self._costs_of(shape)
        return costs.stage_s, sum(costs.hop_s) + sum(self._latency)

    def _costs_of(self, shape: FrameShape) -> FrameCosts:
        times = [cost(shape) for cost in self.costs]
        stage_s = tuple(times[cost] for cost in self._cost_index)
        hop_s = [0.0] * len(self._latency)
        for time, compute, wire, link, size in zip(stage_s, self._stage_hops, self._wire_hops, self._links,
                                                   message_sizes(shape, self._hidden, len(self._names))):
            hop_s[compute] = time
            if wire is not None:
                hop_s[wire] = size / link.bandwidth
        for hop in self._coordinator_hops:
            hop_s[hop] += self._coordinator_s(hop, shape.rows)
        return FrameCosts(stage_s, tuple(hop_s))

    def _enter(self, leg: Leg, costs: FrameCosts, t: float, served: list | None = None) -> float:
        """A frame entering `leg` at `t` counts its stages' busy time and takes its exclusive hops in turn; returns
        when it is through them. `served` (by hop) takes when each hop began and ended serving the frame."""
        busy, stage_s = self._busy, costs.stage_s
        for node, stage in leg.charged:
            busy[node] += stage_s[stage]
        free_at, latency, hop_s = self._free_at, self._latency, costs.hop_s
        for hop in leg.hops:
            start = free_at[hop]
            if t >= start:  # max(t, free_at[hop]) without a call (t on a tie, as max takes its first)
                start = t
            t = start + hop_s[hop]
            free_at[hop] = t
            if served is not None:
                served[hop] = (start, t)
            t += latency[hop]
        return t

    def carry(self, frame: Frame, served: list | None = None):
        """The process of one frame: every leg in turn, the last bringing its sampled tokens back to stage 0.
        `served`: see `_enter` (a shared host serves a frame from its node's turn to the end of its work)."""
        costs, env = self.frame_costs(frame), self.env
        t = env.now
        for leg in self._legs:
            t = self._enter(leg, costs, t, served)
            if leg.shared is not None:
                yield env.timeout(t - env.now)
                host, turn = self._sharing[leg.shared]
                with turn.request() as mine:
                    yield mine
                    start = env.now
                    yield host.compute(costs.hop_s[leg.shared])
                    if served is not None:
                        served[leg.shared] = (start, env.now)
                t = env.now
        yield env.timeout(t - env.now)

    def _launch(self, frame: Frame, land: Callable[[Frame], None], served: bool = False) -> None:
        """Send a frame round the ring; `land(frame)` once its sampled tokens are back at stage 0. `served`: keep
        where it is while in flight (`_flying`)."""
        if self.timings is not None or served:
            self.env.process(self._fly_served(frame, land))
        elif self._sharing:
            self.env.process(self._fly(frame, land))
        else:  # a single leg: the frame takes all its hops now and needs no process, only its landing's timeout
            now = self.env.now
            t = self._enter(self._legs[0], self.frame_costs(frame), now)
            self.env.timeout(t - now).callbacks.append(lambda _: land(frame))

    def _fly(self, frame: Frame, land: Callable[[Frame], None]):
        yield from self.carry(frame)
        land(frame)

    def _fly_served(self, frame: Frame, land: Callable[[Frame], None]):
        """`_fly`, keeping when each hop served the frame, and its timing for a trace: a stage takes a frame in as
        it starts computing it (a node reads its input when it is free: the wait is the link's, as in a run's), and
        its compute ends before the messages' handling, which a run's node does outside its compute too (so that
        in both timelines a link holds the handling, the wire and the wait)."""
        sent, served = self.env.now, [None] * len(self._latency)
        self._flying[frame.seq] = served
        yield from self.carry(frame, served)
        del self._flying[frame.seq]
        if self.timings is not None:
            rows = len(frame.rows)
            handling = [self.costs[cost].handling(rows) + self._coordinator_s(hop, rows)
                        for cost, hop in zip(self._cost_index, self._stage_hops)]
            stages = tuple(StageTiming(served[hop][0], served[hop][0], served[hop][1] - handled)
                           for hop, handled in zip(self._stage_hops, handling))
            self.timings.append(FrameTiming(frame.seq, frame.group, len(frame.rows), frame.padded_rows, sent, stages,
                                            self.env.now, len(frame.sampled_ids)))
        land(frame)

    def run_phase(self, policy: Policy, arrivals: Arrivals, requests: int, recorder: Recorder,
                  loss: tuple[Loss, Recovery] | None = None) -> dict[str, float]:
        """Serve a phase of `requests` requests sent as `arrivals` says; returns each node's busy seconds in it.
        With `loss`, its node is lost that long into the phase and recovers as `Recovery` says (`losses`)."""
        env = self.env
        driver = PhaseDriver(policy, arrivals, requests, recorder)
        busy_before = list(self._busy)
        drained = env.event()
        lost: set[int] = set()  # frames that never come back: their tokens are made again after the replay
        down = False
        recovering: tuple[dict, float] | None = None  # the loss's record and moment, until a token after the replay

        def launch(frames: list[Frame]) -> None:
            for frame in frames:
                if down:  # sent into the lost node, or kept back while its stage is down
                    lost.add(frame.seq)
                else:
                    self._launch(frame, land, served=loss is not None)

        def land(frame: Frame) -> None:
            nonlocal recovering
            if frame.seq in lost:
                lost.discard(frame.seq)
                return
            sampled = [PLACEHOLDER_TOKEN] * len(frame.sampled_ids)
            if recovering is not None and sampled:
                recovering[0]["first_token_s"] = env.now - recovering[1]
                recovering = None
            launch(driver.complete(frame, sampled, env.now))
            if driver.done and not drained.triggered:
                drained.succeed()

        def lose(node: str, at_s: float, how: Recovery):
            nonlocal down, recovering
            yield env.timeout(at_s)
            if drained.triggered:  # the phase was over first
                return
            t, down, hop = env.now, True, self._stage_hops[how.stage]
            lost.update(seq for seq, served in self._flying.items() if served[hop] is None or served[hop][1] > t)
            yield env.timeout(how.detect_s + how.restart_s)
            self._free_at = [min(free, env.now) for free in self._free_at]  # the lost frames hold no hop
            down = False
            record = {"node": node, "at_s": at_s, "detected_s": how.detect_s, "back_s": how.detect_s + how.restart_s,
                      "first_token_s": None}
            self.losses.append(record)
            recovering = record, t
            launch(driver.replay(env.now))

        def arrive():  # open loop: requests come at their own times
            while (due := driver.next_arrival) is not None:
                yield env.timeout(max(0.0, due - env.now))
                launch(driver.arrive(env.now))
            if driver.done and not drained.triggered:  # the last arrivals were rejected at once
                drained.succeed()

        launch(driver.start(env.now))
        if loss is not None:
            env.process(lose(loss[0].node, loss[0].at_s, loss[1]))
        if driver.next_arrival is not None:
            env.process(arrive())
        if not driver.done:  # else every request was rejected at once
            env.run(until=drained)
        return {node: after - before for node, after, before in zip(self._nodes, self._busy, busy_before)}
