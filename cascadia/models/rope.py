"""RoPE's settings as transformers' configs write them, shared by the families that rotate their queries and keys:
`rope_theta` and a scaling, read from `rope_parameters` (transformers 5) or from `rope_theta` and `rope_scaling`
(released configs; a scaling's `type` is the older name of its `rope_type`). The rotation itself is
`cascadia.engine.rope`.
"""

from __future__ import annotations

import typing
from typing import Any

import attrs

from cascadia.errors import shown
from cascadia.models.base import conform_fields

ROPE_TYPES = ("default", "linear", "llama3")


@attrs.frozen
class RopeScaling:
    """How RoPE's frequencies are stretched beyond the trained context (`rope_scaling`): `linear` divides every
    position by `factor`; `llama3` divides the low frequencies by it, keeps the high ones and blends between."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3: the trained context

    def problems(self) -> list[str]:
        out = []
        if self.rope_type not in ROPE_TYPES:
            out.append(f"rope_scaling type {shown(self.rope_type)} is not supported (supported: "
                       f"{', '.join(ROPE_TYPES)})")
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


def read_rope(d: dict[str, Any], max_positions: int) -> list[str]:
    """Set `rope_theta` and `rope_scaling` (a `RopeScaling`, None for plain RoPE) in config keys `d`, read from
    `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling` (a scaling's `type` is the older name of
    its `rope_type`); the problems, each starting with the key it is about."""
    params = d.pop("rope_parameters", None)
    scaling = dict(params if params is not None else d.get("rope_scaling") or {})
    if "rope_theta" in scaling:
        d["rope_theta"] = scaling.pop("rope_theta")
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    d["rope_scaling"] = None
    if rope_type == "default":
        return []
    if rope_type not in ROPE_TYPES:
        return [f"rope_scaling type {shown(rope_type)} is not supported (supported: {', '.join(ROPE_TYPES)})"]
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", max_positions)
    scaling, problems = conform_fields(scaling, _SCALING_TYPES)
    problems += [f"unknown key {key!r} for type {rope_type!r}" for key in sorted(set(scaling) - set(_SCALING_TYPES))]
    if problems:
        return [f"rope_scaling: {problem}" for problem in problems]
    d["rope_scaling"] = RopeScaling(rope_type=rope_type, **scaling)
    return []
