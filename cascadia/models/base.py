"""What every model family's configuration shares: the layer kinds, the errors, and config values read as
transformers reads them (each field's type checked first, as a JSON file would write it).

A family module (`cascadia.models.inkling`, ...) types its own fields (`FIELD_TYPES`) and passes them to
`conform_fields`; nothing here knows any family.
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

# Most num_hidden_layers: per-layer lists are built from it, and a typo like 1e12 layers must fail, not hang.
MAX_LAYERS = 10_000
# A model's config.json takes a few KiB; a file of more is not a model config (a checkpoint named by mistake).
MAX_CONFIG_FILE_BYTES = 1024**2


class LayerKind(str, enum.Enum):
    """The kinds of work the parts of a model do, one name for the graph, the planner, the engine, calibration and
    the simulator: a decoder layer's attention half (sliding or global) and its MLP half (MoE or dense), the
    two ends of the pipeline (the embedding; the head with the final norm and sampling), and the multi-token-
    prediction layer drafting at the head's stage (`cascadia.engine.mtp`)."""

    SLIDING = "sliding"
    GLOBAL = "global"
    MOE = "moe"
    DENSE = "dense"
    EMBEDDING = "embedding"
    HEAD = "head"
    MTP = "mtp"

    def __str__(self) -> str:
        return self.value


class ModelConfig(typing.Protocol):
    """What every family's `Config` answers, beside its own fields: what the graph, the planner, the engine's
    buffers, the simulator and the server read of any model."""

    model_type: typing.ClassVar[str]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    bos_token_id: int | None
    pad_token_id: int | None

    @property
    def output_vocab_size(self) -> int: ...  # logits the head produces

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def routed_experts(self) -> tuple[int, int]: ...  # (routed experts, chosen per row); (0, 0): no MoE layer

    @property
    def sliding_window(self) -> int | None: ...  # keys a sliding layer attends to; None: no sliding layer

    def attention_kind(self, layer: int) -> LayerKind: ...  # SLIDING or GLOBAL

    def mlp_kind(self, layer: int) -> LayerKind: ...  # DENSE or MOE

    def is_sliding(self, layer: int) -> bool: ...

    def heads(self, layer: int) -> tuple[int, int, int]: ...  # (query heads, key/value heads, head dim)

    def kv_values(self, layer: int) -> int: ...  # values a stream keeps per position: its keys and values, or a latent

    def attention_macs(self, layer: int) -> int: ...  # multiply-adds of one row per position it attends to

    def kv_entries(self, layer: int, context_budget: int, largest_bucket: int) -> int: ...

    def to_hf_dict(self) -> dict[str, Any]: ...


class HeadAttention:
    """What a layer's attention keeps and computes per position where every head has its keys and values (all but
    DeepSeek-V3's latent attention): for the config's `heads(layer)`."""

    def kv_values(self, layer: int) -> int:
        """A key and a value of each key/value head."""
        _, kv_heads, head_dim = self.heads(layer)
        return 2 * kv_heads * head_dim

    def attention_macs(self, layer: int) -> int:
        """Each query head's q.k and p.v."""
        heads, _, head_dim = self.heads(layer)
        return 2 * heads * head_dim


class ConfigError(CascadiaError):
    """A model configuration that cannot describe a valid model of its family."""

    exit_status = 2  # as a spec's problems: the input is at fault, not the machine


class UnsupportedModel(ConfigError):
    """A config of a model Cascadia does not run (another family), refused before any of its fields is read."""


def read_config_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The JSON object of a `config.json` (or of the one in folder `path`), and the file read. Raises `ConfigError`
    naming the file for one that cannot be read or holds no object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = read_json(path, MAX_CONFIG_FILE_BYTES, "a model config")
    except UnreadableFile as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw, path


# ---- field types ---------------------------------------------------------------------------------------------------
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


def conform_fields(fields: dict[str, Any], types: dict[str, Any],
                   numeric_text: bool = False) -> tuple[dict[str, Any], list[str]]:
    """`fields` with each key of `types` conformed to its type (`conform`), and a "KEY: expected ..., got ..."
    problem for each that is not; other keys are kept as they are."""
    out, problems = dict(fields), []
    for key, value in fields.items():
        if key in types:
            try:
                out[key] = conform(value, types[key], numeric_text)
            except FieldTypeError as e:
                problems.append(f"{key}: {e}")
    return out, problems


def config_differences(mine: Any, theirs: Any) -> list[str]:
    """`FIELD MINE vs OTHERS` for each field of two configs that differs, in field order (long values shortened);
    configs of two families differ in their family alone."""
    def brief(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    if type(mine) is not type(theirs):
        return [f"family {type(mine).__name__} vs {type(theirs).__name__}"]
    pairs = ((f.name, getattr(mine, f.name), getattr(theirs, f.name)) for f in attrs.fields(type(mine)))
    return [f"{name} {brief(a)} vs {brief(b)}" for name, a, b in pairs if a != b]
