"""The Llama family (transformers' `LlamaForCausalLM`): its configuration, read from a Hugging Face `config.json`,
and every tensor of its checkpoints.

The configuration mirrors transformers' `LlamaConfig`: same field names and defaults (`num_key_value_heads` None is
the query heads, `head_dim` None is hidden / heads), RoPE read from `rope_theta` and `rope_scaling` as released
configs write them, or from `rope_parameters` as transformers 5 saves them, of the kinds Llama checkpoints use
(default, linear and Llama 3.1's `llama3`). Every layer is global attention and a dense SwiGLU; nothing but the K/V
is kept per stream.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar

import attrs
import numpy as np

from cascadia.models.base import MAX_LAYERS, ConfigError, HeadAttention, LayerKind, conform_fields
from cascadia.models.names import EMBED, FINAL_NORM, HEAD, VECTOR, Tensors, checkpoint_tensors, op_by_prefix
from cascadia.models.rope import ROPE_TYPES, RopeScaling, read_rope

MODEL_TYPES = ("llama",)
ARCHITECTURES = ("LlamaForCausalLM",)
ALIASES: dict[str, str] = {}
MTP_PREFIX = "model.mtp."  # no Llama has multi-token-prediction layers: nothing is listed apart


@attrs.frozen(kw_only=True)
class LlamaConfig(HeadAttention):
    model_type: ClassVar[str] = "llama"
    FIELD_TYPES: ClassVar[dict[str, Any]]  # the keys a config may hold, with their types (set below)
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ROPE_TYPES  # the RoPE scalings it may have

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as the query heads (set so when built)
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (set so when built)
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))
        # as transformers' __post_init__ does: the values a missing key stands for
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Build from a transformers config dict; keys of other parts (training, dropout, caching) are ignored."""
        d, problems = conform_fields(text_fields(raw), cls.FIELD_TYPES)
        if problems:
            raise ConfigError("; ".join(problems))
        n_layers = d.get("num_hidden_layers", 32)
        if not 0 < n_layers <= MAX_LAYERS:
            raise ConfigError(f"num_hidden_layers must be an integer in 1..{MAX_LAYERS}, got {n_layers!r}")
        if problems := read_rope(d, d.get("max_position_embeddings", 2048), cls.ROPE_TYPES):
            raise ConfigError("; ".join(problems))
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` body that transformers' `LlamaConfig` reads back to the same model."""
        d = attrs.asdict(self, recurse=False)
        d.pop("rope_scaling")
        d["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling.to_hf_dict() if self.rope_scaling
                                                             else {}), "rope_theta": d.pop("rope_theta")}
        d["model_type"] = "llama"
        d["architectures"] = ["LlamaForCausalLM"]
        return d

    # ---- validation ---------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What makes these values no Llama, each message starting with the field it is about."""
        fields = attrs.asdict(self, recurse=False)
        fields.pop("rope_scaling")
        _, out = conform_fields(fields, self.FIELD_TYPES)
        if out:
            return out
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("num_key_value_heads", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                out.append(f"{name} must be a positive integer (or null), got {getattr(self, name)!r}")
        if out:
            return out
        if self.num_attention_heads % (self.num_key_value_heads or self.num_attention_heads):
            out.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:  # transformers asks it even of a model with head_dim
            out.append("hidden_size must be a multiple of num_attention_heads")
        if self.hidden_act != "silu":
            out.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            out += self.rope_scaling.problems(self.ROPE_TYPES)
        for name in ("bos_token_id", "pad_token_id"):
            if (token := getattr(self, name)) is not None and not 0 <= token < self.vocab_size:
                out.append(f"{name} {token!r} lies outside the vocabulary (0..{self.vocab_size - 1})")
        if bad := [t for t in self._eos_list if t is not None and not 0 <= t < self.vocab_size]:
            out.append(f"eos_token_id {bad[0]!r} lies outside the vocabulary (0..{self.vocab_size - 1})")
        return out

    # ---- per-layer geometry (every layer alike) ------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return False

    def attention_kind(self, layer: int) -> LayerKind:
        return LayerKind.GLOBAL

    def mlp_kind(self, layer: int) -> LayerKind:
        return LayerKind.DENSE

    def heads(self, layer: int) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim) of a layer's attention."""
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def kv_entries(self, layer: int, context_budget: int, largest_bucket: int) -> int:
        """K/V entries a stream keeps for a layer: the whole context."""
        return context_budget

    @property
    def _eos_list(self) -> list[int | None]:
        return self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(t for t in self._eos_list if t is not None)

    @property
    def output_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def routed_experts(self) -> tuple[int, int]:
        return 0, 0

    @property
    def sliding_window(self) -> None:
        return None


def text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The keys of a Llama config (all at its top level)."""
    return dict(raw)


_HINTS = typing.get_type_hints(LlamaConfig)
FIELD_TYPES: dict[str, Any] = {f.name: _HINTS[f.name] for f in attrs.fields(LlamaConfig) if f.name != "rope_scaling"}
FIELD_TYPES.update({"rope_scaling": dict | None, "rope_parameters": dict | None})
LlamaConfig.FIELD_TYPES = FIELD_TYPES
Config = LlamaConfig


# ---- checkpoint tensors --------------------------------------------------------------------------------------------
INPUT_NORM = "input_layernorm.weight"
POST_NORM = "post_attention_layernorm.weight"
Q_PROJ, K_PROJ, V_PROJ, O_PROJ = (f"self_attn.{p}_proj.weight" for p in "qkvo")
GATE, UP, DOWN = (f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
OP_PREFIXES = (("input_layernorm.", "input_norm"), ("post_attention_layernorm.", "post_norm"),
                ("self_attn.", "attention"), ("mlp.", "dense_mlp"))


def layer_tensors(cfg: LlamaConfig, layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name relative to the layer prefix: (shape, group)} for one decoder layer."""
    heads, kv_heads, head_dim = cfg.heads(layer)
    hidden, width = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[tuple[int, ...], str]] = {
        INPUT_NORM: ((hidden,), VECTOR),
        POST_NORM: ((hidden,), VECTOR),
        Q_PROJ: ((heads * head_dim, hidden), "attention"),
        K_PROJ: ((kv_heads * head_dim, hidden), "attention"),
        V_PROJ: ((kv_heads * head_dim, hidden), "attention"),
        O_PROJ: ((hidden, heads * head_dim), "attention"),
        GATE: ((width, hidden), "dense_mlp"),
        UP: ((width, hidden), "dense_mlp"),
        DOWN: ((hidden, width), "dense_mlp"),
    }
    if cfg.attention_bias:
        out |= {name.replace(".weight", ".bias"): ((out[name][0][0],), VECTOR)
                for name in (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)}
    if cfg.mlp_bias:
        out |= {name.replace(".weight", ".bias"): ((out[name][0][0],), VECTOR) for name in (GATE, UP, DOWN)}
    return out


def embedding_tensors(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    return {EMBED: ((cfg.vocab_size, cfg.hidden_size), "embedding")}


def head_tensors(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Final norm and LM head; a tied head is the embedding table, stored once under its name."""
    head = {} if cfg.tie_word_embeddings else {HEAD: ((cfg.vocab_size, cfg.hidden_size), "head")}
    return {FINAL_NORM: ((cfg.hidden_size,), VECTOR)} | head


def all_tensors(cfg: LlamaConfig) -> Tensors:
    """Every tensor by full checkpoint name."""
    layers = (layer_tensors(cfg, layer) for layer in range(cfg.num_hidden_layers))
    return checkpoint_tensors(embedding_tensors(cfg), layers, head_tensors(cfg))


def op_kind(name: str) -> str:
    """The dataflow op of a layer tensor, from its name relative to the layer prefix."""
    return op_by_prefix(name, OP_PREFIXES)


def is_mtp(cfg: LlamaConfig, name: str) -> bool:
    """Whether a stored tensor belongs to multi-token-prediction layers (`model.mtp.*`, as Inkling's)."""
    return name.startswith(MTP_PREFIX)


def canonical_name(stored: str) -> str | None:
    """A stored tensor's name as this module spells it (Llama checkpoints store them so); rotary tables some older
    checkpoints save are ignored."""
    return None if stored.endswith("rotary_emb.inv_freq") else stored


def stacked_parts(cfg: LlamaConfig, stored: str) -> None:
    """None: a Llama's checkpoints store each of its tensors as itself."""
    return None


def kept_f32(name: str) -> bool:
    """Whether a bf16 checkpoint stores this tensor in float32 anyway: none in Llama."""
    return False


def random_values(name: str, shape: tuple[int, ...], noise: np.ndarray) -> np.ndarray:
    """Standard normal noise turned into values of the named tensor: norm weights near 1, biases small, matrices
    N(0, 1/fan_in) over their last axis."""
    if name.endswith("norm.weight"):
        return 1 + np.float32(0.1) * noise
    if name.endswith(".bias"):
        return np.float32(0.02) * noise
    return noise / np.float32(np.sqrt(shape[-1]))


# ---- costs that are no weight matmul -------------------------------------------------------------------------------
def extra_row_flops(cfg: LlamaConfig, layer: int) -> dict[str, float]:
    """None: every matmul of a Llama layer is a weight matrix's."""
    return {}


def conv_history(cfg: LlamaConfig) -> int:
    return 0


def conv_state_channels(cfg: LlamaConfig, layer: int) -> dict[str, int]:
    """None: a Llama keeps nothing per stream but its K/V."""
    return {}


# ---- the dataflow between a layer's ops (`cascadia.graph.build`) -----------------------------------------------
def layer_flows(cfg: LlamaConfig, layer: int) -> tuple[list[tuple[str, str, str, int | None]], str]:
    """The tensors a layer's ops pass each other, as (from, to, tensor, bytes per row; None: a hidden row in f32),
    "in" the residual stream coming in; and the op whose output is the residual stream going out. Each residual
    addition is folded into the op before it (the attention's and the MLP's outputs are the updated stream)."""
    return [("in", "input_norm", "residual", None), ("input_norm", "attention", "normed", None),
            ("in", "attention", "residual", None), ("attention", "post_norm", "residual", None),
            ("post_norm", "dense_mlp", "normed", None), ("attention", "dense_mlp", "residual", None)], "dense_mlp"
