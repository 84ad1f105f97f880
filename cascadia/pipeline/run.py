"""`cascadia run`: a spec's workload through the real pipeline, in the metrics schema `cascadia simulate` writes.

A `Pipeline` is the coordinator plus the plan's nodes: for `local` nodes it starts the node processes itself (see
`cascadia.pipeline.launch`); for nodes with tcp addresses it waits for processes started on those machines, which need
the coordinator's control address (and the last one its token address). It serves workloads (`run`) and scores
token sequences (`score`) until closed; closing shuts every node down.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import attrs
import numpy as np

from cascadia import host_cpus, metrics
from cascadia.driver import Served, serve_workload
from cascadia.errors import CheckpointError, NodeError, PlanError, SpecError
from cascadia.graph import planner
from cascadia.graph.plan import Plan
from cascadia.graph.planner import InfeasiblePlan, checked_plan
from cascadia.pipeline.coordinator import Coordinator, NodeLost, Outputs, PipelineError
from cascadia.pipeline.frame_log import FrameLog
from cascadia.pipeline.launch import LocalNodes, NodeCommand, check_host_memory
from cascadia.pipeline.places import LOCALHOST
from cascadia.pipeline.settings import settings_digest
from cascadia.pipeline.transport import free_port, tcp_address
from cascadia.pipeline.wire import Frame, Hello, Message, Progress, Ready, Tokens
from cascadia.policy import Policy, padded_size, score_schedule
from cascadia.spec.dump import spec_for_nodes, write_spec
from cascadia.spec.types import NodeSpec, Spec, WorkloadSpec
from cascadia.speculation import Drafter, RecordedDrafter, drafter_of
from cascadia.tokenizer import workload_prompts
from cascadia.trace import FrameTiming
from cascadia.workload import Level, Phase, prompt_length_notes

log = logging.getLogger(__name__)

NODE_TIMEOUT_S = 120.0  # a starting node silent for this long is an error
STALL_S = 60.0  # a running pipeline that returns no tokens for this long is an error
SHUTDOWN_S = 10.0  # how long nodes may take to stop after SHUTDOWN before local ones are killed
# ... after a failure, when a node may sit in a send to a dead one for its whole send timeout: kill sooner
AFTER_FAILURE_S = 2.0
MAX_STANDBY_LOSSES = 3  # a local node standing by whose process ends this often is not started again


class RunFailed(NodeError):
    """The pipeline failed mid-run; `result` and `outputs` hold what finished before."""

    def __init__(self, message: str, result: dict, outputs: list[dict]):
        super().__init__(message)
        self.result, self.outputs = result, outputs


@attrs.frozen
class RunResult:
    result: dict  # the metrics schema (cascadia.metrics.result)
    outputs: list[dict]  # one line per request: concurrency, phase, request id, prompt and output ids
    frames: list[FrameTiming] | None = None  # with `trace`: every frame's way through the pipeline
    clock_error_s: dict[str, float] | None = None  # ... and how far each node's times may be off the coordinator's


@attrs.frozen
class Addresses:
    """Where the coordinator listens: its control socket (every node) and token socket (the last node)."""

    control: str
    tokens: str

    @classmethod
    def local(cls, host: str = LOCALHOST) -> Addresses:
        """Free ports on `host` (0.0.0.0: every interface, for nodes in network namespaces)."""
        return cls(tcp_address(host, free_port(host)), tcp_address(host, free_port(host)))


def describe(node: str, message: Message) -> str:
    """A starting node's message for people."""
    match message:
        case Hello():
            doing = (f"loading layers {message.first_layer}-{message.last_layer}"
                     if message.last_layer >= message.first_layer else "standing by, a spare")
            return f"{node}: up on CPUs {host_cpus.format_cpus(message.cpus)}, {doing}"
        case Progress():
            return f"{node}: compiled {message.done}/{message.total} blocks"
        case Ready():
            return f"{node}: ready"
    return f"{node}: {type(message).__name__}"


class Pipeline:
    def __init__(self, spec: Spec, plan: Plan, coordinator: Coordinator, local: LocalNodes | None, run_dir,
                 checkpoint: Path | None, affinity: tuple[int, ...]):
        """`affinity`: the CPUs the calling thread ran on before the coordinator was pinned, for `close`."""
        self.spec, self.plan, self.checkpoint = spec, plan, checkpoint
        self.started_plan = plan  # what the nodes were started with; `plan` is what they serve now
        self.coordinator, self.local, self._run_dir, self._affinity = coordinator, local, run_dir, affinity
        self._own_frames = 0  # frames sent by `score` and `greedy`, not by a policy

    @classmethod
    def start(cls, spec: Spec, plan: Plan, *, checkpoint: Path | None = None, with_logits: bool = False,
              addresses: Addresses | None = None, node_timeout_s: float = NODE_TIMEOUT_S,
              stall_s: float = STALL_S, on_message: Callable[[str, Message], None] = lambda node, message: None,
              emulate_links: bool = False, stop: threading.Event | None = None, with_spares: bool = False) -> Pipeline:
        """Start (local) or wait for (tcp) the plan's nodes, until every one is READY.

        Local nodes read `checkpoint` (default: the spec's), and send the sampled rows' logits back when
        `with_logits` (for `score`); with `emulate_links` each runs in
        a network namespace of its own, its link to the next shaped to the spec's bandwidth. Remote nodes were
        started with their own options; `addresses` must then be ones they reach. `stop`, set by another thread,
        ends the wait (a PipelineError) and shuts the nodes down. `with_spares` starts the spec's local spares
        too, to stand by (`serve`: see `take_over`)."""
        nodes = {node.name: node for node in spec.cluster.members}
        names = [stage.node for stage in plan.stages]
        if unknown := [name for name in names if name not in nodes]:
            raise PlanError(f"the plan places stages on {', '.join(unknown)}, which the spec's cluster does not have")
        spares = [node.name for node in spec.cluster.members if node.name not in names] if with_spares else []
        local = [nodes[name].is_local for name in names + spares]
        if any(local) and not all(local):
            raise SpecError("the spec mixes local nodes with tcp ones: a local node listens on 127.0.0.1, which "
                             "the others cannot reach; give every node a tcp address, or none")
        if emulate_links and not (all(local) and addresses is None and not spares):
            raise SpecError("links are emulated between local nodes only, on addresses chosen here, without spares")
        if all(local):
            check_host_memory(spec, plan)
            for name in names + spares:
                host_cpus.check(nodes[name].cpus, name)
            addresses = addresses or Addresses.local("0.0.0.0" if emulate_links else LOCALHOST)
        elif addresses is None:
            raise SpecError("the nodes have tcp addresses: give the control and token addresses the coordinator "
                             "binds, reachable from them (e.g. --control tcp://0.0.0.0:5555 --tokens "
                             "tcp://0.0.0.0:5556)")
        affinity = host_cpus.available()
        host_cpus.pin(spec.cluster.coordinator_cpus, "the coordinator")  # before ZeroMQ starts its I/O thread
        try:
            coordinator = Coordinator(names, addresses.control, addresses.tokens, spec.cluster.curve_keys, stall_s,
                                      digest=settings_digest(spec, plan, with_logits),
                                      members=[node.name for node in spec.cluster.members])
        except BaseException:
            host_cpus.restore(affinity)
            raise
        # the local nodes' spec, plan and logs (tcp nodes have their own machines' files)
        run_dir = tempfile.TemporaryDirectory(prefix="cascadia-run-") if all(local) else None
        local_nodes = None
        try:
            if all(local):
                command = _node_command(spec, plan, Path(run_dir.name), checkpoint, with_logits)
                rates = [spec.cluster.link(a, b).bandwidth for a, b in zip(names, names[1:])]
                # a node without CPUs of its own runs where this thread ran before it was pinned
                everyone = names + spares
                local_nodes = LocalNodes.start(command, everyone, [nodes[name].threads for name in everyone],
                                               [nodes[name].cpus or affinity for name in everyone],
                                               Path(run_dir.name), addresses.control, addresses.tokens,
                                               rates if emulate_links else None, spares=len(spares))
                first = local_nodes.places[0].address
            else:
                first = nodes[names[0]].address
            pipeline = cls(spec, plan, coordinator, local_nodes, run_dir, checkpoint or spec.model.checkpoint,
                           affinity)
            if local_nodes is not None:
                coordinator.watch = pipeline._watch_local
        except BaseException:
            _close(coordinator, local_nodes, run_dir, affinity, AFTER_FAILURE_S)
            raise
        try:
            coordinator.wait_ready(first, node_timeout_s, on_message, stop)
            coordinator.sync_clocks()
        except BaseException:
            pipeline.close(AFTER_FAILURE_S)
            raise
        return pipeline

    def run(self, workload: WorkloadSpec, prompts: Sequence[tuple[int, ...]] | None = None,
            groups: int | None = None, on_phase: Callable[[str, str, list], None] = lambda level, phase, records: None,
            trace: bool = False, drafter: Drafter | None = None) -> RunResult:
        """Every concurrency level of `workload` (warm-up and measured phase); `prompts` default to the workload's
        prompts file (text encoded by the checkpoint's tokenizer), or seeded random prompts without one; `groups`
        (pipeline groups) to the spec's; with `trace`, each frame's timing too. With `spec.runtime.speculate`,
        drafts come from `drafter` (default: those it names).
        Raises RunFailed, holding what finished, when the pipeline fails or the run is interrupted (Ctrl-C)."""
        spec = self.spec
        if prompts is None:
            prompts = workload_prompts(workload, self.checkpoint, spec.model.config)
        notes = prompt_length_notes(prompts, workload, spec.runtime) if prompts else []
        recorded = RecordedDrafter(drafter or drafter_of(spec.runtime.drafters)) if spec.runtime.max_draft else None
        runtime = attrs.evolve(spec.runtime, pipeline_groups=groups) if groups else spec.runtime
        policy = Policy.for_runtime(runtime, len(self.plan.stages), self.plan.kv_pools, recorded)
        served, outputs = Served(), Outputs(recorded)
        coordinator = self.coordinator
        coordinator.frame_log = FrameLog(coordinator.nodes) if trace else None

        def result(warnings: Sequence[str] = ()) -> dict:
            return metrics.result("run", attrs.evolve(spec, workload=workload), served.levels, served.records,
                                  plan=self.plan.to_dict(), warnings=[*notes, *warnings])

        def run_phase(level: Level, phase: Phase, recorder: metrics.Recorder) -> dict[str, float]:
            return self.coordinator.run_phase(policy, level.arrivals(phase), phase.streams, recorder, outputs)

        try:
            serve_workload(spec, workload, prompts, run_phase, served, on_phase)
        except PipelineError as e:
            raise RunFailed(str(e), result([f"the run stopped early: {e}"]), outputs.lines) from None
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`cascadia.errors.Terminated`)
            why = str(e) or "interrupted"
            raise RunFailed(why, result([f"the run was {why}"]), outputs.lines) from None
        frames = coordinator.frame_log.timings(coordinator.clocks) if trace else None
        coordinator.frame_log = None
        errors = {node: clock.error_bound for node, clock in coordinator.clocks.items()} if trace else None
        return RunResult(result(), outputs.lines, frames, errors)

    def score(self, ids: Sequence[int], prefill: int | None = None) -> np.ndarray:
        """Teacher-forced logits of every position [N, V] of a fresh stream in slot 0, as `Engine.score` computes
        them in one process: the first `prefill` tokens (default: all) in chunks of the largest row bucket, the
        rest one row at a time. The nodes must have been started `with_logits`."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        runtime = self.spec.runtime
        logits = []
        for start, end in score_schedule(len(ids), prefill, runtime.largest_bucket):
            rows = end - start
            self._own_frames += 1
            self.coordinator.send_frame(Frame(self._own_frames, 0, [0] * rows, range(start, end), ids[start:end],
                                              [True] * rows, bucket=padded_size(rows, runtime.row_buckets)))
            logits.append(np.array(self._tokens_with_logits().logits))
        return np.concatenate(logits)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Collection[int] = ()
               ) -> tuple[list[int], np.ndarray]:
        """Greedy tokens of a fresh stream in slot 0 (up to `max_new_tokens`, ending after a stop token), the
        prompt in chunks of the largest row bucket, then a row a frame; and what the head read for each [n, H].
        The nodes must have been started `with_logits`."""
        buckets, tokens, read = self.spec.runtime.row_buckets, [], []
        position, ids = 0, list(prompt_ids)  # the rows to send: the prompt's, then each last token
        while len(tokens) < max_new_tokens and not (tokens and tokens[-1] in stop_ids):
            rows = ids[:buckets[-1]]
            n, last = len(rows), len(rows) == len(ids)  # the frame's last row gives the next token
            self._own_frames += 1
            self.coordinator.send_frame(Frame(self._own_frames, 0, [0] * n, range(position, position + n), rows,
                                              [False] * (n - 1) + [last], bucket=padded_size(n, buckets)))
            back = self._tokens_with_logits()
            position, ids = position + n, ids[n:]
            if last:
                tokens += back.token_ids.tolist()
                read.append(np.array(back.head_inputs))
                ids = tokens[-1:]
        return tokens, np.concatenate(read)

    def _tokens_with_logits(self) -> Tokens:
        """The tokens of the last frame sent, with logits and head inputs."""
        tokens = self.coordinator.next_tokens()
        if tokens.frame_id != self._own_frames or tokens.logits is None:
            raise PipelineError(f"frame {self._own_frames}: the last node sent back frame {tokens.frame_id} "
                                f"{'without' if tokens.logits is None else 'with'} logits (were the nodes "
                                "started with --logits?)")
        return tokens

    def replace(self, node: str, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Take a lost node back: a local one is started again here; a remote one must be started again on its
        machine. Wait up to `timeout_s` for it to say HELLO and READY (`stop` ends the wait). A node started again
        knows only the plan it was started with: if stages have moved since, every node is told where they are."""
        if self.local is not None:
            self.local.restart(node)
        self.coordinator.rejoin(node, timeout_s, stop)
        if self.plan != self.started_plan:
            self.assign(self.plan, timeout_s, stop)

    def take_over(self, lost: str, timeout_s: float, stop: threading.Event | None = None) -> str | None:
        """Give a lost node's stage to a node standing by (a spare, or a lost node back), the first whose memory
        holds the stage as planned; wait up to `timeout_s` for it to load. A lost local node is started again here,
        holding no stage: a spare for the next loss. The node that took the stage, or None when none stands by."""
        for spare in self.coordinator.standing_by():
            moved = attrs.evolve(self.plan, stages=tuple(attrs.evolve(stage, node=spare) if stage.node == lost
                                                         else stage for stage in self.plan.stages))
            try:
                checked_plan(moved, self.spec, f"{spare} in place of {lost}")
            except PlanError as e:
                log.warning("%s cannot take %s's stage: %s", spare, lost, e)
                continue
            if self.local is not None:  # it may be frozen, not gone: started afresh, it stands by in the spare's place
                self.local.restart(lost, standby=True)
            self.assign(moved, timeout_s, stop)
            return spare
        return None

    def survivors_plan(self, lost: str) -> Plan:
        """A plan over the nodes left after `lost` (in their stage order; the spec's `layers` pins were for the whole
        fleet), from the planner as `cascadia plan` makes one; InfeasiblePlan when the model does not fit them."""
        survivors = tuple(attrs.evolve(self.spec.cluster.node(stage.node), layers=None)
                          for stage in self.plan.stages if stage.node != lost)
        if not survivors:
            raise InfeasiblePlan(f"no node is left once {lost} is gone")
        cluster = attrs.evolve(self.spec.cluster, nodes=survivors, spares=())
        return planner.plan(attrs.evolve(self.spec, cluster=cluster))

    def assign(self, plan: Plan, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Serve `plan` from now on: each of its nodes takes its stage (`Coordinator.assign`). The plan is the
        pipeline's as soon as it is told, so that a node lost while loading is lost from it. Nodes invited into the
        run (those with a door) are told the spec too, which names the nodes that joined since."""
        if self.local is not None:
            addresses = self.local.addresses
        else:
            addresses = {node.name: node.address for node in self.spec.cluster.members}
        self.plan = plan
        invited = any(node.door for node in self.spec.cluster.members)
        self.coordinator.assign([stage.node for stage in plan.stages], plan.to_json(), addresses, timeout_s, stop,
                                spec_for_nodes(self.spec) if invited else "")

    def add_spare(self, node: NodeSpec) -> Spec:
        """A node that joins after the start, to stand by as a spare (a late one of a fleet that formed itself):
        the spec with it, which the node is to be invited with."""
        cluster = self.spec.cluster
        self.spec = attrs.evolve(self.spec, cluster=attrs.evolve(cluster, spares=(*cluster.spares, node)))
        self.coordinator.add_member(node.name)
        return self.spec

    def _watch_local(self) -> None:
        """The coordinator's look at the local node processes while it waits: a stage holder's that has ended is
        lost (NodeLost); a node standing by whose process has ended stands by no more, and is started again to stand
        by, as a lost stage holder is (until it has been lost MAX_STANDBY_LOSSES times), so that the next loss finds
        it."""
        losses = self.coordinator.standby_losses
        for node, how in self.local.ended():
            if node in self.coordinator.nodes:
                raise NodeLost(node, how)
            if losses[node] >= MAX_STANDBY_LOSSES:
                continue  # given up on, and said so
            self.coordinator.stand_down(node, how)
            if losses[node] < MAX_STANDBY_LOSSES:
                log.info("%s started again to stand by", node)
                self.local.restart(node, standby=True)
            else:
                log.error("%s was lost %d times while standing by; it is not started again", node, losses[node])

    def close(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Shut every node down; kill local ones not gone within `timeout_s`."""
        _close(self.coordinator, self.local, self._run_dir, self._affinity, timeout_s)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(SHUTDOWN_S if exc_type is None else AFTER_FAILURE_S)


def _node_command(spec: Spec, plan: Plan, run_dir: Path, checkpoint: Path | None, with_logits: bool) -> NodeCommand:
    """Local nodes read the spec and plan as this process holds them, written to the run's folder."""
    checkpoint = checkpoint or spec.model.checkpoint
    if checkpoint is None:
        raise CheckpointError("no checkpoint: the spec's model names none; give one (--checkpoint DIR)")
    if not Path(checkpoint).is_dir():
        raise CheckpointError(f"{checkpoint}: no such checkpoint folder")
    return NodeCommand(write_spec(spec, run_dir / "spec.yaml"), plan.save(run_dir / "plan.json"),
                       Path(checkpoint).resolve(), with_logits)


def _close(coordinator: Coordinator, local: LocalNodes | None, run_dir, affinity: tuple[int, ...],
           timeout_s: float) -> None:
    try:
        coordinator.shutdown(timeout_s)
        if local is not None:
            local.stop(timeout_s)
    finally:
        coordinator.close()
        if run_dir is not None:
            run_dir.cleanup()
        host_cpus.restore(affinity)


def run(spec: Spec, plan: Plan, workload: WorkloadSpec | None = None, *, prompts=None,
        checkpoint: Path | None = None, addresses: Addresses | None = None,
        node_timeout_s: float = NODE_TIMEOUT_S, on_message=lambda node, message: None,
        on_phase=lambda level, phase, records: None, emulate_links: bool = False, trace: bool = False) -> RunResult:
    """Start the pipeline, run `workload` (default: the spec's) through it, shut it
    down. `emulate_links`: see `Pipeline.start`; `trace`: `Pipeline.run`."""
    workload = workload or spec.workload
    if prompts is None:  # before the nodes start: a bad prompts file fails at once, as do prompts too long
        prompts = workload_prompts(workload, checkpoint or spec.model.checkpoint, spec.model.config)
        if prompts:
            prompt_length_notes(prompts, workload, spec.runtime)
    with Pipeline.start(spec, plan, checkpoint=checkpoint,
                        addresses=addresses, node_timeout_s=node_timeout_s, on_message=on_message,
                        emulate_links=emulate_links) as pipeline:
        return pipeline.run(workload, prompts, on_phase=on_phase, trace=trace)


def score_on_pipeline(spec: Spec, plan: Plan, ids: Sequence[int], prefill: int | None = None, *,
                      checkpoint: Path | None = None, addresses: Addresses | None = None,
                      node_timeout_s: float = NODE_TIMEOUT_S, on_message=lambda node, message: None) -> np.ndarray:
    """Teacher-forced logits [N, V] of `ids` computed by the plan's nodes (see `Pipeline.score`); remote nodes must
    have been started with --logits."""
    with Pipeline.start(spec, plan, checkpoint=checkpoint, with_logits=True, addresses=addresses,
                        node_timeout_s=node_timeout_s, on_message=on_message) as pipeline:
        return pipeline.score(ids, prefill)
