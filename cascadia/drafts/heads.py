"""Draft heads: the model's LM head stored in some weight format, computed at some precision, scoring the whole
output vocabulary or a subset of it. Built with the engine's own code: its quantisation, its projection graph, its
compiled blocks, so that a head in the deployed format and precision is the deployed head itself."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from cascadia.engine import graphs
from cascadia.engine.checkpoint import Checkpoint
from cascadia.engine.device import CompiledBlock, compile_options, device_precision
from cascadia.engine.quantize import Quantized, quantize_stacks
from cascadia.spec.types import WeightFormat

FULL, REDUCED = "full", "reduced"  # vocabularies
F32, DEPLOYED, INT4 = "f32", "deployed", "int4"  # weights
_BLOCK_ROWS = 1024  # head rows read and quantised at a time: a whole vocabulary table in f32 takes gigabytes


@attrs.frozen(eq=False)
class DraftHead:
    vocabulary: str  # FULL or REDUCED
    weights: str  # F32, DEPLOYED or INT4
    ids: np.ndarray  # the token ids it scores, increasing
    fmt: WeightFormat  # how its weights are stored
    precision: str  # what it asks the device to compute in

    @property
    def name(self) -> str:
        """"full f32", "top 8192 int4", ..."""
        return f"{'full' if self.vocabulary == FULL else f'top {len(self.ids)}'} {self.weights}"


def head_matrix(checkpoint: Checkpoint, ids: np.ndarray, fmt: WeightFormat) -> np.ndarray | Quantized:
    """The head's rows `ids` (increasing), stored in `fmt`: quantised a block of rows at a time, as the engine
    quantises its own head (groups never span rows, so a row comes out as it does in the whole head)."""
    blocks = _rows(checkpoint, ids)
    if not fmt.is_integer:
        return np.concatenate(list(blocks))
    return quantize_stacks(((block,) for block in blocks), len(ids), fmt)[0]


def _rows(checkpoint: Checkpoint, ids: np.ndarray) -> Iterator[np.ndarray]:
    start = 0
    for block in checkpoint.slices(checkpoint.head_weight, _BLOCK_ROWS):
        wanted = ids[(ids >= start) & (ids < start + len(block))] - start
        if len(wanted):
            yield block[wanted]
        start += len(block)


class CompiledHead:
    """A draft head compiled for `device`, called as the engine calls its head: rows padded to `buckets`, in calls
    of at most the largest."""

    def __init__(self, head: DraftHead, checkpoint: Checkpoint, device: str, buckets: tuple[int, ...],
                 threads: int | None = None):
        self.head = head
        options = compile_options(device_precision(head.precision, device), threads)
        model = graphs.projection([head_matrix(checkpoint, head.ids, head.fmt)], head.fmt)
        self.block = CompiledBlock(model, device, options, buckets)
        self.precision = self.block.precision  # what the plugin runs (a bf16 request is f32 on a CPU without bf16)
        # what it reads per token: its rows in its format, scales and zero points included
        self.weight_bytes = head.fmt.matrix_bytes(len(head.ids), checkpoint.config.hidden_size)

    def tokens(self, head_inputs: np.ndarray) -> np.ndarray:
        """The head's most likely token id for each row of `head_inputs` [n, H] (the rows the engine's head reads)."""
        most = self.block.buckets[-1]
        best = [self.block(head_inputs[start: start + most])[0].argmax(axis=1)
                for start in range(0, len(head_inputs), most)]
        return self.head.ids[np.concatenate(best)]
