"""A stage's layers as one compiled graph (`runtime.stage_graph`), for the families whose layers are a Llama's
(Llama, Qwen3-MoE): one infer call computes every layer of a frame, where the layer-by-layer engine makes three a
layer with attention, RoPE, norms, routers and residuals on the host between them (bench/one_graph.py).

    StageGraph(x [T, H]) for the rows of G streams (T rows, a stream's rows consecutive):
      for each layer:
        q, k, v = qkv(input_layernorm(x)) (+ bias); q, k = q_norm(q), k_norm(k) (Qwen3-MoE); RoPE
        a = attention of q over the stream's keys in the pool before its first row in the call, and the call's own
        x = x + o_proj(a) (+ bias)
        h = post_attention_layernorm(x)
        x = x + experts(h, top_k(softmax(router h)))  |  mlp(h)                         tiled MoE or SwiGLU
      out: x

Attention runs one of two ways, as the pool allows:
- paged (`cascadia.engine.paged_attention`): OpenVINO's PagedAttention reads the pool's blocks where they lie and
  writes the call's keys and values into them itself; one call for every row of a frame. Where the CPU plugin takes
  the pool as it is: blocks of 32 positions (the default `kv_block` with a stage graph), K/V stored in f32 or f16
  under f32 compute, in bf16 under bf16.
- gathered, elsewhere: each stream's blocks gathered from the pool (passed in whole, in its stored format) and
  widened to f32, the call's own k/v concatenated, ScaledDotProductAttention under a mask that lets a row see its
  stream's entries before the call's first position and the call's rows up to its own; the streams of each row
  count in one call; the graph returns each layer's new k/v, which the host writes into the pool.

Against the layer-by-layer engine, in f32: the same model within about 1e-6 of the largest logit
(tests/test_engine_exact.py), not bit for bit: a row's attention and sums depend on the frame it rides in, so a
replayed stream's logits are not its decode steps' to the last bit. At bf16 the graph computes its residuals,
RoPE, router and attention at the engine's precision where the layer-by-layer engine keeps them in f32 on the host,
and the FP32 restoration (for a GPU's f16) is not there: on the CPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import openvino as ov
import openvino.opset16 as ops

from cascadia.engine import paged_attention
from cascadia.engine.device import Compiled, runs_as
from cascadia.engine.families import host_layers
from cascadia.engine.kv_store import BlockPool, PagedKV
from cascadia.engine.ov_ops import const, ints
from cascadia.engine.quantize import bf16_to_f32
from cascadia.engine.rope import cos_sin_factor, inverse_frequencies
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.models.base import UnsupportedModel
from cascadia.spec.types import RuntimeSpec, WeightFormats

_STORED_TYPES = {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16}


class StageGraph:
    """The compiled graph of a stage's `layers` and how to call it on a frame's rows (`forward`)."""

    def __init__(self, config, layers: range, tensors: Callable[[int], Mapping[str, np.ndarray]],
                 formats: WeightFormats, pool: BlockPool, stores: list[PagedKV], fmt: StateFormat, device: str,
                 options: dict[str, object]):
        """`tensors(i)`: layer i's float32 tensors by name relative to its prefix (`Checkpoint.layer`: read as the
        graph is built, a layer at a time); `stores`: each layer's keys and values in `pool`, kept in `fmt`."""
        if why := RuntimeSpec(stage_graph=True).stage_graph_misfit(config):
            raise UnsupportedModel(f"runtime.stage_graph {why}")  # a family module without `graph_layer`
        if device != "CPU":
            raise UnsupportedModel(f"runtime.stage_graph runs on the CPU, not {device}: it has no FP32 restoration "
                                   "for a GPU's f16")
        self.config, self.pool, self.stores = config, pool, stores
        heads, self.kv_heads, self.head_dim = config.heads(layers[0])
        self.inv_freq = inverse_frequencies(self.head_dim, config.rope_theta, config.rope_scaling)
        self.rope_factor = np.float32(cos_sin_factor(config.rope_scaling))
        shape = (self.kv_heads, pool.block, self.head_dim)
        self.parts = pool.parts(fmt.dtype, shape)  # the whole pool, as the graph reads it (its tensors share this)
        self.parts_a_block = len(self.parts) // pool.blocks
        places = [store.places for store in stores]
        compute = runs_as(str(options["INFERENCE_PRECISION_HINT"]), device)
        self.paged = paged_attention.takes(pool.block, fmt.precision, compute) and all(
            values == keys + 1 for keys, values in places)  # a block's values right after its keys
        finish = None
        if self.paged:  # the plugin stores its caches as asked (else in u8)
            finish = lambda model: paged_attention.substitute(model, self.kv_heads, self.head_dim)  # noqa: E731
            options = {**options, "KEY_CACHE_PRECISION": fmt.precision, "VALUE_CACHE_PRECISION": fmt.precision}
        self.out_type = _STORED_TYPES[compute]
        self.compiled = Compiled(lambda: _stage_model(config, layers, tensors, formats, places,
                                                      _STORED_TYPES[fmt.precision], heads, self.paged,
                                                      self.out_type),
                                 device, options, finish)
        if self.paged:
            taken = self.compiled.compiled.input("keys")
            if taken.get_element_type() != _STORED_TYPES[fmt.precision] or taken.get_partial_shape()[2] != pool.block:
                raise UnsupportedModel(f"OpenVINO's paged attention stores its cache as {taken.get_element_type()} "
                                       f"{taken.get_partial_shape()}, not as the pool's {fmt.precision} blocks of "
                                       f"{pool.block} positions under {compute} compute")
            pool_tensors = paged_attention.cache_tensors(self.parts, _STORED_TYPES[fmt.precision])
        else:
            pool_tensors = {"pool": ov.Tensor(self.parts, list(self.parts.shape), _STORED_TYPES[fmt.precision])}
        for name, tensor in pool_tensors.items():  # bound once: the pool's array never moves
            self.compiled.request.set_tensor(name, tensor)
        self._bound: dict[str, np.ndarray] = {}  # the other inputs as the request reads them (`_call`)
        self.reach_told = 0  # paged: the longest context told to the plugin so far (`_paged`)

    def forward(self, x: np.ndarray, rows: Rows) -> np.ndarray:
        """The rows x [T, H] through the stage's layers; writes their keys and values (the pool has given the slots
        blocks for their positions). Paged: one call; gathered: one for the streams of each row count."""
        if self.paged:
            ends = rows.positions[rows.starts] + rows.counts
            table = self.pool.table(rows.group_slots, self.pool.blocks_for(int(ends.max())))
            return self._paged(x, rows.positions, rows.starts, rows.counts, table)
        out = np.empty_like(x)
        starts, counts = rows.starts, rows.counts
        for count in np.unique(counts).tolist():
            groups = np.flatnonzero(counts == count)
            picked = (starts[groups][:, None] + np.arange(count)).reshape(-1)
            out[picked] = self._gathered(x[picked], rows.slots[picked], rows.positions[picked], len(groups), count)
        return out

    def warm_up(self, sizes: Sequence[int], reach: int) -> None:
        """One stream's call at each of `sizes` rows, then the weights' file pages out of the process
        (`Compiled.drop_mapped_pages`), so that first requests are not slow, nor the weights held twice. Paged, the
        calls write into the pool's first blocks (before any stream holds them), and one more row tells the plugin
        that streams reach `reach` positions (at most `paged_attention.WARM_REACH`): it sizes its kernels for the
        longest context it has been told of and rebuilds them (10-15 ms here) whenever a call reaches further."""
        for count in sizes:
            count = min(count, self.pool.blocks * self.pool.block)  # rows the pool has room for
            x, positions = np.zeros((count, self.config.hidden_size), np.float32), np.arange(count)
            if self.paged:
                self._paged(x, positions, np.zeros(1, np.int64), np.array([count]),
                            np.arange(self.pool.blocks_for(count))[None])
            else:
                table = self.pool.table(np.zeros(1, np.int64), 1)  # its first block or 0: every entry is masked
                self._infer(x, positions, 1, count, table)
        if self.paged:
            x, one = np.zeros((1, self.config.hidden_size), np.float32), np.zeros(1, np.int64)
            self._paged(x, one, one, np.ones(1, np.int64), one[None], max(1, min(reach, paged_attention.WARM_REACH)))
        self.compiled.drop_mapped_pages()

    def _rotation(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """RoPE's cos and sin [T, 1, d] at the rows' positions."""
        angles = positions.astype(np.float32)[:, None, None] * self.inv_freq
        angles = np.concatenate([angles, angles], -1)  # each half of a head rotates by the same angles
        return {"cos": self.rope_factor * np.cos(angles), "sin": self.rope_factor * np.sin(angles)}

    def _paged(self, x: np.ndarray, positions: np.ndarray, starts: np.ndarray, counts: np.ndarray,
               table: np.ndarray, longest: int | None = None) -> np.ndarray:
        """The graph's output for the rows of streams starting at rows `starts` with `counts` rows each, `table`
        [G, b] their blocks (at least enough for each one's last row). `longest`: the context the plugin is told
        the longest stream reaches (default: the call's own; the op's single-row path costs in proportion), told
        further where that passes the furthest so far (`paged_attention.REACH_GROWTH`)."""
        first = positions[starts]
        held = -(-(first + counts) // self.pool.block)
        blocks = table[np.arange(table.shape[1]) < held[:, None]] * self.parts_a_block  # stream by stream
        longest = longest or int((first + counts).max())
        if longest > self.reach_told:  # the plugin rebuilds its kernels: tell it of more (`REACH_GROWTH`)
            longest = self.reach_told = max(longest, int(self.reach_told * paged_attention.REACH_GROWTH))
        i32 = np.int32
        self._call({"x": x, **self._rotation(positions), "past_lens": first.astype(i32),
                    "subsequence_begins": np.append(starts, len(x)).astype(i32), "block_indices": blocks.astype(i32),
                    "block_indices_begins": np.append(0, np.cumsum(held)).astype(i32),
                    "max_context_len": np.array(longest, i32)})
        return self._hidden()

    def _call(self, inputs: dict[str, np.ndarray]) -> None:
        """Run the graph on `inputs` by name (besides the pool's, bound once). Each is copied into the array the
        request already reads where it has that array's shape (decode steps repeat theirs), else bound anew: binding
        every input on every call made a decode step 1.04-1.07x as long at one stream on the race's models. The
        outputs stay readable until the next call."""
        request = self.compiled.request
        for name, array in inputs.items():
            bound = self._bound.get(name)
            if bound is not None and bound.shape == array.shape:
                np.copyto(bound, array)
            else:
                bound = np.array(array, order="C")
                request.set_tensor(name, ov.Tensor(bound, shared_memory=True))
                self._bound[name] = bound
        request.infer()

    def _hidden(self) -> np.ndarray:
        """A copy of the last call's output rows, in f32 (bf16 arrives as bit patterns typed float16)."""
        out = self.compiled.request.get_output_tensor(0).data
        return bf16_to_f32(out.view(np.uint16)) if self.out_type == ov.Type.bf16 else out.copy()

    def _gathered(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray, streams: int,
                  count: int) -> np.ndarray:
        """One call on `streams` streams of `count` rows each (a stream's rows consecutive); writes their keys and
        values."""
        first = positions[::count]
        table = self.pool.table(slots[::count], max(1, self.pool.blocks_for(int(first.max()))))
        self._infer(x, positions, streams, count, table)
        by_stream = (streams, count, self.kv_heads, self.head_dim)
        output = self.compiled.request.get_output_tensor
        for i, store in enumerate(self.stores):
            store.write(slots[::count], positions.reshape(streams, count), output(1 + 2 * i).data.reshape(by_stream),
                        output(2 + 2 * i).data.reshape(by_stream))
        return self._hidden()

    def _infer(self, x: np.ndarray, positions: np.ndarray, streams: int, count: int, table: np.ndarray) -> None:
        """The gathered graph's call on these rows, the streams' pool blocks `table` [G, b]: a row sees its
        stream's entries before the stream's first position in the call, and the call's rows up to its own."""
        first = positions[::count]  # [G]
        entries = np.arange(table.shape[1] * self.pool.block)
        seen = np.concatenate([np.broadcast_to(entries < first[:, None, None], (streams, count, len(entries))),
                               np.broadcast_to(np.tri(count, dtype=bool), (streams, count, count))], axis=2)
        mask = np.where(seen, np.float32(0), np.float32(-np.inf))[:, None]
        self._call({"x": x, **self._rotation(positions), "mask": mask, "table": table * self.parts_a_block})


def _stage_model(config, layers: range, tensors, formats: WeightFormats, places: list[tuple[int, int]],
                 stored: ov.Type, heads: int, paged: bool, out_type: ov.Type) -> ov.Model:
    """The graph: in x [T, H], cos and sin [T, 1, d]; paged, the streams' lengths, rows and blocks and the caches
    (`paged_attention.Inputs`); gathered, mask [G, 1, R, S + R], table [G, S / block] (each stream's blocks' first
    part in the pool's parts), pool [parts, kv, block, d] in the stored type. Out x in `out_type` (the compute
    precision); gathered, also each layer's new keys and values [T, kv, d]. `places[i]`: layer i's keys' and values'
    part in a block. The family's module builds each layer (`graph_layer`) around the attention built here."""
    _, kv_heads, d = config.heads(layers[0])
    x = ops.parameter([-1, config.hidden_size], ov.Type.f32, name="x")
    cos, sin = (ops.parameter([-1, 1, d], ov.Type.f32, name=name) for name in ("cos", "sin"))
    h, outputs, extra = x.output(0), [], []
    if paged:
        given = paged_attention.Inputs(kv_heads, d)
        inputs = [x, cos, sin, *given.parameters]
    else:
        given_mask = ops.parameter([-1, 1, -1, -1], ov.Type.f32, name="mask")
        table = ops.parameter([-1, -1], ov.Type.i64, name="table")
        pool = ops.parameter([-1, kv_heads, -1, d], stored, name="pool")
        inputs = [x, cos, sin, given_mask, table, pool]
        streams = ops.gather(ops.shape_of(table), ints(0), const(np.int64(0)))  # [1]: G
        frame = _Frame(streams, kv_heads, heads // kv_heads, d)
        # a K/V head's query rows: its g query heads' R rows each, head by head
        mask = ops.tile(given_mask, ints(1, 1, heads // kv_heads, 1)).output(0)
    for layer, parts in zip(layers, places):
        def attend(q: ov.Output, k: ov.Output, v: ov.Output, layer=layer, parts=parts) -> ov.Output:
            """q [T, h, d], k and v [T, kv, d], before RoPE -> attention over the pool and the frame [T, h d]."""
            q, k = _rope(q, cos, sin, d // 2), _rope(k, cos, sin, d // 2)
            if paged:
                rows = [ops.reshape(z, ints(0, -1), True).output(0) for z in (q, k, v)]
                blocks = ops.add(given.blocks, const(np.int32(parts[0]))).output(0)
                out, carried = paged_attention.stand_in(layer, *rows, blocks)
                extra.extend(carried)
                return out
            outputs.extend((k, v))  # to be written into the pool
            past = [frame.past(pool, ops.add(table, const(np.int64(part))).output(0)) for part in parts]
            keys, values = (ops.concat([p, frame.by_stream(z)], 2).output(0) for p, z in zip(past, (k, v)))
            attended = ops.scaled_dot_product_attention(frame.queries(q), keys, values, mask,
                                                        const(np.float32(d ** -0.5)), causal=False)
            return frame.rows(attended.output(0))

        h = host_layers(config).graph_layer(config, layer, tensors(layer), formats, h, attend)
    # The CPU plugin keeps in f32 whatever leads to an f32 output without passing a matmul: here the whole residual
    # stream, a reorder each side of every residual add. Out at the compute precision, the stream stays at it (as in
    # OpenVINO GenAI's graphs): 1.06x the decode at one stream on the race's Llama.
    out = h if out_type == ov.Type.f32 else ops.convert(h, out_type).output(0)
    return ov.Model([ops.result(out), *[ops.result(z) for z in outputs], *extra], inputs, "stage")


class _Frame:
    """Reshapes between the frame's rows [T, ...] (G streams of R rows) and attention's layout per stream."""

    def __init__(self, streams: ov.Output, kv_heads: int, group: int, head_dim: int):
        self.streams, self.kv_heads, self.group, self.head_dim = streams, kv_heads, group, head_dim

    def _shape(self, *dims) -> ov.Output:
        """[G, *dims] (-1 at most once among dims)."""
        return ops.concat([self.streams, ints(*dims)], 0).output(0)

    def by_stream(self, z: ov.Output) -> ov.Output:
        """A layer's new keys or values [T, kv, d] -> [G, kv, R, d]."""
        return ops.transpose(ops.reshape(z, self._shape(-1, self.kv_heads, self.head_dim), False),
                             ints(0, 2, 1, 3)).output(0)

    def queries(self, q: ov.Output) -> ov.Output:
        """[T, h, d] -> [G, kv, g R, d]: each K/V head's query heads, R rows each, as its query rows."""
        split = ops.reshape(q, self._shape(-1, self.kv_heads, self.group, self.head_dim), False)  # [G, R, kv, g, d]
        return ops.reshape(ops.transpose(split, ints(0, 2, 3, 1, 4)), self._shape(self.kv_heads, -1, self.head_dim),
                           False).output(0)

    def rows(self, attended: ov.Output) -> ov.Output:
        """[G, kv, g R, d] -> [T, h d]."""
        split = ops.reshape(attended, self._shape(self.kv_heads, self.group, -1, self.head_dim), False)
        return ops.reshape(ops.transpose(split, ints(0, 3, 1, 2, 4)),
                           ints(-1, self.kv_heads * self.group * self.head_dim), False).output(0)

    def past(self, pool: ov.Output, parts: ov.Output) -> ov.Output:
        """Each stream's pool entries [G, kv, S, d] in f32, from its blocks' parts [G, b]."""
        gathered = ops.convert(ops.gather(pool, parts, const(np.int64(0))), ov.Type.f32)  # [G, b, kv, block, d]
        return ops.reshape(ops.transpose(gathered, ints(0, 2, 1, 3, 4)), self._shape(self.kv_heads, -1, self.head_dim),
                           False).output(0)


def _rope(z: ov.Output, cos: ov.Output, sin: ov.Output, half: int) -> ov.Output:
    """z [T, heads, 2 half] rotated as `cascadia.engine.rope.rotate` does: z cos + rotate_half(z) sin, cos and sin
    [T, 1, 2 half], in the form the CPU plugin fuses into one RoPE kernel (halves sliced, not split)."""
    first = ops.slice(z, ints(0), ints(half), ints(1), ints(2))
    second = ops.slice(z, ints(half), ints(2 * half), ints(1), ints(2))
    rotated = ops.concat([ops.negative(second), first], -1)
    return ops.add(ops.multiply(z, cos), ops.multiply(rotated, sin)).output(0)
