"""RoPE's settings as transformers' configs write them, shared by the families that rotate their queries and keys:
`rope_theta` and a scaling, read from `rope_parameters` (transformers 5) or from `rope_theta` and `rope_scaling`
(released configs; a scaling's `type` is the older name of its `rope_type`). The rotation itself is
`cascadia.engine.rope`, of the types in ROPE_TYPES; a family that plans with another (DeepSeek-V3's `yarn`) names it.
"""

from __future__ import annotations

import typing
from typing import Any

import attrs

from cascadia.errors import shown
from cascadia.models.base import conform_fields

ROPE_TYPES = ("default", "linear", "llama3")  # what the engine rotates by
YARN = "yarn"


@attrs.frozen
class RopeScaling:
    """How RoPE's frequencies are stretched beyond the trained context (`rope_scaling`): `linear` divides every
    position by `factor`; `llama3` divides the low frequencies by it, keeps the high ones and blends between; `yarn`
    blends between the frequencies divided by it and the trained ones along a ramp set by `beta_fast` and
    `beta_slow`, and scales the attention by `mscale` terms."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn: the trained context
    beta_fast: float | None = None  # yarn (transformers' default: 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool | None = None  # yarn

    def problems(self, types: tuple[str, ...] = ROPE_TYPES) -> list[str]:
        """What makes it no scaling of `types`, each message starting with "rope_scaling"."""
        out = []
        if self.rope_type not in types:
            out.append(f"rope_scaling type {shown(self.rope_type)} is not supported (supported: "
                       f"{', '.join(types)})")
        if self.factor <= 0:
            out.append(f"rope_scaling factor must be a positive number, got {self.factor!r}")
        if self.rope_type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None or not 0 < low < high:
                out.append(f"rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor, got {low!r} and "
                           f"{high!r}")
            if self.original_max_position_embeddings is None or self.original_max_position_embeddings < 1:
                out.append("rope_scaling llama3 needs original_max_position_embeddings, a positive integer")
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        return {key: value for key, value in attrs.asdict(self).items() if value is not None}


_SCALING_TYPES = {name: hint for name, hint in typing.get_type_hints(RopeScaling).items() if name != "rope_type"}
_KEYS = {"linear": {"factor"},  # each type's keys
         "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
         YARN: {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate"}}


def read_rope(d: dict[str, Any], max_positions: int, types: tuple[str, ...] = ROPE_TYPES) -> list[str]:
    """Set `rope_theta` and `rope_scaling` (a `RopeScaling`, None for plain RoPE) in config keys `d`, read from
    `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling` (a scaling's `type` is the older name of
    its `rope_type`), of one of `types`; the problems, each starting with the key it is about."""
    params = d.pop("rope_parameters", None)
    scaling = dict(params if params is not None else d.get("rope_scaling") or {})
    if "rope_theta" in scaling:
        d["rope_theta"] = scaling.pop("rope_theta")
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    d["rope_scaling"] = None
    if rope_type == "default":
        return []
    if rope_type not in types:
        return [f"rope_scaling type {shown(rope_type)} is not supported (supported: {', '.join(types)})"]
    if rope_type in ("llama3", YARN):
        scaling.setdefault("original_max_position_embeddings", max_positions)
    scaling, problems = conform_fields(scaling, _SCALING_TYPES)
    problems += [f"unknown key {key!r} for type {rope_type!r}" for key in sorted(set(scaling) - _KEYS[rope_type])]
    if problems:
        return [f"rope_scaling: {problem}" for problem in problems]
    d["rope_scaling"] = RopeScaling(rope_type=rope_type, **scaling)
    return []
