"""One Inkling decoder layer on the host, in the order transformers' `modeling_inkling.py` computes it.

OpenVINO runs the weight-heavy blocks (`CompiledBlock`s: the q|k|v|r and o projections, the dense SwiGLU or the
experts) at the engine's precision on compressed weights, the input norm and q's head norm inside the first; what
lies between the blocks runs here in FP32, as the reference keeps it: the other norms, the four short convolutions
with their per-stream states, the router, attention with its relative-position bias (a prompt chunk's far keys
through OpenVINO's fused attention, also in FP32: see `cascadia.engine.attention`), residuals, and the FP32
restoration of the MLP's output.

    DecoderLayer.forward(x [T, H])
      q, k|v|r = q_norm(qkvr(input_layernorm(x)))         compiled; q's norm per head
      k, v = k_sconv(k), v_sconv(v)                       causal, over each stream's last K-1 inputs
      k = k_norm(k)                                       per head
      a = attention(q, k, v) + relative bias(r)           over each stream's keys; log-scaled on global layers
      x = x + attn_sconv(o_proj(a))                       compiled o_proj
      h = post_attention_layernorm(x)
      m = SwiGLU(h) * global_scale                        dense layers, compiled
        | routed(h, router(h)) + shared(h)                MoE layers, compiled, fused or expert-grouped by the
                                                          call's rows; FP32 restoration around them
      x = x + mlp_sconv(m)

Shapes: T rows of one call (several streams, each at its own positions), n one stream's rows in it, H hidden,
h query heads, kv key/value heads, d head dim, r d_rel, X a layer's bias extent (distances 0..X-1), m keys
attended, K convolution kernel, C a convolution's channels, k routed experts per row,
S shared experts.

What stays on the host, and why: the short convolutions and attention read and write each stream's state (rings,
blocks, histories), and the router's choice is the host's to steer (calibration times a frame's MoE at a chosen
number of distinct experts; the expert-grouped path sorts rows by it), so the post-attention norm that feeds it
stays here too.

FP32 restoration (the paper's scheme for FP16 expert arithmetic; FP16 overflows above 65504): the build divides the
up projections by A = 2^n (`layer_build.up_divisor`), which divides silu(gate) * up, the down projection and the
MLP's output by A; per row, the routing weights are divided by F = 2^ceil(log2 max(1, sum |w|)) (`row_factor`), so
the weighted sum of expert outputs is no larger than the largest expert output. The host multiplies by A * F in
FP32: exact in every precision, short of underflow.
"""

from __future__ import annotations

import attrs
import numpy as np

from cascadia.engine.attention import AttentionShape, KeyStore, attend
from cascadia.engine.device import Compiled, CompiledBlock
from cascadia.engine.grouped_moe import GroupedBlock
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.policy import padded_size


# ---- norms, softmax, short convolutions ----------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (the mean as np.mean takes it, sum / n, without its
    per-call overhead: a decode step makes dozens of these calls on single rows)."""
    variance = np.square(x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def head_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm of rows [T, heads * d] -> [T, heads, d]."""
    return rms_norm(x.reshape(x.shape[0], -1, weight.shape[0]), weight, eps)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def short_conv(y: np.ndarray, taps: np.ndarray, states: np.ndarray, rows: Rows,
               fmt: StateFormat = StateFormat()) -> np.ndarray:
    """Depthwise causal convolution over each stream's history, plus the residual: y + conv(y), y [T, C].
    `taps` [K, C], the convolution's weight transposed (tap K-1 meets the current row); `states` [slots, K-1, C],
    the streams' last K-1 inputs stored in `fmt`, is updated in place."""
    group_slots = rows.group_slots
    history = np.concatenate([fmt.decode(states[group_slots]).reshape(-1, y.shape[1]), y])
    conv = (history[rows.conv_taps] * taps).sum(axis=1)
    states[group_slots] = fmt.encode(history[rows.conv_keep])
    return conv + y


def conv_taps(*weights: np.ndarray) -> np.ndarray:
    """Convolution weights [C, 1, K] (several side by side, as their channels in one projection) as taps [K, C]."""
    return np.ascontiguousarray(np.concatenate([w[:, 0, :] for w in weights]).T)


# ---- the router --------------------------------------------------------------------------------------------------
@attrs.frozen
class Routing:
    index: np.ndarray  # [T, k] int32 routed experts of each row
    weights: np.ndarray  # [T, k] their weights
    shared_weights: np.ndarray  # [T, S] weights of the shared experts


@attrs.frozen(eq=False)
class Router:
    """Logits in FP32 over routed then shared experts (so close scores do not tie before top-k); selection by top-k
    of sigmoid(logit) + correction; weights a softmax over the log-sigmoid of the selected and shared logits (the
    shared experts are the sink), times route_scale * global_scale."""

    weight: np.ndarray  # [E + S, H]
    correction: np.ndarray  # [E] e_score_correction_bias: shifts selection, not weights
    route_scale: float
    global_scale: np.ndarray  # [1]
    top_k: int

    def __call__(self, h: np.ndarray) -> Routing:
        n_routed = self.correction.shape[0]
        logits = h @ self.weight.T
        routed = logits[:, :n_routed]
        choice = 1 / (1 + np.exp(-routed)) + self.correction
        index = np.argpartition(-choice, self.top_k - 1, axis=1)[:, : self.top_k]
        chosen = np.concatenate([routed[np.arange(len(h))[:, None], index], logits[:, n_routed:]], axis=1)
        weights = softmax(log_sigmoid(chosen), axis=1) * (np.float32(self.route_scale) * self.global_scale)
        return Routing(index.astype(np.int32), weights[:, : self.top_k], weights[:, self.top_k:])


def row_factor(*weights: np.ndarray) -> np.ndarray:
    """F [T, 1] = 2^ceil(log2 max(1, sum |w|)) over all of a row's routing weights (see the module's text)."""
    total = sum(np.abs(w).sum(axis=1, keepdims=True) for w in weights)
    return np.exp2(np.ceil(np.log2(np.maximum(total, 1)))).astype(np.float32)


class SlotState:
    """A layer's state for every slot: its keys and values (`kv`: a ring of the stage's pool's blocks per stream on a
    sliding layer, blocks of it on a global one) and the last K-1+rewind inputs of its short convolutions
    [slots, K-1+rewind, C] (those of k and v side by side: they run as one; `rewind`, the positions a stream
    may step back, see `cascadia.engine.rows`), all stored in `fmt`. Zero-filled, so pages are only committed as
    slots fill."""

    def __init__(self, kv: KeyStore, hidden: int, kernel: int, slots: int, fmt: StateFormat = StateFormat(),
                 rewind: int = 0):
        self.kv, self.fmt = kv, fmt
        kv_width = kv.k.shape[1] * kv.k.shape[3]
        history = kernel - 1 + rewind
        self.conv_kv = fmt.zeros((slots, history, 2 * kv_width))
        self.conv_attn = fmt.zeros((slots, history, hidden))
        self.conv_mlp = fmt.zeros((slots, history, hidden))

    @property
    def nbytes(self) -> int:
        """Of the convolution states (the keys and values are the stage's pool's)."""
        return sum(a.nbytes for a in (self.conv_kv, self.conv_attn, self.conv_mlp))

    def release(self, slot: int) -> None:
        """Ready a slot for a new stream. Stale K/V need no clearing: a stream only reads entries it wrote (its
        blocks go back to the pool with `BlockPool.release`, once for all layers)."""
        for states in (self.conv_kv, self.conv_attn, self.conv_mlp):
            states[slot] = 0


# ---- the layer ---------------------------------------------------------------------------------------------------
@attrs.define(eq=False, slots=False)  # no slots: calibration times a layer's methods by wrapping them
class DecoderLayer:
    """A layer's FP32 host weights and compiled blocks (made by `cascadia.engine.layer_build.build_layer`)."""

    shape: AttentionShape
    eps: float
    post_norm: np.ndarray  # [H]
    k_norm: np.ndarray  # [d]
    rel_bank: np.ndarray  # [r, X]
    conv_kv: np.ndarray  # taps [K, 2 kv d]: k's then v's
    conv_attn: np.ndarray  # taps [K, H]
    conv_mlp: np.ndarray  # taps [K, H]
    kv_width: int  # 2 kv d: k's then v's columns, first of the k|v|r output
    qkvr: CompiledBlock  # x [T, H] -> q [T, h d] (normed, per head), k|v|r [T, 2 kv d + h r] (`graphs.attention_input`)
    o_proj: CompiledBlock  # [T, h d] -> [T, H]
    mlp: CompiledBlock | None  # dense: [T, H] -> [T, H]; MoE: (x, index, weights, shared weights) -> [T, H] (None:
    # a MoE layer whose every call runs `grouped`)
    up_divisor: float  # A of the FP32 restoration
    router: Router | None = None  # MoE layers
    output_scale: np.ndarray | None = None  # dense layers: the MLP's global_scale [1]
    dense_slices: int | None = None  # dense layers run as this many all-active expert slices
    grouped: GroupedBlock | None = None  # MoE layers: the same experts, expert-grouped (`graphs.moe_grouped`)
    grouped_from: int | None = None  # calls of at least this many rows (their bucket) run `grouped`, not `mlp`

    def blocks(self) -> list[Compiled]:
        return [block for block in (self.qkvr, self.o_proj, self.mlp, self.grouped) if block is not None]

    def runs_grouped(self, bucket: int) -> bool:
        """Whether a call of `bucket` rows runs the expert-grouped MoE."""
        return self.grouped is not None and self.grouped_from is not None and bucket >= self.grouped_from

    def forward(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream of the rows -> after this layer. Updates the rows' slots in `state`."""
        attn = self.o_proj(self.attention(x, rows, state), bucket=rows.bucket)[0]
        x = x + short_conv(attn, self.conv_attn, state.conv_attn, rows, state.fmt)
        h = rms_norm(x, self.post_norm, self.eps)
        return x + short_conv(self.feed_forward(h, rows.bucket), self.conv_mlp, state.conv_mlp, rows, state.fmt)

    def attention(self, x: np.ndarray, rows: Rows, state: SlotState) -> np.ndarray:
        """x [T, H], the residual stream -> attention output [T, h d], before o_proj."""
        q, kvr = self.qkvr(x, bucket=rows.bucket)
        k, v = np.split(short_conv(kvr[:, :self.kv_width], self.conv_kv, state.conv_kv, rows, state.fmt), 2, axis=1)
        q, r = q.reshape(len(q), self.shape.heads, -1), kvr[:, self.kv_width:]
        k = head_rms_norm(k, self.k_norm, self.eps)
        v = v.reshape(k.shape)
        rel = r.reshape(len(r), self.shape.heads, -1) @ self.rel_bank  # [T, h, X]: bias per distance
        out = np.empty((len(x), self.shape.heads * self.shape.head_dim), np.float32)
        for count in np.unique(rows.counts).tolist():  # streams with as many rows in one call: all decode rows
            groups = np.flatnonzero(rows.counts == count)
            part = rows.starts[groups][:, None] + np.arange(count)  # [G, n] rows of these streams
            out[part] = attend(self.shape, q[part], k[part], v[part], rel[part], state.kv,
                               rows.group_slots[groups], rows.positions[rows.starts[groups]])
        return out

    def expert_inputs(self, h: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """A MoE layer's block inputs for rows h [T, H] (h, index, weights / F, shared weights / F), and F [T, 1]."""
        routing = self.router(h)
        factor = row_factor(routing.weights, routing.shared_weights)
        return (h, routing.index, routing.weights / factor, routing.shared_weights / factor), factor

    def feed_forward(self, h: np.ndarray, bucket: int | None = None) -> np.ndarray:
        """The MLP of the rows h [T, H], restored to full scale in FP32; the blocks run at `bucket` rows (None: the
        smallest bucket that holds them)."""
        if self.router is None:
            if self.dense_slices:
                out = self.mlp(h, np.ones((len(h), self.dense_slices), np.float32), bucket=bucket)[0]
            else:
                out = self.mlp(h, bucket=bucket)[0]
            return out * np.float32(self.up_divisor) * self.output_scale
        inputs, factor = self.expert_inputs(h)
        if self.mlp is None or self.runs_grouped(padded_size(len(h), self.mlp.buckets) if bucket is None else bucket):
            out = self.grouped(*inputs)
        else:
            out = self.mlp(*inputs, bucket=bucket)[0]
        return out * (np.float32(self.up_divisor) * factor)
