"""The real pipeline stage: a `StageEngine` behind the node's `Stage` protocol, and the node process serving it.

A frame's rows go through the engine in calls of at most its largest row bucket. The first stage embeds the rows'
token ids; the last applies the head to the rows it samples and returns their tokens (with their log-probabilities
when a row asks for them, and their logits when scoring).
A row at position 0 starts a new stream, so the stage resets that slot before computing: the data channel itself
says when a slot is reused, and no message on the control channel can race with the new stream's first frame. A row
that forks another slot starts its stream as a copy of that one's as it stands (one prompt's choices).
Before anything changes, a frame is checked against the stage's state as it would leave it (`ForeignFrame` for an
unknown slot, a position its stream is not at, a bucket, width or token id the stage does not have): a stray or
forged frame that cannot belong to the run is dropped by the node, never computed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np
from llguidance import LLTokenizer

from cascadia.engine.checkpoint import Checkpoint, CheckpointError
from cascadia.engine.engine import StageEngine
from cascadia.engine.rows import BatchError
from cascadia.errors import NodeError, PlanError, SpecError
from cascadia.graph.plan import Plan, Stage, stage_state_words
from cascadia.graph.planner import plan_from_dict
from cascadia.host_cpus import pin
from cascadia.host_memory import shortfall
from cascadia.models.base import config_differences
from cascadia.pipeline.node import ForeignFrame, NodeSettings, Peer, ProgressFn, run_node
from cascadia.pipeline.settings import settings_digest
from cascadia.pipeline.transport import COORDINATOR
from cascadia.pipeline.wire import Assign, Frame, Tokens, node_sender
from cascadia.grammar import Constraint, GrammarError, vocabulary
from cascadia.sampling import LogitAdjustments, Sampling, extend_history, held, log_probabilities
from cascadia.spec.types import Spec
from cascadia.units import format_bytes


class RowSampler:
    """Draws the token of each sampled row as its stream asks (`cascadia.sampling`), keeping the token history of
    each slot whose stream samples at random (a greedy stream needs none): the hash of its tokens up to each of its
    last `rewind` + 1 positions, so that a stream whose drafts were rejected goes on from the position it stands at
    (`cascadia.policy`); and for a stream whose logits change with its tokens (`LogitAdjustments`, which come with
    its first row), its tokens by position, cut back to where a rewind leaves it, and where it has a grammar, the
    grammar's matcher (`cascadia.grammar.Constraint`, over `vocabulary()`: the checkpoint's tokenizer)."""

    def __init__(self, slots: int, rewind: int = 0, vocabulary: Callable[[], LLTokenizer] | None = None):
        self._history = np.zeros((slots, rewind + 1), np.uint32)  # [slot, position % (rewind + 1)]
        self._rows = np.zeros(0, np.uint32)  # the history up to each row of the frame last observed
        self._adjust: dict[int, LogitAdjustments] = {}  # by slot
        self._tokens: dict[int, list[int]] = {}  # by slot, of the streams in `_adjust`
        self._constraints: dict[int, Constraint] = {}  # by slot, of the streams with a grammar
        self._vocabulary = functools.cache(vocabulary) if vocabulary is not None else None

    def observe(self, frame: Frame) -> None:
        """Take in a frame's rows, in order."""
        for slot in frame.slots[frame.starting].tolist():  # a new stream there
            self._adjust.pop(slot, None)
            self._tokens.pop(slot, None)
            self._constraints.pop(slot, None)
        self._adjust.update(frame.adjustments)
        self._tokens.update((slot, []) for slot in frame.adjustments)
        for slot, source, position in frame.forked():  # a choice of a prompt: its tokens so far are the source's
            self._history[slot] = self._history[source]
            if slot in self._tokens:
                self._tokens[slot] = self._tokens[source][:position]
        for slot, adjust in frame.adjustments.items():
            if adjust.grammar is not None:
                self._constraints[slot] = Constraint(self._grammar_vocabulary(), adjust.grammar)
        if self._adjust:
            for slot, position, token in zip(frame.slots.tolist(), frame.positions.tolist(),
                                             frame.token_ids.tolist()):
                if (tokens := self._tokens.get(slot)) is not None:
                    del tokens[position:]
                    tokens.append(token)
        drawn = np.flatnonzero(frame.temperature > 0)
        self._rows = np.zeros(len(frame.slots), np.uint32)
        depth = self._history.shape[1]
        for i, slot, position, token in zip(drawn.tolist(), frame.slots[drawn].tolist(),
                                            frame.positions[drawn].tolist(), frame.token_ids[drawn].tolist()):
            start = 0 if position == 0 else int(self._history[slot, (position - 1) % depth])
            self._history[slot, position % depth] = self._rows[i] = extend_history(start, [token])

    def keeps_tokens(self, slot: int) -> bool:
        """Whether the slot's stream's tokens are kept (for its adjustments), so that a choice that forks it and
        adjusts its logits can start from them."""
        return slot in self._tokens

    def sample(self, logits: np.ndarray, frame: Frame) -> np.ndarray:
        """One token per sampled row of the frame, from their logits [n, V]."""
        rows = frame.sample
        logits = self._adjusted(logits, frame.slots[rows], frame.positions[rows])
        temperature = frame.temperature[rows]
        if not temperature.any():
            return np.argmax(logits, axis=1)
        settings = zip(temperature.tolist(), frame.top_p[rows].tolist(), frame.seed[rows].tolist(),
                       frame.top_k[rows].tolist(), frame.min_p[rows].tolist())
        draws = (Sampling(*setting).draw(row, int(history))
                 for row, history, setting in zip(logits, self._rows[rows].tolist(), settings))
        return np.array(list(draws))

    def _adjusted(self, logits: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The sampled rows' logits as their streams' adjustments change them (the same array where none do)."""
        if not self._adjust:
            return logits
        changed = logits
        for i, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
            if (adjust := self._adjust.get(slot)) is not None:
                changed = logits.copy() if changed is logits else changed
                tokens = self._tokens[slot][:position + 1]
                changed[i] = adjust.apply(logits[i], tokens)
                if (constraint := self._constraints.get(slot)) is not None:
                    changed[i] = held(changed[i], logits[i], constraint.allowed(tokens[adjust.prompt_tokens:]))
        return changed

    def _grammar_vocabulary(self) -> LLTokenizer:
        if self._vocabulary is None:
            raise GrammarError("this stage holds no tokenizer for grammars")
        return self._vocabulary()



def reported(logits: np.ndarray, tokens: np.ndarray, asked: np.ndarray) -> tuple:
    """The log-probabilities of the sampled rows' tokens and of the likeliest `max(asked)` tokens, computed for
    the rows that asked (`asked` >= 0; the others' are zeros); (None, None, None) when none did."""
    rows = np.flatnonzero(asked >= 0)
    if not len(rows):
        return None, None, None
    k = int(asked.max())
    chosen, ids, values = np.zeros(len(tokens)), np.zeros((len(tokens), k), np.int32), np.zeros((len(tokens), k))
    chosen[rows], ids[rows], values[rows] = log_probabilities(logits[rows], tokens[rows], k)
    return chosen, ids, values


class EngineStage:
    """A node's stage: embedding when first, its decoder layers, head and sampling when last."""

    def __init__(self, engine: StageEngine, sampler: RowSampler | None = None, with_logits: bool = False):
        if engine.head is not None and sampler is None:
            raise ValueError("the last stage needs a sampler")
        self.engine = engine
        self.sampler = sampler
        self.with_logits = with_logits  # send the sampled rows' logits and head inputs back (scoring, draft-eval)

    def process(self, frame: Frame) -> Frame | Tokens:
        engine = self.engine
        self._check(frame)
        for slot in np.unique(frame.slots[frame.positions == 0]).tolist():
            engine.release(slot)
        for slot, source, _ in frame.forked():
            engine.fork(source, slot)
        bucket = self._bucket(frame)
        parts = []
        for rows in self._calls(frame.rows):
            x = engine.embed(frame.token_ids[rows]) if engine.embedding is not None else frame.residual[rows]
            parts.append(engine.forward(x, frame.slots[rows], frame.positions[rows], bucket))
        hidden = np.concatenate(parts)
        if engine.head is None:
            return attrs.evolve(frame, residual=hidden)
        reporting = frame.reporting  # the sampled rows, and those whose next token's log-probability is reported
        heads = hidden[reporting]  # none in a frame that only carries the middle of prompts
        logits = np.zeros((0, engine.config.output_vocab_size), np.float32)
        head_inputs = []  # what the head reads, where it is sent back
        if len(heads):
            engine.head_input_observer = head_inputs.append if self.with_logits else None
            try:
                logits = np.concatenate([engine.logits(heads[rows]) for rows in self._calls(len(heads))])
            finally:  # a failed call must not leave the next frames observed
                engine.head_input_observer = None
        sampled = frame.sample[reporting]
        self.sampler.observe(frame)
        tokens = self.sampler.sample(logits[sampled], frame)
        chosen = np.zeros(len(heads), np.int64) if frame.targets is None else frame.targets[reporting].astype(np.int64)
        chosen[sampled] = tokens
        read = np.concatenate([*head_inputs, np.zeros((0, hidden.shape[1]), np.float32)])[sampled] \
            if self.with_logits else None
        return Tokens(frame.frame_id, frame.group, frame.slots[frame.sample], tokens,
                      logits[sampled] if self.with_logits else None,
                      *reported(logits, chosen, frame.logprobs[reporting]), self._drafts(frame, hidden, tokens), read)

    def _drafts(self, frame: Frame, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray | None:
        """The MTP layer's drafts after each sampled row's token [n, K] (-1: none; None without the layer, or
        where it proposes nothing)."""
        mtp = self.engine.mtp
        if mtp is None or not (proposed := mtp.advance(frame.slots, frame.positions, frame.token_ids, hidden,
                                                      frame.sample, tokens, frame.propose)):
            return None
        drafts = np.full((len(tokens), mtp.max_draft), -1, np.int32)
        among_sampled = np.cumsum(frame.sample) - 1
        for row, proposal in proposed.items():
            drafts[among_sampled[row], :len(proposal)] = proposal
        return drafts

    def _bucket(self, frame: Frame) -> int | None:
        """The rows each call of the frame is padded to. Beyond the largest bucket a frame runs as calls of the
        largest (the policy pads to a multiple of it)."""
        return min(frame.bucket, self.engine.max_rows) or None

    def _check(self, frame: Frame) -> None:
        """ForeignFrame unless every row of the frame fits what this stage holds, call by call, as `process` would
        run them: the slots' lengths after the frame's new streams are reset, then moved on by each call."""
        engine, cfg = self.engine, self.engine.config
        if not frame.rows:
            raise ForeignFrame("it has no rows")
        if engine.embedding is not None and (token := frame.token_ids.max()) >= cfg.vocab_size:
            raise ForeignFrame(f"token id {token} lies outside the vocabulary (0..{cfg.vocab_size - 1})")
        if engine.embedding is None and frame.residual is None:
            raise ForeignFrame("it carries no residual, and this stage has no embedding")
        if engine.embedding is None and frame.residual.shape[1] != cfg.hidden_size:
            raise ForeignFrame(f"its residual rows are {frame.residual.shape[1]} wide, the model's "
                               f"{cfg.hidden_size}")
        for slot, adjust in frame.adjustments.items():
            named = [*adjust.stop_ids, *(token for token, _ in adjust.logit_bias)]
            if named and max(named) >= cfg.output_vocab_size:
                raise ForeignFrame(f"the adjustments of slot {slot} name token {max(named)}, beyond the "
                                   f"vocabulary (0..{cfg.output_vocab_size - 1})")
        if frame.targets is not None and (target := frame.targets.max()) >= cfg.output_vocab_size:
            raise ForeignFrame(f"target token {target} lies outside the vocabulary (0..{cfg.output_vocab_size - 1})")
        if frame.slots.max() >= len(engine.lengths):
            raise ForeignFrame(f"slot {frame.slots.max()} is not one of the stage's 0..{len(engine.lengths) - 1}")
        lengths, reach = engine.lengths.copy(), engine.reach.copy()
        lengths[frame.slots[frame.positions == 0]] = reach[frame.slots[frame.positions == 0]] = 0
        for slot, source, position in frame.forked():
            if lengths[source] != position:
                raise ForeignFrame(f"slot {slot} forks slot {source} at position {position}, where that stream "
                                   f"stands at {lengths[source]}")
            if slot in frame.adjustments and self.sampler is not None and not self.sampler.keeps_tokens(source):
                raise ForeignFrame(f"slot {slot} forks slot {source}, whose tokens this stage does not keep")
            lengths[slot], reach[slot] = position, 0
        for rows in self._calls(frame.rows):
            try:
                checked = engine.rows(frame.slots[rows], frame.positions[rows], self._bucket(frame), lengths, reach)
            except BatchError as e:
                raise ForeignFrame(str(e)) from None
            lengths[checked.group_slots] = checked.positions[checked.starts] + checked.counts
            reach[checked.group_slots] = checked.counts - 1

    def _calls(self, n: int) -> Iterator[slice]:
        """Consecutive row ranges of at most the engine's largest bucket (a stream's rows may span two calls: the
        second continues where the first left its state)."""
        for start in range(0, n, self.engine.max_rows):
            yield slice(start, min(n, start + self.engine.max_rows))


# ---- the node process ----------------------------------------------------------------------------------------------
def find_stage(plan: Plan, name: str) -> tuple[int, Stage]:
    for index, stage in enumerate(plan.stages):
        if stage.node == name:
            return index, stage
    raise PlanError(f"node {name!r} holds no stage of the plan (its nodes: "
                     f"{', '.join(s.node for s in plan.stages)})")


def node_settings(spec: Spec, plan: Plan, name: str, listen: str, control: str, successor: str | None,
                  parent_pid: int | None = None, standby: bool = False) -> NodeSettings:
    """Where node `name` listens and sends. `successor` defaults to the next stage's address in the spec; the last
    stage sends to the coordinator's token socket, which only the coordinator can say. A spare (`cluster.spares`),
    or any node on `standby`, holds no stage, and sends nowhere, until the coordinator assigns it one."""
    members = [node.name for node in spec.cluster.members]
    if name not in members:
        raise SpecError(f"node {name!r} is not in the spec's cluster (its nodes: {', '.join(members)})")
    control_sender = node_sender(members.index(name))
    holding_none = NodeSettings(name, sender=control_sender, first_layer=0, last_layer=-1, listen=listen,
                                successor=None, control=Peer(COORDINATOR, control), input_peer=None,
                                curve_keys=spec.cluster.curve_keys, parent_pid=parent_pid,
                                control_sender=control_sender)
    if standby or name in {spare.name for spare in spec.cluster.spares}:
        return holding_none
    return attrs.evolve(holding_none, **_placement(spec, plan, name, successor))


def assigned_settings(spec: Spec, settings: NodeSettings, assign: Assign) -> NodeSettings:
    """A node's settings for its stage of the plan an ASSIGN carries (PlanError for a plan that is not one of
    the spec's, or gives the node no stage)."""
    plan = plan_from_dict(_json(assign.plan), spec, "the assigned plan")
    successor = assign.successor
    if successor.startswith("tcp://*:"):  # the coordinator's token socket, on the host we reach it on
        successor = f"{settings.control.address.rsplit(':', 1)[0]}:{successor.rsplit(':', 1)[1]}"
    return attrs.evolve(settings, **_placement(spec, plan, settings.name, successor))


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"the assigned plan is not JSON: {e}") from None


def _placement(spec: Spec, plan: Plan, name: str, successor: str | None) -> dict:
    """The settings that place node `name` in `plan`'s pipeline (see `node_settings`)."""
    index, stage = find_stage(plan, name)
    if successor is None:
        if index == len(plan.stages) - 1:
            raise SpecError(f"node {name!r} holds the last stage: give the coordinator's token address as its "
                             "successor")
        after = plan.stages[index + 1].node
        address = {node.name: node.address for node in spec.cluster.nodes}.get(after)
        if address is None or address == "local":
            raise SpecError(f"the next stage's node {after!r} has no tcp address in the spec: give its address "
                             "as the successor")
        successor = address
    peer = COORDINATOR if index == len(plan.stages) - 1 else plan.stages[index + 1].node
    before = COORDINATOR if index == 0 else plan.stages[index - 1].node
    return {"sender": node_sender(index), "first_layer": stage.first_layer, "last_layer": stage.last_layer,
            "successor": Peer(peer, successor), "input_peer": before, "stage": stage,
            "stage_key": (stage.roles, stage.kv_blocks, stage.kv_block, stage.ring_blocks, stage.weight_bytes,
                          stage.state_bytes)}


def load_stage(spec: Spec, stage: Stage, checkpoint: Path, threads: int | None, with_logits: bool,
               progress: ProgressFn) -> EngineStage:
    """Read only this stage's layers (and the embedding or head it holds) and compile them, once this machine's
    memory can hold them and their state (the plan's figures: every slot's own state and the K/V pool)."""
    weights, state = stage.weight_bytes, stage.state_bytes
    if short := shortfall(weights + state):
        raise NodeError(f"{stage.node}: its stage needs {format_bytes(weights + state, digits=3)} (weights "
                        f"{format_bytes(weights, digits=3)}, state {format_bytes(state, digits=3)}: "
                        f"{stage_state_words(spec.runtime.max_streams, stage)}) {short}")
    opened = Checkpoint.open(checkpoint)
    if differences := config_differences(opened.config, spec.model.config):
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        # The spec is not named: `run` hands its nodes a temporary copy of it.
        raise CheckpointError(f"{checkpoint}: its config.json describes another model than the spec's: "
                              f"{', '.join(differences[:3])}{more} (checkpoint vs spec)")
    engine = StageEngine.for_stage(spec, stage, opened, threads=threads, progress=progress)
    cfg = engine.config
    sampler = RowSampler(spec.runtime.max_streams, engine.rewind,
                         lambda: vocabulary(checkpoint, cfg.output_vocab_size, cfg.eos_ids)) \
        if engine.head is not None else None
    return EngineStage(engine, sampler, with_logits)


def serve_node(spec: Spec, plan: Plan, settings: NodeSettings, checkpoint: Path, threads: int | None,
               with_logits: bool, cpus: Sequence[int] | None = None,
               respec: Callable[[str], Spec] | None = None) -> None:
    """Run node `settings.name` until the coordinator shuts it down (see `cascadia.pipeline.node.run_node`), on
    `cpus` (default: the node's in the spec, else where it was started). `respec`, for a node invited into the run:
    how it reads the spec an ASSIGN carries (the cluster may have grown since); None: it keeps its own."""
    cpus = pin(cpus or spec.cluster.node(settings.name).cpus, settings.name, whole_process=True)
    latest = [spec]

    def assigned(settings: NodeSettings, assign: Assign) -> NodeSettings:
        if assign.spec and respec is not None:
            latest[0] = respec(assign.spec)
        return assigned_settings(latest[0], settings, assign)

    settings = attrs.evolve(settings, digest=settings_digest(spec, plan, with_logits), cpus=cpus, assigned=assigned)
    run_node(settings, lambda settings, progress: load_stage(spec, settings.stage, checkpoint, threads, with_logits,
                                                             progress))

