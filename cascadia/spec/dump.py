"""Write specs out as plain data: `dump_spec` (a spec that loads back equal), `summarize` (one line), and
`spec_from_hf` (a starting spec for a transformers config)."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import yaml

from cascadia.models import read_config
from cascadia.spec.types import (PAPER_FORMATS, TENSOR_GROUPS, LinkSpec, NodeSpec, RuntimeSpec, Spec, WeightFormat,
                                 WeightFormats, WorkloadSpec)
from cascadia.units import format_bytes, format_duration, format_flops, format_rate


def _dump_format(fmt: WeightFormat) -> str | dict[str, Any]:
    if fmt.group_size is None and fmt.symmetric:
        return fmt.dtype
    return {"dtype": fmt.dtype, "group_size": fmt.group_size, **({} if fmt.symmetric else {"symmetric": False})}


def _dump_formats(formats: WeightFormats) -> dict[str, Any]:
    return {group: _dump_format(getattr(formats, group)) for group in TENSOR_GROUPS}


def _dump_node(node: NodeSpec) -> dict[str, Any]:
    values = {
        "name": node.name, "address": node.address, "device": node.device, "memory": format_bytes(node.memory_bytes),
        "memory_bandwidth": node.memory_bandwidth and format_rate(node.memory_bandwidth),
        "compute": node.compute_flops and format_flops(node.compute_flops),
        "disk_bandwidth": node.disk_bandwidth and format_rate(node.disk_bandwidth), "host": node.host,
        "threads": node.threads, "reserve": None if node.reserve_bytes is None else format_bytes(node.reserve_bytes),
        "layers": node.layers, "cpus": None if node.cpus is None else list(node.cpus), "door": node.door,
    }
    return {k: v for k, v in values.items() if v is not None}


def _dump_link(link: LinkSpec) -> dict[str, str]:
    return {"bandwidth": format_rate(link.bandwidth, bits=True), "latency": format_duration(link.latency)}


def _dump_runtime(runtime: RuntimeSpec) -> dict[str, Any]:
    return attrs.asdict(runtime, value_serializer=lambda _, __, v: list(v) if isinstance(v, tuple) else v)


def _dump_workload(workload: WorkloadSpec) -> dict[str, Any]:
    prompt = workload.prompt_tokens
    values = {
        **attrs.asdict(workload, recurse=False), "concurrency": list(workload.concurrency),
        "rate": list(workload.rate) or None,
        "slo": workload.slo and {key: format_duration(getattr(workload.slo, key)) for key in ("ttft", "tpot")},
        "prompt_tokens": prompt.low if prompt.low == prompt.high else {"uniform": [prompt.low, prompt.high]},
        "prompts_file": workload.prompts_file and str(workload.prompts_file),
    }
    if workload.prompts_file is not None:
        del values["prompt_tokens"]
    return {k: v for k, v in values.items() if v is not None}


def dump_spec(spec: Spec) -> dict[str, Any]:
    """The resolved spec as plain data (for `spec show`); written as YAML it loads back to an equal spec."""
    model = spec.model
    cluster = spec.cluster
    links: dict[str, Any] = {"default": _dump_link(cluster.default_link)}
    if cluster.links:
        links["pairs"] = [{"between": list(pair), **_dump_link(link)} for pair, link in cluster.links.items()]
    return {
        "model": {
            "name": model.name,
            **({"checkpoint": str(model.checkpoint)} if model.checkpoint else {}),
            "formats": _dump_formats(model.formats),
            "config": model.config.to_hf_dict(),
        },
        "cluster": {
            "reserve": format_bytes(cluster.reserve_bytes),
            **({"curve_keys": str(cluster.curve_keys)} if cluster.curve_keys else {}),
            **({"coordinator_cpus": list(cluster.coordinator_cpus)} if cluster.coordinator_cpus else {}),
            "nodes": [_dump_node(node) for node in cluster.nodes],
            **({"spares": [_dump_node(node) for node in cluster.spares]} if cluster.spares else {}),
            **({"discover": True} if cluster.discover else {}),
            "links": links,
        },
        "runtime": _dump_runtime(spec.runtime),
        "workload": _dump_workload(spec.workload),
    }


def spec_for_nodes(spec: Spec) -> str:
    """The spec as a coordinator sends it to the nodes it invites (`cascadia.fleet`): YAML, without the workload,
    which is the coordinator's alone (its prompts file may be a path on its own machine)."""
    document = dump_spec(spec)
    del document["workload"]
    return yaml.safe_dump(document, sort_keys=False)


def write_spec(spec: Spec, path: Path) -> Path:
    """The resolved spec as a YAML file that loads back to an equal spec (for processes started with it); `path`."""
    path.write_text(yaml.safe_dump(dump_spec(spec), sort_keys=False))
    return path


def summarize(spec: Spec) -> str:
    """One line for `spec validate`: the model, the fleet, the serving envelope."""
    cfg, nodes = spec.model.config, spec.cluster.nodes
    sizes = Counter(format_bytes(n.memory_bytes) for n in nodes)  # in order of first appearance
    memory = " + ".join(f"{count} x {size}" for size, count in sizes.items())
    levels = spec.workload.concurrency
    concurrency = f"{min(levels)}-{max(levels)} in {len(levels)} levels" if len(levels) > 1 else str(levels[0])
    experts, top_k = cfg.routed_experts
    mlp = f"{experts} experts top-{top_k}" if experts else "dense"
    fleet = f"{len(nodes)} nodes ({memory})" if nodes else "the nodes found when served (cluster.discover)"
    return (f"{spec.model.name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {mlp}; {fleet}; "
            f"context {spec.runtime.context_budget} x {spec.runtime.max_streams} streams; concurrency {concurrency}")


def spec_from_hf(config_path: str | Path, out_dir: str | Path, nodes: int, memory_bytes: int,
                 link: LinkSpec = LinkSpec()) -> dict[str, Any]:
    """A starting spec for a transformers config (or checkpoint folder) on `nodes` alike machines.

    `out_dir` is where the spec will be saved: a config inside it is named by a relative path (the folder can move
    as a whole), any other by its absolute path. Raises `ConfigError` for a config that is no valid model of a
    supported family.
    """
    config_path = Path(config_path)
    folder = config_path if config_path.is_dir() else config_path.parent
    read_config(config_path)
    has_weights = any(folder.glob("*.safetensors"))

    def written(path: Path) -> str:
        relative = os.path.relpath(path, out_dir)
        return os.path.abspath(path) if relative.startswith("..") else relative

    return {
        "model": {
            "name": re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.resolve().name).lstrip("_.-") or "inkling",
            "hf_config": written(config_path),
            **({"checkpoint": written(folder)} if has_weights else {}),
            "formats": _dump_formats(PAPER_FORMATS),  # a sensible start for any large Inkling
        },
        "cluster": {
            "nodes": [{"name": "pc", "count": nodes, "memory": format_bytes(memory_bytes), "device": "auto"}],
            "links": {"default": _dump_link(link)},
        },
        "runtime": _dump_runtime(RuntimeSpec()),
        "workload": _dump_workload(WorkloadSpec()),
    }
