"""What each part of a model costs: parameters, stored bytes, bytes and FLOPs per decode row, state.

Shapes come from the model's family (`cascadia.models`: the checkpoint layout); bytes from the spec's weight
formats. Conventions:
- `params` counts every stored tensor, as transformers builds it (the LM head has `vocab_size` rows).
- Bytes and FLOPs of the head use the rows the checkpoint stores and the logits produced: `unpadded_vocab_size`.
- Small tensors (norms, convolution weights, the router, the relative-bias bank) are stored in f32 whatever the
  format; the router is f32 because routing is computed in FP32.
- FLOPs are matmul FLOPs (2 per multiply-add): 2 per weight of each matrix, plus those the family names on f32
  vectors (`extra_row_flops`); norms, convolutions and activations are left out.
- K/V and convolution states use the runtime's `kv_precision`, and are counted as the engine allocates them: a
  sliding layer keeps window - 1 + (the largest row bucket) K/V entries. A short convolution of kernel K keeps the
  previous K - 1 inputs of its channels (K - 1 + MAX_DRAFT with speculation: `cascadia.engine.rows`), where the
  family has them.
"""

from __future__ import annotations

import math

import attrs

from cascadia.models import family
from cascadia.models.base import LayerKind
from cascadia.models import names
from cascadia.policy import stream_blocks
from cascadia.spec.types import ModelSpec, RuntimeSpec
from cascadia.speculation import MTP

STATE_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
VECTOR_BYTES = 4  # small tensors are f32
ACTIVATION_BYTES = 4  # FP32 per element between ops

# Op kinds of a decoder layer, in dataflow order; each checkpoint tensor belongs to one (a family's `op_kind`).
LAYER_KINDS = ("input_norm", "attention", "attn_sconv", "post_norm", "router", "routed_experts", "shared_experts",
               "dense_mlp", "mlp_sconv")
# Op kinds outside the decoder layers.
EMBEDDING, FINAL_NORM, HEAD, SAMPLER = "embedding", "final_norm", "head", "sampler"

@attrs.frozen
class OpCost:
    """One op of the dataflow graph (tensors used together): its size, and what one decode row reads and computes."""

    kind: str
    params: int
    active_params: int  # parameters one row uses
    weight_bytes: int  # stored bytes
    bytes_per_row: int  # weight bytes one decode row reads
    flops_per_row: float


@attrs.frozen
class LayerCost:
    """One decoder layer: what it stores, what one decode row reads and computes, what state a stream keeps."""

    layer: int
    attention: LayerKind  # SLIDING | GLOBAL
    mlp: LayerKind  # DENSE | MOE
    params: int  # all parameters of the layer
    active_params: int  # parameters one token uses (top-k routed + shared experts, or the dense MLP)
    weight_bytes: int  # stored bytes under the spec's formats (scales and zero points included)
    held_bytes: int  # what the engine holds of them: the experts once per MoE path it builds (`moe_paths`)
    bytes_per_row: int  # weight bytes one decode row reads (attention + router + top-k experts + shared, or dense)
    expert_bytes: int  # bytes of ONE routed expert (0 for dense layers)
    flops_per_row: float  # matmul FLOPs of one row at context 0
    attn_flops_per_position: float  # extra FLOPs per row per attended position (QK and PV)
    kv_bytes_per_position: int  # K+V (or latent) bytes per position per stream
    kv_window: int | None  # K/V entries a sliding layer keeps, whatever the context (`kv_entries`); None = all
    conv_state_bytes: int  # the four short-convolution states per stream

    def kv_positions(self, context: int) -> int:
        return context if self.kv_window is None else min(context, self.kv_window)

    def state_bytes(self, context: int) -> int:
        """K/V and convolution state of one stream of `context` positions."""
        return self.kv_bytes_per_position * self.kv_positions(context) + self.conv_state_bytes

    @property
    def pool_bytes_per_position(self) -> int:
        """K/V bytes a stream takes from the stage's pool per position: a global layer's (0 on a sliding one)."""
        return self.kv_bytes_per_position if self.kv_window is None else 0

    @property
    def ring_bytes_per_entry(self) -> int:
        """K/V bytes of one entry of a sliding layer's ring (0 on a global one)."""
        return 0 if self.kv_window is None else self.kv_bytes_per_position


@attrs.frozen
class EndCost:
    """The embedding (with its norm) or the head (final norm and LM head)."""

    params: int
    weight_bytes: int
    bytes_per_row: int
    flops_per_row: float


def _tensor_bytes(model: ModelSpec, shape: tuple[int, ...], group: str) -> int:
    """Stored bytes of a tensor; stacked matrices ([n, rows, cols]) are quantised matrix by matrix."""
    if group == names.VECTOR:
        return math.prod(shape) * VECTOR_BYTES
    fmt = getattr(model.formats, group)
    *stack, rows, cols = shape
    return math.prod(stack) * fmt.matrix_bytes(rows, cols)


def _matmul_flops(shape: tuple[int, ...]) -> float:
    return 2.0 * math.prod(shape)


def layer_ops(model: ModelSpec, layer: int) -> dict[str, OpCost]:
    """The costs of each op kind present in a decoder layer, in dataflow order."""
    cfg, fam = model.config, family(model.config)
    by_kind: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for name, (shape, group) in fam.layer_tensors(cfg, layer).items():
        by_kind.setdefault(fam.op_kind(name), []).append((shape, group))
    extra_flops = fam.extra_row_flops(cfg, layer)
    ops = {}
    for kind in (k for k in LAYER_KINDS if k in by_kind):
        entries = by_kind[kind]
        params = sum(math.prod(shape) for shape, _ in entries)
        weight_bytes = sum(_tensor_bytes(model, shape, group) for shape, group in entries)
        flops = sum(_matmul_flops(shape) for shape, group in entries if group != names.VECTOR)
        flops += extra_flops.get(kind, 0.0)
        active, row_bytes = params, weight_bytes
        if kind == "routed_experts":
            # one row reads top_k of the n_routed_experts stacked experts
            n, k = cfg.routed_experts
            active, row_bytes, flops = params // n * k, weight_bytes // n * k, flops / n * k
        ops[kind] = OpCost(kind, params, active, weight_bytes, row_bytes, flops)
    return ops


def conv_state_bytes(model: ModelSpec, layer: int, kv_precision: str, rewind: int = 0) -> dict[str, int]:
    """Bytes of the short-convolution states of one stream, by the op kind that owns them (`rewind`: the positions a
    speculating stream may step back, whose inputs they keep too); none for a family without them."""
    cfg, fam = model.config, family(model.config)
    channels = fam.conv_state_channels(cfg, layer)
    per_channel = (fam.conv_history(cfg) + rewind) * STATE_DTYPE_BYTES[kv_precision] if channels else 0
    return {kind: n * per_channel for kind, n in channels.items()}


def kv_bytes_per_position(model: ModelSpec, layer: int, kv_precision: str) -> int:
    return model.config.kv_values(layer) * STATE_DTYPE_BYTES[kv_precision]


def layer_costs(model: ModelSpec, runtime: RuntimeSpec = RuntimeSpec()) -> list[LayerCost]:
    """Every decoder layer's costs, with its state as the engine keeps it under `runtime` (`kv_precision`; a
    sliding layer's entries depend on the largest row bucket: the config's `kv_entries`)."""
    cfg, kv_precision = model.config, runtime.kv_precision
    out = []
    for layer in range(cfg.num_hidden_layers):
        ops = layer_ops(model, layer).values()
        routed = [op for op in ops if op.kind == "routed_experts"]
        weight_bytes = sum(op.weight_bytes for op in ops)
        experts = sum(op.weight_bytes for op in ops if op.kind in ("routed_experts", "shared_experts"))
        out.append(LayerCost(
            layer=layer,
            attention=cfg.attention_kind(layer),
            mlp=cfg.mlp_kind(layer),
            params=sum(op.params for op in ops),
            active_params=sum(op.active_params for op in ops),
            weight_bytes=weight_bytes,
            held_bytes=weight_bytes + experts * (len(runtime.moe_paths) - 1),
            bytes_per_row=sum(op.bytes_per_row for op in ops),
            expert_bytes=routed[0].weight_bytes // cfg.routed_experts[0] if routed else 0,
            flops_per_row=sum(op.flops_per_row for op in ops),
            attn_flops_per_position=2.0 * cfg.attention_macs(layer),
            kv_bytes_per_position=kv_bytes_per_position(model, layer, kv_precision),
            kv_window=cfg.kv_entries(layer, math.inf, runtime.largest_bucket) if cfg.is_sliding(layer) else None,
            conv_state_bytes=sum(conv_state_bytes(model, layer, kv_precision, runtime.max_draft).values()),
        ))
    return out


def end_ops(model: ModelSpec) -> dict[str, OpCost]:
    """The ops outside the decoder layers: embedding (with its norm), final norm and LM head.

    The whole embedding table counts as active (the usual convention: 41.06B active for Inkling), though a row
    reads only its own table row. The head's bytes and FLOPs count the stored rows (`output_vocab_size`).
    """
    cfg, fam = model.config, family(model.config)
    hidden, vector = cfg.hidden_size, cfg.hidden_size * VECTOR_BYTES
    embedding = fam.embedding_tensors(cfg)
    embed_shape, head = embedding[names.EMBED][0], fam.head_tensors(cfg).get(names.HEAD)
    # beside the table, f32 vectors (Inkling's embedding norm), read whole by every row
    vectors = sum(math.prod(shape) for name, (shape, _) in embedding.items() if name != names.EMBED)
    # a tied head is the embedding's table, counted there; its stage still holds (and reads) it in the head's format
    embed_params, head_params = math.prod(embed_shape) + vectors, math.prod(head[0]) if head else 0
    head_bytes = model.formats.head.matrix_bytes(cfg.output_vocab_size, hidden)
    return {
        EMBEDDING: OpCost(EMBEDDING, embed_params, embed_params,
                          weight_bytes=_tensor_bytes(model, embed_shape, "embedding") + vectors * VECTOR_BYTES,
                          bytes_per_row=model.formats.embedding.matrix_bytes(1, hidden) + vectors * VECTOR_BYTES,
                          flops_per_row=0.0),
        FINAL_NORM: OpCost(FINAL_NORM, hidden, hidden, vector, vector, 0.0),
        HEAD: OpCost(HEAD, head_params, head_params, head_bytes, head_bytes,
                     flops_per_row=_matmul_flops((cfg.output_vocab_size, hidden))),
    }


def _end_cost(*ops: OpCost) -> EndCost:
    return EndCost(params=sum(op.params for op in ops), weight_bytes=sum(op.weight_bytes for op in ops),
                   bytes_per_row=sum(op.bytes_per_row for op in ops),
                   flops_per_row=sum(op.flops_per_row for op in ops))


def embedding_cost(model: ModelSpec) -> EndCost:
    return _end_cost(end_ops(model)[EMBEDDING])


def head_cost(model: ModelSpec) -> EndCost:
    """The final norm and the LM head."""
    ops = end_ops(model)
    return _end_cost(ops[FINAL_NORM], ops[HEAD])


def state_bytes(costs: list[LayerCost], context: int) -> int:
    """K/V and convolution state of one stream of `context` positions over a slice of layers."""
    return sum(c.state_bytes(context) for c in costs)


@attrs.frozen
class PoolLayout:
    """How a stage's K/V pool is cut (`cascadia.engine.kv_store.BlockPool`). A block holds `kv_block` positions of
    every global layer's keys and values, or, lent to a ring, `ring_entries_per_block` entries of one sliding
    layer's (every sliding layer's entry has the same size): `block_bytes`, a whole number of the first so that
    each global layer's part of every block can be gathered as one array, holds at least one of the second.
    A stream holds `ring_layer_blocks` blocks for its ring on each of the `sliding_layers` whatever its length, and
    on a stage with global layers (`paged`) a block per `kv_block` positions."""

    block_bytes: int
    kv_block: int
    paged: bool
    sliding_layers: int
    ring_entries_per_block: int  # 0: no sliding layer
    ring_layer_blocks: int  # of one layer's ring

    @property
    def ring_blocks(self) -> int:
        """Of all of a stream's rings."""
        return self.sliding_layers * self.ring_layer_blocks

    @classmethod
    def of(cls, global_bytes: int, ring_entry_bytes: int, sliding_layers: int, ring_entries: int,
           kv_block: int) -> PoolLayout | None:
        """From the K+V bytes of one position over the stage's global layers, and of one ring entry of one sliding
        layer; None for a stage with neither."""
        if not global_bytes and not sliding_layers:
            return None
        if global_bytes:
            block_bytes = global_bytes * kv_block * max(1, -(-ring_entry_bytes // (global_bytes * kv_block)))
        else:
            block_bytes = ring_entry_bytes * kv_block
        per_block = block_bytes // ring_entry_bytes if sliding_layers else 0
        return cls(block_bytes, kv_block, global_bytes > 0, sliding_layers, per_block,
                   -(-ring_entries // per_block) if per_block else 0)

    def stream_blocks(self, positions: int) -> int:
        """Blocks one stream of `positions` positions holds."""
        return stream_blocks(positions, self.kv_block, self.ring_blocks, self.paged)

    def least_blocks(self, streams: int, context: int) -> int:
        """What a plan asks of the pool: rings for `streams` streams at once, one of which reaches `context`."""
        return self.stream_blocks(context) + (streams - 1) * self.ring_blocks


def pool_layout(costs: list[LayerCost], runtime: RuntimeSpec) -> PoolLayout | None:
    """The K/V pool of a stage of these layers (None: no attention state to pool)."""
    sliding = [c for c in costs if c.kv_window is not None]
    if len({(c.ring_bytes_per_entry, c.kv_window) for c in sliding}) > 1:
        raise ValueError("sliding layers whose ring entries differ in size or number cannot share a pool's blocks")
    entries = sliding[0].kv_positions(runtime.context_budget) if sliding else 0
    return PoolLayout.of(sum(c.pool_bytes_per_position for c in costs),
                         sliding[0].ring_bytes_per_entry if sliding else 0, len(sliding), entries, runtime.kv_block)


def least_state_bytes(costs: list[LayerCost], runtime: RuntimeSpec) -> int:
    """The least state a stage of these layers must be able to hold: every slot's convolution states for
    `runtime.max_streams` slots, and K/V pool blocks for their rings and for one stream at the context budget."""
    layout = pool_layout(costs, runtime)
    pool = layout.least_blocks(runtime.max_streams, runtime.context_budget) * layout.block_bytes if layout else 0
    return runtime.max_streams * sum(c.conv_state_bytes for c in costs) + pool


def mtp_cost(model: ModelSpec, runtime: RuntimeSpec) -> LayerCost:
    """The model's multi-token-prediction layer (`cascadia.engine.mtp`), as a decoder layer's costs with what
    surrounds its decoder layer (its norms, `eh_proj`) folded in; its state as it keeps it under `runtime`
    (`kv_precision`; its convolutions never step back). The embedding rows it reads are not in it."""
    cfg, fam = model.config, family(model.config)
    layer_config = fam.mtp_config(cfg)
    layer = layer_costs(attrs.evolve(model, config=layer_config), attrs.evolve(runtime, speculate=None))[0]
    decoder = fam.layer_tensors(layer_config, 0)
    around = [entry for name, entry in fam.mtp_tensors(cfg).items() if name not in decoder]
    params = sum(math.prod(shape) for shape, _ in around)
    stored = sum(_tensor_bytes(model, shape, group) for shape, group in around)
    flops = sum(_matmul_flops(shape) for shape, group in around if group != names.VECTOR)
    return attrs.evolve(layer, params=layer.params + params, active_params=layer.active_params + params,
                        weight_bytes=layer.weight_bytes + stored, held_bytes=layer.held_bytes + stored,
                        bytes_per_row=layer.bytes_per_row + stored, flops_per_row=layer.flops_per_row + flops)


def mtp_memory(model: ModelSpec, runtime: RuntimeSpec, embed: bool) -> tuple[int, int]:
    """What drafting with the model's multi-token-prediction layer (`runtime.speculate` names mtp; (0, 0)
    otherwise) adds to the stage holding the head, as `cascadia.engine.mtp` allocates it: the layer's weights, and
    the embedding table it reads where the stage does not embed; and its state, whole from the start: every slot's
    convolution states, K/V up to the context budget plus the drafts, and the rows it may hold back (a largest row
    bucket's: f32 hidden states and i32 tokens)."""
    if MTP not in runtime.drafters:
        return 0, 0
    layer = mtp_cost(model, runtime)
    positions = runtime.blocks_for(runtime.context_budget + runtime.max_draft) * runtime.kv_block
    held = runtime.row_buckets[-1] * (model.config.hidden_size + 1) * 4
    state = runtime.max_streams * (layer.conv_state_bytes + positions * layer.kv_bytes_per_position + held)
    return layer.held_bytes + (0 if embed else embedding_cost(model).weight_bytes), state


def stage_memory(model: ModelSpec, runtime: RuntimeSpec, layers: range, embed: bool, head: bool) -> tuple[int, int]:
    """What a stage holding `layers` (and the embedding, the head) needs at least, as the planner counts it: its
    weight bytes as the engine holds them, and `least_state_bytes` (and, holding the head, `mtp_memory`)."""
    costs = layer_costs(model, runtime)[layers.start:layers.stop]
    ends = (embed and embedding_cost(model).weight_bytes) + (head and head_cost(model).weight_bytes)
    mtp_weights, mtp_state = mtp_memory(model, runtime, embed) if head else (0, 0)
    return sum(c.held_bytes for c in costs) + ends + mtp_weights, least_state_bytes(costs, runtime) + mtp_state
