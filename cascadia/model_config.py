"""The Inkling text-model configuration, read from a Hugging Face `config.json`.

Mirrors transformers' `InklingTextConfig` (the definition of correct): same field names, same defaults, same
derivation of `layer_types` and `mlp_layer_types`. Only the text model is described; vision and audio keys are
ignored. Everything else in Cascadia (graph, planner, engine, simulator) reads the model through this class.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

import attrs

from cascadia.errors import CascadiaError

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


class ConfigError(CascadiaError):
    """A model configuration that cannot describe a valid Inkling text model."""


def text_fields(raw: Any) -> dict[str, Any]:
    """The text model's keys of a transformers config: its `text_config` (a multimodal config) or its top level,
    with `mtp_config`'s layer count as `num_mtp_layers` unless the text config sets that (as transformers does)."""
    if not isinstance(raw, dict):
        raise ConfigError("expected a JSON object")
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
        return text_fields(json.loads(path.read_text(encoding="utf-8"))), path
    except ConfigError as e:
        problem = str(e)
    except FileNotFoundError:
        problem = "no such file"
    except IsADirectoryError:
        problem = "is a folder, not a file"
    except OSError as e:  # permissions, a name too long
        problem = f"cannot read: {e.strerror or e}"
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deeply
        problem = f"not valid JSON ({e})"
    raise ConfigError(f"{path}: {problem}")


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
        """Build from a transformers config dict: the text config, or the multimodal top level."""
        d = text_fields(raw)
        for alias, name in _ALIASES.items():
            if alias in d:
                d.setdefault(name, d.pop(alias))
        if d.get("dense_intermediate_size") is not None:
            # In such checkpoints `intermediate_size` is the experts' width (transformers #49416).
            d["moe_intermediate_size"] = d.get("intermediate_size", attrs.fields(cls).moe_intermediate_size.default)
            d["intermediate_size"] = d.pop("dense_intermediate_size")
        n_layers = d.get("num_hidden_layers", 66)
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS:
            raise ConfigError(f"num_hidden_layers must be an integer in 1..{MAX_LAYERS}, got {n_layers!r}")
        try:
            if not d.get("layer_types"):
                local = d.get("local_layer_ids")
                local = set(local) if local is not None else {i for i in range(n_layers) if (i + 1) % 6}
                d["layer_types"] = [HF_SLIDING if i in local else HF_GLOBAL for i in range(n_layers)]
            if not d.get("mlp_layer_types"):
                dense_idx = int(d.get("dense_mlp_idx") or 0)
                d["mlp_layer_types"] = [HF_DENSE if i < dense_idx else HF_SPARSE for i in range(n_layers)]
            known = {f.name for f in attrs.fields(cls)}
            kwargs = {k: v for k, v in d.items() if k in known}
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
            kwargs["mlp_layer_types"] = tuple(kwargs["mlp_layer_types"])
            return cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a wrongly typed value (a config.json not checked as a spec's is)
            raise ConfigError(str(e)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> InklingConfig:
        """Build from a `config.json`, or from the one in folder `path`."""
        fields, path = read_text_fields(path)
        try:
            return cls.from_hf_dict(fields)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

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
        out = []
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                     "sliding_window_size", "d_rel", "rel_extent", "conv_kernel_size", "intermediate_size",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                out.append(f"{name} must be a positive integer, got {value!r}")
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
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < math.inf):
            out.append(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        # A stop token the head cannot produce would never stop a generation.
        if bad := [t for t in eos if t is not None and not (isinstance(t, int) and 0 <= t < self.output_vocab_size)]:
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
