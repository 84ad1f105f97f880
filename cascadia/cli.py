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
    try:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        if plot_path:
            plot(result, plot_path)
    except OSError as e:
        raise click.ClickException(f"{e.filename}: cannot write ({e.strerror})") from None
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None


def _sampling_options(command):
    """--greedy | --temperature T --top-p P, and --seed: how tokens are picked (default: the spec's workload; for
    `generate`, greedy). Read them with `_with_sampling`."""
    for option in reversed((
            click.option("--greedy", is_flag=True, default=None, help="take the most likely token"),
            click.option("--temperature", type=click.FloatRange(min=0, min_open=True),
                         help="sample at this temperature"),
            click.option("--top-p", type=click.FloatRange(0, 1, min_open=True),
                         help="sample from the most likely tokens holding this probability"),
            click.option("--seed", type=int, help="seed of the random draws"))):
        command = option(command)
    return command


def _with_sampling(workload, greedy: bool | None, temperature: float | None, top_p: float | None, seed: int | None):
    import attrs

    if greedy and (temperature is not None or top_p is not None):
        raise click.UsageError("give --greedy or --temperature/--top-p, not both")
    changes = {"greedy": True} if greedy else {}
    if temperature is not None or top_p is not None:
        changes["greedy"] = False
    changes.update({k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("seed", seed))
                    if v is not None})
    return attrs.evolve(workload, **changes)


def _engine_options(func):
    """Options shared by the commands that run the single-process engine."""
    for option in reversed([
        click.option("--precision", type=click.Choice(["f32", "bf16", "f16"]), default="bf16", show_default=True,
                     help="compute precision (f32: exact; f16 runs as bf16 on a CPU)"),
        click.option("--compressed", is_flag=True,
                     help="the paper's weight formats: experts int4 in groups of 32, attention and head int8"),
        click.option("--device", type=click.Choice(["auto", "GPU", "CPU"]), default="auto", show_default=True),
        click.option("--threads", type=click.IntRange(min=1), help="inference threads (default: OpenVINO's choice)"),
    ]):
        func = option(func)
    return func


def _open_engine(checkpoint: str, context: int, precision: str, compressed: bool, device: str, threads: int | None):
    from cascadia.exec.checkpoint import Checkpoint, CheckpointError
    from cascadia.exec.device import DeviceError
    from cascadia.exec.engine import Engine
    from cascadia.spec.types import WeightFormat, WeightFormats

    formats = WeightFormats()
    if compressed:
        formats = WeightFormats(routed_experts=WeightFormat("int4", 32), shared_experts=WeightFormat("int4", 32),
                                attention=WeightFormat("int8"), head=WeightFormat("int8"))
    try:
        return Engine(Checkpoint.open(checkpoint), formats=formats, precision=precision, max_streams=1,
                      context_budget=context, device=device, threads=threads)
    except (CheckpointError, DeviceError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint="--ids") from None
    if not ids or min(ids) < 0:
        raise click.BadParameter(f"{text!r}: token ids are integers >= 0", param_hint="--ids")
    return ids


@cli.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", help="prompt text (needs CHECKPOINT/tokenizer.json)")
@click.option("--ids", "ids_text", help="prompt token ids, e.g. 1,2,3")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@_sampling_options
@click.option("--ignore-eos", is_flag=True, help="keep going past the end-of-sequence token")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write ids, text and timings as JSON")
@_engine_options
def generate(checkpoint: str, prompt: str | None, ids_text: str | None, max_new_tokens: int, greedy: bool | None,
             temperature: float | None, top_p: float | None, seed: int | None, ignore_eos: bool,
             json_path: str | None, precision: str, compressed: bool, device: str, threads: int | None) -> None:
    """Generate text (or token ids) from a prompt with the single-process OpenVINO engine (greedy unless sampling
    options say otherwise; a workload's defaults: temperature 1, top-p 1, seed 0)."""
    import json
    from pathlib import Path

    from cascadia.exec.generate import generate as run_generation
    from cascadia.exec.sampling import Sampling
    from cascadia.spec.types import WorkloadSpec

    if (prompt is None) == (ids_text is None):
        raise click.UsageError("give --prompt or --ids (one of them)")
    sampling = Sampling.of(_with_sampling(WorkloadSpec(), greedy, temperature, top_p, seed))
    tokenizer = None
    if (tokenizer_file := Path(checkpoint) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if prompt is not None and tokenizer is None:
        raise click.UsageError(f"--prompt needs {tokenizer_file}; give --ids instead")
    prompt_ids = tokenizer.encode(prompt).ids if prompt is not None else _token_ids(ids_text)
    if not prompt_ids:
        raise click.UsageError("the prompt has no tokens")
    engine = _open_engine(checkpoint, len(prompt_ids) + max_new_tokens, precision, compressed, device, threads)
    eos = engine.config.eos_token_id
    stop = () if ignore_eos or eos is None else (eos if isinstance(eos, list) else [eos])
    try:
        result = run_generation(engine, prompt_ids, max_new_tokens, sampling, stop)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    text = tokenizer.decode(list(result.ids)) if tokenizer else None
    if text is not None:
        click.echo(text)
    click.echo(f"ids: {','.join(map(str, result.ids))}")
    click.echo(f"{len(result.ids)} tokens ({'stop token' if result.stopped else 'token limit'}); prefill "
               f"{len(prompt_ids)} tokens in {result.prefill_s * 1e3:.1f} ms; decode {result.decode_tokens_per_s:.1f} "
               f"tokens/s; {engine.stage.precision} on {engine.stage.device}")
    if json_path:
        body = result.to_json() | {"text": text, "precision": engine.stage.precision, "device": engine.stage.device}
        with open(json_path, "w") as f:
            json.dump(body, f, indent=1)


@cli.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--ids", "ids_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help='JSON file: a list of token ids, or {"ids": [...]}')
@click.option("--prefill", type=click.IntRange(min=1), help="tokens fed by prefill; the rest go one decode step at a "
                                                            "time (default: all by prefill)")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="write the logits [N, vocab] (.npy)")
@_engine_options
@click.option("--spec", "spec_path", type=click.Path(exists=True, dir_okay=False),
              help="score on this spec's pipeline (its nodes and runtime; local nodes are started here) instead of "
                   "in one process; the engine options above are then the spec's")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="with --spec: a plan saved by `cascadia plan -o` (default: plan now)")
def score(checkpoint: str, ids_path: str, prefill: int | None, out: str, precision: str, compressed: bool,
          device: str, threads: int | None, spec_path: str | None, plan_path: str | None) -> None:
    """Teacher-forced logits for every position of a token sequence, with its mean log-prob and perplexity."""
    import json

    import numpy as np

    from cascadia.exec.generate import score_logits

    try:
        body = json.loads(open(ids_path).read())
        ids = body["ids"] if isinstance(body, dict) else body
        ids = [int(i) for i in ids]
    except (ValueError, KeyError, TypeError) as e:
        raise click.ClickException(f"{ids_path}: expected a JSON list of token ids or {{\"ids\": [...]}} ({e})") \
            from None
    if len(ids) < 2:
        raise click.ClickException(f"{ids_path}: scoring needs at least two tokens, got {len(ids)}")
    try:
        if spec_path:
            logits = _score_on_pipeline(spec_path, plan_path, checkpoint, ids, prefill)
        else:
            engine = _open_engine(checkpoint, len(ids), precision, compressed, device, threads)
            logits = engine.score(ids, prefill=prefill)
        result = score_logits(logits, ids)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    np.save(out, logits)
    click.echo(f"scored {result.tokens} tokens ({prefill or len(ids)} by prefill): mean log-prob "
               f"{result.mean_log_prob:.4f} nats, perplexity {result.perplexity:.2f}; logits {logits.shape} -> {out}")


def _workload_options(command):
    """The plan, checkpoint, workload and group options that `run` and `validate` share."""
    for option in reversed((
            click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
                         help="a plan saved by `cascadia plan -o` (default: plan now)"),
            click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's"),
            click.option("--concurrency", type=_IntList(), help="concurrency levels, e.g. 1,2,4 (default: the spec's)"),
            click.option("--requests", type=click.IntRange(min=1),
                         help="requests per phase (default: the level's concurrency)"),
            click.option("--prompts", type=click.Path(exists=True, dir_okay=False),
                         help='JSONL prompts, one {"ids": [...]} per line (default: the spec\'s, or random ids)'),
            click.option("--prompt-tokens", type=click.IntRange(min=1), help="random prompts of this many tokens"),
            click.option("--max-new-tokens", type=click.IntRange(min=1), help="output tokens per request"),
            click.option("--groups", type=click.IntRange(min=1), help="pipeline groups (default: one per stage)"),
    )):
        command = option(command)
    return command


def _workload(loaded, concurrency, requests, prompts, prompt_tokens, max_new_tokens):
    """The spec's workload with the command line's overrides."""
    import attrs

    from cascadia.workload import override

    workload = override(loaded.workload, concurrency, requests, max_new_tokens, prompt_tokens)
    return attrs.evolve(workload, prompts_file=prompts) if prompts else workload


@cli.command()
@click.option("--spec", "spec_path", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="the plan the coordinator runs (`cascadia plan -o`)")
@click.option("--name", required=True, help="this node's name in the plan")
@click.option("--listen", required=True, help="address to bind this node's input, e.g. tcp://0.0.0.0:5601")
@click.option("--control", required=True, help="the coordinator's control address, e.g. tcp://10.0.0.1:5555")
@click.option("--successor", help="where this node sends its results (default: the next node's address in the "
                                  "spec; the last node: the coordinator's token address)")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--threads", type=click.IntRange(min=1), help="inference threads (default: the node's, in the spec)")
@_sampling_options
@click.option("--logits", is_flag=True, help="last node: send the logits of sampled rows back too (scoring)")
@click.option("--parent-pid", type=int, help="stop when this process is no longer our parent")
@click.option("--keep-serving", is_flag=True,
              help="serve run after run: when a run ends, keep the compiled stage and wait for the next coordinator")
@click.option("--wait-coordinator", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="seconds to wait at start for the coordinator to accept this node (--keep-serving: for ever)")
def node(spec_path: str, plan_path: str, name: str, listen: str, control: str, successor: str | None,
         checkpoint: str | None, threads: int | None, greedy, temperature, top_p, seed, logits: bool,
         parent_pid: int | None, keep_serving: bool, wait_coordinator: float) -> None:
    """Serve one stage of a plan: load its layers, then compute frames until the coordinator says stop.

    `cascadia run` starts these itself for `local` nodes; on other machines, start one per node, before or after
    `cascadia run`, with the same spec and plan files. With --keep-serving a node loads once and serves every
    later run too, until stopped with Ctrl-C."""
    import logging
    from pathlib import Path

    import attrs

    from cascadia.exec.sampling import Sampling
    from cascadia.exec.stage import node_settings, serve_node
    from cascadia.graph.plan import Plan

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    loaded = _load_spec_or_exit(spec_path)
    sampling = Sampling.of(_with_sampling(loaded.workload, greedy, temperature, top_p, seed))
    try:
        chosen = Plan.load(plan_path)
        settings = attrs.evolve(node_settings(loaded, chosen, name, listen, control, successor, parent_pid),
                                keep_serving=keep_serving,
                                coordinator_wait_s=None if keep_serving else wait_coordinator)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    folder = Path(checkpoint) if checkpoint else loaded.model.checkpoint
    if folder is None:
        raise click.UsageError(f"{spec_path}: the model names no checkpoint; give --checkpoint")
    try:
        serve_node(loaded, chosen, settings, folder, threads, sampling, logits)
    except Exception as e:  # already reported to the coordinator by the node loop; say it here too, briefly
        raise click.ClickException(f"{name}: {type(e).__name__}: {e}") from None


def _score_on_pipeline(spec_path: str, plan_path: str | None, checkpoint: str, ids: list[int],
                       prefill: int | None):
    """`cascadia score --spec`: the logits as the plan's nodes compute them, with their start-up on stderr."""
    from pathlib import Path

    from cascadia.exec.checkpoint import CheckpointError
    from cascadia.exec.coordinator import PipelineError
    from cascadia.exec.run import describe, score_on_pipeline
    from cascadia.exec.transport import TransportError
    from cascadia.graph.plan import Plan
    from cascadia.graph.planner import InfeasiblePlan
    from cascadia.graph.planner import plan as make_plan

    loaded = _load_spec_or_exit(spec_path)
    try:
        chosen = Plan.load(plan_path) if plan_path else make_plan(loaded)
        return score_on_pipeline(loaded, chosen, ids, prefill, checkpoint=Path(checkpoint),
                                 on_message=lambda node, message: click.echo(describe(node, message), err=True))
    except (PipelineError, TransportError, CheckpointError, InfeasiblePlan) as e:
        raise click.ClickException(str(e)) from None


def _run_and_report(loaded, plan_path: str | None, workload, checkpoint: str | None = None, groups: int | None = None,
                    json_path: str | None = None, outputs_path: str | None = None, control: str | None = None,
                    tokens: str | None = None, node_timeout: float | None = None) -> None:
    """Run the workload through the pipeline, with progress on stderr; print the table, write the files."""
    import json
    from pathlib import Path

    from cascadia.exec.checkpoint import CheckpointError
    from cascadia.exec.coordinator import PipelineError
    from cascadia.exec.run import NODE_TIMEOUT_S, Addresses, RunFailed, describe, run
    from cascadia.exec.transport import TransportError
    from cascadia.graph.plan import Plan
    from cascadia.graph.planner import InfeasiblePlan
    from cascadia.graph.planner import plan as make_plan
    from cascadia.metrics import format_table

    def write(result: dict, outputs: list[dict]) -> None:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        if outputs_path:
            with open(outputs_path, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in outputs)

    def phase_done(level: int, phase: str, records: list) -> None:
        tokens_out = sum(r.output_tokens for r in records)
        click.echo(f"concurrency {level}, {phase}: {len(records)} requests, {tokens_out} tokens", err=True)

    if (control is None) != (tokens is None):
        raise click.UsageError("give both --control and --tokens, or neither")
    try:
        chosen = Plan.load(plan_path) if plan_path else make_plan(loaded)
        done = run(loaded, chosen, workload, groups=groups, checkpoint=Path(checkpoint) if checkpoint else None,
                   addresses=Addresses(control, tokens) if control else None,
                   node_timeout_s=node_timeout or NODE_TIMEOUT_S,
                   on_message=lambda node, message: click.echo(describe(node, message), err=True),
                   on_phase=phase_done)
    except RunFailed as e:
        write(e.result, e.outputs)
        raise click.ClickException(f"run failed: {e}") from None
    except (PipelineError, TransportError, CheckpointError, InfeasiblePlan, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_table(done.result))
    for warning in done.result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    write(done.result, done.outputs)


@cli.command("run")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@_workload_options
@_sampling_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the metrics JSON here")
@click.option("--outputs", "outputs_path", type=click.Path(dir_okay=False),
              help="write each request's prompt and output token ids here (JSONL)")
@click.option("--control", help="tcp nodes: the control address to bind, e.g. tcp://0.0.0.0:5555")
@click.option("--tokens", help="tcp nodes: the token address to bind (the last node's --successor)")
@click.option("--node-timeout", type=click.FloatRange(min=0, min_open=True),
              help="seconds a starting node may stay silent [default: 120]")
def run_command(spec: str, plan_path: str | None, checkpoint: str | None, concurrency, requests, prompts,
                prompt_tokens, max_new_tokens, greedy, temperature, top_p, seed, groups, json_path, outputs_path,
                control, tokens, node_timeout) -> None:
    """Run the spec's workload through the real pipeline and print throughput and latency per concurrency level.

    Local nodes are started here, on 127.0.0.1. Nodes with tcp addresses are started on their machines with
    `cascadia node ... --control ADDRESS` (the last one also with --successor set to the --tokens address)."""
    loaded = _load_spec_or_exit(spec)
    workload = _with_sampling(_workload(loaded, concurrency, requests, prompts, prompt_tokens, max_new_tokens),
                              greedy, temperature, top_p, seed)
    _run_and_report(loaded, plan_path, workload, checkpoint, groups, json_path, outputs_path, control, tokens,
                    node_timeout)


@cli.command()
@click.option("--concurrency", type=_IntList(), help="concurrency levels (default: the spec's, 1,2,4,8)")
def demo(concurrency) -> None:
    """The whole loop on the tiny model (specs/tiny-local.yaml) and 3 local node processes: plan, calibrate with the
    real engine, simulate and run the same workload, and compare the prediction with the measurement. Its random
    weights are written to specs/tiny-checkpoint on first use."""
    from pathlib import Path

    import attrs

    from cascadia.exec.calibrate import format_calibration
    from cascadia.exec.run import ensure_random_checkpoint
    from cascadia.workload import override

    specs = Path(__file__).resolve().parent.parent / "specs"
    if not (specs / "tiny-local.yaml").is_file():
        raise click.ClickException(f"{specs}: not found (the demo runs from a source checkout)")
    _describe_paper_deployment(specs / "inkling-975b-11pc.yaml")
    loaded = _load_spec_or_exit(str(specs / "tiny-local.yaml"))
    if ensure_random_checkpoint(loaded):
        click.echo(f"wrote random weights to {loaded.model.checkpoint}", err=True)
    chosen = _chosen_plan(loaded, None)
    click.echo(f"The tiny model on 3 local node processes (specs/tiny-local.yaml)\n\nplan\n{chosen.table()}\n")
    calibration = _calibrate(loaded, chosen)
    click.echo(f"calibration, measured now (ms)\n{format_calibration(calibration)}\n")
    click.echo("simulated and measured")
    _validate_and_report(attrs.evolve(loaded, workload=override(loaded.workload, concurrency)), chosen, calibration)


def _describe_paper_deployment(path) -> None:
    """The paper's 11-PC Inkling deployment: its plan, and a simulation from the spec's hardware figures."""
    import attrs

    from cascadia.metrics import format_table
    from cascadia.sim.analytic import analytic_calibration
    from cascadia.sim.simulate import simulate
    from cascadia.workload import override

    paper = _load_spec_or_exit(str(path))
    paper = attrs.evolve(paper, workload=override(paper.workload, (1, 11, 44, 176)))
    chosen = _chosen_plan(paper, None)
    click.echo(f"The Cascadia paper's deployment (specs/{path.name}): Inkling 975B on 11 PCs\n\n{chosen.table()}\n")
    click.echo(f"{format_table(simulate(paper, analytic_calibration(paper), chosen))}\n(analytic estimate)\n")


@cli.command("calibrate")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="a plan saved by `cascadia plan -o` (default: plan now)")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--rounds", type=click.IntRange(min=1),
              help="sweeps of each node's layer grid; each point is their median [default: 10]")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), required=True,
              help="the calibration JSON to write (for `cascadia simulate --calibration`)")
def calibrate_command(spec: str, plan_path: str | None, checkpoint: str | None, rounds: int | None,
                      output: str) -> None:
    """Measure what the simulator needs with the real engine and transport on the plan's local nodes: per node and
    layer kind, time over rows, attended positions and distinct experts; the links; the host overheads; the cores
    of a shared host."""
    from cascadia.exec.calibrate import format_calibration

    loaded = _load_spec_or_exit(spec)
    measured = _calibrate(loaded, _chosen_plan(loaded, plan_path), checkpoint, rounds)
    try:
        measured.save(output)
    except OSError as e:
        raise click.ClickException(f"{output}: cannot write ({e.strerror})") from None
    click.echo(format_calibration(measured))
    click.echo(f"wrote {output}")


def _chosen_plan(loaded, plan_path: str | None):
    """The saved plan, or the planner's."""
    from cascadia.graph.plan import Plan
    from cascadia.graph.planner import InfeasiblePlan
    from cascadia.graph.planner import plan as make_plan

    try:
        return Plan.load(plan_path) if plan_path else make_plan(loaded)
    except (InfeasiblePlan, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _calibrate(loaded, chosen, checkpoint: str | None = None, rounds: int | None = None):
    """The measured calibration, with progress on stderr."""
    from pathlib import Path

    from cascadia.exec.calibrate import ROUNDS, CalibrationFailed, calibrate
    from cascadia.exec.checkpoint import CheckpointError
    from cascadia.exec.coordinator import PipelineError
    from cascadia.exec.transport import TransportError

    try:
        return calibrate(loaded, chosen, Path(checkpoint) if checkpoint else None, rounds or ROUNDS,
                         progress=lambda text: click.echo(text, err=True))
    except (CalibrationFailed, PipelineError, TransportError, CheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@cli.command("validate")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--calibration", "calibration_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="the calibration the simulator uses (`cascadia calibrate -o`)")
@_workload_options
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="serve the workload this many times; the median is the measurement")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="write both results and the errors here")
def validate_command(spec: str, calibration_path: str, plan_path: str | None, checkpoint: str | None, concurrency,
                     requests, prompts, prompt_tokens, max_new_tokens, groups, repeats, json_path) -> None:
    """Simulate and run the same workload on the same plan, and print per level and metric the measured and
    predicted values and the error, then each metric's median absolute error."""
    import attrs

    from cascadia.sim.calibration import Calibration, CalibrationError

    loaded = _load_spec_or_exit(spec)
    workload = _workload(loaded, concurrency, requests, prompts, prompt_tokens, max_new_tokens)
    try:
        calibration = Calibration.load(calibration_path)
    except CalibrationError as e:
        raise click.ClickException(str(e)) from None
    _validate_and_report(attrs.evolve(loaded, workload=workload), _chosen_plan(loaded, plan_path), calibration,
                         checkpoint, groups, repeats, json_path)


def _validate_and_report(loaded, chosen, calibration, checkpoint: str | None = None, groups: int | None = None,
                         repeats: int = 1, json_path: str | None = None) -> None:
    """Simulate and run with progress on stderr; print the comparison, write the JSON."""
    import json
    from pathlib import Path

    from cascadia.exec.checkpoint import CheckpointError
    from cascadia.exec.coordinator import PipelineError
    from cascadia.exec.run import RunFailed, describe
    from cascadia.exec.transport import TransportError
    from cascadia.sim.calibration import CalibrationError
    from cascadia.validate import format_comparison, validate

    def phase_done(level: int, phase: str, records: list) -> None:
        click.echo(f"run: concurrency {level}, {phase}: {len(records)} requests", err=True)

    try:
        result = validate(loaded, chosen, calibration, repeats=repeats, groups=groups,
                          checkpoint=Path(checkpoint) if checkpoint else None,
                          on_message=lambda node, message: click.echo(describe(node, message), err=True),
                          on_phase=phase_done)
    except RunFailed as e:
        raise click.ClickException(f"run failed: {e}") from None
    except (CalibrationError, PipelineError, TransportError, CheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_comparison(result))
    warnings = [f"warning (predicted): {w}" for w in result["predicted"]["warnings"]]
    warnings += dict.fromkeys(f"warning (measured): {w}" for run in result["measured"] for w in run["warnings"])
    for warning in warnings:
        click.echo(warning, err=True)
    if json_path:
        try:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as e:
            raise click.ClickException(f"{json_path}: cannot write ({e.strerror})") from None


def main() -> None:
    cli()
