"""OpenVINO's PagedAttention (the op OpenVINO GenAI's continuous batching runs) over a stage's own K/V pool: it reads
each stream's keys and values where they lie in the pool's blocks and writes the call's new ones there itself, in
place, so a stage graph needs no gather, no mask and no host write (`cascadia.engine.stage_graph`).

The op is OpenVINO's experimental extension (`_PagedAttentionExtension`; its inputs below are 2026.4's, checked by
tests/test_engine_exact.py). Its key and value caches are [blocks, kv heads, block, d] each, indexed by one table
of blocks: here both are views of the pool's parts array (`BlockPool.parts`), the values' one part further on, so
that a layer's index of a block's key part is also that of its value part. The CPU plugin stores the caches in
blocks of 32 positions, at f32 or f16 under f32 compute and at bf16 under bf16 (anything else it refuses or copies,
and then nothing is written): `takes` says where it serves. An IR file cannot hold the op (OpenVINO reads no
"extension" opset back), so a graph saved to one carries a stand-in per layer (`stand_in`) that `substitute`
replaces once the file is read.
"""

from __future__ import annotations

import functools

import numpy as np
import openvino as ov
import openvino.opset16 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

from cascadia.spec.types import PAGED_ATTENTION_BLOCK as BLOCK

CACHE_TYPES = {"f32": ("f32", "f16"), "bf16": ("bf16",)}  # the cache's stored types at each compute precision
# The longest context a stage graph's warm-up tells the plugin of (`StageGraph.warm_up`): it then holds a score
# buffer of threads x heads x 32 x this many f32 for prefill (17 MB for 16 heads on 2 threads), rebuilt as a stream
# reaches further.
WARM_REACH = 4096
# How much further than the furthest so far a stage graph tells the plugin a stream reaches when one passes it
# (`StageGraph.reach_told`): the plugin rebuilds its kernels (10-15 ms here) each time the context it is told of
# passes the largest before, rounded up to a block, so exact values past the warm-up's reach cost a rebuild every 32
# decode steps of the longest stream; told a quarter further, one every quarter of its length. Its score buffer is
# then at most a quarter larger than the longest stream needs.
REACH_GROWTH = 1.25
_STAND_IN, _KEYS, _VALUES, _BLOCKS = "paged_attention", "paged_keys", "paged_values", "paged_blocks"


def takes(block: int, stored: str, compute: str) -> bool:
    """Whether the CPU plugin's PagedAttention reads and writes a pool of `block` positions a block, its keys and
    values stored in `stored`, under `compute` precision (and this OpenVINO's op takes the inputs built here)."""
    return block == BLOCK and stored in CACHE_TYPES.get(compute, ()) and _builds()


@functools.cache
def _builds() -> bool:
    """Whether this OpenVINO builds the op from the inputs `_op` gives (2026.4's; its list moves between versions)."""
    given = Inputs(1, 2)
    params = {p.get_friendly_name(): p.output(0) for p in given.parameters}
    q = ops.parameter([-1, 2], ov.Type.f32).output(0)
    try:
        _op(q, q, q, params, given.blocks.output(0), 1, 2)
    except RuntimeError:
        return False
    return True


class Inputs:
    """The graph's parameters the op reads, besides a layer's q, k, v: the streams' lengths and blocks, the caches."""

    def __init__(self, kv_heads: int, head_dim: int):
        i32 = ov.Type.i32
        self.past_lens = ops.parameter([-1], i32, name="past_lens")  # [G] positions each stream has before the call
        self.begins = ops.parameter([-1], i32, name="subsequence_begins")  # [G + 1] each stream's first row, T
        self.blocks = ops.parameter([-1], i32, name="block_indices")  # the streams' blocks' first parts, in order
        self.blocks_begins = ops.parameter([-1], i32, name="block_indices_begins")  # [G + 1] each stream's first
        self.max_context = ops.parameter([], i32, name="max_context_len")  # the most positions a stream reaches
        # typed by the plugin (its cache precision), so it is left open here
        self.keys, self.values = (ops.parameter([-1, kv_heads, -1, head_dim], ov.Type.dynamic, name=name)
                                  for name in ("keys", "values"))

    @property
    def parameters(self) -> list[ov.Node]:
        return [self.past_lens, self.begins, self.blocks, self.blocks_begins, self.max_context, self.keys,
                self.values]


def stand_in(layer: int, q: ov.Output, k: ov.Output, v: ov.Output, blocks: ov.Output) -> tuple[ov.Output, list]:
    """What layer `layer`'s attention is in the saved graph: q [T, h d] passed on under a name `substitute` finds,
    and results carrying k, v [T, kv d] and the layer's block indices to it. Returns the stand-in's output (the
    attention's, [T, h d]) and the extra results."""
    out = ops.convert(q, ov.Type.f32)
    out.set_friendly_name(f"{_STAND_IN}.{layer}")
    results = []
    for name, z in ((_KEYS, k), (_VALUES, v), (_BLOCKS, blocks)):
        result = ops.result(z)
        result.set_friendly_name(f"{name}.{layer}")
        results.append(result)
    return out.output(0), results


def substitute(model: ov.Model, kv_heads: int, head_dim: int) -> None:
    """Replace every stand-in of `model` (read back from its file) by the op itself, and drop its extra results."""
    nodes = {node.get_friendly_name(): node for node in model.get_ordered_ops()}
    params = {p.get_friendly_name(): p.output(0) for p in model.get_parameters()}
    for name, node in nodes.items():
        if not name.startswith(_STAND_IN + "."):
            continue
        layer = name.split(".", 1)[1]
        carried = [nodes[f"{kind}.{layer}"] for kind in (_KEYS, _VALUES, _BLOCKS)]
        k, v, blocks = (result.input_value(0) for result in carried)
        attention = _op(node.input_value(0), k, v, params, blocks, kv_heads, head_dim)
        node.output(0).replace(attention)
        for result in carried:
            model.remove_result(result)
    model.validate_nodes_and_infer_types()


def _op(q: ov.Output, k: ov.Output, v: ov.Output, params: dict[str, ov.Output], blocks: ov.Output, kv_heads: int,
        head_dim: int) -> ov.Output:
    i32, f32 = np.int32, np.float32
    empty = [ops.constant(np.zeros(0, i32)).output(0)]
    node = _PagedAttentionExtension([
        q, k, v, params["keys"], params["values"], params["past_lens"], params["subsequence_begins"], blocks,
        params["block_indices_begins"],
        ops.constant(f32(head_dim ** -0.5)).output(0),  # scale
        ops.constant(i32(0)).output(0),  # sliding_window: none
        ops.constant(np.zeros(0, f32)).output(0),  # alibi_slopes: none
        params["max_context_len"],
        *empty,  # score_aggregation_window
        *empty, *empty, ops.constant(np.zeros(0, f32)).output(0),  # rotated_block_indices, rotation_deltas, _trig_lut
        ops.constant(np.zeros(0, f32)).output(0), ops.constant(i32(0)).output(0),  # xattention_threshold, _block_size
        ops.constant(i32(0)).output(0),  # xattention_stride
        ops.constant(np.zeros((0, 0, 0, 0), f32)).output(0),  # sinks
        ops.constant(i32(0)).output(0), *empty, *empty, *empty,  # adaptive R-KV: start, sizes, block sets, begins
        *empty, ops.constant(np.zeros(0, np.uint8)).output(0), *empty,  # token_type_ids, qq_bias, qq_bias_begins
    ])
    for key, value in {"num_k_heads": kv_heads, "k_head_size": head_dim, "num_v_heads": kv_heads,
                       "v_head_size": head_dim}.items():
        node.get_rt_info()[key] = value
    return node.output(0)


def cache_tensors(parts: np.ndarray, stored: ov.Type) -> dict[str, ov.Tensor]:
    """The pool's parts [parts, kv, block, d] as the op's key and value caches, by input name: views, the values'
    one part on."""
    return {name: ov.Tensor(view, list(view.shape), stored) for name, view in (("keys", parts[:-1]),
                                                                                ("values", parts[1:]))}
