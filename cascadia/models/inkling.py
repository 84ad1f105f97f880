"""The Inkling family: its text model's configuration, read from a Hugging Face `config.json`, and every tensor of
its checkpoints.

The configuration mirrors transformers' `InklingTextConfig` (the definition of correct): same field names, same
defaults, same derivation of `layer_types` and `mlp_layer_types`. Only the text model is described; vision and audio
keys are ignored. Tensor names are as transformers' `save_pretrained` writes them, shapes as `modeling_inkling.py`
builds them, each with its weight-format group and the dataflow op it belongs to.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar

import attrs
import numpy as np

from cascadia.models.base import MAX_LAYERS, ConfigError, HeadAttention, LayerKind, conform_fields
from cascadia.models.names import EMBED, FINAL_NORM, HEAD, VECTOR, Tensors, checkpoint_tensors, op_by_prefix

# The `model_type`s of Inkling's configs (transformers picks a config's class by it) and the classes an
# `architectures` list may name: the multimodal checkpoint and its text model.
MODEL_TYPES = ("inkling", "inkling_text")
ARCHITECTURES = ("InklingForConditionalGeneration", "InklingForCausalLM")

# transformers' layer type names, in `layer_types` and `mlp_layer_types`
HF_SLIDING, HF_GLOBAL, HF_DENSE, HF_SPARSE = "hybrid_sliding", "hybrid", "dense", "sparse"

# Keys a checkpoint may use for a field (transformers' `attribute_map`).
ALIASES = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "embedding_multiplier": "logits_mup_width_multiplier",
}


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys of a transformers config: its `text_config` (a multimodal config) or its top level,
    with `mtp_config`'s layer count as `num_mtp_layers` unless the text config sets that (as transformers does)."""
    for key in ("text_config", "mtp_config"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"{key}: expected a JSON object")
    fields, mtp = dict(raw.get("text_config") or raw), raw.get("mtp_config") or {}
    if "num_mtp_layers" not in fields and mtp.get("num_nextn_predict_layers") is not None:
        fields["num_mtp_layers"] = mtp["num_nextn_predict_layers"]
    return fields


@attrs.frozen(kw_only=True)
class InklingConfig(HeadAttention):
    model_type: ClassVar[str] = "inkling_text"

    vocab_size: int = 201024
    unpadded_vocab_size: int | None = None
    hidden_size: int = 6144
    num_hidden_layers: int = 66
    # global ("hybrid") attention layers
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    # sliding-window ("hybrid_sliding") attention layers
    swa_num_attention_heads: int = 64
    swa_num_key_value_heads: int = 16
    swa_head_dim: int = 128
    sliding_window_size: int = 512
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    intermediate_size: int = 24576  # dense MLP width
    hidden_act: str = "silu"
    moe_intermediate_size: int = 3072  # width of one routed or shared expert
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    shared_expert_sink: bool = True
    route_scale: float = 8.0
    logits_mup_width_multiplier: float = 24.0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    num_mtp_layers: int | None = None

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> InklingConfig:
        """Build from a transformers config dict: the text config, or the multimodal top level. Every key that sets
        a field is checked for its type first (`conform_fields`; no number may come as text, as a JSON file would
        not write it); keys of other parts of the model are ignored."""
        d, problems = conform_fields(text_fields(raw), FIELD_TYPES)
        if problems:
            raise ConfigError("; ".join(problems))
        for alias, name in ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        if d.get("dense_intermediate_size") is not None:
            # In such checkpoints `intermediate_size` is the experts' width (transformers #49416).
            d["moe_intermediate_size"] = d.get("intermediate_size", attrs.fields(cls).moe_intermediate_size.default)
            d["intermediate_size"] = d.pop("dense_intermediate_size")
        n_layers = d.get("num_hidden_layers", 66)
        if not 0 < n_layers <= MAX_LAYERS:
            raise ConfigError(f"num_hidden_layers must be an integer in 1..{MAX_LAYERS}, got {n_layers!r}")
        if not d.get("layer_types"):
            local = d.get("local_layer_ids")
            local = set(local) if local is not None else {i for i in range(n_layers) if (i + 1) % 6}
            d["layer_types"] = [HF_SLIDING if i in local else HF_GLOBAL for i in range(n_layers)]
        if not d.get("mlp_layer_types"):
            dense_idx = d.get("dense_mlp_idx") or 0
            d["mlp_layer_types"] = [HF_DENSE if i < dense_idx else HF_SPARSE for i in range(n_layers)]
        known = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["layer_types"] = tuple(kwargs["layer_types"])
        kwargs["mlp_layer_types"] = tuple(kwargs["mlp_layer_types"])
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` body that transformers' `InklingTextConfig` reads back to the same model."""
        d = attrs.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["model_type"] = "inkling_text"
        d["architectures"] = ["InklingForCausalLM"]
        return d

    # ---- validation ---------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What makes these values no Inkling text model, each message starting with the field it is about."""
        _, out = conform_fields(attrs.asdict(self, recurse=False), FIELD_TYPES)
        if out:
            return out
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                     "sliding_window_size", "d_rel", "rel_extent", "conv_kernel_size", "intermediate_size",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if out:
            return out
        if len(self.layer_types) != self.num_hidden_layers:
            out.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                       f"{self.num_hidden_layers}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            out.append(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                       f"num_hidden_layers is {self.num_hidden_layers}")
        if bad := sorted(set(self.layer_types) - {HF_SLIDING, HF_GLOBAL}):
            out.append(f"layer_types may hold only {HF_SLIDING!r} and {HF_GLOBAL!r}, found {bad}")
        if bad := sorted(set(self.mlp_layer_types) - {HF_DENSE, HF_SPARSE}):
            out.append(f"mlp_layer_types may hold only {HF_DENSE!r} and {HF_SPARSE!r}, found {bad}")
        if self.num_experts_per_tok > self.n_routed_experts:
            out.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                       f"({self.n_routed_experts})")
        if self.n_shared_experts < 1:
            out.append("n_shared_experts must be at least 1 (the shared experts are the router's softmax sink)")
        if self.num_attention_heads % self.num_key_value_heads:
            out.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.swa_num_attention_heads % self.swa_num_key_value_heads:
            out.append("swa_num_attention_heads must be a multiple of swa_num_key_value_heads")
        if self.unpadded_vocab_size is not None and not 0 < self.unpadded_vocab_size <= self.vocab_size:
            out.append(f"unpadded_vocab_size must lie in 1..vocab_size ({self.vocab_size})")
        if self.hidden_act != "silu":
            out.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        # Divisors and scales: zero would divide by zero or silence a whole path of the model.
        for name in ("rms_norm_eps", "route_scale", "logits_mup_width_multiplier"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.log_scaling_alpha < 0:
            out.append(f"log_scaling_alpha must be a number >= 0, got {self.log_scaling_alpha!r}")
        if self.log_scaling_n_floor is not None and self.log_scaling_n_floor < 1:
            out.append(f"log_scaling_n_floor must be at least 1 (or null), got {self.log_scaling_n_floor!r}")
        if self.num_mtp_layers is not None and self.num_mtp_layers < 0:
            out.append(f"num_mtp_layers must be at least 0 (or null), got {self.num_mtp_layers!r}")
        for name in ("bos_token_id", "pad_token_id"):
            if (token := getattr(self, name)) is not None and not 0 <= token < self.vocab_size:
                out.append(f"{name} {token!r} lies outside the vocabulary (0..{self.vocab_size - 1})")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        # A stop token the head cannot produce would never stop a generation.
        if bad := [t for t in eos if t is not None and not 0 <= t < self.output_vocab_size]:
            out.append(f"eos_token_id {bad[0]!r} lies outside the vocabulary (0..{self.output_vocab_size - 1})")
        return out

    # ---- per-layer geometry -------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == HF_SLIDING

    def is_dense(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == HF_DENSE

    def attention_kind(self, layer: int) -> LayerKind:
        return LayerKind.SLIDING if self.is_sliding(layer) else LayerKind.GLOBAL

    def mlp_kind(self, layer: int) -> LayerKind:
        return LayerKind.DENSE if self.is_dense(layer) else LayerKind.MOE

    def heads(self, layer: int) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim) of a layer's attention."""
        if self.is_sliding(layer):
            return self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def kv_entries(self, layer: int, context_budget: int, largest_bucket: int) -> int:
        """K/V entries a stream keeps for a layer: the whole context on a global layer; on a sliding layer the
        window's last window - 1 keys plus one call's rows (`largest_bucket`), so that writing a call's rows never
        overwrites a key an earlier row of the call still sees, or the whole context when it is shorter."""
        if not self.is_sliding(layer):
            return context_budget
        return min(context_budget, self.sliding_window_size - 1 + largest_bucket)

    def layer_rel_extent(self, layer: int) -> int:
        """Backward distance covered by a layer's relative-position bias bank (the window on sliding layers)."""
        return self.sliding_window_size if self.is_sliding(layer) else self.rel_extent

    @property
    def eos_ids(self) -> frozenset[int]:
        """The end-of-sequence tokens (none when the config names none)."""
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        return frozenset(t for t in eos if t is not None)

    @property
    def output_vocab_size(self) -> int:
        """Logits actually produced: the head's unpadded rows when the checkpoint says so."""
        return self.unpadded_vocab_size or self.vocab_size

    @property
    def routed_experts(self) -> tuple[int, int]:
        """(routed experts, chosen per row)."""
        return self.n_routed_experts, self.num_experts_per_tok

    @property
    def sliding_window(self) -> int:
        return self.sliding_window_size


# ---- field types ---------------------------------------------------------------------------------------------------
# Keys a config may hold, with their types: InklingConfig's fields, the checkpoint aliases of some, and the keys
# transformers derives fields from.
_HINTS = typing.get_type_hints(InklingConfig)
FIELD_TYPES: dict[str, Any] = {f.name: _HINTS[f.name] for f in attrs.fields(InklingConfig)}
FIELD_TYPES.update({alias: FIELD_TYPES[name] for alias, name in ALIASES.items()})
FIELD_TYPES.update({"local_layer_ids": list[int] | None, "dense_mlp_idx": int | None,
                    "dense_intermediate_size": int | None})  # null: not given
Config = InklingConfig


# ---- checkpoint tensors ------------------------------------------------------------------------------------------
EMBED_NORM = "model.embed_tokens.embed_norm.weight"
MTP_PREFIX = "model.mtp."  # multi-token-prediction layers: listed apart, not part of the text model's forward


def is_mtp(cfg: InklingConfig, name: str) -> bool:
    """Whether a stored tensor belongs to the multi-token-prediction layers (`model.mtp.*`)."""
    return name.startswith(MTP_PREFIX)


# A multi-token-prediction layer, DeepSeek-V3's in Inkling's terms (scripts/train_mtp.py holds its reference): at
# position i the final hidden state (after the model's norm) and the normed embedding of token i+1, each RMS-normed
# (hnorm, enorm), side by side hidden first, projected back to the width (eh_proj), through one decoder layer with
# global attention and a dense MLP, and a norm; the model's own head turns that into logits for token i+2.
MTP_HNORM, MTP_ENORM, MTP_PROJ, MTP_NORM = "hnorm.weight", "enorm.weight", "eh_proj.weight", "norm.weight"


def mtp_layer_prefix(index: int) -> str:
    return f"{MTP_PREFIX}layers.{index}."


def mtp_config(cfg: InklingConfig) -> InklingConfig:
    """The decoder layer of a multi-token-prediction layer, as the one layer of a model."""
    return attrs.evolve(cfg, num_hidden_layers=1, layer_types=(HF_GLOBAL,), mlp_layer_types=(HF_DENSE,),
                        num_mtp_layers=None)


def mtp_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to `mtp_layer_prefix`: (shape, group)} for one multi-token-prediction layer."""
    hidden = cfg.hidden_size
    return layer_tensors(mtp_config(cfg), 0) | {
        MTP_HNORM: ((hidden,), VECTOR), MTP_ENORM: ((hidden,), VECTOR), MTP_PROJ: ((hidden, 2 * hidden), "attention"),
        MTP_NORM: ((hidden,), VECTOR)}

_IGNORED_PREFIXES = ("model.vision_tower.", "model.audio_tower.")
_MULTIMODAL_TEXT_PREFIX = "model.language_model."

# Names within a decoder layer (after `layer_prefix`), by module of InklingDecoderLayer.
INPUT_NORM = "input_layernorm.weight"
POST_NORM = "post_attention_layernorm.weight"
Q_PROJ, K_PROJ, V_PROJ, R_PROJ, O_PROJ = (f"self_attn.{p}_proj.weight" for p in "qkvro")
K_SCONV, V_SCONV = "self_attn.k_sconv.conv1d.weight", "self_attn.v_sconv.conv1d.weight"
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
REL_BANK = "self_attn.rel_logits_proj.proj"  # [d_rel, extent]: bias profiles over backward distance
ATTN_SCONV, MLP_SCONV = "attn_sconv.conv1d.weight", "mlp_sconv.conv1d.weight"
DENSE_GATE, DENSE_UP, DENSE_DOWN = (f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
DENSE_SCALE = "mlp.global_scale"
ROUTER, ROUTER_SCALE, ROUTER_CORRECTION = "mlp.gate.weight", "mlp.gate.global_scale", "mlp.gate.e_score_correction_bias"
EXPERTS_GATE_UP, EXPERTS_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
SHARED_GATE, SHARED_UP, SHARED_DOWN = (f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down"))

# The dataflow op each layer tensor belongs to, by name prefix (the first that matches: "mlp.gate." before the
# dense "mlp."). The op kinds, in dataflow order, are `cascadia.graph.costs.LAYER_KINDS`.
_OP_PREFIXES = (
    ("input_layernorm.", "input_norm"),
    ("post_attention_layernorm.", "post_norm"),
    ("self_attn.", "attention"),
    ("attn_sconv.", "attn_sconv"),
    ("mlp_sconv.", "mlp_sconv"),
    ("mlp.gate.", "router"),
    ("mlp.experts.", "routed_experts"),
    ("mlp.shared_experts.", "shared_experts"),
    ("mlp.", "dense_mlp"),
)
# transformers' `_keep_in_fp32_modules_strict` for Inkling: these stay float32 in a bf16 checkpoint.
_KEPT_F32 = ("sconv.conv1d.weight", "e_score_correction_bias", "gate.global_scale")


def layer_tensors(cfg: InklingConfig, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer."""
    n_heads, n_kv, head_dim = cfg.heads(layer)
    hidden, kernel = cfg.hidden_size, cfg.conv_kernel_size
    kv_width = n_kv * head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {
        INPUT_NORM: ((hidden,), VECTOR),
        POST_NORM: ((hidden,), VECTOR),
        Q_PROJ: ((n_heads * head_dim, hidden), "attention"),
        K_PROJ: ((kv_width, hidden), "attention"),
        V_PROJ: ((kv_width, hidden), "attention"),
        R_PROJ: ((n_heads * cfg.d_rel, hidden), "attention"),
        O_PROJ: ((hidden, n_heads * head_dim), "attention"),
        K_SCONV: ((kv_width, 1, kernel), VECTOR),
        V_SCONV: ((kv_width, 1, kernel), VECTOR),
        Q_NORM: ((head_dim,), VECTOR),
        K_NORM: ((head_dim,), VECTOR),
        REL_BANK: ((cfg.d_rel, cfg.layer_rel_extent(layer)), VECTOR),
        ATTN_SCONV: ((hidden, 1, kernel), VECTOR),
        MLP_SCONV: ((hidden, 1, kernel), VECTOR),
    }
    if cfg.is_dense(layer):
        width = cfg.intermediate_size
        out |= {
            DENSE_GATE: ((width, hidden), "dense_mlp"),
            DENSE_UP: ((width, hidden), "dense_mlp"),
            DENSE_DOWN: ((hidden, width), "dense_mlp"),
            DENSE_SCALE: ((1,), VECTOR),
        }
    else:
        n_exp, n_shared, width = cfg.n_routed_experts, cfg.n_shared_experts, cfg.moe_intermediate_size
        out |= {
            ROUTER: ((n_exp + n_shared, hidden), VECTOR),  # routing is computed in FP32
            ROUTER_SCALE: ((1,), VECTOR),
            ROUTER_CORRECTION: ((n_exp,), VECTOR),
            EXPERTS_GATE_UP: ((n_exp, 2 * width, hidden), "routed_experts"),
            EXPERTS_DOWN: ((n_exp, hidden, width), "routed_experts"),
            SHARED_GATE: ((n_shared, width, hidden), "shared_experts"),
            SHARED_UP: ((n_shared, width, hidden), "shared_experts"),
            SHARED_DOWN: ((n_shared, hidden, width), "shared_experts"),
        }
    return out


def embedding_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    return {EMBED: ((cfg.vocab_size, cfg.hidden_size), "embedding"), EMBED_NORM: ((cfg.hidden_size,), VECTOR)}


def head_tensors(cfg: InklingConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Final norm and LM head. transformers always builds a `vocab_size`-row head; logits beyond
    `unpadded_vocab_size` are dropped after the matmul."""
    return {FINAL_NORM: ((cfg.hidden_size,), VECTOR), HEAD: ((cfg.vocab_size, cfg.hidden_size), "head")}


def all_tensors(cfg: InklingConfig) -> Tensors:
    """Every text-model tensor by full checkpoint name."""
    layers = (layer_tensors(cfg, layer) for layer in range(cfg.num_hidden_layers))
    return checkpoint_tensors(embedding_tensors(cfg), layers, head_tensors(cfg))


def op_kind(name: str) -> str:
    """The dataflow op of a layer tensor, from its name relative to the layer prefix (e.g. `Q_PROJ`: "attention")."""
    return op_by_prefix(name, _OP_PREFIXES)


def canonical_name(stored: str) -> str | None:
    """The text-model name of a stored tensor (as this module spells it), or None for tensors Cascadia ignores.
    Multimodal checkpoints keep the text model under `model.language_model.`."""
    if stored.startswith(_IGNORED_PREFIXES):
        return None
    if stored.startswith(_MULTIMODAL_TEXT_PREFIX):
        return "model." + stored.removeprefix(_MULTIMODAL_TEXT_PREFIX)
    return stored


def stacked_parts(cfg: InklingConfig, stored: str) -> None:
    """None: Inkling's checkpoints store each of its tensors as itself (its expert stacks are its own tensors)."""
    return None


def kept_f32(name: str) -> bool:
    """Whether a bf16 checkpoint stores this tensor in float32 anyway (as transformers saves Inkling)."""
    return name.endswith(_KEPT_F32)


# ---- what a tensor holds, for drawing random ones ------------------------------------------------------------------
def random_values(name: str, shape: tuple[int, ...], noise: np.ndarray) -> np.ndarray:
    """Standard normal noise turned into values of the named tensor, by its role (`cascadia.engine.init_model`):
    norm weights and global scales near 1; the short convolutions a perturbation (they add to a residual); routing
    corrections small next to sigmoid scores; matrices N(0, 1/fan_in), where a matrix [..., out, in] sums over its
    last axis, except the relative-bias bank, applied as `relative_states @ bank`, which sums over its first."""
    if name.endswith(("norm.weight", "global_scale")):
        return 1 + np.float32(0.1) * noise
    if name.endswith("conv1d.weight"):
        return np.float32(0.1) * noise
    if name.endswith(ROUTER_CORRECTION.rsplit(".", 1)[1]):
        return np.float32(0.05) * noise
    fan_in = shape[0] if name.endswith(REL_BANK) else shape[-1]
    return noise / np.float32(np.sqrt(fan_in))


# ---- costs that are no weight matmul (`cascadia.graph.costs` counts 2 FLOPs per weight of the others) -------------
def extra_row_flops(cfg: InklingConfig, layer: int) -> dict[str, float]:
    """Matmul FLOPs one decode row spends on f32 vectors, by op kind: the relative-bias bank, which every row mixes
    with its relative states ([heads, d_rel] @ [d_rel, extent]), and the router, computed in FP32."""
    out = {"attention": 2.0 * cfg.heads(layer)[0] * cfg.d_rel * cfg.layer_rel_extent(layer)}
    if not cfg.is_dense(layer):
        out["router"] = 2.0 * (cfg.n_routed_experts + cfg.n_shared_experts) * cfg.hidden_size
    return out


def conv_history(cfg: InklingConfig) -> int:
    """Inputs a short convolution keeps per channel and stream (its kernel's K - 1)."""
    return cfg.conv_kernel_size - 1


def conv_state_channels(cfg: InklingConfig, layer: int) -> dict[str, int]:
    """Channels of a layer's short convolutions, by the op kind that owns them."""
    n_kv, head_dim = cfg.heads(layer)[1:]
    return {"attention": 2 * n_kv * head_dim,  # k_sconv and v_sconv
            "attn_sconv": cfg.hidden_size, "mlp_sconv": cfg.hidden_size}


# ---- the dataflow between a layer's ops (`cascadia.graph.build`) -----------------------------------------------
ROUTING_BYTES = 8  # per selected expert: an f32 weight and an int32 index
ACTIVATION_BYTES = 4  # f32


def layer_flows(cfg: InklingConfig, layer: int) -> tuple[list[tuple[str, str, str, int | None]], str]:
    """The tensors a layer's ops pass each other, as (from, to, tensor, bytes per row; None: a hidden row in f32),
    "in" the residual stream coming in; and the op whose output is the residual stream going out. Each residual
    addition is folded into the short convolution before it (`attn_sconv` and `mlp_sconv` output the updated
    residual stream); the attention op holds the projections, the k/v short convolutions, the q/k norms and the
    relative-position bias."""
    flows: list[tuple[str, str, str, int | None]] = [
        ("in", "input_norm", "residual", None), ("input_norm", "attention", "normed", None),
        ("attention", "attn_sconv", "attn_out", None), ("in", "attn_sconv", "residual", None),
        ("attn_sconv", "post_norm", "residual", None), ("attn_sconv", "mlp_sconv", "residual", None)]
    if cfg.is_dense(layer):
        flows += [("post_norm", "dense_mlp", "normed", None), ("dense_mlp", "mlp_sconv", "mlp_out", None)]
    else:
        flows += [("post_norm", kind, "normed", None) for kind in ("router", "routed_experts", "shared_experts")]
        flows += [("router", "routed_experts", "routing", cfg.num_experts_per_tok * ROUTING_BYTES),
                  ("router", "shared_experts", "shared_gammas", cfg.n_shared_experts * ACTIVATION_BYTES),
                  ("routed_experts", "mlp_sconv", "routed_out", None),
                  ("shared_experts", "mlp_sconv", "shared_out", None)]
    return flows, "mlp_sconv"
