"""The resident engine, for every family: `StageEngine` serves a run of consecutive layers (one pipeline stage,
optionally with the embedding and the head), `Engine` is all of them in one process. Each family's layers run as
its module of `cascadia.engine.families` builds them.

Streams live in slots. A slot holds, per layer, the stream's keys and values in blocks of the stage's K/V pool (a
ring of a few on a sliding layer, taken when the stream starts; on a global one, taken as it grows) and whatever
else its family keeps (Inkling: four short-convolution states), and the stage remembers each slot's length (its
next position), so rows that do not continue their stream, or that the pool has no room for, are refused before any
state changes. Rows of different streams at different positions share one call; a slot's rows in a call are
consecutive and at consecutive positions (one decode row, or a prefill chunk). A stream can also start as a copy of
another as it stands (`fork`: the choices of one prompt share the positions computed for it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cascadia.engine import graphs, paged_kernel
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock, compile_options, device_precision, pick_device
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.families import host_layers
from cascadia.engine.kv_store import BlockPool, PagedKV, PagedRing
from cascadia.engine.layers import rms_norm
from cascadia.engine.mlp import Mlp
from cascadia.engine.moe_choice import measured_grouped_from
from cascadia.engine.mtp import MtpLayer
from cascadia.engine.quantize import Quantized, quantize_stacks
from cascadia.engine.rows import BatchError, Rows
from cascadia.engine.stage_graph import StageGraph
from cascadia.engine.state_format import StateFormat
from cascadia.errors import RequestError
from cascadia.graph.costs import layer_costs, pool_layout
from cascadia.graph.plan import EMBED as EMBED_ROLE
from cascadia.graph.plan import HEAD as HEAD_ROLE
from cascadia.graph.plan import Stage
from cascadia.policy import padded_size, score_schedule
from cascadia.models import family
from cascadia.models.names import EMBED, FINAL_NORM
from cascadia.spec.types import ModelSpec, RuntimeSpec, Spec, WeightFormat, WeightFormats
from cascadia.speculation import MTP

ProgressFn = Callable[[int, int], None]  # (parts built, parts to build): embedding, each layer, head


class StageEngine:
    def __init__(self, checkpoint: Checkpoint, layers: range, *, embed: bool, head: bool, runtime: RuntimeSpec,
                 formats: WeightFormats = WeightFormats(), device: str = "auto", threads: int | None = None,
                 dense_slices: int | None = None, warm_up: bool = True, progress: ProgressFn | None = None,
                 kv_blocks: int | None = None):
        """Compile the stage's graphs (one per weight block, dynamic rows; with `runtime.stage_graph`, one for all
        its layers: `cascadia.engine.stage_graph`) and allocate its slots, as `runtime` says: compute `precision`,
        `max_streams` slots of at most `context_budget` positions, states stored in `kv_precision` (computed with
        in f32), calls padded to `row_buckets` (the stage graph's calls are not padded). Keys and values take
        blocks from a pool of `kv_blocks` (`PoolLayout`; None: enough for every slot at the budget).
        `formats`: how weights are stored. `dense_slices`: run dense MLPs as that many all-active expert slices
        (not in a stage graph). `warm_up`: run every block at every bucket once now, so that first requests are not
        slow (a stage graph: one call at one row and one at the largest bucket). MoE calls of at
        least `moe_grouped_from` rows run expert-grouped (`cascadia.engine.moe_choice`; "auto" is measured here and
        the result kept in `self.moe_grouped_from`, None for fused only)."""
        cfg = self.config = checkpoint.config
        if len(layers) and not (0 <= layers[0] and layers[-1] < cfg.num_hidden_layers and layers.step == 1):
            raise ValueError(f"layers must be consecutive within 0..{cfg.num_hidden_layers - 1}, got {layers}")
        self.layer_ids = layers
        self.host = host = host_layers(cfg)
        self.conv_kernel = family(cfg).conv_history(cfg) + 1  # 1: a family without short convolutions
        self.device = pick_device(device)
        self.row_buckets = runtime.row_buckets
        self.max_rows = runtime.largest_bucket
        self.rewind = runtime.max_draft  # the most positions a stream steps back (its rejected drafts)
        self.context_budget = context_budget = runtime.context_budget
        options = compile_options(device_precision(runtime.precision, self.device), threads)
        total, done = len(layers) + embed + head, 0

        def compile_block(model) -> CompiledBlock:
            return CompiledBlock(model, self.device, options, runtime.row_buckets)

        def compile_grouped(model) -> GroupedBlock:
            return GroupedBlock(model, self.device, options, runtime.row_buckets)

        def advance() -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, total)

        self.embedding = self.head = self.mtp = None  # the embedding as this stage's role
        drafts_with_mtp = head and MTP in runtime.drafters
        self._table = None  # the embedding table, also at a last stage whose MTP layer reads it
        if embed or drafts_with_mtp:
            self._table = compile_block(graphs.embedding(_matrix(checkpoint, EMBED, formats.embedding),
                                                         formats.embedding))
            self.embed_tensors = {name: checkpoint.tensor(name) for name in family(cfg).embedding_tensors(cfg)
                                  if name != EMBED}
        if embed:
            self.embedding = self._table
            advance()
        self.layers, self.states = [], []
        fmt = StateFormat(runtime.kv_precision)
        layout = pool_layout(layer_costs(ModelSpec(cfg, formats), runtime)[layers.start:layers.stop], runtime)
        self.pool = BlockPool(kv_blocks or runtime.max_streams * layout.stream_blocks(context_budget), layout,
                              runtime.max_streams) if layout else None
        self.moe_grouped_from = _grouped_setting(runtime)
        fused_from = None if runtime.fused_attention_from == "never" else runtime.fused_attention_from
        self.graph = None  # the stage's layers as one graph (`runtime.stage_graph`), in place of `layers`
        for i in layers:
            if runtime.stage_graph:
                _, kv_heads, head_dim = cfg.heads(i)
                kv = PagedKV(self.pool, kv_heads, head_dim, fmt)
            else:
                grouped = compile_grouped if self.moe_grouped_from is not None else None
                self.layers.append(host.build_layer(cfg, i, checkpoint.layer(i), formats, compile_block,
                                                    dense_slices, grouped, fused="fused" in runtime.moe_paths))
                self._choose_moe_path(self.layers[-1])
                shape = self.layers[-1].shape
                if cfg.is_sliding(i):
                    place = sum(map(cfg.is_sliding, layers[:len(self.states)]))  # among the stage's sliding layers
                    kv = PagedRing(self.pool, place, shape.kv_heads, shape.head_dim, fmt)
                else:
                    kv = PagedKV(self.pool, shape.kv_heads, shape.head_dim, fmt, fused_from, shape.values_are_keys)
                advance()
            self.states.append(host.slot_state(cfg, kv, runtime.max_streams, fmt, self.rewind))
        if runtime.stage_graph and len(layers):
            self.graph = StageGraph(cfg, layers, checkpoint.layer, formats, self.pool,
                                    [state.kv for state in self.states], fmt, self.device, options)
            for _ in layers:
                advance()
        if head:
            self.final_norm = checkpoint.tensor(FINAL_NORM)
            self.head = compile_block(graphs.projection([_matrix(checkpoint, checkpoint.head_weight, formats.head)],
                                                        formats.head))
            if drafts_with_mtp:
                self.mtp = MtpLayer(checkpoint, runtime, formats, compile_block, self.final_norm, self.embed,
                                    self.head_logits)
            advance()
        self.lengths = np.zeros(runtime.max_streams, np.int64)  # next position of each slot
        self.reach = np.zeros(runtime.max_streams, np.int64)  # how far before it the slot's next rows may start
        if warm_up:
            for block in self.blocks:
                block.warm_up()
            if self.graph is not None:
                self.graph.warm_up((1, self.max_rows), context_budget)
            if self.states:  # every attention layer's spans, a global layer's or a ring's, go through the kernel
                paged_kernel.warm_up(fmt.dtype)

    def _choose_moe_path(self, layer: Mlp) -> None:
        """Settle `moe_grouped_from` on the first MoE layer when it is "auto" (measured on that layer's blocks),
        and give a MoE layer the expert-grouped block only where some call size uses it."""
        if layer.grouped is None:
            return
        if self.moe_grouped_from == AUTO:
            layer.mlp.warm_up()
            layer.grouped.warm_up()
            self.moe_grouped_from = measured_grouped_from(layer, self.row_buckets)
        if self.moe_grouped_from is None:
            layer.grouped = None
        layer.grouped_from = self.moe_grouped_from

    @classmethod
    def for_stage(cls, spec: Spec, stage: Stage, checkpoint: Checkpoint, *, threads: int | None = None,
                  progress: ProgressFn | None = None) -> StageEngine:
        """The engine of one stage of a plan, as the spec's runtime and weight formats and the stage's node say
        (`threads`, when given, in place of the node's), with the K/V pool the plan gives it."""
        node = spec.cluster.node(stage.node)
        return cls(checkpoint, stage.layers, embed=EMBED_ROLE in stage.roles, head=HEAD_ROLE in stage.roles,
                   runtime=spec.runtime, formats=spec.model.formats, device=node.device,
                   threads=node.threads if threads is None else threads, progress=progress, kv_blocks=stage.kv_blocks)

    @property
    def blocks(self) -> list[CompiledBlock]:
        return [b for b in (self._table, self.head) if b] + [b for layer in self.layers for b in layer.blocks()] + \
            (self.mtp.blocks if self.mtp else [])

    @property
    def state_bytes(self) -> int:
        """Bytes of the per-stream state allocated: the convolution histories of every slot and the K/V pool
        (committed as it is written)."""
        return sum(state.nbytes for state in self.states) + (self.pool.arena.nbytes if self.pool else 0) + \
            (self.mtp.state_bytes if self.mtp else 0)

    @property
    def precision(self) -> str:
        """The precision the plugin actually runs (an f16 request on a CPU without FP16 gives bf16)."""
        return self.blocks[0].precision

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> the first layer's input [T, H] (the embedding table's rows, as the family treats them)."""
        if self._table is None:
            raise RuntimeError("this stage was built without the embedding")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        vocab = self.config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise RequestError(f"token ids must lie in 0..{vocab - 1}, got {ids.min()}..{ids.max()}")
        return self.host.embedded(self.config, self._table(ids)[0], self.embed_tensors)

    def forward(self, hidden: np.ndarray, slots, positions, bucket: int | None = None) -> np.ndarray:
        """Rows [T, H] of several streams, each at its own position, through this stage's layers, every block
        called at `bucket` rows (None: the smallest row bucket that holds them)."""
        rows = self.rows(slots, positions, bucket)
        ends = rows.positions[rows.starts] + rows.counts
        x = np.asarray(hidden, dtype=np.float32)
        if x.shape != (len(rows.slots), self.config.hidden_size):
            raise BatchError(f"hidden rows must be [{len(rows.slots)}, {self.config.hidden_size}] (one per slot and "
                             f"position), got {list(x.shape)}")
        if self.pool:
            self.pool.grow(dict(zip(rows.group_slots.tolist(), ends.tolist())))
        if self.graph is not None:
            x = self.graph.forward(x, rows)
        for layer, state in zip(self.layers, self.states):
            x = layer.forward(x, rows, state)
        self.lengths[rows.group_slots] = ends
        self.reach[rows.group_slots] = rows.counts - 1
        return x

    def rows(self, slots, positions, bucket: int | None = None, lengths: np.ndarray | None = None,
             reach: np.ndarray | None = None) -> Rows:
        """The rows of one call (see `forward`) checked against the slots' `lengths` and `reach` (default: the
        engine's own): BatchError, before any state changes, for rows that do not continue their streams (or step
        back further than their state allows), a bucket that is not one of the row buckets, or a stream that would
        pass the context budget."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        bucket = padded_size(len(slots), self.row_buckets) if bucket is None else bucket
        rows = Rows.build(slots, positions, self.lengths if lengths is None else lengths, self.conv_kernel,
                          self.row_buckets, bucket, self.rewind, self.reach if reach is None else reach)
        ends = rows.positions[rows.starts] + rows.counts
        if ends.max() > self.context_budget:
            slot = int(rows.group_slots[np.argmax(ends)])
            raise BatchError(f"slot {slot} would reach {ends.max()} positions, beyond the context budget "
                             f"({self.context_budget})")
        return rows

    # Told the rows the head reads, on every call of `logits`: how `cascadia draft-eval` captures the final hidden
    # states of the deployed path. None: nobody listens.
    head_input_observer: Callable[[np.ndarray], None] | None = None

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The model's final hidden states [T, H] -> final norm -> `head_logits`, its head input observed."""
        if self.head is None:
            raise RuntimeError("this stage was built without the head")
        normed = rms_norm(np.asarray(hidden, dtype=np.float32), self.final_norm, self.config.rms_norm_eps)
        return self.head_logits(normed, self.head_input_observer)

    def head_logits(self, normed: np.ndarray, observer: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Rows after a final norm (the model's or the MTP layer's) -> the family's head input (Inkling's: divided
        by the muP width multiplier), told to `observer` -> the head's logits, only the unpadded vocabulary [T, V]."""
        head_input = self.host.head_input(self.config, normed)
        if observer is not None:
            observer(head_input)
        return self.head(head_input)[0][:, : self.config.output_vocab_size]

    def release(self, slot: int) -> None:
        """Forget a slot's stream; its next rows start at position 0."""
        for state in self.states:
            state.release(slot)
        if self.pool:
            self.pool.release(slot)
        if self.mtp:
            self.mtp.release(slot)
        self.lengths[slot] = self.reach[slot] = 0

    def fork(self, source: int, target: int) -> None:
        """Start a new stream in slot `target` as a copy of slot `source`'s as it stands (one prompt's choices): its
        next rows continue from `source`'s length, the positions before it computed once, their K/V blocks shared
        (`BlockPool.fork`). BatchError, before any change, for a slot forked from itself or a pool too full for the
        copies."""
        if source == target:
            raise BatchError(f"slot {source} cannot be forked into itself")
        self.release(target)
        if self.pool:
            self.pool.fork(source, target, int(self.lengths[source]))
        for state in self.states:
            state.fork(source, target)
        if self.mtp:
            self.mtp.fork(source, target)
        self.lengths[target], self.reach[target] = self.lengths[source], 0


AUTO = "auto"


def _grouped_setting(runtime: RuntimeSpec) -> int | str | None:
    """`runtime.moe_grouped_from` as the engine starts with it: a row count, AUTO (to measure), or None (fused only,
    also for a count above the largest bucket)."""
    return runtime.moe_grouped_from if "grouped" in runtime.moe_paths else None


def _matrix(checkpoint: Checkpoint, name: str, fmt: WeightFormat) -> np.ndarray | Quantized:
    """A weight matrix for a graph storing it in `fmt`. An integer format quantises it a block of rows at a time: the
    vocabulary tables are the largest matrices, and whole in float32 they and the temporaries of their quantisation
    would take several times the bytes they are stored in."""
    if not fmt.is_integer:
        return checkpoint.tensor(name)
    rows = ((block,) for block in checkpoint.slices(name, _QUANTIZED_ROWS))
    return quantize_stacks(rows, checkpoint.shape(name)[0], fmt)[0]


_QUANTIZED_ROWS = 1024


class Engine:
    """The whole model in one process: embedding, every layer, head."""

    def __init__(self, checkpoint: Checkpoint, runtime: RuntimeSpec = RuntimeSpec(), **options):
        """`options`: those of `StageEngine` (formats, device, threads, ...)."""
        self.config = checkpoint.config
        self.stage = StageEngine(checkpoint, range(self.config.num_hidden_layers), embed=True, head=True,
                                 runtime=runtime, **options)

    def step(self, slots, ids) -> np.ndarray:
        """One call: rows of token `ids` for `slots` (a slot's rows consecutive), each continuing its stream.
        Returns the logits of every row [T, V]."""
        return self.stage.logits(self._hidden(slots, ids))

    def prefill(self, slot: int, ids, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Feed a prompt (or more of it) to one slot's stream, in chunks of the largest row bucket; logits of the
        last row [V]. `progress(done, total)` is told the tokens taken in after each chunk."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            raise ValueError("prefill needs at least one token")
        for start in range(0, len(ids), self.stage.max_rows):
            chunk = ids[start: start + self.stage.max_rows]
            hidden = self._hidden(np.full(len(chunk), slot), chunk)
            if progress:
                progress(start + len(chunk), len(ids))
        return self.stage.logits(hidden[-1:])[0]

    def score(self, ids, prefill: int | None = None, slot: int = 0) -> np.ndarray:
        """Teacher-forced logits of every position [N, V] of a fresh stream: the first `prefill` tokens (default:
        all) in prefill chunks, the rest one decode step at a time."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.release(slot)
        return np.concatenate([self.step(np.full(end - start, slot), ids[start:end])
                               for start, end in score_schedule(len(ids), prefill, self.stage.max_rows)])

    def release(self, slot: int) -> None:
        self.stage.release(slot)

    def fork(self, source: int, target: int) -> None:
        self.stage.fork(source, target)

    def _hidden(self, slots, ids) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if slots.shape != ids.shape:
            raise ValueError(f"need one slot per token, got {len(slots)} slots and {len(ids)} tokens")
        first = np.ones(len(slots), bool)
        first[1:] = slots[1:] != slots[:-1]
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(slots)), 0))
        positions = self.stage.lengths[slots] + np.arange(len(slots)) - group_start
        return self.stage.forward(self.stage.embed(ids), slots, positions)
