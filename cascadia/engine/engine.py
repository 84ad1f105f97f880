"""The resident Inkling engine: `StageEngine` serves a run of consecutive layers (one pipeline stage, optionally
with the embedding and the head), `Engine` is all of them in one process.

Streams live in slots. A slot holds, per layer, the stream's K/V ring and its four short-convolution states, and
the stage remembers each slot's length (its next position), so rows that do not continue their stream are refused
before any state changes. Rows of different streams at different positions share one call; a slot's rows in a
call are consecutive and at consecutive positions (one decode row, or a prefill chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.decoder import DecoderLayer, SlotState
from cascadia.engine.device import CompiledBlock, compile_options, device_precision, pick_device
from cascadia.engine.host_ops import rms_norm
from cascadia.engine.quantize import Quantized, quantize_stacks
from cascadia.engine.rows import BatchError, Rows
from cascadia.engine.state_format import StateFormat
from cascadia.errors import RequestError
from cascadia.spec.types import WeightFormat, WeightFormats
from cascadia.tensors import EMBED, EMBED_NORM, FINAL_NORM, HEAD

ProgressFn = Callable[[int, int], None]  # (parts built, parts to build): embedding, each layer, head


class StageEngine:
    def __init__(self, checkpoint: Checkpoint, layers: range, *, embed: bool, head: bool,
                 formats: WeightFormats = WeightFormats(), precision: str = "f32", max_streams: int = 16,
                 context_budget: int = 1024, kv_precision: str = "f32",
                 row_buckets: Sequence[int] = (1, 2, 8, 16, 24, 32),
                 device: str = "auto", threads: int | None = None, dense_slices: int | None = None,
                 warm_up: bool = True, progress: ProgressFn | None = None):
        """Compile the stage's graphs (one per weight block, dynamic rows) and allocate its slots.
        `row_buckets`: row counts the graphs are called with (rows are zero-padded up to one); the largest is
        also the most rows of one call. `kv_precision`: how K/V and convolution states are stored (f32, f16,
        bf16; computed with in f32). `dense_slices`: run dense MLPs as that many all-active expert slices.
        `warm_up`: run every graph at every bucket once now, so that first requests are not slow."""
        cfg = self.config = checkpoint.config
        if len(layers) and not (0 <= layers[0] and layers[-1] < cfg.num_hidden_layers and layers.step == 1):
            raise ValueError(f"layers must be consecutive within 0..{cfg.num_hidden_layers - 1}, got {layers}")
        self.layer_ids = layers
        self.device = pick_device(device)
        self.max_rows = max(row_buckets)
        self.context_budget = context_budget
        options = compile_options(device_precision(precision, self.device), threads)
        total, done = len(layers) + embed + head, 0

        def compile_block(model) -> CompiledBlock:
            return CompiledBlock(model, self.device, options, row_buckets)

        def advance() -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, total)

        self.embedding = self.head = None
        if embed:
            self.embedding = compile_block(graphs.embedding(_matrix(checkpoint, EMBED, formats.embedding),
                                                            formats.embedding))
            self.embed_norm = checkpoint.tensor(EMBED_NORM)
            advance()
        self.layers, self.states = [], []
        for i in layers:
            self.layers.append(DecoderLayer(cfg, i, checkpoint.layer(i), formats, compile_block, dense_slices))
            # A sliding ring keeps window - 1 old keys plus one call's rows (see cascadia.engine.attention).
            ring = min(context_budget, cfg.sliding_window_size - 1 + self.max_rows) if cfg.is_sliding(i) \
                else context_budget
            self.states.append(SlotState(self.layers[-1].shape, ring, cfg.hidden_size, cfg.conv_kernel_size,
                                         max_streams, StateFormat(kv_precision)))
            advance()
        if head:
            self.final_norm = checkpoint.tensor(FINAL_NORM)
            self.head = compile_block(graphs.projection([_matrix(checkpoint, HEAD, formats.head)], formats.head))
            advance()
        self.lengths = np.zeros(max_streams, np.int64)  # next position of each slot
        if warm_up:
            for block in self.blocks:
                block.warm_up()

    @property
    def blocks(self) -> list[CompiledBlock]:
        return [b for b in (self.embedding, self.head) if b] + [b for layer in self.layers for b in layer.blocks()]

    @property
    def precision(self) -> str:
        """The precision the plugin actually runs (an f16 request on a CPU without FP16 gives bf16)."""
        return self.blocks[0].precision

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> normalised embeddings [T, H] (the first stage's input)."""
        if self.embedding is None:
            raise RuntimeError("this stage was built without the embedding")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        vocab = self.config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise RequestError(f"token ids must lie in 0..{vocab - 1}, got {ids.min()}..{ids.max()}")
        return rms_norm(self.embedding(ids)[0], self.embed_norm, self.config.rms_norm_eps)

    def forward(self, hidden: np.ndarray, slots, positions) -> np.ndarray:
        """Rows [T, H] of several streams, each at its own position, through this stage's layers."""
        rows = Rows.build(slots, positions, self.lengths, self.config.conv_kernel_size, self.max_rows)
        ends = rows.positions[rows.starts] + rows.counts
        if ends.max() > self.context_budget:
            slot = int(rows.group_slots[np.argmax(ends)])
            raise BatchError(f"slot {slot} would reach {ends.max()} positions, beyond the context budget "
                             f"({self.context_budget})")
        x = np.asarray(hidden, dtype=np.float32)
        if x.shape != (len(rows.slots), self.config.hidden_size):
            raise BatchError(f"hidden rows must be [{len(rows.slots)}, {self.config.hidden_size}] (one per slot and "
                             f"position), got {list(x.shape)}")
        for layer, state in zip(self.layers, self.states):
            x = layer.forward(x, rows, state)
        self.lengths[rows.group_slots] = ends
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm, division by the muP width multiplier, head; only the unpadded vocabulary [T, V]."""
        if self.head is None:
            raise RuntimeError("this stage was built without the head")
        cfg = self.config
        h = rms_norm(np.asarray(hidden, dtype=np.float32), self.final_norm, cfg.rms_norm_eps)
        return self.head(h / np.float32(cfg.logits_mup_width_multiplier))[0][:, : cfg.output_vocab_size]

    def release(self, slot: int) -> None:
        """Forget a slot's stream; its next rows start at position 0."""
        for state in self.states:
            state.release(slot)
        self.lengths[slot] = 0


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

    def __init__(self, checkpoint: Checkpoint, **options):
        """`options`: those of `StageEngine` (formats, precision, max_streams, context_budget, ...)."""
        self.config = checkpoint.config
        self.stage = StageEngine(checkpoint, range(self.config.num_hidden_layers), embed=True, head=True, **options)

    def step(self, slots, ids) -> np.ndarray:
        """One call: rows of token `ids` for `slots` (a slot's rows consecutive), each continuing its stream.
        Returns the logits of every row [T, V]."""
        return self.stage.logits(self._hidden(slots, ids))

    def prefill(self, slot: int, ids) -> np.ndarray:
        """Feed a prompt (or more of it) to one slot's stream, in chunks of the largest row bucket; logits of the
        last row [V]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            raise ValueError("prefill needs at least one token")
        for start in range(0, len(ids), self.stage.max_rows):
            chunk = ids[start: start + self.stage.max_rows]
            hidden = self._hidden(np.full(len(chunk), slot), chunk)
        return self.stage.logits(hidden[-1:])[0]

    def score(self, ids, prefill: int | None = None, slot: int = 0) -> np.ndarray:
        """Teacher-forced logits of every position [N, V] of a fresh stream: the first `prefill` tokens (default:
        all) in prefill chunks, the rest one decode step at a time."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids) if prefill is None else prefill
        if not 0 < n <= len(ids):
            raise ValueError(f"prefill must lie in 1..{len(ids)}, got {n}")
        self.release(slot)
        out = [self.step(np.full(len(chunk), slot), chunk)
               for chunk in np.split(ids[:n], range(self.stage.max_rows, n, self.stage.max_rows))]
        out += [self.step([slot], ids[t: t + 1]) for t in range(n, len(ids))]
        return np.concatenate(out)

    def release(self, slot: int) -> None:
        self.stage.release(slot)

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
