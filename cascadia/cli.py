"""The `cascadia` command line: thin click commands over the Python API (argument handling and printing only)."""

from __future__ import annotations

import click

from cascadia import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="cascadia")
def cli() -> None:
    """Plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""


def _load_spec_or_exit(path: str):
    """The validated spec, or its problems printed and exit status 2."""
    from cascadia.spec.load import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as e:
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["json", "dot"]), default="json", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), help="file to write (default: stdout)")
def graph(spec: str, fmt: str, output: str | None) -> None:
    """Write the model's dataflow graph (ops with parameters, bytes, FLOPs and state) as JSON or DOT."""
    from cascadia.graph.build import build_graph, graph_totals, render
    from cascadia.units import format_bytes

    loaded = _load_spec_or_exit(spec)
    g = build_graph(loaded.model, loaded.runtime)
    if output is None:
        click.echo(render(g, fmt), nl=False)
        return
    with open(output, "w") as f:
        f.write(render(g, fmt))
    totals = graph_totals(g)
    click.echo(f"wrote {output}: {g.number_of_nodes()} ops, {g.number_of_edges()} edges; {totals.params:,} params "
               f"({totals.active_params:,} active), {format_bytes(totals.weight_bytes, digits=4)} of weights, "
               f"{format_bytes(totals.bytes_per_row, digits=4)} read per token")


@cli.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="write the plan as JSON to this file ('-' = stdout, instead of the table)")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="save the plan for `cascadia run` and `cascadia simulate`")
def plan(spec: str, json_path: str | None, output: str | None) -> None:
    """Place consecutive layers on the spec's nodes: the fastest split that fits in memory."""
    import json

    from cascadia.graph.planner import InfeasiblePlan
    from cascadia.graph.planner import plan as make_plan

    loaded = _load_spec_or_exit(spec)
    try:
        result = make_plan(loaded)
    except InfeasiblePlan as e:
        raise click.ClickException(f"{spec}: no plan fits. {e}") from None
    for path in (output, json_path):
        if path and path != "-":
            result.save(path)
    if json_path == "-":
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    click.echo(result.table())


class _Quantity(click.ParamType):
    """A quantity with units on the command line: a "size" ("64GB"), "rate" ("1gbit") or "duration" ("100us")."""

    def __init__(self, kind: str):
        self.name = kind

    def convert(self, value, param, ctx):
        from cascadia import units

        parse = {"size": units.parse_bytes, "rate": units.parse_rate, "duration": units.parse_duration}[self.name]
        try:
            return parse(value)
        except units.UnitError as e:
            self.fail(str(e), param, ctx)


@cli.group()
def spec() -> None:
    """Check, show and start YAML specs (model, cluster, runtime, workload)."""


@spec.command("validate")
@click.argument("path", type=click.Path(dir_okay=False))
def spec_validate(path: str) -> None:
    """Check a spec: print a summary, or every problem.

    Problems print one per line as FILE:LINE: key: message, and the exit status is 2.
    """
    from cascadia.spec.load import summarize

    click.echo(f"OK: {path}: {summarize(_load_spec_or_exit(path))}")


@spec.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
def spec_show(path: str) -> None:
    """Print the resolved spec as YAML.

    Includes merged, counted nodes stamped out, defaults filled in, paths absolute: it loads back as the same spec.
    """
    import yaml

    from cascadia.spec.load import dump_spec

    resolved = dump_spec(_load_spec_or_exit(path))
    click.echo(yaml.safe_dump(resolved, sort_keys=False, width=120, default_flow_style=None), nl=False)


@spec.command("from-hf")
@click.argument("config", type=click.Path(exists=True))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="number of alike machines")
@click.option("--memory", type=_Quantity("size"), required=True, help="usable memory per machine, e.g. 61.2GiB")
@click.option("--bandwidth", type=_Quantity("rate"), default="1gbit", show_default=True,
              help="network link between machines")
@click.option("--latency", type=_Quantity("duration"), default="100us", show_default=True,
              help="one-way network latency")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), required=True,
              help="the spec file to write")
def spec_from_hf(config: str, nodes: int, memory: int, bandwidth: float, latency: float, output: str) -> None:
    """Write a starting spec for a transformers model.

    CONFIG is a config.json or a checkpoint folder holding one; the spec puts the model on --nodes alike machines
    in the paper's weight formats (experts int4, the rest int8).
    """
    import os

    import yaml

    from cascadia.model_config import ConfigError
    from cascadia.spec.load import spec_from_hf as make_spec
    from cascadia.spec.load import summarize
    from cascadia.spec.types import LinkSpec

    try:
        body = make_spec(config, os.path.dirname(os.path.abspath(output)), nodes, memory, LinkSpec(bandwidth, latency))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    header = (f"# Written by `cascadia spec from-hf {config}`: a start. Check the weight formats, add\n"
              "# memory_bandwidth and compute per node for analytic estimates, and shape the workload.\n")
    try:
        with open(output, "w") as f:
            f.write(header + yaml.safe_dump(body, sort_keys=False, width=120, default_flow_style=None))
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror}") from None
    click.echo(f"wrote {output}: {summarize(_load_spec_or_exit(output))}")


@cli.group()
def keys() -> None:
    """CurveZMQ keys that authenticate and encrypt the pipeline's connections."""


@keys.command("generate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--nodes", required=True, help="comma-separated node names, e.g. a,b,c (the coordinator gets keys too)")
def keys_generate(folder: str, nodes: str) -> None:
    """Make a key pair per node and for the coordinator in FOLDER (public/*.key, secret/*.key_secret).

    Point the cluster's curve_keys at FOLDER; each machine needs public/ and its own secret key."""
    from cascadia.exec.transport import COORDINATOR, TransportError, generate_keys

    names = [n.strip() for n in nodes.split(",")]
    if not all(names):
        raise click.BadParameter(f"empty node name in {nodes!r}", param_hint="--nodes")
    try:
        written = generate_keys(folder, [*names, COORDINATOR])
    except TransportError as e:
        raise click.ClickException(str(e)) from None
    for path in written:
        click.echo(path)


@cli.command("init-model")
@click.argument("source", type=click.Path(exists=True))
@click.argument("out_dir", type=click.Path(file_okay=False, writable=True))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True)
def init_model_command(source: str, out_dir: str, seed: int, dtype: str) -> None:
    """Write a random checkpoint (config.json, safetensors, tokenizer.json) for SOURCE: a config.json, a checkpoint
    directory or a YAML spec."""
    from cascadia.exec.init_model import init_model
    from cascadia.model_config import ConfigError, InklingConfig

    if source.endswith((".yaml", ".yml")):
        config = _load_spec_or_exit(source).model.config
    else:
        try:
            config = InklingConfig.from_file(source)
        except ConfigError as e:
            raise click.ClickException(str(e)) from None
    report = init_model(config, out_dir, seed=seed, dtype=dtype, progress=click.echo)
    tokenizer = f", tokenizer.json ({report.tokenizer_size} tokens)" if report.tokenizer_size else ""
    click.echo(f"wrote {out_dir}: config.json, {len(report.weight_files)} safetensors file(s) "
               f"({report.weight_bytes / 1e6:.1f} MB, {dtype}, seed {seed}){tokenizer}")
    for note in report.notes:
        click.echo(f"note: {note}")


class _IntList(click.ParamType):
    """Comma-separated positive integers, e.g. "1,2,4"."""

    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(part) for part in value.split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if any(n < 1 for n in numbers):
            self.fail(f"{value!r}: every value must be at least 1", param, ctx)
        return numbers


@cli.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--calibration", "calibration_path", type=click.Path(exists=True, dir_okay=False),
              help="calibration JSON (measured with `cascadia calibrate`, or saved)")
@click.option("--analytic", is_flag=True, help="estimate from the spec's hardware figures (the default without "
                                               "--calibration)")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="a plan saved by `cascadia plan -o` (default: plan now)")
@click.option("--concurrency", type=_IntList(), help="concurrency levels, e.g. 1,2,4 (default: the spec's)")
@click.option("--requests", type=click.IntRange(min=1), help="requests per phase (default: the level's concurrency)")
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="output tokens per request")
@click.option("--prompt-tokens", type=click.IntRange(min=1), help="prompt tokens per request")
@click.option("--groups", type=click.IntRange(min=1), help="pipeline groups (default: one per stage)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the metrics JSON here")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="write a throughput/latency plot (PNG)")
def simulate(spec: str, calibration_path: str | None, analytic: bool, plan_path: str | None,
             concurrency: tuple[int, ...] | None, requests: int | None, max_new_tokens: int | None,
             prompt_tokens: int | None, groups: int | None, json_path: str | None, plot_path: str | None) -> None:
    """Predict throughput and latency of the plan at each concurrency level with the calibrated simulator."""
    import json

    import attrs

    from cascadia.graph.plan import Plan
    from cascadia.graph.planner import InfeasiblePlan
    from cascadia.metrics import format_table
    from cascadia.sim.analytic import analytic_calibration
    from cascadia.sim.calibration import Calibration, CalibrationError
    from cascadia.sim.simulate import plot, simulate as run_simulation
    from cascadia.workload import override

    if analytic and calibration_path:
        raise click.UsageError("give --calibration or --analytic, not both")
    loaded = _load_spec_or_exit(spec)
    loaded = attrs.evolve(loaded, workload=override(loaded.workload, concurrency, requests, max_new_tokens,
                                                    prompt_tokens))
    try:
        calibration = Calibration.load(calibration_path) if calibration_path else analytic_calibration(loaded)
        chosen_plan = Plan.load(plan_path) if plan_path else None
        result = run_simulation(loaded, calibration, chosen_plan, groups=groups)
    except (CalibrationError, InfeasiblePlan, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_table(result))
    if calibration.is_analytic:
        click.echo("(analytic estimate)")
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        try:
            plot(result, plot_path)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None


def main() -> None:
    cli()
