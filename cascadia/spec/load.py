"""Load a spec: validate the node tree `yaml_tree` reads into a `Spec`, reporting every problem with its file, line
and key path.

    model:     hf_config: inkling-975b/config.json      # or config: {...}; overrides: {...} on top
               checkpoint: DIR                           # optional
               formats: {default: int8, routed_experts: {dtype: int4, group_size: 32}}
    cluster:   nodes: [{name: pc, count: 11, memory: 61.2GiB, memory_bandwidth: 120GB/s, compute: 30TFLOPS}]
               links: {default: {bandwidth: 1gbit, latency: 100us}, pairs: [{between: [pc0, pc1], ...}]}
               reserve: 2GiB                             # kept free on every node
    runtime:   context_budget, max_streams, kv_block, precision, kv_precision, row_buckets, prefill_window,
               pipeline_groups,
               moe_grouped_from, fused_attention_from, speculate
    workload:  concurrency: 1,2,4  requests  prompt_tokens: {uniform: [8, 24]}  output_tokens  greedy ...
    include:   [models/inkling.yaml, clusters/lab.yaml]  # merged first, in order; this file's keys win

Paths are relative to the file that names them. A key set to null counts as absent, so a file can drop a key it
included. Every value keeps its line, and no input, however malformed, escapes as anything but `SpecError`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from cascadia.host_cpus import parse_cpus
from cascadia.models import family_of, read_fields
from cascadia.models.base import ConfigError, FieldTypeError, ModelConfig, conform
from cascadia.spec.problems import Problem, SpecError, shown
from cascadia.spec.types import (DEVICES, PRECISIONS, TENSOR_GROUPS, WEIGHT_DTYPES, Catalogue, ClusterSpec, LengthSpec,
                                 LinkSpec, MachineType, ModelSpec, NodeSpec, RuntimeSpec, SloSpec, Spec, WeightFormat,
                                 WeightFormats, WorkloadSpec, is_tcp_address)
from cascadia.spec.yaml_tree import Node, read_document
from cascadia.speculation import parse_speculate
from cascadia.units import UnitError, format_bytes, parse_bytes, parse_duration, parse_flops, parse_rate
from cascadia.workload import misfits

_MAX_COUNT = 10_000  # nodes one `count:` may stamp out: a guard against a billion
# Rows of one engine call: every block is compiled and warmed up at each bucket, so a mistyped 10**9 would allocate
# its activations at once. The paper's largest bucket is 32.
MAX_ROW_BUCKET = 4096


# ---- reading values ------------------------------------------------------------------------------------------------
class _Invalid(ValueError):
    """A value of the wrong kind; the message says what was expected."""


class _Context:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def report(self, node: Node, key: str, message: str) -> None:
        self.problems.append(Problem(node.file, node.line, key, message))

    def parse(self, node: Node, key: str, parse: Callable[[Any], Any]) -> Any:
        """`parse` of the node's plain value, or None with the problem recorded at the node."""
        try:
            return parse(node.plain())
        except (_Invalid, UnitError) as e:
            self.report(node, key, str(e))
            return None


class _Fields:
    """The keys of one mapping, read one at a time; keys never asked for are reported as unknown by `finish`."""

    def __init__(self, ctx: _Context, node: Node, path: str):
        self.ctx, self.node, self.path = ctx, node, path
        self.items: dict[str, Node] = node.value if isinstance(node.value, dict) else {}
        self.asked: list[str] = []
        if not isinstance(node.value, dict):
            ctx.report(node, path, f"expected a mapping of keys, got {shown(node.plain())}")

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, required: bool = False) -> Node | None:
        """The node under `name`, or None when absent or null (reported when required)."""
        self.asked.append(name)
        node = self.items.get(name)
        if node is not None and node.value is not None:
            return node
        if required and isinstance(self.node.value, dict):
            self.ctx.report(node or self.node, self.key(name), "missing (required)")
        return None

    def given(self, name: str) -> bool:
        """Whether `name` holds a value (absent and null count as not given)."""
        node = self.items.get(name)
        return node is not None and node.value is not None

    def take(self, name: str, parse: Callable[[Any], Any], required: bool = False) -> Any:
        """The parsed value under `name`, or None when absent or invalid (a problem is recorded)."""
        node = self.get(name, required)
        return None if node is None else self.ctx.parse(node, self.key(name), parse)

    def path_value(self, name: str, must_exist: bool = False) -> Path | None:
        """A path under `name`, made absolute from the folder of the file that wrote it."""
        node = self.get(name)
        text = None if node is None else self.ctx.parse(node, self.key(name), _text)
        if text is None:
            return None
        path = Path(os.path.abspath(node.file.parent / text))
        if must_exist and not _is_file(path):
            self.ctx.report(node, self.key(name), f"no such file: {path}")
        return path

    def finish(self) -> None:
        for name, node in self.items.items():
            if name not in self.asked:
                hint = difflib.get_close_matches(name, self.asked, n=1)
                known = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(self.asked)}"
                self.ctx.report(node, self.key(name), f"unknown key; {known}")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _integer(low: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _Invalid(f"expected an integer >= {low}, got {shown(value)}")
        return value
    return parse


_positive_int = _integer(1)
_count_int = _integer(0)


def _number(value: Any) -> float:
    # PyYAML reads `1e-3` (no dot) as text, so numeric text is accepted too.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Invalid(f"expected a number, got {shown(value)}")
    return float(value)


def _fraction(value: Any) -> float:
    number = _number(value)
    if not 0 < number <= 1:
        raise _Invalid(f"expected a number in (0, 1], got {shown(value)}")
    return number


def _share(value: Any) -> float:
    number = _number(value)
    if not 0 <= number <= 1:
        raise _Invalid(f"expected a number in [0, 1], got {shown(value)}")
    return number


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {shown(value)}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise _Invalid(f"expected text, got {shown(value)}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    """One of `options`, matched ignoring case, returned as spelled in `options`."""
    def parse(value: Any) -> str:
        for option in options:
            if isinstance(value, str) and value.lower() == option.lower():
                return option
        raise _Invalid(f"expected one of {', '.join(options)}, got {shown(value)}")
    return parse


def _positive(parse: Callable[[Any], float]) -> Callable[[Any], float]:
    def positive(value: Any) -> float:
        quantity = parse(value)
        if quantity <= 0:
            raise _Invalid(f"must be more than zero, got {shown(value)}")
        return quantity
    return positive


def _int_list(value: Any) -> tuple[int, ...]:
    """Positive integers, distinct: `[1, 2, 4]`, `"1,2,4"` or `8`."""
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",")]
        except ValueError:
            raise _Invalid(f"expected integers like '1,2,4', got {shown(value)}") from None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items):
        raise _Invalid(f"expected positive integers like [1, 2, 4], got {shown(value)}")
    if len(set(items)) != len(items):
        raise _Invalid(f"values repeat: {shown(value)}")
    return tuple(items)


def _rate_list(value: Any) -> tuple[float, ...]:
    """Positive arrival rates (requests per second), distinct: `[0.5, 2, 8]`, `"0.5,2,8"` or `4`."""
    if isinstance(value, str):
        try:
            value = [float(part) for part in value.split(",")]
        except ValueError:
            raise _Invalid(f"expected rates like '0.5,2,8', got {shown(value)}") from None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                            for v in items):
        raise _Invalid(f"expected positive rates (requests per second) like [0.5, 2, 8], got {shown(value)}")
    if len(set(items)) != len(items):
        raise _Invalid(f"values repeat: {shown(value)}")
    return tuple(float(v) for v in items)


def _cpu_list(value: Any) -> tuple[int, ...]:
    try:
        return parse_cpus(value)
    except ValueError as e:
        raise _Invalid(str(e)) from None


def parse_row_buckets(value: Any) -> tuple[int, ...]:
    """`runtime.row_buckets` from its YAML value or a string "1,2,8"; a ValueError saying what is wrong."""
    buckets = _int_list(value)
    if list(buckets) != sorted(buckets):
        raise _Invalid(f"must be increasing, got {shown(value)}")
    if buckets[-1] > MAX_ROW_BUCKET:
        raise _Invalid(f"a call holds at most {MAX_ROW_BUCKET} rows, got {buckets[-1]}")
    return buckets


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _node_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise _Invalid(f"expected a name of letters, digits, '_', '.', '-', got {shown(value)}")
    return value


def _tcp_address(value: Any) -> str:
    if not is_tcp_address(value):
        raise _Invalid(f"expected 'tcp://HOST:PORT', got {shown(value)}")
    return value


def _address(value: Any) -> str:
    if value != "local" and not is_tcp_address(value):
        raise _Invalid(f"expected 'local' or 'tcp://HOST:PORT', got {shown(value)}")
    return value


# ---- model ---------------------------------------------------------------------------------------------------------
_CONFIG_METADATA = {"model_type", "architectures"}  # in every config.json; harmless inline


def _config_values(fields: dict[str, Any], types: dict[str, Any], report: Callable[[str, str], None],
                   check_unknown: bool, numeric_text: bool) -> dict[str, Any] | None:
    """Config fields conformed to `types`, their family's (`models.base.conform`; `numeric_text`: for YAML, which
    reads `1e-3` as text), or None; each problem goes to `report(key, message)`.

    None when a field is wrong, rather than the others alone: a dropped field would come back as its default
    and set off problems of its own (a default 66 layers against a 6-entry layer_types).
    """
    out, valid = {}, True
    for key, value in fields.items():
        if key not in types:
            if check_unknown and key not in _CONFIG_METADATA:
                hint = difflib.get_close_matches(key, list(types), n=1)
                report(key, "unknown model config key" + (f"; did you mean {hint[0]!r}?" if hint else ""))
                valid = False
            out[key] = value
            continue
        try:
            out[key] = conform(value, types[key], numeric_text)
        except FieldTypeError as e:
            report(key, str(e))
            valid = False
    return out if valid else None


def _read_hf_config(ctx: _Context, node: Node) -> tuple[ModuleType, dict[str, Any], Path] | None:
    """The family and text-model fields of the config.json that `node` names (see `models.read_fields`), and that
    file; problems name the file and the key, reported at `node`."""
    if ctx.parse(node, "model.hf_config", _text) is None:
        return None
    try:
        fam, fields, path = read_fields(os.path.normpath(node.file.parent / node.value))
    except ConfigError as e:
        ctx.report(node, "model.hf_config", str(e))
        return None

    def report(key: str, message: str) -> None:
        ctx.report(node, "model.hf_config", f"{path}: {key}: {message}")

    values = _config_values(fields, fam.FIELD_TYPES, report, check_unknown=False, numeric_text=False)
    return None if values is None else (fam, values, path)


def _inline_family(ctx: _Context, node: Node, path: str) -> ModuleType | None:
    """The family an inline mapping of config fields names by its `model_type` (or `architectures`)."""
    if not isinstance(node.value, dict):
        ctx.report(node, path, f"expected a mapping of config fields, got {shown(node.plain())}")
        return None
    try:
        return family_of({key: value.plain() for key, value in node.value.items() if key in _CONFIG_METADATA})
    except ConfigError as e:
        key = next((key for key in ("model_type", "architectures") if key in node.value), None)
        ctx.report(node if key is None else node.value[key], path if key is None else f"{path}.{key}", str(e))
        return None


def _mapping_values(ctx: _Context, node: Node, path: str, fam: ModuleType) -> dict[str, Any] | None:
    """Inline config fields (`model.config`, `model.overrides`) of family `fam`, each checked at its own line."""
    if not isinstance(node.value, dict):
        ctx.report(node, path, f"expected a mapping of config fields, got {shown(node.plain())}")
        return None
    return _config_values({k: v.plain() for k, v in node.value.items()}, fam.FIELD_TYPES,
                          lambda key, message: ctx.report(node.value[key], f"{path}.{key}", message),
                          check_unknown=True, numeric_text=True)


def _model_config(ctx: _Context, model: Node, fields: _Fields) -> ModelConfig | None:
    hf_node, inline_node, overrides_node = fields.get("hf_config"), fields.get("config"), fields.get("overrides")
    if hf_node is not None and inline_node is not None:
        ctx.report(inline_node, "model.config", "give model.hf_config or model.config, not both")
        return None
    if hf_node is None and inline_node is None:
        ctx.report(model, "model", "missing hf_config (path of a transformers config.json) or config (inline fields)")
        return None
    if inline_node is not None:
        fam, source = _inline_family(ctx, inline_node, "model.config"), None
        base = None if fam is None else _mapping_values(ctx, inline_node, "model.config", fam)
    else:
        fam, base, source = _read_hf_config(ctx, hf_node) or (None, None, None)
    if fam is None:
        return None
    overrides = {} if overrides_node is None else _mapping_values(ctx, overrides_node, "model.overrides", fam)
    if base is None or overrides is None:
        return None
    if overrides.get("model_type", fam.MODEL_TYPES[0]) not in fam.MODEL_TYPES:
        ctx.report(overrides_node.value["model_type"], "model.overrides.model_type",
                   "an override cannot change the model's family")
        return None
    # An override under an alias (sliding_window) must beat the base's proper name (sliding_window_size).
    merged = {**base, **{fam.ALIASES.get(key, key): value for key, value in overrides.items()}}
    try:
        return fam.Config.from_hf_dict(merged)
    except ConfigError as e:
        for message in str(e).split("; "):
            # A message starts with the field it is about: point at the line that set that field.
            field = message.split(" ", 1)[0].rstrip(":")
            if field in overrides:
                ctx.report(overrides_node.value[field], f"model.overrides.{field}", message)
            elif inline_node is not None:
                ctx.report(inline_node.value.get(field, inline_node), f"model.config.{field}", message)
            else:
                ctx.report(hf_node, "model.hf_config", f"{source}: {message}")
        return None


def _weight_format(ctx: _Context, node: Node, path: str) -> WeightFormat | None:
    """`int4`, `bf16`, or `{dtype: int4, group_size: 32, symmetric: true}`."""
    dtype = _choice(WEIGHT_DTYPES)
    if not isinstance(node.value, dict):
        kind = ctx.parse(node, path, dtype)
        return None if kind is None else WeightFormat(kind)
    fields = _Fields(ctx, node, path)
    kind = fields.take("dtype", dtype, required=True)
    group_size = fields.take("group_size", _positive_int)
    symmetric = fields.take("symmetric", _boolean)
    fields.finish()
    if kind is None:
        return None
    if not WeightFormat(kind).is_integer and (group_size is not None or symmetric is not None):
        ctx.report(node, path, f"group_size and symmetric apply to int4 and int8 only, not {kind}")
        return None
    return WeightFormat(kind, group_size, True if symmetric is None else symmetric)


def _weight_formats(ctx: _Context, node: Node | None) -> WeightFormats:
    """One format for every tensor group (`formats: int8`), or per group over an optional `default`."""
    if node is None:
        return WeightFormats()
    if not isinstance(node.value, dict):
        fmt = _weight_format(ctx, node, "model.formats")
        return WeightFormats(**dict.fromkeys(TENSOR_GROUPS, fmt)) if fmt else WeightFormats()
    fields = _Fields(ctx, node, "model.formats")
    default_node = fields.get("default")
    default = WeightFormat() if default_node is None else _weight_format(ctx, default_node, "model.formats.default")
    groups = {}
    for group in TENSOR_GROUPS:
        group_node = fields.get(group)
        fmt = default if group_node is None else _weight_format(ctx, group_node, f"model.formats.{group}")
        if fmt is not None:
            groups[group] = fmt
    fields.finish()
    return WeightFormats(**groups)


def _model(ctx: _Context, node: Node) -> ModelSpec | None:
    fields = _Fields(ctx, node, "model")
    name = fields.take("name", _node_name)
    checkpoint = fields.path_value("checkpoint")
    formats = _weight_formats(ctx, fields.get("formats"))
    config = _model_config(ctx, node, fields) if isinstance(node.value, dict) else None
    fields.finish()
    if config is None:
        return None
    return ModelSpec(config, formats, checkpoint, **({"name": name} if name else {}))


# ---- cluster -------------------------------------------------------------------------------------------------------
def _nodes(ctx: _Context, entry: Node, path: str, cluster_reserve: int | None) -> list[NodeSpec]:
    """The node(s) of one `nodes:` entry: `count: N` stamps out N alike, named NAME0..NAME{N-1}.
    `cluster_reserve`: None when the cluster's is invalid (already reported)."""
    fields = _Fields(ctx, entry, path)
    name = fields.take("name", _node_name, required=True)
    count = fields.take("count", _integer(1))
    values = {
        "address": fields.take("address", _address),
        "device": fields.take("device", _choice(DEVICES)),
        "memory_bytes": fields.take("memory", _positive(parse_bytes), required=True),
        "memory_bandwidth": fields.take("memory_bandwidth", _positive(parse_rate)),
        "compute_flops": fields.take("compute", _positive(parse_flops)),
        "disk_bandwidth": fields.take("disk_bandwidth", _positive(parse_rate)),
        "host": fields.take("host", _text),
        "threads": fields.take("threads", _positive_int),
        "reserve_bytes": fields.take("reserve", parse_bytes),
        "layers": fields.take("layers", _positive_int),
        "cpus": fields.take("cpus", _cpu_list),
        "door": fields.take("door", _tcp_address),
    }
    fields.finish()
    if values["door"] is not None and values["address"] in (None, "local"):
        ctx.report(fields.items["door"], fields.key("door"), "a node invited at a door needs a tcp address too")
    if values["cpus"] is not None and values["threads"] is None and not fields.given("threads"):
        values["threads"] = len(values["cpus"])  # a thread per CPU it may use
    memory = values["memory_bytes"]
    reserve = values["reserve_bytes"] if fields.given("reserve") else cluster_reserve  # None: invalid, reported
    if memory is not None and reserve is not None and memory <= reserve:
        ctx.report(fields.items["memory"], fields.key("memory"),
                   f"{format_bytes(memory)} leaves nothing beyond the reserve of {format_bytes(reserve)}")
    if count is not None and count > _MAX_COUNT:
        ctx.report(fields.items["count"], fields.key("count"), f"expected at most {_MAX_COUNT} nodes")
        return []
    if count is not None and values["address"] not in (None, "local"):
        ctx.report(fields.items["address"], fields.key("address"), "nodes stamped out by count cannot share an address")
        return []
    if name is None:
        return []
    # Nodes with an invalid value are still named, so links to them are not reported too; the spec is refused anyway.
    given = {k: v for k, v in values.items() if v is not None}
    names = [name] if count is None else [f"{name}{i}" for i in range(count)]
    return [NodeSpec(node_name, **given) for node_name in names]


def _link(fields: _Fields, base: LinkSpec) -> LinkSpec:
    bandwidth = fields.take("bandwidth", _positive(parse_rate))
    latency = fields.take("latency", parse_duration)
    return LinkSpec(base.bandwidth if bandwidth is None else bandwidth, base.latency if latency is None else latency)


def _links(ctx: _Context, node: Node | None, names: set[str]) -> tuple[LinkSpec, dict[tuple[str, str], LinkSpec]]:
    """The default link, and per node pair what differs from it (`pairs: [{between: [a, b], bandwidth: ...}]`)."""
    if node is None:
        return LinkSpec(), {}
    fields = _Fields(ctx, node, "cluster.links")
    default_node = fields.get("default")
    default = LinkSpec()
    if default_node is not None:
        default_fields = _Fields(ctx, default_node, "cluster.links.default")
        default = _link(default_fields, default)
        default_fields.finish()
    pairs_node = fields.get("pairs")
    fields.finish()
    pairs: dict[tuple[str, str], LinkSpec] = {}
    entries = [] if pairs_node is None else pairs_node.value
    if not isinstance(entries, list):
        ctx.report(pairs_node, "cluster.links.pairs", "expected a list of {between: [a, b], bandwidth, latency}")
        entries = []
    for i, entry in enumerate(entries):
        pair_fields = _Fields(ctx, entry, f"cluster.links.pairs[{i}]")
        between = pair_fields.get("between", required=True)
        link = _link(pair_fields, default)
        pair_fields.finish()
        if between is None:
            continue
        ends = between.plain()
        if not (isinstance(ends, list) and len(ends) == 2 and all(isinstance(e, str) for e in ends)
                and ends[0] != ends[1]):
            ctx.report(between, pair_fields.key("between"), f"expected two node names, got {shown(ends)}")
        elif unknown := [e for e in ends if e not in names]:
            hint = difflib.get_close_matches(unknown[0], names, n=1)
            ctx.report(between, pair_fields.key("between"),
                       f"no node named {unknown[0]!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))
        elif (key := tuple(sorted(ends))) in pairs:
            ctx.report(between, pair_fields.key("between"), f"link {key[0]}-{key[1]} given twice")
        else:
            pairs[key] = link
    return default, pairs


def _cluster(ctx: _Context, node: Node) -> ClusterSpec | None:
    fields = _Fields(ctx, node, "cluster")
    reserve = fields.take("reserve", parse_bytes)  # None: invalid, reported
    if not fields.given("reserve"):
        reserve = attrs.fields(ClusterSpec).reserve_bytes.default
    curve_keys = fields.path_value("curve_keys")
    if curve_keys is not None and not _is_folder(curve_keys / "public"):
        # Without its public keys no socket could tell a peer's key from a stranger's.
        ctx.report(fields.items["curve_keys"], "cluster.curve_keys",
                   f"{curve_keys}: no folder of public keys ({curve_keys / 'public'}); make one with `cascadia keys "
                   "generate`")
    coordinator_cpus = fields.take("coordinator_cpus", _cpu_list)
    discover = fields.take("discover", _boolean) or False
    nodes_node = fields.get("nodes", required=not discover)
    spares_node = fields.get("spares")
    links_node = fields.get("links")
    fields.finish()
    if nodes_node is None and not discover:
        return None
    if nodes_node is not None and (not isinstance(nodes_node.value, list) or not (nodes_node.value or discover)):
        ctx.report(nodes_node, "cluster.nodes", "expected a list of nodes ({name, memory, ...})")
        return None
    if spares_node is not None and not isinstance(spares_node.value, list):
        ctx.report(spares_node, "cluster.spares", "expected a list of nodes ({name, memory, ...})")
        spares_node = None
    seen: dict[str, str] = {}  # name or tcp address -> key path of the entry that introduced it
    nodes = [] if nodes_node is None else _node_list(ctx, nodes_node, "cluster.nodes", reserve, seen)
    spares = [] if spares_node is None else _node_list(ctx, spares_node, "cluster.spares", reserve, seen)
    for spare in spares:
        if spare.layers is not None:
            ctx.report(spares_node, "cluster.spares", f"spare {spare.name!r} pins `layers`: a spare holds no stage "
                                                      "of the plan")
    default, pairs = _links(ctx, links_node, {n.name for n in nodes + spares})
    return None if reserve is None else ClusterSpec(tuple(nodes), default, pairs, reserve, curve_keys,
                                                    coordinator_cpus, tuple(spares), discover)


def _node_list(ctx: _Context, node: Node, key: str, reserve: int | None, seen: dict[str, str]) -> list[NodeSpec]:
    """The nodes of a `nodes:` or `spares:` list; a name or tcp address in `seen` (from the key path that
    introduced it) is reported."""
    nodes: list[NodeSpec] = []
    for i, entry in enumerate(node.value):
        for spec in _nodes(ctx, entry, f"{key}[{i}]", reserve):
            for label, value in (("name", spec.name), ("address", None if spec.is_local else spec.address)):
                if value in seen:
                    ctx.report(entry, f"{key}[{i}]", f"{label} {value!r} already used by {seen[value]}")
                elif value is not None:
                    seen[value] = f"{key}[{i}]"
            nodes.append(spec)
    return nodes


# ---- runtime and workload ------------------------------------------------------------------------------------------
def _runtime(ctx: _Context, node: Node | None) -> RuntimeSpec:
    if node is None:
        return RuntimeSpec()
    fields = _Fields(ctx, node, "runtime")
    values = {
        "context_budget": fields.take("context_budget", _positive_int),
        "max_streams": fields.take("max_streams", _positive_int),
        "kv_block": fields.take("kv_block", _positive_int),
        "precision": fields.take("precision", _choice(PRECISIONS)),
        "kv_precision": fields.take("kv_precision", _choice(PRECISIONS)),
        "row_buckets": fields.take("row_buckets", parse_row_buckets),
        "prefill_window": fields.take("prefill_window", _positive_int),
        "pipeline_groups": fields.take("pipeline_groups", _positive_int),
        "moe_grouped_from": fields.take("moe_grouped_from", _rows_or("auto", "never")),
        "fused_attention_from": fields.take("fused_attention_from", _rows_or("never")),
        "stage_graph": fields.take("stage_graph", _boolean),
        "speculate": fields.take("speculate", _speculate),
    }
    fields.finish()
    return RuntimeSpec(**{k: v for k, v in values.items() if v is not None})


def _rows_or(*words: str) -> Callable[[Any], int | str]:
    """A parser of a row count >= 1 or one of `words` (runtime.moe_grouped_from, runtime.fused_attention_from)."""
    def parse(value: Any) -> int | str:
        if isinstance(value, str) and value.lower() in words:
            return value.lower()
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        choices = ("a row count >= 1", *words)
        raise _Invalid(f"expected {', '.join(choices[:-1])} or {choices[-1]}, got {shown(value)}")
    return parse


def _speculate(value: Any) -> str:
    """`ngram`, `mtp` or `ngram+mtp`, maybe with `:MAX_DRAFT`."""
    try:
        parse_speculate(value)
    except ValueError as e:
        raise _Invalid(str(e)) from None
    return str(value)


def _length(ctx: _Context, node: Node, path: str) -> LengthSpec | None:
    """`16` or `{uniform: [8, 24]}`."""
    if not isinstance(node.value, dict):
        n = ctx.parse(node, path, _positive_int)
        return None if n is None else LengthSpec.fixed(n)
    fields = _Fields(ctx, node, path)
    bounds = fields.get("uniform", required=True)
    fields.finish()
    if bounds is None:
        return None
    low_high = bounds.plain()
    if not (isinstance(low_high, list) and len(low_high) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in low_high)
            and 1 <= low_high[0] <= low_high[1]):
        ctx.report(bounds, fields.key("uniform"), f"expected [low, high] with 1 <= low <= high, got {shown(low_high)}")
        return None
    return LengthSpec(*low_high)


def _slo(ctx: _Context, node: Node | None) -> SloSpec | None:
    """`{ttft: 2s, tpot: 200ms}`: both."""
    if node is None:
        return None
    fields = _Fields(ctx, node, "workload.slo")
    ttft, tpot = (fields.take(key, _positive(parse_duration), required=True) for key in ("ttft", "tpot"))
    fields.finish()
    return None if ttft is None or tpot is None else SloSpec(ttft, tpot)


def _workload(ctx: _Context, node: Node | None) -> WorkloadSpec:
    if node is None:
        return WorkloadSpec()
    fields = _Fields(ctx, node, "workload")
    prompt_node = fields.get("prompt_tokens")
    values = {
        "concurrency": fields.take("concurrency", _int_list),
        "requests": fields.take("requests", _positive_int),
        "prompt_tokens": None if prompt_node is None else _length(ctx, prompt_node, "workload.prompt_tokens"),
        "prompts_file": fields.path_value("prompts_file", must_exist=True),
        "output_tokens": fields.take("output_tokens", _positive_int),
        "choices": fields.take("choices", _positive_int),
        "stop_at_eos": fields.take("stop_at_eos", _boolean),
        "greedy": fields.take("greedy", _boolean),
        "temperature": fields.take("temperature", _positive(_number)),
        "top_p": fields.take("top_p", _fraction),
        "seed": fields.take("seed", _count_int),
        "top_k": fields.take("top_k", _count_int),
        "min_p": fields.take("min_p", _share),
        "rate": fields.take("rate", _rate_list),
        "slo": _slo(ctx, fields.get("slo")),
    }
    fields.finish()
    if prompt_node is not None and values["prompts_file"] is not None:
        ctx.report(prompt_node, "workload.prompt_tokens", "give prompt_tokens or prompts_file, not both")
    return WorkloadSpec(**{k: v for k, v in values.items() if v is not None})


def _check_runtime_fits(ctx: _Context, root: _Fields, runtime: RuntimeSpec, model: ModelSpec) -> None:
    """The runtime must stay within the model's positions, and a frame's prompt rows within what the slots hold:
    beyond either, a value sizes work (state, tables of frame sizes) that no run can use."""
    node = root.items["runtime"]
    at = node.value if isinstance(node.value, dict) else {}
    limit = model.config.max_position_embeddings
    if runtime.context_budget > limit:
        ctx.report(at.get("context_budget", node), "runtime.context_budget",
                   f"{runtime.context_budget} positions exceed the model's max_position_embeddings ({limit})")
    if misfit := runtime.window_misfit():
        ctx.report(at.get("prefill_window", node), "runtime.prefill_window", misfit)
    if misfit := runtime.drafting_misfit(model.config):
        ctx.report(at.get("speculate", node), "runtime.speculate", misfit)
    if misfit := runtime.stage_graph_misfit(model.config):
        ctx.report(at.get("stage_graph", node), "runtime.stage_graph", misfit)


def _check_workload_fits(ctx: _Context, root: _Fields, runtime: RuntimeSpec, workload: WorkloadSpec) -> None:
    """The workload must fit the stream slots and the context budget the runtime sizes its state for."""
    node = root.items["workload"]
    at = node.value if isinstance(node.value, dict) else {}
    for key, message in misfits(workload, runtime):
        # a default output length is reported at the prompt length it adds to
        where = at.get(key) or (at.get("prompt_tokens") if key == "output_tokens" else None) or node
        ctx.report(where, f"workload.{key}", message)


# ---- entry points --------------------------------------------------------------------------------------------------
def load_spec(path: str | Path, text: str | None = None) -> Spec:
    """Read, merge includes, validate. Raises `SpecError` listing every problem; never anything else. `text`: the
    spec's contents, validated as if read from `path` (a spec checked before it is written there)."""
    path = Path(path)
    ctx = _Context()
    root = read_document(path, ctx.problems, text=text)
    if root is None:
        raise SpecError(ctx.problems)
    fields = _Fields(ctx, root, "")
    model_node, cluster_node = fields.get("model", required=True), fields.get("cluster", required=True)
    runtime_node, workload_node = fields.get("runtime"), fields.get("workload")
    fields.finish()
    model = None if model_node is None else _model(ctx, model_node)
    cluster = None if cluster_node is None else _cluster(ctx, cluster_node)
    before = len(ctx.problems)
    runtime, workload = _runtime(ctx, runtime_node), _workload(ctx, workload_node)
    if runtime_node is not None and model is not None and len(ctx.problems) == before:
        _check_runtime_fits(ctx, fields, runtime, model)
    if workload_node is not None and len(ctx.problems) == before:
        _check_workload_fits(ctx, fields, runtime, workload)
    if ctx.problems or model is None or cluster is None:
        raise SpecError(sorted(ctx.problems, key=lambda p: (str(p.file), p.line or 0)))
    return Spec(model, cluster, runtime, workload, source=path)


# ---- a catalogue of machines (`cascadia search`) -------------------------------------------------------------------
_CURRENCY = re.compile(r"[A-Z]{3}")


def _currency(value: Any) -> str:
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise _Invalid(f"expected a three-letter currency code such as USD, got {shown(value)}")
    return value


def _machine(ctx: _Context, entry: Node, path: str) -> MachineType | None:
    """One `machines:` entry; None when it is invalid (reported)."""
    fields = _Fields(ctx, entry, path)
    values = {
        "name": fields.take("name", _node_name, required=True),
        "memory_bytes": fields.take("memory", _positive(parse_bytes), required=True),
        "calibration": _measured(ctx, fields.get("calibration"), fields.key("calibration")),
        "memory_bandwidth": fields.take("memory_bandwidth", _positive(parse_rate),
                                        required=not fields.given("calibration")),
        "compute_flops": fields.take("compute", _positive(parse_flops)),
        "device": fields.take("device", _choice(DEVICES)),
        "disk_bandwidth": fields.take("disk_bandwidth", _positive(parse_rate)),
        "price": fields.take("price", _positive(_number), required=True),
        "power_w": fields.take("power", _positive(_number)),
        "source": fields.take("source", _text),
    }
    link = fields.get("link")
    if link is not None:
        link_fields = _Fields(ctx, link, fields.key("link"))
        values["link"] = _link(link_fields, LinkSpec())
        link_fields.finish()
    before = len(ctx.problems)
    fields.finish()
    if any(values[key] is None for key in ("name", "memory_bytes", "price")) or len(ctx.problems) > before:
        return None
    return MachineType(**{key: value for key, value in values.items() if value is not None})


def _measured(ctx: _Context, entry: Node | None, path: str):
    """A machine's `calibration: {file: CALIBRATION.json, node: NAME}`: that node's measured times (`node` may be left
    out when the file has one), or `nodes: [NAME, ...]`: nodes of this type that a pipeline's calibration measured
    (no one of them holding the whole model), each layer kind's times from the first that has them and the host
    overheads of the first; as a calibration of a single node (named NAME+NAME..); None when absent or invalid
    (reported)."""
    from cascadia.errors import CalibrationError
    from cascadia.sim.calibration import Calibration

    if entry is None:
        return None
    fields = _Fields(ctx, entry, path)
    fields.get("file", required=True)
    file = fields.path_value("file", must_exist=True)
    node = fields.take("node", _node_name)
    several = fields.take("nodes", _node_names)
    fields.finish()
    if node is not None and several is not None:
        ctx.report(entry, f"{path}.nodes", "give node or nodes, not both")
        return None
    if file is None or not _is_file(file):
        return None
    try:
        calibration = Calibration.load(file)
    except CalibrationError as e:
        ctx.report(entry, f"{path}.file", str(e))
        return None
    names = list(calibration.nodes)
    if node is None and several is None and len(names) > 1:
        ctx.report(entry, f"{path}.node", f"missing: {file} measured {len(names)} nodes ({', '.join(names)}); "
                                          "name the one that is this machine, or the nodes of this type")
        return None
    chosen = several or [node or names[0]]
    if unknown := [name for name in chosen if name not in calibration.nodes]:
        key = "nodes" if several else "node"
        ctx.report(entry, f"{path}.{key}", f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} "
                                          f"not {'a node' if len(unknown) == 1 else 'nodes'} of {file} (it measured "
                                          f"{', '.join(names)})")
        return None
    measured = [calibration.nodes[name] for name in chosen]
    tables = {}
    for each in measured:
        for kind, table in each.tables.items():
            tables.setdefault(kind, table)
    merged = attrs.evolve(measured[0], tables=tables)
    return attrs.evolve(calibration, nodes={"+".join(chosen): merged}, links={}, hosts={})


def _node_names(value: Any) -> list[str]:
    """Node names, at least one, each once."""
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a list of node names, got {shown(value)}")
    names = [_node_name(item) for item in value]
    if len(set(names)) != len(names):
        raise _Invalid(f"names repeat: {shown(value)}")
    return names


def load_catalogue(path: str | Path) -> Catalogue:
    """Read and validate a catalogue of machine types:

        currency: USD                       # of the prices; USD when absent
        machines:
          - {name: x7-358h-64gb, memory: 61.2GiB, memory_bandwidth: 120GB/s, compute: 30TFLOPS, device: GPU,
             link: {bandwidth: 1gbit, latency: 100us}, price: 1600, power: 80, source: "..."}
          - {name: my-pc, memory: 60GiB, calibration: {file: my-pc.json, node: pc0}, price: 1000}   # measured

    Raises `SpecError` listing every problem (file, line and key), never anything else."""
    path = Path(path)
    ctx = _Context()
    root = read_document(path, ctx.problems)
    if root is None:
        raise SpecError(ctx.problems)
    fields = _Fields(ctx, root, "")
    currency = fields.take("currency", _currency)
    listed = fields.get("machines", required=True)
    fields.finish()
    entries = [] if listed is None else listed.value
    if listed is not None and (not isinstance(entries, list) or not entries):
        ctx.report(listed, "machines", f"expected a list of machine types, got {shown(listed.plain())}")
        entries = []
    machines: list[MachineType] = []
    index: dict[str, int] = {}  # name -> where it was first
    for i, entry in enumerate(entries):
        machine = _machine(ctx, entry, f"machines[{i}]")
        if machine is not None and machine.name in index:
            ctx.report(entry, f"machines[{i}].name", f"{machine.name!r} is machines[{index[machine.name]}] too")
        elif machine is not None:
            index[machine.name] = i
            machines.append(machine)
    if ctx.problems:
        raise SpecError(sorted(ctx.problems, key=lambda p: (str(p.file), p.line or 0)))
    return Catalogue(tuple(machines), currency or "USD", source=path)
