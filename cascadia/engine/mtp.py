"""Drafts from the checkpoint's multi-token-prediction (MTP) layer, at the stage that holds the head.

At position i the layer reads the model's final hidden state (after its norm) and the embedding of token i+1, and
gives logits for token i+2 (`cascadia.models.inkling.mtp_tensors` says how). So it runs one position behind the
model: a row joins it once the token after it is known (the next row's, or the one sampled from it), and only on
its stream's own path (up to the first rejected draft). A stream whose last such row was sampled gets drafts: the
layer's top token for the position after the sampled one, then, chained, further ones, each from the layer's own
output and the draft before it (DeepSeek-V3's single layer reused, its pre-norm output as the hidden state, as
Inkling's `chain_hidden_post_norm: false` says; the layer was trained for the first draft only). Drafts are only
proposals: the policy verifies them (`cascadia.policy`), so they never change a stream's tokens.

The layer keeps its own state per slot as a decoder layer does (keys and values in a pool of its own, short-
convolution histories), its length, and the final hidden state of a row whose next token is not known yet (a prompt
chunk's last row: the next frame's first row completes it). Chained positions are guesses: the state is put back
as it was before them, so the next frame's rows continue where the stream truly stands. Rows that do not continue
a stream's path as the layer knows it (teacher-forced scoring, calibration's probes) lose the stream: it drafts
nothing until its slot starts afresh.

The layer runs a stream's rows only when it drafts for it (the frame proposes drafts after the stream's last row:
the policy asks while the pipeline has idle stages) or when they fill a full call: until then it holds them, up to
the largest row bucket per slot, so that on busy stages it costs a share of full calls instead of a call a frame.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock
from cascadia.engine.families import host_layers
from cascadia.engine.kv_store import PagedKV
from cascadia.engine.layers import rms_norm
from cascadia.engine.rows import BatchError, Rows
from cascadia.engine.state_format import StateFormat
from cascadia.models import family
from cascadia.policy import padded_size
from cascadia.spec.types import RuntimeSpec, WeightFormats


LOST = -1  # the length of a slot whose stream the layer lost: it drafts nothing until the slot starts afresh


class MtpLayer:
    def __init__(self, checkpoint: Checkpoint, runtime: RuntimeSpec, formats: WeightFormats,
                 compile_block: Callable[..., CompiledBlock], final_norm: np.ndarray,
                 embed: Callable[[np.ndarray], np.ndarray], head: Callable[[np.ndarray], np.ndarray]):
        """The checkpoint's first MTP layer, its blocks compiled by `compile_block`, with state for the runtime's
        slots up to its context budget plus its drafts. `final_norm`: the model's; `embed`: token ids -> the first
        layer's input rows (the normed embedding); `head`: normed rows -> logits, the model's own."""
        cfg, described = checkpoint.config, family(checkpoint.config)
        layer_config, self.eps = described.mtp_config(cfg), cfg.rms_norm_eps
        self.final_norm, self.embed, self.head = final_norm, embed, head
        self.max_draft, self.context_budget = runtime.max_draft, runtime.context_budget
        self.row_buckets = runtime.row_buckets
        t = checkpoint.mtp_layer(0)
        self.hnorm, self.enorm, self.norm = t[described.MTP_HNORM], t[described.MTP_ENORM], t[described.MTP_NORM]
        self.eh_proj = compile_block(graphs.projection([t[described.MTP_PROJ]], formats.attention))
        host = host_layers(cfg)
        self.layer = host.build_layer(layer_config, 0, t, formats, compile_block)
        shape, fmt = self.layer.shape, StateFormat(runtime.kv_precision)
        fused_from = None if runtime.fused_attention_from == "never" else runtime.fused_attention_from
        blocks = runtime.blocks_for(runtime.context_budget + runtime.max_draft)  # as the plan counts them
        kv = PagedKV.alone(runtime.max_streams * blocks, runtime.kv_block, runtime.max_streams, shape.kv_heads,
                           shape.head_dim, fmt, fused_from)
        self.pool = kv.pool
        self.state = host.slot_state(layer_config, kv, runtime.max_streams, fmt, 0)
        self.conv_kernel = described.conv_history(cfg) + 1
        self.lengths = np.zeros(runtime.max_streams, np.int64)  # next position of each slot
        self._pending: dict[int, tuple[int, np.ndarray]] = {}  # slot: (position, final hidden state after norm)
        # rows on each slot's path not run yet, from its length on: their hidden states and the tokens after them
        held = (runtime.max_streams, self.row_buckets[-1])
        self._held_hidden = np.zeros((*held, cfg.hidden_size), np.float32)
        self._held_after = np.zeros(held, np.int32)
        self._held = np.zeros(runtime.max_streams, np.int64)  # how many

    @property
    def blocks(self) -> list[CompiledBlock]:
        return [self.eh_proj, *self.layer.blocks()]

    @property
    def state_bytes(self) -> int:
        return self.state.nbytes + self.pool.arena.nbytes + self._held_hidden.nbytes + self._held_after.nbytes

    # ---- teacher-forced rows ------------------------------------------------------------------------------------
    def step(self, hidden: np.ndarray, next_ids: np.ndarray, slots, positions) -> np.ndarray:
        """Rows [T, H] of the hidden state the layer reads (the model's final one after its norm, or a chained
        draft's), each with the token after its position, through the layer (a slot's rows consecutive and
        continuing where it stands, in calls of at most the largest row bucket); its outputs before its norm."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        positions = np.asarray(positions, np.int64).reshape(-1)
        next_ids = np.asarray(next_ids, np.int64).reshape(-1)
        if len(slots) and (positions.max() >= self.context_budget + self.max_draft):
            raise BatchError(f"the MTP layer holds {self.context_budget + self.max_draft} positions per slot, got "
                             f"position {positions.max()}")
        most = self.row_buckets[-1]
        return np.concatenate([self._call(hidden[at], next_ids[at], slots[at], positions[at])
                               for at in (slice(s, s + most) for s in range(0, len(slots), most))])

    def _call(self, hidden: np.ndarray, next_ids: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        bucket = padded_size(len(slots), self.row_buckets)
        rows = Rows.build(slots, positions, self.lengths, self.conv_kernel, self.row_buckets, bucket)
        ends = rows.positions[rows.starts] + rows.counts
        self.pool.grow(dict(zip(rows.group_slots.tolist(), ends.tolist())))
        x = np.concatenate([rms_norm(hidden, self.hnorm, self.eps),
                            rms_norm(self.embed(next_ids), self.enorm, self.eps)], axis=1)
        out = self.layer.forward(self.eh_proj(x, bucket=bucket)[0], rows, self.state)
        self.lengths[rows.group_slots] = ends
        return out

    def logits(self, out: np.ndarray) -> np.ndarray:
        """The layer's outputs [T, H] -> logits for the token two positions after each row's [T, V]."""
        normed, most = rms_norm(out, self.norm, self.eps), self.row_buckets[-1]
        return np.concatenate([self.head(normed[s:s + most]) for s in range(0, len(normed), most)])

    # ---- a frame's rows -----------------------------------------------------------------------------------------
    def advance(self, slots, positions, token_ids, hidden: np.ndarray, sampled: np.ndarray, tokens: np.ndarray,
                propose: np.ndarray | None = None) -> dict[int, list[int]]:
        """Take a frame's rows as the last stage computed them: their slots, positions and input tokens, the model's
        final hidden states before its norm [T, H], which rows were `sampled` [T] and the `tokens` sampled from
        them, in row order, and the sampled rows after whose token drafts are wanted (`propose` [T]; None: none).
        Returns up to `max_draft` drafts to follow the sampled token of each slot's last row on its path, where
        that row was sampled and proposes, by the row's index."""
        slots, positions, token_ids = (np.asarray(a, np.int64).reshape(-1) for a in (slots, positions, token_ids))
        normed = rms_norm(np.asarray(hidden, np.float32), self.final_norm, self.eps)
        drawn = np.full(len(slots), -1, np.int64)
        drawn[sampled] = tokens
        wanted = np.zeros(len(slots), bool) if propose is None else np.asarray(propose, bool)
        rows: list[tuple[int, int, np.ndarray, int]] = []  # to run now: (slot, position, hidden, token after)
        drafting: dict[int, int] = {}  # the last row of each slot that drafts: its index in `rows`, by its own
        starts = np.flatnonzero(np.append(True, slots[1:] != slots[:-1]))
        for first, end in zip(starts.tolist(), [*starts[1:].tolist(), len(slots)]):
            slot = int(slots[first])
            path, last = self._path(slot, range(first, end), positions, token_ids, normed, sampled, drawn)
            drafts = last is not None and wanted[last]
            if not drafts and self._held[slot] + len(path) <= self._held_after.shape[1]:
                self._hold(slot, path)
                continue
            rows += self._take_held(slot) + [(slot, *row) for row in path]
            if drafts:
                drafting[last] = len(rows) - 1
        if not rows:
            return {}
        row_slots, row_positions, row_hidden, row_after = (np.array(column) for column in zip(*rows))
        out = self.step(np.stack(row_hidden), row_after, row_slots, row_positions)
        at = np.array(list(drafting.values()), np.int64)
        drafts = self._drafts(out[at], row_slots[at], row_positions[at]) if len(at) else []
        return dict(zip(drafting, drafts))

    def _path(self, slot: int, frame_rows: range, positions: np.ndarray, token_ids: np.ndarray, normed: np.ndarray,
              sampled: np.ndarray, drawn: np.ndarray) -> tuple[list[tuple[int, np.ndarray, int]], int | None]:
        """A slot's rows of the frame (`frame_rows`) that join its path: (position, hidden, token after) each, the
        pending row first; and the index of the path's last row where it was sampled (its drafts would follow it)."""
        first = frame_rows[0]
        pending = self._pending.pop(slot, None)
        if positions[first] != (self.lengths[slot] + self._held[slot] if pending is None else pending[0] + 1):
            self.lengths[slot], self._held[slot] = LOST, 0  # rows that do not follow its path (scoring, probes)
            return [], None
        path = [] if pending is None else [(pending[0], pending[1], int(token_ids[first]))]
        for i in frame_rows:
            last = i + 1 == frame_rows.stop
            if last and not sampled[i]:  # a prompt chunk's last row: the next frame's first row completes it
                self._pending[slot] = (int(positions[i]), normed[i])
                return path, None
            after = int(drawn[i] if sampled[i] else token_ids[i + 1])
            path.append((int(positions[i]), normed[i], after))
            if last or token_ids[i + 1] != after:  # its path ends here: the frame's end, or a rejected draft
                return path, i if sampled[i] else None
        raise AssertionError("a path ends at the frame's last row")

    def _hold(self, slot: int, path: list[tuple[int, np.ndarray, int]]) -> None:
        at = self._held[slot]
        for k, (_, row, after) in enumerate(path, start=at):
            self._held_hidden[slot, k], self._held_after[slot, k] = row, after
        self._held[slot] = at + len(path)

    def _take_held(self, slot: int) -> list[tuple[int, int, np.ndarray, int]]:
        """The slot's rows held so far (to run now, before its next ones), as `advance` lists rows."""
        count, length = int(self._held[slot]), int(self.lengths[slot])
        self._held[slot] = 0
        return [(slot, length + k, self._held_hidden[slot, k], int(self._held_after[slot, k])) for k in range(count)]

    def _drafts(self, out: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> list[list[int]]:
        """Chain drafts from the layer's outputs at each drafting slot's last row, then put its state back."""
        drafts = [self.logits(out).argmax(axis=1)]
        lengths, saved = self.lengths[slots].copy(), self.state.saved(slots)
        for step in range(1, self.max_draft):
            if (positions + step >= self.context_budget).any():
                break
            out = self.step(out, drafts[-1], slots, positions + step)
            drafts.append(self.logits(out).argmax(axis=1))
        self.lengths[slots] = lengths
        self.state.restore(slots, saved)
        return np.stack(drafts, axis=1).tolist()

    # ---- slots --------------------------------------------------------------------------------------------------
    def release(self, slot: int) -> None:
        self.state.release(slot)
        self.pool.release(slot)
        self.lengths[slot] = self._held[slot] = 0
        self._pending.pop(slot, None)

    def fork(self, source: int, target: int) -> None:
        """`target` starts as `source` stands (after `release(target)`)."""
        if self.lengths[source] == LOST:
            self.lengths[target] = LOST
            return
        self.pool.fork(source, target, int(self.lengths[source]))
        self.state.fork(source, target)
        self.lengths[target], held = self.lengths[source], self._held[source]
        self._held_hidden[target, :held], self._held_after[target, :held] = self._held_hidden[source, :held], \
            self._held_after[source, :held]
        self._held[target] = held
        if (pending := self._pending.get(source)) is not None:
            self._pending[target] = pending
