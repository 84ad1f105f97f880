"""Calibration: what each layer kind costs on each node, what each link costs, and the hosts' overheads. Data, not code.

A calibration file (JSON, format "cascadia.calibration/2") is measured with the real engine (kind "measured") or derived
from the spec's hardware figures (kind "analytic", see `analytic.py`):

    {"format": "cascadia.calibration/2",
     "meta": {"kind", "cascadia", "openvino", "device", "precision", "weight_formats", "model", "date",
              "cpu": {"model", "isa"}},             # cpu: a measured one's; absent in older files
     "grid_bounds": {...},                        # written for readers, ignored when loading
     "nodes": {NAME: {"frame_s": S, "row_s": S,   # host overheads per frame and per row (scheduling, serialisation)
                      "stream_s": S,              # host time per stream in a frame (per-stream attention and state)
                      "restart_s": S,             # optional: a node started in its place until it is ready
                      "tables": {KIND: TABLE}}},
     "links": [{"from": A, "to": B, "latency_s": S, "bandwidth_Bps": B}],
     "hosts": {HOST: {"speedup": [S1, S2, ...]}}, # optional: nodes sharing HOST (default: one core, S = [1])
     "routing": {"rows": [...], "distinct_experts": [...]},  # optional: measured from real routing
     "spread": {"tables": {NODE: [L...]}, "pipeline": [L...], "watch": [L...],   # optional: a measured one's
                "seconds": S},                                                   # rounds, and the time they spanned
     "coordinator": {"frame_s": S, "row_s": S}}  # optional: its own work per frame and row (then not the nodes')

A TABLE is the time (s) of ONE layer of its kind over a grid: "sliding" and "global" attention over rows x "context"
(attended positions: a sliding layer attends at most its window), "moe" over rows x "experts" (distinct routed experts
the frame's rows touch), "dense", "embedding" and "head" (final norm, head and sampling) over rows alone:
    {"rows": [r...], "context": [c...], "time_s": [[t(r, c) for c] for r]}    or    {"rows": [...], "time_s": [...]}
A host's speedup S_k is the work its nodes get done per second while k of them compute at once, in seconds of one
node computing alone (each of the k progresses at S_k / k); beyond the list, its last value holds. N cores shared
fairly would be S_k = min(k, N).
A second axis with a single point means the time does not depend on it. Lookups interpolate linearly along each axis
(bilinear) and extrapolate linearly from the edge segment outside the grid, noting that they did.
The spread says how the machine's speed moved while it was measured: each round's level L, the seconds it measured
over the median round's (1.1: 10% slower), for each node's sweeps of its layer grid, for the pipeline's passes (their
frames' round trips) and for the probes of `calibrate --watch` (one stream's frames, against the passes' median), over
S seconds from the first sweep to the last probe. A measured figure is the rounds' median; `simulate --interval`
reads the levels as the speeds a later run may meet (`cascadia.sim.interval`).
The coordinator's work on each frame (encoding and sending it, taking its tokens in: its process's CPU seconds) is
its own where a measured calibration has it, and the simulator puts it on the core it runs on
(`cascadia.sim.model.coordinator_shares`); without it, the nodes' per-frame and per-row times hold it, shared evenly.
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from cascadia import __version__, host_cpus
from cascadia.errors import CalibrationError
from cascadia.files import UnreadableFile, read_json
from cascadia.models.base import LayerKind, ModelConfig
from cascadia.spec.types import LinkSpec, Spec

FORMAT = "cascadia.calibration/2"
MAX_CALIBRATION_FILE_BYTES = 64 * 1024**2  # the paper's 11 nodes take 111 KiB (analytic)
MEASURED, ANALYTIC = "measured", "analytic"
# Each layer kind's second table axis; None: the time depends on rows alone.
KIND_AXES = {LayerKind.SLIDING: "context", LayerKind.GLOBAL: "context", LayerKind.MOE: "experts",
             LayerKind.DENSE: None, LayerKind.EMBEDDING: None, LayerKind.HEAD: None, LayerKind.MTP: "context"}


def interpolate(grid: Sequence[float], values: Sequence[float], x: float) -> tuple[float, bool]:
    """Piecewise-linear value at x, and whether x lies outside the grid (then extrapolated from the edge segment)."""
    if len(grid) == 1:
        return values[0], False
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return values[i] + w * (values[i + 1] - values[i]), not grid[0] <= x <= grid[-1]


def uniform_distinct_experts(rows: float, top_k: int, n_experts: int) -> float:
    """Expected distinct experts that `rows` rows touch when each picks top_k of n_experts uniformly at random: at
    least top_k from one row on (the formula's rounding can leave it a hair below, 1.9999999999999996 for 2 of 6,
    outside a calibration grid that starts at top_k)."""
    expected = n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)
    return max(expected, float(top_k)) if rows >= 1 else expected


def model_dims(config: ModelConfig) -> dict[str, int]:
    """The model figures a calibration is only valid for (0: a width the model does not have, as a dense model's
    experts')."""
    experts, top_k = config.routed_experts
    return {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "intermediate_size": getattr(config, "intermediate_size", 0),
            "moe_intermediate_size": getattr(config, "moe_intermediate_size", 0),
            "n_routed_experts": experts, "num_experts_per_tok": top_k, "vocab_size": config.output_vocab_size}


@attrs.frozen
class Table:
    """Seconds for one layer of a kind on one node, on a grid of rows (x the kind's second axis)."""

    rows: tuple[float, ...]
    points: tuple[float, ...]  # grid of the second axis; () when the time depends on rows alone
    time_s: tuple[tuple[float, ...], ...]  # [row][point]; a single column when points == ()

    def column(self, rows: float) -> tuple[tuple[float, ...], bool]:
        """Times along the second axis at `rows` rows, and whether `rows` is outside the grid."""
        outside = not self.rows[0] <= rows <= self.rows[-1]
        column = tuple(interpolate(self.rows, [t[j] for t in self.time_s], rows)[0] for j in range(len(self.time_s[0])))
        return column, outside

    def scaled(self, factor: float) -> Table:
        """Every time `factor` times over."""
        return attrs.evolve(self, time_s=tuple(tuple(t * factor for t in line) for line in self.time_s))

    def lookup(self, rows: float, x: float | None = None) -> tuple[float, bool]:
        column, outside = self.column(rows)
        if not self.points:
            return column[0], outside
        value, x_outside = interpolate(self.points, column, x)
        return value, outside or x_outside


@attrs.frozen
class NodeCalibration:
    tables: dict[str, Table]  # by layer kind (KIND_AXES); a node needs the kinds its stage holds
    frame_s: float = 0.0  # host overhead per frame through the node
    row_s: float = 0.0  # host overhead per row of a frame
    stream_s: float = 0.0  # host time per stream (distinct request) among a frame's rows, beyond the tables
    restart_s: float | None = None  # a node started in the lost one's place, until it is ready; None: not known


@attrs.frozen
class CoordinatorCalibration:
    """The coordinator's own work on a frame: CPU seconds per frame and per real row."""

    frame_s: float = 0.0
    row_s: float = 0.0

    def seconds(self, rows: int) -> float:
        return self.frame_s + self.row_s * rows


@attrs.frozen
class Spread:
    """Each measuring round's level (its seconds over the median round's): see the module's text."""

    tables: dict[str, tuple[float, ...]]  # by node: the sweeps of its layer grid
    pipeline: tuple[float, ...] = ()  # the pipeline's passes; () for a calibration of the layers alone
    watch: tuple[float, ...] = ()  # the probes of the machine's speed after the passes
    seconds: float = 0.0  # the time from the first sweep to the last round or probe

    def levels(self) -> tuple[float, ...]:
        """Every round's level, sorted."""
        tables = (level for levels in self.tables.values() for level in levels)
        return tuple(sorted([*tables, *self.pipeline, *self.watch]))


def relative_levels(seconds: Sequence[float]) -> tuple[float, ...]:
    """Each round's seconds over the median round's."""
    middle = statistics.median(seconds)
    return tuple(s / middle for s in seconds)


@attrs.frozen
class CalibrationMeta:
    kind: str  # MEASURED or ANALYTIC
    cascadia: str
    openvino: str | None
    device: str
    precision: str
    weight_formats: dict[str, str]
    model: dict[str, int]  # model_dims() of the model it was made for
    date: str | None  # ISO date of the measurement; None for analytic estimates (nothing was measured)
    cpu: dict | None = None  # the measuring machine's CPU (`host_cpus.identity`); None: analytic, or not recorded


@attrs.frozen
class Calibration:
    meta: CalibrationMeta
    nodes: dict[str, NodeCalibration]
    links: dict[tuple[str, str], LinkSpec] = attrs.Factory(dict)  # directed: (from, to)
    hosts: dict[str, tuple[float, ...]] = attrs.Factory(dict)  # speedup of the nodes naming a host; absent: (1,)
    routing: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # (rows, expected distinct experts)
    source: str | None = None  # the file it came from
    spread: Spread | None = None  # a measured one's rounds; None: analytic, or measured before they were kept
    coordinator: CoordinatorCalibration | None = None  # None: the nodes' handling holds the coordinator's work

    @property
    def is_analytic(self) -> bool:
        return self.meta.kind == ANALYTIC

    def distinct_experts(self, rows: int, top_k: int, n_experts: int) -> tuple[float, bool]:
        """Expected distinct experts touched by `rows` rows: from routing statistics when given, else uniform."""
        if self.routing is None:
            return uniform_distinct_experts(rows, top_k, n_experts), False
        return interpolate(*self.routing, rows)

    def grid_bounds(self) -> dict[str, dict[str, list[float]]]:
        """{kind: {axis: [low, high]}} over all nodes."""
        bounds: dict[str, dict[str, list[float]]] = {}
        for node in self.nodes.values():
            for kind, table in node.tables.items():
                axes = {"rows": table.rows} | ({KIND_AXES[kind]: table.points} if table.points else {})
                for axis, grid in axes.items():
                    low, high = bounds.setdefault(kind, {}).setdefault(axis, [grid[0], grid[-1]])
                    bounds[kind][axis] = [min(low, grid[0]), max(high, grid[-1])]
        return bounds

    def check_model(self, spec: Spec) -> list[str]:
        """Raise if made for another model; return warnings for other formats, precision or CPU, and for links to nodes
        the spec lacks (harmless for a calibration of a larger cluster, a typo otherwise: the link the spec's nodes
        use then comes from the spec, as the simulation notes)."""
        where = self.source or "calibration"
        dims = model_dims(spec.model.config)
        wrong = [f"{key} {self.meta.model.get(key)} (the spec's model has {value})"
                 for key, value in dims.items() if self.meta.model.get(key) != value]
        if wrong:
            raise CalibrationError(f"{where}: meta.model: made for another model: " + ", ".join(wrong))
        notes = []
        formats = weight_formats(spec)
        if self.meta.weight_formats != formats:
            notes.append(f"{where}: measured with weight formats {self.meta.weight_formats}, the spec uses {formats}")
        if self.meta.precision != spec.runtime.precision:
            notes.append(f"{where}: measured at precision {self.meta.precision}, "
                         f"the spec runs {spec.runtime.precision}")
        here = host_cpus.identity()
        if self.meta.cpu is not None and self.meta.cpu != here:
            notes.append(f"{where}: measured on {host_cpus.describe(self.meta.cpu)}; this machine has "
                         f"{host_cpus.describe(here)}: its timings may not hold here")
        names = {node.name for node in spec.cluster.nodes}
        if stray := [f"links[{i}] ({a}->{b})" for i, (a, b) in enumerate(self.links) if not {a, b} <= names]:
            notes.append(f"{where}: links name nodes the spec's cluster does not have, so they are not used: "
                         + ", ".join(stray))
        return notes

    # ---- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "meta": attrs.asdict(self.meta),
            "grid_bounds": self.grid_bounds(),
            "nodes": {name: {"frame_s": node.frame_s, "row_s": node.row_s, "stream_s": node.stream_s,
                             **({} if node.restart_s is None else {"restart_s": node.restart_s}),
                             "tables": {kind: _table_dict(kind, t) for kind, t in node.tables.items()}}
                      for name, node in self.nodes.items()},
            "links": [{"from": a, "to": b, "latency_s": link.latency, "bandwidth_Bps": link.bandwidth}
                      for (a, b), link in self.links.items()],
        }
        if self.hosts:
            out["hosts"] = {host: {"speedup": list(speedup)} for host, speedup in self.hosts.items()}
        if self.routing is not None:
            out["routing"] = {"rows": list(self.routing[0]), "distinct_experts": list(self.routing[1])}
        if self.spread is not None:
            out["spread"] = {"tables": {node: list(levels) for node, levels in self.spread.tables.items()},
                             "pipeline": list(self.spread.pipeline), "watch": list(self.spread.watch),
                             "seconds": self.spread.seconds}
        if self.coordinator is not None:
            out["coordinator"] = attrs.asdict(self.coordinator)
        return out

    def describe(self) -> dict[str, Any]:
        """What a result says about its calibration."""
        return {"source": self.source, **attrs.asdict(self.meta), "grid_bounds": self.grid_bounds(),
                "routing": "measured" if self.routing else "uniform"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            raw = read_json(path, MAX_CALIBRATION_FILE_BYTES, "a calibration file")
        except UnreadableFile as e:
            raise CalibrationError(f"{path}: {e}") from None
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "calibration") -> Calibration:
        r = _Reader(where)
        r.mapping(raw, "")
        if raw.get("format") != FORMAT:
            r.fail("format", f"expected {FORMAT!r}, got {raw.get('format')!r}")
        meta_raw = r.mapping(r.get(raw, "meta", ""), "meta")
        meta_fields = {f.name for f in attrs.fields(CalibrationMeta)}
        if missing := sorted(meta_fields - set(meta_raw) - {"cpu"}):  # older files name no CPU
            r.fail("meta", f"missing {', '.join(missing)}")
        r.mapping(meta_raw["model"], "meta.model")
        r.mapping(meta_raw["weight_formats"], "meta.weight_formats")
        meta = CalibrationMeta(**{k: meta_raw[k] for k in meta_fields if k in meta_raw})
        if meta.cpu is not None:
            r.mapping(meta.cpu, "meta.cpu")
        if meta.kind not in (MEASURED, ANALYTIC):
            r.fail("meta.kind", f"must be {MEASURED!r} or {ANALYTIC!r}, got {meta.kind!r}")
        nodes = {}
        for name, node in r.mapping(r.get(raw, "nodes", ""), "nodes").items():
            at = f"nodes.{name}"
            r.mapping(node, at)
            tables = {}
            for kind, t in r.mapping(r.get(node, "tables", at), f"{at}.tables").items():
                tables[LayerKind(kind)] = r.table(kind, t, f"{at}.tables.{kind}")  # checks the kind first
            restart_s = None if node.get("restart_s") is None else r.seconds(node["restart_s"], f"{at}.restart_s")
            nodes[name] = NodeCalibration(tables, *(r.seconds(node.get(key, 0.0), f"{at}.{key}")
                                                    for key in ("frame_s", "row_s", "stream_s")), restart_s)
        if not nodes:
            r.fail("nodes", "no nodes")
        links = {}
        for i, link in enumerate(r.list(raw.get("links", []), "links", empty=True)):
            at = f"links[{i}]"
            r.mapping(link, at)
            pair = tuple(r.name(r.get(link, end, at), f"{at}.{end}") for end in ("from", "to"))
            if pair in links:
                r.fail(at, f"link {pair[0]}->{pair[1]} given twice")
            bandwidth = r.positive(r.get(link, "bandwidth_Bps", at), f"{at}.bandwidth_Bps")
            links[pair] = LinkSpec(bandwidth=bandwidth, latency=r.seconds(r.get(link, "latency_s", at),
                                                                           f"{at}.latency_s"))
        hosts = {}
        for host, entry in r.mapping(raw.get("hosts", {}), "hosts").items():
            at = f"hosts.{host}.speedup"
            values = r.list(r.get(r.mapping(entry, f"hosts.{host}"), "speedup", f"hosts.{host}"), at)
            hosts[host] = tuple(r.positive(v, f"{at}[{i}]") for i, v in enumerate(values))
        routing = None
        if "routing" in raw:
            rt = r.mapping(raw["routing"], "routing")
            rows = r.grid(r.get(rt, "rows", "routing"), "routing.rows")
            experts = tuple(r.positive(v, f"routing.distinct_experts[{i}]")
                            for i, v in enumerate(r.list(r.get(rt, "distinct_experts", "routing"),
                                                         "routing.distinct_experts")))
            if len(experts) != len(rows):
                r.fail("routing.distinct_experts", f"has {len(experts)} values for {len(rows)} rows")
            routing = (rows, experts)
        spread = None
        if "spread" in raw:
            sp = r.mapping(raw["spread"], "spread")
            tables = {node: r.levels(levels, f"spread.tables.{node}")
                      for node, levels in r.mapping(r.get(sp, "tables", "spread"), "spread.tables").items()}
            spread = Spread(tables, *(r.levels(sp.get(key, []), f"spread.{key}", empty=True)
                                      for key in ("pipeline", "watch")),
                            r.seconds(sp.get("seconds", 0.0), "spread.seconds"))
        coordinator = None
        if "coordinator" in raw:
            entry = r.mapping(raw["coordinator"], "coordinator")
            coordinator = CoordinatorCalibration(*(r.seconds(entry.get(key, 0.0), f"coordinator.{key}")
                                                   for key in ("frame_s", "row_s")))
        return cls(meta, nodes, links, hosts, routing, source=where, spread=spread, coordinator=coordinator)


class Extrapolations:
    """Lookups that left their grid: one note per (node, kind), kept to be shown with the results."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._seen: set[tuple[str, str]] = set()

    def note(self, nodes: str, kind: str, detail: str) -> None:
        """`nodes`: "node NAME", or "nodes A, B" for stages that share their calibration and layer kinds."""
        if (nodes, kind) not in self._seen:
            self._seen.add((nodes, kind))
            self.notes.append(f"{nodes}: {kind} time extrapolated beyond the calibration grid ({detail})")


def weight_formats(spec: Spec) -> dict[str, str]:
    """The spec's weight formats as a calibration's meta records them."""
    formats = spec.model.formats
    return {f.name: str(getattr(formats, f.name)) for f in attrs.fields(type(formats))}


def make_meta(spec: Spec, kind: str, device: str, openvino: str | None) -> CalibrationMeta:
    """Metadata for a calibration of the spec's model made now (measured ones are dated)."""
    measured = kind == MEASURED
    return CalibrationMeta(kind=kind, cascadia=__version__, openvino=openvino, device=device,
                           precision=spec.runtime.precision, weight_formats=weight_formats(spec),
                           model=model_dims(spec.model.config), date=datetime.date.today().isoformat() if measured
                           else None, cpu=host_cpus.identity() if measured else None)


def _table_dict(kind: str, table: Table) -> dict[str, Any]:
    if not table.points:
        return {"rows": list(table.rows), "time_s": [t[0] for t in table.time_s]}
    return {"rows": list(table.rows), KIND_AXES[kind]: list(table.points), "time_s": [list(t) for t in table.time_s]}


class _Reader:
    """Checks one calibration document; every failure names the file and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str) -> None:
        raise CalibrationError(f"{self.where}: {key}: {message}" if key else f"{self.where}: {message}")

    def get(self, d: dict, key: str, at: str) -> Any:
        if key not in d:
            self.fail(at, f"missing {key!r}")
        return d[key]

    def mapping(self, value: Any, at: str) -> dict:
        if not isinstance(value, dict):
            self.fail(at, f"expected an object, got {type(value).__name__}")
        return value

    def list(self, value: Any, at: str, empty: bool = False) -> list:
        if not isinstance(value, list) or not (value or empty):
            self.fail(at, "expected a list" if empty else "expected a non-empty list")
        return value

    def name(self, value: Any, at: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(at, f"expected a node name, got {value!r}")
        return value

    def number(self, value: Any, at: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(at, f"expected a finite number, got {value!r}")
        return float(value)

    def seconds(self, value: Any, at: str) -> float:
        if self.number(value, at) < 0:
            self.fail(at, f"a time cannot be negative, got {value!r}")
        return float(value)

    def positive(self, value: Any, at: str) -> float:
        if self.number(value, at) <= 0:
            self.fail(at, f"must be positive, got {value!r}")
        return float(value)

    def levels(self, value: Any, at: str, empty: bool = False) -> tuple[float, ...]:
        return tuple(self.positive(v, f"{at}[{i}]") for i, v in enumerate(self.list(value, at, empty)))

    def grid(self, value: Any, at: str) -> tuple[float, ...]:
        grid = tuple(self.number(v, f"{at}[{i}]") for i, v in enumerate(self.list(value, at)))
        if any(b <= a for a, b in zip(grid, grid[1:])):
            self.fail(at, f"must be strictly increasing, got {list(grid)}")
        if grid[0] < 0:
            self.fail(at, f"cannot be negative, got {grid[0]}")
        return grid

    def table(self, kind: str, raw: Any, at: str) -> Table:
        if kind not in KIND_AXES:
            self.fail(at, f"unknown layer kind; expected one of {', '.join(KIND_AXES)}")
        self.mapping(raw, at)
        rows = self.grid(self.get(raw, "rows", at), f"{at}.rows")
        if len(rows) < 2:
            self.fail(f"{at}.rows", "needs at least two row counts to interpolate")
        axis = KIND_AXES[kind]
        if axis is None and set(raw) - {"rows", "time_s"}:
            self.fail(at, f"a {kind} table has only 'rows' and 'time_s', found {sorted(set(raw) - {'rows', 'time_s'})}")
        points = self.grid(self.get(raw, axis, at), f"{at}.{axis}") if axis else ()
        times = self.list(self.get(raw, "time_s", at), f"{at}.time_s")
        if len(times) != len(rows):
            self.fail(f"{at}.time_s", f"has {len(times)} entries for {len(rows)} rows")
        if axis is None:
            return Table(rows, (), tuple((self.seconds(t, f"{at}.time_s[{i}]"),) for i, t in enumerate(times)))
        out = []
        for i, line in enumerate(times):
            line = self.list(line, f"{at}.time_s[{i}]")
            if len(line) != len(points):
                self.fail(f"{at}.time_s[{i}]", f"has {len(line)} values for {len(points)} {axis} points")
            out.append(tuple(self.seconds(t, f"{at}.time_s[{i}][{j}]") for j, t in enumerate(line)))
        return Table(rows, points, tuple(out))
