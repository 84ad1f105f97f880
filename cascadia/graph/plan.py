"""A plan: which consecutive layers each node holds, and what that costs. Written by the planner, read by
`cascadia run` and `cascadia simulate`; saved as JSON so that later commands need not plan again."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

PLAN_VERSION = 1
# Roles a stage may hold besides its decoder layers.
EMBED = "embed"  # token embedding and admission (first stage)
HEAD = "head"  # final norm, LM head and sampling (last stage)


@attrs.frozen
class Stage:
    node: str
    first_layer: int
    last_layer: int  # inclusive
    roles: tuple[str, ...]  # "embed", "layers", "head"
    weight_bytes: int
    state_bytes: int  # K/V and convolution state for max_streams x context_budget
    free_bytes: int  # memory left after weights, state and reserve
    max_positions_per_stream: int  # context per stream that would fit at max_streams
    est_time_s: float  # estimated time of one decode row through this stage

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


@attrs.frozen
class Plan:
    stages: tuple[Stage, ...]
    total_params: int
    active_params: int
    bottleneck_s: float  # the slowest stage's estimated time
    cost_source: str  # where stage times came from: "spec figures", "calibration FILE", "uniform"

    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "stages": [
                {"node": s.node, "layers": [s.first_layer, s.last_layer], "roles": list(s.roles),
                 "weight_bytes": s.weight_bytes, "state_bytes": s.state_bytes, "free_bytes": s.free_bytes,
                 "max_positions_per_stream": s.max_positions_per_stream, "est_time_s": s.est_time_s}
                for s in self.stages
            ],
            "total_params": self.total_params,
            "active_params": self.active_params,
            "bottleneck_s": self.bottleneck_s,
            "cost_source": self.cost_source,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"{where}: plan version {d.get('version')!r} is not {PLAN_VERSION}")
        try:
            stages = tuple(
                Stage(node=s["node"], first_layer=s["layers"][0], last_layer=s["layers"][1], roles=tuple(s["roles"]),
                      weight_bytes=s["weight_bytes"], state_bytes=s["state_bytes"], free_bytes=s["free_bytes"],
                      max_positions_per_stream=s["max_positions_per_stream"], est_time_s=s["est_time_s"])
                for s in d["stages"]
            )
            return cls(stages=stages, total_params=d["total_params"], active_params=d["active_params"],
                       bottleneck_s=d["bottleneck_s"], cost_source=d["cost_source"])
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{where}: malformed plan ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read plan ({e})") from None
        return cls.from_dict(d, where=str(path))
