"""The Inkling text-model configuration, read from a Hugging Face `config.json`.

Mirrors transformers' `InklingTextConfig` (the definition of correct): same field names, same defaults, same
derivation of `layer_types` and `mlp_layer_types`. Only the text model is described; vision and audio keys are
ignored. Everything else in Cascadia (graph, planner, engine, simulator) reads the model through this class.
"""

from __future__ import annotations

import enum
import math
import typing
from pathlib import Path
from typing import Any

import attrs

from cascadia.errors import CascadiaError, shown
from cascadia.files import UnreadableFile, read_json

# transformers' layer type names, in `layer_types` and `mlp_layer_types`
HF_SLIDING, HF_GLOBAL, HF_DENSE, HF_SPARSE = "hybrid_sliding", "hybrid", "dense", "sparse"


class LayerKind(str, enum.Enum):
    """The kinds of work the parts of the model do, one name for the graph, the planner, the engine, calibration and
    the simulator: a decoder layer's attention half (sliding or global) and its MLP half (MoE or dense), and the
    two ends of the pipeline (the embedding; the head with the final norm and sampling)."""

    SLIDING = "sliding"
    GLOBAL = "global"
    MOE = "moe"
    DENSE = "dense"
    EMBEDDING = "embedding"
    HEAD = "head"

    def __str__(self) -> str:
        return self.value


# Keys a checkpoint may use for a field (transformers' `attribute_map`).
_ALIASES = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "embedding_multiplier": "logits_mup_width_multiplier",
}
# Most num_hidden_layers: per-layer lists are built from it, and a typo like 1e12 layers must fail, not hang.
MAX_LAYERS = 10_000
# Inkling's config.json takes 3 KiB; a file of more is not a model config (a checkpoint named by mistake).
MAX_CONFIG_FILE_BYTES = 1024**2


# The models Cascadia runs, by the `model_type` their config names (transformers picks a config's class by it) and
# by the classes its `architectures` lists: Inkling's multimodal checkpoint and its text model.
MODEL_TYPES = ("inkling", "inkling_text")
ARCHITECTURES = ("InklingForConditionalGeneration", "InklingForCausalLM")


class ConfigError(CascadiaError):
    """A model configuration that cannot describe a valid Inkling text model."""

    exit_status = 2  # as a spec's problems: the input is at fault, not the machine


class UnsupportedModel(ConfigError):
    """A config of a model Cascadia does not run (another family), refused before any of its fields is read."""


def check_model_type(raw: dict[str, Any], required: bool) -> None:
    """Refuse a config whose `model_type` or `architectures` names a model Cascadia does not run; with `required`
    (a config.json, as transformers requires), one that names neither. Checked before any field is read, so that
    another family's config is never read as Inkling's defaults."""
    supported = f"(supported: {', '.join(MODEL_TYPES)})"
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise UnsupportedModel(f"model_type {shown(model_type)} is not supported {supported}")
    if architectures is not None and not (isinstance(architectures, list)
                                          and any(name in ARCHITECTURES for name in architectures)):
        raise UnsupportedModel(f"architectures {shown(architectures)} names no supported model "
                               f"(supported: {', '.join(ARCHITECTURES)})")
    if required and model_type is None and architectures is None:
        raise UnsupportedModel(f"model_type missing (a config.json names its model's type; {supported[1:]}")


def text_fields(raw: Any, model_type_required: bool = False) -> dict[str, Any]:
    """The text model's keys of a transformers config: its `text_config` (a multimodal config) or its top level,
    with `mtp_config`'s layer count as `num_mtp_layers` unless the text config sets that (as transformers does).
    Refuses a config of another model first (`check_model_type`)."""
    if not isinstance(raw, dict):
        raise ConfigError("expected a JSON object")
    check_model_type(raw, model_type_required)
    for key in ("text_config", "mtp_config"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"{key}: expected a JSON object")
    fields, mtp = dict(raw.get("text_config") or raw), raw.get("mtp_config") or {}
    if "num_mtp_layers" not in fields and mtp.get("num_nextn_predict_layers") is not None:
        fields["num_mtp_layers"] = mtp["num_nextn_predict_layers"]
    return fields


def read_text_fields(path: str | Path) -> tuple[dict[str, Any], Path]:
    """`text_fields` of a `config.json` (or of the one in folder `path`), and the file read. Raises `ConfigError`
    naming the file for one that cannot be read."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return text_fields(read_json(path, MAX_CONFIG_FILE_BYTES, "a model config"), model_type_required=True), path
    except UnreadableFile as e:
        raise ConfigError(f"{path}: {e}") from None
    except ConfigError as e:
        raise type(e)(f"{path}: {e}") from None


@attrs.frozen(kw_only=True)
class InklingConfig:
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
        d, problems = conform_fields(text_fields(raw))
        if problems:
            raise ConfigError("; ".join(problems))
        for alias, name in _ALIASES.items():
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

    @classmethod
    def from_file(cls, path: str | Path) -> InklingConfig:
        """Build from a `config.json`, or from the one in folder `path`."""
        fields, path = read_text_fields(path)
        try:
            return cls.from_hf_dict(fields)
        except ConfigError as e:
            raise type(e)(f"{path}: {e}") from None

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
        _, out = conform_fields(attrs.asdict(self, recurse=False))
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

    def differences(self, other: InklingConfig) -> list[str]:
        """`FIELD MINE vs OTHERS` for each field that differs, in field order (long values shortened)."""
        def shown(value: Any) -> str:
            text = repr(value)
            return text if len(text) <= 40 else text[:37] + "..."

        pairs = ((f.name, getattr(self, f.name), getattr(other, f.name)) for f in attrs.fields(InklingConfig))
        return [f"{name} {shown(mine)} vs {shown(theirs)}" for name, mine, theirs in pairs if mine != theirs]

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


# ---- field types ---------------------------------------------------------------------------------------------------
# Keys a model config may hold, with their types: InklingConfig's fields, the checkpoint aliases of some, and the
# keys transformers derives fields from.
FIELD_TYPES: dict[str, Any] = typing.get_type_hints(InklingConfig)
FIELD_TYPES.update({alias: FIELD_TYPES[name] for alias, name in _ALIASES.items()})
FIELD_TYPES.update({"local_layer_ids": list[int] | None, "dense_mlp_idx": int | None,
                    "dense_intermediate_size": int | None})  # null: not given
ALIASES = dict(_ALIASES)


class FieldTypeError(ValueError):
    """A config value of the wrong type; the message says what was expected."""


def describe_type(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, type(int | None)):
        return " or ".join(describe_type(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) in (list, tuple):
        return "a list of " + {int: "integers", str: "text values"}[typing.get_args(hint)[0]]
    names = {int: "an integer", float: "a number", bool: "true or false", str: "text", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def conform(value: Any, hint: Any, numeric_text: bool = False) -> Any:
    """`value` as type `hint` (an int widened to float, a list for a tuple), or raise FieldTypeError. A bool is no
    number; `numeric_text` takes "1e-3" for a number too (YAML reads `1e-3`, without a dot, as text)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, type(int | None)):
        for arg in typing.get_args(hint):
            try:
                return conform(value, arg, numeric_text)
            except FieldTypeError:
                pass
    elif origin in (list, tuple) and isinstance(value, (list, tuple)):
        try:
            return [conform(item, typing.get_args(hint)[0], numeric_text) for item in value]
        except FieldTypeError:
            pass
    elif hint is float:
        if numeric_text and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif isinstance(hint, type) and isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
        return value
    raise FieldTypeError(f"expected {describe_type(hint)}, got {shown(value)}")


def conform_fields(fields: dict[str, Any], numeric_text: bool = False) -> tuple[dict[str, Any], list[str]]:
    """`fields` with each known key's value conformed to its type (`conform`), and a "KEY: expected ..., got ..."
    problem for each that is not; other keys are kept as they are."""
    out, problems = dict(fields), []
    for key, value in fields.items():
        if key in FIELD_TYPES:
            try:
                out[key] = conform(value, FIELD_TYPES[key], numeric_text)
            except FieldTypeError as e:
                problems.append(f"{key}: {e}")
    return out, problems
