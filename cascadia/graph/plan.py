"""A plan: which consecutive layers each node holds, and what that costs. Written by the planner, read by
`cascadia run` and `cascadia simulate`; saved as JSON so that later commands need not plan again."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import attrs

from cascadia.errors import PlanError
from cascadia.files import UnreadableFile, read_json
from cascadia.policy import KVPool
from cascadia.table import format_rows
from cascadia.units import binary_unit

PLAN_VERSION = 3  # 2: stages name their K/V pool; 3: the pool holds the sliding layers' rings too
MAX_PLAN_FILE_BYTES = 16 * 1024**2  # a stage takes about 300 bytes
# Roles a stage holds: its decoder layers, and the embedding or head at the ends of the pipeline.
EMBED = "embed"  # token embedding and admission (first stage)
LAYERS = "layers"  # a run of consecutive decoder layers (every stage)
HEAD = "head"  # final norm, LM head and sampling (last stage)


def _count(n: int) -> str:
    """947.03B, 1.23M, 512: a parameter count (units.py formats quantities with units, none of them counts)."""
    return next((f"{n / size:.2f}{suffix}" for suffix, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)) if n >= size),
                str(n))


@attrs.frozen
class Stage:
    node: str
    first_layer: int
    last_layer: int  # inclusive
    roles: tuple[str, ...]  # "embed", "layers", "head"
    weight_bytes: int
    state_bytes: int  # every slot's own state (convolutions) and the K/V pool
    free_bytes: int  # memory left after weights, state and reserve (less than a block)
    # context per stream when max_streams streams share the pool alike; None = any (only sliding-window K/V)
    max_positions_per_stream: int | None
    est_time_s: float  # estimated time of one decode row through this stage
    kv_blocks: int | None = None  # the K/V pool's blocks (`PoolLayout`); None = no attention layer, no pool
    kv_block: int = 64  # positions of the global layers per block
    ring_blocks: int = 0  # blocks a stream holds for its sliding layers' rings, however long it is
    paged: bool = True  # the stage has global layers: a stream also takes a block per kv_block positions

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    @property
    def allocated_bytes(self) -> int:
        """What the stage's node process allocates: weights, slots' state and the K/V pool."""
        return self.weight_bytes + self.state_bytes

    @property
    def positions_one_stream(self) -> int | None:
        """The longest context one stream alone could reach in the pool; None = any."""
        return None if self.kv_blocks is None or not self.paged else (self.kv_blocks - self.ring_blocks) * self.kv_block

    @property
    def kv_pool(self) -> KVPool | None:
        """The pool as admission counts it."""
        return None if self.kv_blocks is None else KVPool(self.kv_blocks, self.ring_blocks, self.paged)


# What the table's pool columns mean, under it
POOL_NOTE = ("free is what the K/V pool leaves of a node's memory (0: the pool takes the rest); positions: the context "
             "one stream alone can reach on the stage, and each of max_streams at once (any: the stage holds no global "
             "layer, whose K/V grows with the context)")

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
                 "kv_blocks": s.kv_blocks, "kv_block": s.kv_block, "ring_blocks": s.ring_blocks, "paged": s.paged,
                 "max_positions_per_stream": s.max_positions_per_stream, "est_time_s": s.est_time_s}
                for s in self.stages
            ],
            "total_params": self.total_params,
            "active_params": self.active_params,
            "bottleneck_s": self.bottleneck_s,
            "cost_source": self.cost_source,
        }

    @classmethod
    def from_dict(cls, d: object, where: str = "plan") -> Plan:
        """The plan `to_dict` wrote; a ValueError names the key that is missing or of the wrong type."""
        _typed(d, dict, where)
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{where}: plan version {json.dumps(d.get('version'))} is not {PLAN_VERSION}")
        field = partial(_field, d, prefix=f"{where}: ")
        stages = field("stages", list)
        if not stages:
            raise PlanError(f"{where}: stages is empty")
        return cls(stages=tuple(_stage_from_dict(s, f"{where}: stages[{i}]") for i, s in enumerate(stages)),
                   total_params=field("total_params", int), active_params=field("active_params", int),
                   bottleneck_s=float(field("bottleneck_s", _NUMBER)), cost_source=field("cost_source", str))

    @property
    def kv_pools(self) -> tuple[KVPool, ...]:
        """Every stage's pool (every node holds every stream): what admission counts."""
        return tuple(pool for s in self.stages if (pool := s.kv_pool) is not None)

    def hops(self) -> list[tuple[str, str]]:
        """(node, the next stage's node) for every stage, the last with the first's: where each stage sends its rows
        (the last sends the sampled tokens back to the first). A one-stage plan's hop is (node, node)."""
        return ring_pairs([s.node for s in self.stages])

    def table(self) -> str:
        """The plan for people: one line per stage, then totals and what the stage times bound."""
        unit, size = binary_unit(max(max(s.weight_bytes, s.state_bytes, s.free_bytes) for s in self.stages))
        rows = [("node", "layers", "roles", f"weight {unit}", f"state {unit}", f"free {unit}", "K/V blocks",
                 "positions: 1 stream", "each of max", "est. ms")]

        def count(n: int | None) -> str:
            return "any" if n is None else f"{n:,}"
        for s in self.stages:
            rows.append((s.node, f"{s.first_layer}-{s.last_layer}", "+".join(s.roles), f"{s.weight_bytes / size:.2f}",
                         f"{s.state_bytes / size:.2f}", f"{s.free_bytes / size:.2f}",
                         "-" if s.kv_blocks is None else f"{s.kv_blocks:,} x {s.kv_block}",
                         count(s.positions_one_stream), count(s.max_positions_per_stream),
                         f"{s.est_time_s * 1e3:.3f}"))
        slowest = max(self.stages, key=lambda s: s.est_time_s)
        one_row = sum(s.est_time_s for s in self.stages)
        return "\n".join([
            format_rows(rows, left=range(3)),
            f"params: {_count(self.total_params)} total, {_count(self.active_params)} active per token",
            f"bottleneck: {slowest.node}, {self.bottleneck_s * 1e3:.3f} ms per row ({self.cost_source})",
            f"bounds before batching: one stream {1 / one_row:.2f} tokens/s (a row crosses every stage in turn); "
            f"{1 / self.bottleneck_s:.2f} tokens/s with a row in flight on every stage",
            *([POOL_NOTE] if any(s.kv_blocks is not None for s in self.stages) else []),
        ])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON; returns `path`."""
        Path(path).write_text(self.to_json())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan saved at `path` (`cascadia.graph.planner.load_plan` also checks it against a spec)."""
        try:
            d = read_json(path, MAX_PLAN_FILE_BYTES, "a plan file")
        except UnreadableFile as e:
            raise PlanError(f"{path}: cannot read plan: {e}") from None
        return cls.from_dict(d, where=str(path))


def stage_state_words(streams: int, stage: Stage) -> str:
    """A stage's state in words, for messages: "16 streams' slots and a K/V pool of 1,024 blocks of 64 positions"."""
    pool = "no K/V pool" if stage.kv_blocks is None else \
        f"a K/V pool of {stage.kv_blocks:,} blocks of {stage.kv_block} positions ({stage.ring_blocks} a stream's rings)"
    return f"{streams} streams' slots and {pool}"


T = TypeVar("T")


def ring_pairs(items: Sequence[T]) -> list[tuple[T, T]]:
    """Each item and the next, the last with the first: the hops of a pipeline whose last stage feeds its first."""
    return list(zip(items, [*items[1:], *items[:1]]))


# ---- reading a plan's JSON: shapes and types -----------------------------------------------------------------------

_NUMBER = (int, float)
_INT_OR_NULL = (int, type(None))
_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", _NUMBER: "a number",
               _INT_OR_NULL: "an integer or null", bool: "true or false"}


def _typed(value: object, kind: type | tuple[type, ...], label: str):
    """`value` if it is of `kind` (JSON's true and false count as no number, and only they as bool), else a
    ValueError naming `label`."""
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise PlanError(f"{label} must be {_KIND_NAMES[kind]}, not {json.dumps(value)}")
    return value


def _field(d: dict, key: str, kind: type | tuple[type, ...], prefix: str):
    """d[key] of `kind`; `prefix` names d ("plan.json: stages[1].")."""
    if key not in d:
        raise PlanError(f"{prefix}{key} is missing")
    return _typed(d[key], kind, prefix + key)


def _stage_from_dict(d: object, label: str) -> Stage:
    _typed(d, dict, label)
    field = partial(_field, d, prefix=f"{label}.")
    layers = field("layers", list)
    if len(layers) != 2:
        raise PlanError(f"{label}.layers must be [first, last], two layer numbers, not {json.dumps(layers)}")
    first, last = (_typed(n, int, f"{label}.layers[{i}]") for i, n in enumerate(layers))
    roles = tuple(_typed(role, str, f"{label}.roles[{i}]") for i, role in enumerate(field("roles", list)))
    return Stage(node=field("node", str), first_layer=first, last_layer=last, roles=roles,
                 weight_bytes=field("weight_bytes", int), state_bytes=field("state_bytes", int),
                 free_bytes=field("free_bytes", int), kv_blocks=field("kv_blocks", _INT_OR_NULL),
                 kv_block=field("kv_block", int), ring_blocks=field("ring_blocks", int), paged=field("paged", bool),
                 max_positions_per_stream=field("max_positions_per_stream", _INT_OR_NULL),
                 est_time_s=float(field("est_time_s", _NUMBER)))
