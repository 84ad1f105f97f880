"""One Inkling decoder layer on the host, in the order transformers' `modeling_inkling.py` computes it, and its
build from a checkpoint's tensors.

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

The MLP and its FP32 restoration (the paper's scheme for FP16 expert arithmetic) are every family's:
`cascadia.engine.mlp`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import numpy as np

from cascadia.engine import graphs
from cascadia.engine.attention import AttentionShape, KeyStore, attend_rows
from cascadia.engine.device import Compiled, CompiledBlock
from cascadia.engine.layer_build import Chunk, Compile, CompileGrouped, moe_blocks, stack_chunks, swiglu_block
from cascadia.engine.layers import Routing, head_rms_norm, log_sigmoid, rms_norm, router_logits, softmax
from cascadia.engine.mlp import Mlp
from cascadia.engine.rows import Rows
from cascadia.engine.state_format import StateFormat
from cascadia.models import inkling as names
from cascadia.models.inkling import InklingConfig
from cascadia.spec.types import WeightFormats


# ---- short convolutions -------------------------------------------------------------------------------------------
def short_conv(y: np.ndarray, taps: np.ndarray, states: np.ndarray, rows: Rows,
               fmt: StateFormat = StateFormat()) -> np.ndarray:
    """Depthwise causal convolution over each stream's history, plus the residual: y + conv(y), y [T, C].
    `taps` [K, C], the convolution's weight transposed (tap K-1 meets the current row); `states` [slots, K-1, C],
    the streams' last K-1 inputs stored in `fmt`, is updated in place. A row's earlier inputs are taken as `fmt`
    stores them, whether they come from the state or from earlier rows of the same call (a prompt's chunk, a
    replay), so that a stream's results do not depend on how its tokens were split into calls; its own input is
    taken exact."""
    group_slots = rows.group_slots
    stored = np.concatenate([fmt.decode(states[group_slots]).reshape(-1, y.shape[1]), fmt.decode(fmt.encode(y))])
    inputs = stored[rows.conv_taps]  # [T, K, C]
    inputs[:, -1] = y
    conv = (inputs * taps).sum(axis=1)
    states[group_slots] = fmt.encode(stored[rows.conv_keep])
    return conv + y


def conv_taps(*weights: np.ndarray) -> np.ndarray:
    """Convolution weights [C, 1, K] (several side by side, as their channels in one projection) as taps [K, C]."""
    return np.ascontiguousarray(np.concatenate([w[:, 0, :] for w in weights]).T)


# ---- the router --------------------------------------------------------------------------------------------------
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
        logits = router_logits(h, self.weight)
        routed = logits[:, :n_routed]
        choice = 1 / (1 + np.exp(-routed)) + self.correction
        index = np.argpartition(-choice, self.top_k - 1, axis=1)[:, : self.top_k]
        chosen = np.concatenate([routed[np.arange(len(h))[:, None], index], logits[:, n_routed:]], axis=1)
        weights = softmax(log_sigmoid(chosen), axis=1) * (np.float32(self.route_scale) * self.global_scale)
        return Routing(index.astype(np.int32), weights[:, : self.top_k], weights[:, self.top_k:])


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

    def fork(self, source: int, target: int) -> None:
        """Start `target`'s convolution states as `source`'s stand (its keys and values: `BlockPool.fork`)."""
        for states in (self.conv_kv, self.conv_attn, self.conv_mlp):
            states[target] = states[source]

    def saved(self, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        """Copies of the slots' convolution states, for `restore` (keys and values past a slot's length are never
        read, so they need none)."""
        return tuple(states[slots] for states in (self.conv_kv, self.conv_attn, self.conv_mlp))

    def restore(self, slots: np.ndarray, saved: tuple[np.ndarray, ...]) -> None:
        for states, kept in zip((self.conv_kv, self.conv_attn, self.conv_mlp), saved, strict=True):
            states[slots] = kept


# ---- the layer ---------------------------------------------------------------------------------------------------
@attrs.define(eq=False, slots=False, kw_only=True)  # no slots: calibration times a layer's methods by wrapping them
class DecoderLayer(Mlp):
    """A layer's FP32 host weights and compiled blocks (made by `build_layer`), its MLP's among them."""

    shape: AttentionShape
    eps: float
    k_norm: np.ndarray  # [d]
    rel_bank: np.ndarray  # [r, X]
    conv_kv: np.ndarray  # taps [K, 2 kv d]: k's then v's
    conv_attn: np.ndarray  # taps [K, H]
    conv_mlp: np.ndarray  # taps [K, H]
    kv_width: int  # 2 kv d: k's then v's columns, first of the k|v|r output
    qkvr: CompiledBlock  # x [T, H] -> q [T, h d] (normed, per head), k|v|r [T, 2 kv d + h r] (`graphs.attention_input`)
    o_proj: CompiledBlock  # [T, h d] -> [T, H]

    def blocks(self) -> list[Compiled]:
        return [block for block in (self.qkvr, self.o_proj, self.mlp, self.grouped) if block is not None]

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
        return attend_rows(self.shape, q, k, v, rel, state.kv, rows)


# ---- the build from a checkpoint's tensors ----------------------------------------------------------------------
def build_layer(cfg: InklingConfig, layer: int, t: Mapping[str, np.ndarray], formats: WeightFormats,
                compile: Compile, dense_slices: int | None = None, compile_grouped: CompileGrouped | None = None,
                fused: bool = True) -> DecoderLayer:
    """Layer `layer` from its float32 tensors `t` by name relative to its prefix (`Checkpoint.layer`): the host
    weights it keeps in FP32 and the blocks it compiles (`cascadia.engine.families` says what the arguments
    do)."""
    heads, kv_heads, head_dim = cfg.heads(layer)
    log_scaling = None
    if not cfg.is_sliding(layer) and cfg.log_scaling_n_floor is not None:
        log_scaling = (cfg.log_scaling_n_floor, cfg.log_scaling_alpha)
    shape = AttentionShape(heads, kv_heads, head_dim, cfg.sliding_window_size if cfg.is_sliding(layer) else None,
                           cfg.layer_rel_extent(layer), log_scaling, scale=1 / head_dim)  # q, k RMS-normalised
    qkvr = [t[name] for name in (names.Q_PROJ, names.K_PROJ, names.V_PROJ, names.R_PROJ)]
    post_norm = t[names.POST_NORM]
    common = dict(
        shape=shape, eps=cfg.rms_norm_eps, post_norm=post_norm, k_norm=t[names.K_NORM], rel_bank=t[names.REL_BANK],
        conv_kv=conv_taps(t[names.K_SCONV], t[names.V_SCONV]), conv_attn=conv_taps(t[names.ATTN_SCONV]),
        conv_mlp=conv_taps(t[names.MLP_SCONV]), kv_width=2 * qkvr[1].shape[0],
        qkvr=compile(graphs.attention_input(qkvr, formats.attention, t[names.INPUT_NORM], t[names.Q_NORM],
                                            cfg.rms_norm_eps)),
        o_proj=compile(graphs.projection([t[names.O_PROJ]], formats.attention)))
    if cfg.is_dense(layer):
        mlp, divisor = swiglu_block(t[names.DENSE_GATE], t[names.DENSE_UP], t[names.DENSE_DOWN], post_norm,
                                    formats.dense_mlp, compile, dense_slices)
        return DecoderLayer(**common, mlp=mlp, up_divisor=divisor, output_scale=t[names.DENSE_SCALE],
                            dense_slices=dense_slices)
    router = Router(t[names.ROUTER], t[names.ROUTER_CORRECTION], cfg.route_scale, t[names.ROUTER_SCALE],
                    cfg.num_experts_per_tok)
    width = cfg.moe_intermediate_size

    def routed(per: int | None) -> Iterator[Chunk]:
        for gate_up, down in zip(stack_chunks(t, names.EXPERTS_GATE_UP, per), stack_chunks(t, names.EXPERTS_DOWN, per),
                                 strict=True):
            yield gate_up[:, :width], gate_up[:, width:], down

    def shared(per: int | None) -> Iterator[Chunk]:
        return zip(*(stack_chunks(t, name, per) for name in (names.SHARED_GATE, names.SHARED_UP, names.SHARED_DOWN)),
                   strict=True)

    mlp, grouped, divisor = moe_blocks(routed, cfg.n_routed_experts, shared, cfg.n_shared_experts,
                                       cfg.num_experts_per_tok, formats, post_norm, compile if fused else None,
                                       compile_grouped)
    return DecoderLayer(**common, mlp=mlp, up_divisor=divisor, router=router, grouped=grouped)


# ---- the ends of the model and the state of a stream ------------------------------------------------------------
def embedded(cfg: InklingConfig, x: np.ndarray, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The embedding table's rows x [T, H] -> the first layer's input: normed by the embedding norm."""
    return rms_norm(x, tensors[names.EMBED_NORM], cfg.rms_norm_eps)


def head_input(cfg: InklingConfig, h: np.ndarray) -> np.ndarray:
    """The final norm's output h [T, H] -> the LM head's input: divided by the muP width multiplier."""
    return h / np.float32(cfg.logits_mup_width_multiplier)


def slot_state(cfg: InklingConfig, kv: KeyStore, slots: int, fmt: StateFormat, rewind: int) -> SlotState:
    """A layer's state for `slots` streams: its keys and values in `kv`, and its short convolutions' histories."""
    return SlotState(kv, cfg.hidden_size, cfg.conv_kernel_size, slots, fmt, rewind)
