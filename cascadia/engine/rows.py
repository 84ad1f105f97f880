"""The geometry of one batch of rows: which rows belong to which stream, and where each stream's history is.

Rows of several streams travel together; the rows of one stream (slot) are consecutive and at consecutive
positions (a prefill chunk) or a single row (a decode step). Everything stateful (K/V caches, short convolutions)
works per group of rows of one slot.

With speculation, a stream's rows may start up to `rewind` positions (its drafts that were rejected) before where its
slot stands: its short-convolution states keep the last K-1+rewind inputs by position, and a group that starts `back`
positions early takes its history from the first K-1+rewind-back of them. A slot may step back at most one row fewer
than its last call had (`reach`): the inputs before that call's first row are all its state still holds for sure.
"""

from __future__ import annotations

import attrs
import numpy as np

from cascadia.errors import RequestError


class BatchError(RequestError):
    """Rows that do not continue their streams as the engine's state says they must."""


@attrs.frozen(eq=False)
class Rows:
    slots: np.ndarray  # [T] slot of each row
    positions: np.ndarray  # [T] position of each row in its stream
    starts: np.ndarray  # [G] first row of each group
    counts: np.ndarray  # [G] rows in each group
    conv_taps: np.ndarray  # [T, K] index of each row's K convolution inputs in concat(group states, rows)
    conv_keep: np.ndarray  # [G, K-1+rewind] index of each group's new convolution state in the same concatenation
    bucket: int  # the rows every block of the call is padded to

    @property
    def group_slots(self) -> np.ndarray:
        return self.slots[self.starts]

    @classmethod
    def build(cls, slots, positions, lengths: np.ndarray, kernel: int, buckets: tuple[int, ...],
              bucket: int, rewind: int = 0, reach: np.ndarray | None = None) -> Rows:
        """Check rows against the slots' current `lengths` (the next position each slot expects; a slot's rows may
        start up to its `reach` before it, at most `rewind`), and `bucket` against the engine's `buckets`: one of
        them, holding the rows."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if slots.shape != positions.shape or not len(slots):
            raise BatchError(f"need one slot and one position per row, got {len(slots)} slots and "
                             f"{len(positions)} positions")
        if bucket not in buckets or len(slots) > bucket:
            raise BatchError(f"{len(slots)} rows cannot run padded to {bucket}: one call runs at one of the row "
                             f"buckets {list(buckets)}, holding its rows")
        if slots.min() < 0 or slots.max() >= len(lengths):
            raise BatchError(f"slots must lie in 0..{len(lengths) - 1}, got {sorted(set(slots.tolist()))}")
        new_group = np.ones(len(slots), bool)
        new_group[1:] = slots[1:] != slots[:-1]
        starts = np.flatnonzero(new_group)
        counts = np.diff(np.append(starts, len(slots)))
        group_slots = slots[starts]
        if len(set(group_slots.tolist())) != len(group_slots):
            raise BatchError(f"rows of one slot must be consecutive, got slots {slots.tolist()}")
        first = np.repeat(positions[starts], counts)
        offset = np.arange(len(slots)) - np.repeat(starts, counts)
        if np.any(positions != first + offset):
            raise BatchError(f"rows of one slot must be at consecutive positions, got {positions.tolist()}")
        expected = lengths[group_slots]
        back = expected - positions[starts]
        allowed = np.zeros_like(back) if reach is None else np.minimum(reach[group_slots], rewind)
        if np.any((back < 0) | (back > allowed)):
            bad = int(np.flatnonzero((back < 0) | (back > allowed))[0])
            earliest = f" (or up to {allowed[bad]} before)" if allowed[bad] else ""
            raise BatchError(f"slot {group_slots[bad]} is at position {expected[bad]}{earliest}, "
                             f"but its rows start at {positions[starts][bad]}")
        taps, keep = _conv_indices(starts, counts, back, kernel, kernel - 1 + rewind)
        return cls(slots, positions, starts, counts, taps, keep, bucket)


def _conv_indices(starts: np.ndarray, counts: np.ndarray, back: np.ndarray, kernel: int,
                  size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into Z = concat(states [G*S], rows [T]) for a causal convolution of width K, each group's state the
    inputs at its slot's last S = `size` positions (S >= K-1).

    Group g's history is the first S - back_g of its state rows (those before its first row's position) followed by
    its own rows, so input j of row t (offset i in group g) is history[g][S - back_g - (K-1) + i + j], and the
    group's next state is the last S of its history, history[g][n_g - back_g : n_g - back_g + S] (an offset below 0,
    before what the state held, only where the next call may not reach: see the module's text)."""
    n_states = len(starts) * size
    kept = size - back  # [G]

    def index(group: np.ndarray, offset: np.ndarray) -> np.ndarray:  # offset into history[g]
        in_state = offset < kept[group]
        return np.where(in_state, group * size + np.maximum(offset, 0),
                        n_states + starts[group] + offset - kept[group])

    group_of_row = np.repeat(np.arange(len(starts)), counts)
    offset_of_row = np.arange(counts.sum()) - starts[group_of_row] + kept[group_of_row] - (kernel - 1)
    taps = index(group_of_row[:, None], offset_of_row[:, None] + np.arange(kernel))
    groups = np.arange(len(starts))[:, None]
    keep = index(groups, (counts - back)[:, None] + np.arange(size))
    return taps, keep
