"""Describing and placing the model: `spec`, `graph`, `plan`, `init-model`, and `keys` for the transport."""

from __future__ import annotations

import click

from cascadia.cli.common import OutputPath, Quantity, chosen_plan, report_to, say_written, writing
from cascadia.errors import SpecError
from cascadia.spec.load import load_spec
from cascadia.units import format_bytes


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["json", "dot"]), default="json", show_default=True)
@click.option("-o", "--output", type=OutputPath(), default="-", help="file to write (default: stdout)")
def graph(spec: str, fmt: str, output: str) -> None:
    """Write the model's dataflow graph (ops with parameters, bytes, FLOPs and state) as JSON or DOT."""
    from cascadia.graph.build import build_graph, graph_totals, render
    from cascadia.units import format_bytes

    loaded = load_spec(spec)
    g = build_graph(loaded.model, loaded.runtime)
    with writing(output) as f:
        f.write(render(g, fmt))
    if output == "-":
        return
    totals = graph_totals(g)
    click.echo(f"wrote {output}: {g.number_of_nodes()} ops, {g.number_of_edges()} edges; {totals.params:,} params "
               f"({totals.active_params:,} active), {format_bytes(totals.weight_bytes, digits=4)} of weights, "
               f"{format_bytes(totals.bytes_per_row, digits=4)} read per token")


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "json_path", type=OutputPath(), help="write the plan as JSON to this file ('-': stdout)")
@click.option("-o", "--output", type=OutputPath(),
              help="save the plan for `cascadia run` and `cascadia simulate` (the same JSON)")
def plan(spec: str, json_path: str | None, output: str | None) -> None:
    """Place consecutive layers on the spec's nodes: the fastest split that fits in memory."""
    report = report_to(json_path, output)
    loaded = load_spec(spec)
    result = chosen_plan(loaded, None)
    for path in filter(None, (output, json_path)):
        with writing(path) as f:
            f.write(result.to_json())
    spares = "".join(f"\nspare {node.name} ({format_bytes(node.memory_bytes)}): holds no stage; `serve` gives it a "
                     "lost node's" for node in loaded.cluster.spares)
    report(result.table() + spares)
    say_written(report, output, json_path)


@click.group()
def spec() -> None:
    """Check, show and start YAML specs (model, cluster, runtime, workload)."""


@spec.command("validate")
@click.argument("path", type=click.Path(dir_okay=False))
def spec_validate(path: str) -> None:
    """Check a spec: print a summary, or every problem.

    Problems print one per line as FILE:LINE: key: message, and the exit status is 2.
    """
    from cascadia.spec.dump import summarize

    click.echo(f"OK: {path}: {summarize(load_spec(path))}")


@spec.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
def spec_show(path: str) -> None:
    """Print the resolved spec as YAML.

    Includes merged, counted nodes stamped out, defaults filled in, paths absolute: it loads back as the same spec.
    """
    import yaml

    from cascadia.spec.dump import dump_spec

    resolved = dump_spec(load_spec(path))
    click.echo(yaml.safe_dump(resolved, sort_keys=False, width=120, default_flow_style=None), nl=False)


@spec.command("from-hf")
@click.argument("config", type=click.Path(exists=True))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="number of alike machines")
@click.option("--memory", type=Quantity("size"), required=True, help="usable memory per machine, e.g. 61.2GiB")
@click.option("--bandwidth", type=Quantity("rate"), default="1gbit", show_default=True,
              help="network link between machines")
@click.option("--latency", type=Quantity("duration"), default="100us", show_default=True,
              help="one-way network latency")
@click.option("-o", "--output", type=OutputPath(), required=True, help="the spec file to write")
def spec_from_hf(config: str, nodes: int, memory: int, bandwidth: float, latency: float, output: str) -> None:
    """Write a starting spec for a transformers model.

    CONFIG is a config.json or a checkpoint folder holding one; the spec puts the model on --nodes alike machines
    in the paper's weight formats (experts and dense MLP int4 in groups of 32, attention and head int8, embedding
    bf16).
    """
    import os

    import yaml

    from cascadia.spec.dump import spec_from_hf as make_spec
    from cascadia.spec.dump import summarize
    from cascadia.spec.types import LinkSpec

    where = "<stdout>" if output == "-" else output  # a spec on standard output reads paths from this folder
    body = make_spec(config, os.path.dirname(os.path.abspath(where)), nodes, memory, LinkSpec(bandwidth, latency))
    header = (f"# Written by `cascadia spec from-hf {config}`: a start. Check the weight formats, add\n"
              "# memory_bandwidth and compute per node for analytic estimates, and shape the workload.\n")
    text = header + yaml.safe_dump(body, sort_keys=False, width=120, default_flow_style=None)
    try:
        written = load_spec(where, text=text)  # validated before it is written: nothing is written on failure
    except SpecError as e:
        raise SpecError([f"the spec for {config} is not valid; nothing was written:", *e.problems]) from None
    with writing(output) as f:
        f.write(text)
    if output != "-":
        click.echo(f"wrote {output}: {summarize(written)}")


@click.group()
def keys() -> None:
    """CurveZMQ keys that authenticate and encrypt the pipeline's connections."""


@keys.command("generate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--nodes", required=True, help="comma-separated node names, e.g. a,b,c (the coordinator gets keys too)")
def keys_generate(folder: str, nodes: str) -> None:
    """Make a key pair per node and for the coordinator in FOLDER (public/*.key, secret/*.key_secret).

    Point the cluster's curve_keys at FOLDER; each machine needs public/ and its own secret key."""
    from cascadia.pipeline.transport import COORDINATOR, generate_keys

    names = [n.strip() for n in nodes.split(",")]
    if not all(names):
        raise click.BadParameter(f"empty node name in {nodes!r}", param_hint="--nodes")
    for path in generate_keys(folder, [*names, COORDINATOR]):
        click.echo(path)


@click.command("init-model")
@click.argument("source", type=click.Path(exists=True))
@click.argument("out_dir", type=click.Path(file_okay=False, writable=True))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True)
@click.option("--force", is_flag=True, help="replace a checkpoint already in OUT_DIR")
def init_model_command(source: str, out_dir: str, seed: int, dtype: str, force: bool) -> None:
    """Write a random checkpoint (config.json, safetensors, tokenizer.json) for SOURCE: a config.json, a checkpoint
    directory or a YAML spec. A checkpoint already in OUT_DIR is kept unless --force."""
    from pathlib import Path

    from cascadia.engine.checkpoint import INDEX_FILE, SINGLE_FILE
    from cascadia.engine.init_model import init_model
    from cascadia.errors import CheckpointError
    from cascadia.models import read_config

    held = [name for name in ("config.json", SINGLE_FILE, INDEX_FILE) if (Path(out_dir) / name).exists()]
    if held and not force:
        raise CheckpointError(f"{out_dir}: already holds a checkpoint ({', '.join(held)}); give --force to replace "
                              "it")

    config = load_spec(source).model.config if source.endswith((".yaml", ".yml")) else read_config(source)
    report = init_model(config, out_dir, seed=seed, dtype=dtype, progress=click.echo)
    tokenizer = f", tokenizer.json ({report.tokenizer_size} tokens)" if report.tokenizer_size else ""
    click.echo(f"wrote {out_dir}: config.json, {len(report.weight_files)} safetensors file(s) "
               f"({report.weight_bytes / 1e6:.1f} MB, {dtype}, seed {seed}){tokenizer}")
    for note in report.notes:
        click.echo(f"note: {note}")
