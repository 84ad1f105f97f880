"""The sizes of the pipeline's messages on the wire: one source for `cascadia.pipeline.wire`, which lays them out, and
for what costs them (the planner, the analytic calibration, the simulator, calibration's fits), so that a cost is the
size of the message that is really sent.

A message is a fixed header, then one buffer per array of its kind (see `cascadia.pipeline.wire`): a FRAME has, per row,
an i32 slot, position and token id, a u8 "sample" flag, how its token is drawn (f64 temperature and top-p, u64 seed,
i32 top-k, f64 min-p) and how many log-probabilities are reported beside it (i32), then the f32 residual rows (none into
the first stage); the TOKENS the last stage sends back have an i32 slot and token id per sampled row (and the
log-probabilities a client asked for, which no cost counts: a few hundred bytes a row at most).
"""

from __future__ import annotations

import struct

# magic, version, kind, sender, sequence number, then: frame id, group, rows, bucket, cols, dtype code; last the body's
# bytes (all buffers together), so that a receiver tells a cut buffer from an array the sender left out
HEADER_LAYOUT = "<4sHBIQQIIIIBQ"
HEADER_BYTES = struct.calcsize(HEADER_LAYOUT)
INDEX_BYTES = 4  # i32: a slot, position or token id
# a row: slot, position, token id, top-k and logprobs (i32), the sample flag (u8), temperature, top-p, seed and min-p
# (8 bytes each)
FRAME_ROW_BYTES = 5 * INDEX_BYTES + 1 + 4 * 8
TOKENS_ROW_BYTES = 2 * INDEX_BYTES  # slot, token id
RESIDUAL_VALUE_BYTES = 4  # f32


def frame_bytes(rows: int, hidden: int) -> int:
    """A FRAME of `rows` rows carrying residual rows of width `hidden` (0: none, into the first stage)."""
    return HEADER_BYTES + rows * (FRAME_ROW_BYTES + hidden * RESIDUAL_VALUE_BYTES)


def tokens_bytes(rows: int) -> int:
    """The TOKENS of `rows` sampled rows, without logits."""
    return HEADER_BYTES + rows * TOKENS_ROW_BYTES
