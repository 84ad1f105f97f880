"""The geometry of one batch of rows: which rows belong to which stream, and where each stream's history is.

Rows of several streams travel together; the rows of one stream (slot) are consecutive and at consecutive
positions (a prefill chunk) or a single row (a decode step). Everything stateful (K/V caches, short convolutions)
works per group of rows of one slot.
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
    conv_keep: np.ndarray  # [G, K-1] index of each group's new convolution state in the same concatenation
    bucket: int  # the rows every block of the call is padded to

    @property
    def group_slots(self) -> np.ndarray:
        return self.slots[self.starts]

    @classmethod
    def build(cls, slots, positions, lengths: np.ndarray, kernel: int, buckets: tuple[int, ...],
              bucket: int) -> Rows:
        """Check rows against the slots' current `lengths` (the next position each slot expects), and `bucket`
        against the engine's `buckets`: one of them, holding the rows."""
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
        if np.any(positions[starts] != expected):
            bad = int(np.flatnonzero(positions[starts] != expected)[0])
            raise BatchError(f"slot {group_slots[bad]} is at position {expected[bad]}, "
                             f"but its rows start at {positions[starts][bad]}")
        taps, keep = _conv_indices(starts, counts, kernel)
        return cls(slots, positions, starts, counts, taps, keep, bucket)


def _conv_indices(starts: np.ndarray, counts: np.ndarray, kernel: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into Z = concat(states [G*(K-1)], rows [T]) for a causal convolution of width K.

    A group's history is its K-1 state rows followed by its own rows, so input j of row t (offset i in group g) is
    history[g][i + j], and the group's next state is history[g][n_g : n_g + K-1]."""
    history = kernel - 1
    n_states = len(starts) * history

    def index(group: np.ndarray, offset: np.ndarray) -> np.ndarray:  # offset into history[g]
        in_state = offset < history
        return np.where(in_state, group * history + offset, n_states + starts[group] + offset - history)

    group_of_row = np.repeat(np.arange(len(starts)), counts)
    offset_of_row = np.arange(counts.sum()) - starts[group_of_row]
    taps = index(group_of_row[:, None], offset_of_row[:, None] + np.arange(kernel))
    groups = np.arange(len(starts))[:, None]
    keep = index(groups, counts[:, None] + np.arange(history))
    return taps, keep
