"""Predicting and checking: `simulate`, `calibrate`, `validate`, and `demo`, the whole loop on a trained tiny model."""

from __future__ import annotations

import click

from cascadia.cli.common import (WORKLOAD_CHOICES, IntList, NodeAtSeconds, OutputPath, chosen_plan,
                                 emulate_links_option, report_to, speculate_option, with_runtime, workload_options,
                                 say_written, workload_overrides, write_trace, writing)
from cascadia.sim.drafts import DEFAULT_ACCEPTANCE
from cascadia.sim.interval import SAMPLES
from cascadia.sim.loss import DETECT_S
from cascadia.spec.load import load_spec

MAX_TRACE_BYTES = 256 * 2**20  # an outputs file of a long run


def interval_options(command):
    """--interval and --interval-samples (`cascadia.sim.interval`)."""
    command = click.option("--interval-samples", "samples", type=click.IntRange(min=2), default=SAMPLES,
                           show_default=True, help="with --interval: the machine speeds simulated")(command)
    return click.option("--interval", type=click.FloatRange(0, 100, min_open=True, max_open=True),
                        metavar="PERCENT", help="each figure also as a median and its PERCENT interval over the "
                        "speeds the machine had while it was calibrated (the calibration's rounds)")(command)


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--calibration", "calibration_path", type=click.Path(exists=True, dir_okay=False),
              help="calibration JSON (measured with `cascadia calibrate`, or saved)")
@click.option("--analytic", is_flag=True, help="estimate from the spec's hardware figures (the default without "
                                               "--calibration)")
@workload_options
@click.option("--json", "json_path", type=OutputPath(), help="write the metrics JSON here")
@click.option("--plot", "plot_path", type=OutputPath(), help="write a throughput/latency plot (PNG)")
@click.option("--trace", "trace_path", type=OutputPath(),
              help="write the simulated timeline here (Chrome trace JSON, for Perfetto or chrome://tracing)")
@click.option("--fail", "loss", type=NodeAtSeconds(),
              help="lose this node this many seconds into each level's measured phase, and recover as `serve` does")
@click.option("--detect", "detect_s", type=click.FloatRange(min=0),
              help=f"with --fail: seconds until the loss is known [default: {DETECT_S:g}, serve's --stall-timeout; "
                   "a local node's exit is seen within 0.1]")
@speculate_option
@click.option("--acceptance", type=click.FloatRange(0, 1), help="with --speculate: the chance that a draft is "
              f"accepted once the drafts before it were [default: {DEFAULT_ACCEPTANCE:g}]")
@click.option("--acceptance-trace", "trace_file", type=click.Path(dir_okay=False),
              help="with --speculate: accept drafts as the run that wrote this `--outputs` file did, request by "
                   "request and step by step")
@click.option("--fit-acceptance", "fit", is_flag=True,
              help="with --acceptance-trace: draft at every level at the rates fitted to the trace (how often its "
                   "steps proposed, how often a draft was accepted once those before it were) instead of replaying "
                   "it: one concurrency's run predicting the others")
@click.option("--replay-trace", "replay_path", type=click.Path(dir_okay=False),
              help="take each frame's compute on each node from this trace of a run on the same plan (`run "
                   "--trace`) instead of the calibration's tables, so that what differs from the run is the model's "
                   "error alone; frames of a shape the trace lacks are costed from the tables")
@interval_options
def simulate(spec: str, calibration_path: str | None, analytic: bool, plan_path: str | None, checkpoint: str | None,
             choices: dict, groups: int | None, json_path: str | None, plot_path: str | None,
             trace_path: str | None, loss, detect_s: float, speculate: str | None, acceptance: float | None,
             trace_file: str | None, fit: bool, replay_path: str | None, interval: float | None,
             samples: int) -> None:
    """Predict throughput and latency of the plan at each level (closed-loop concurrency or open-loop arrival rate)
    with the calibrated simulator. It reads no weights: a checkpoint matters only for the tokenizer of text
    prompts."""
    import json
    from pathlib import Path

    import attrs

    from cascadia.metrics import format_table
    from cascadia.sim.analytic import analytic_calibration
    from cascadia.sim.calibration import Calibration
    from cascadia.sim.drafts import fitted_rates
    from cascadia.sim.interval import format_interval, simulate_interval
    from cascadia.sim.loss import format_losses
    from cascadia.sim.simulate import plot
    from cascadia.sim.simulate import simulate as run_simulation
    from cascadia.workload import describe as describe_workload

    if analytic and calibration_path:
        raise click.UsageError("give --calibration or --analytic, not both")
    if detect_s is not None and loss is None:
        raise click.UsageError("--detect is the detection time of a loss: give --fail NODE@SECONDS with it")
    if interval is not None and replay_path:
        raise click.UsageError("--interval draws the machine's speed from the calibration; --replay-trace takes it "
                               "from a run: give one of them")
    report = report_to(json_path, plot_path, trace_path)
    loaded = with_runtime(load_spec(spec), speculate=speculate, pipeline_groups=groups)
    trace = _acceptance_trace(loaded, trace_file, acceptance)
    acceptance, proposing = _acceptance(loaded, acceptance), 1.0
    if fit:
        if trace is None:
            raise click.UsageError("--fit-acceptance fits the rates of a trace: give --acceptance-trace with it")
        try:
            (acceptance, proposing), trace = fitted_rates(trace), None
        except ValueError as e:
            raise click.ClickException(f"{trace_file}: {e}") from None
    model = attrs.evolve(loaded.model, checkpoint=Path(checkpoint)) if checkpoint else loaded.model
    workload = workload_overrides(loaded, choices)
    loaded = attrs.evolve(loaded, model=model, workload=workload)
    chosen = chosen_plan(loaded, plan_path)  # first: it refuses a runtime no node can hold, before any table is built
    calibration = Calibration.load(calibration_path) if calibration_path else analytic_calibration(loaded)
    timings = [] if trace_path else None
    replay = _replay(replay_path) if replay_path else None
    how = {"loss": loss, "detect_s": DETECT_S if detect_s is None else detect_s, "acceptance": acceptance,
           "acceptance_trace": trace, "proposing": proposing}
    result = run_simulation(loaded, calibration, chosen, timings=timings, replay=replay, **how)
    if interval is not None:
        result["interval"] = simulate_interval(loaded, calibration, chosen, interval, samples, **how)
    report(describe_workload(loaded.workload))
    if replay:
        report(f"replayed the compute of {replay.replayed} of {replay.replayed + replay.tabled} frames from "
               f"{replay_path} ({replay.frames} traced)")
    if fit:
        report(f"drafts proposed at {proposing:.0%} of the steps asked, each accepted at {acceptance:.3f} once "
               f"those before it were (fitted to {trace_file})")
    report(format_table(result))
    if interval is not None:
        report(f"\n{format_interval(result['interval'])}")
    if calibration.is_analytic:
        report("(analytic estimate)")
    if result.get("losses"):
        report(f"\n{format_losses(result['losses'])}")
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    if json_path:
        with writing(json_path) as f:
            json.dump(result, f, indent=1)
    if plot_path:
        with writing(plot_path, binary=True) as f:
            plot(result, f)
    if trace_path:
        write_trace(trace_path, timings, result, [s.node for s in chosen.stages])
    say_written(report, json_path, plot_path, trace_path)


@click.command("calibrate")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="a plan saved by `cascadia plan -o` (default: plan now)")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--rounds", type=click.IntRange(min=1),
              help="sweeps of each node's layer grid; each point is their median [default: 10]")
@click.option("--layers-only", is_flag=True,
              help="the layer tables and links alone, without the pipeline's overheads and shared cores (zero, as "
                   "analytic): minutes, not an hour, for a spec with large prefill buckets")
@click.option("--watch", "watch_s", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS",
              help="then time one stream's frames once a second for this long, so that the spread of the rounds "
                   "(`simulate --interval`) holds how the machine's speed moves over minutes, not one")
@click.option("-o", "--output", type=OutputPath(), required=True,
              help="the calibration JSON to write (for `cascadia simulate --calibration`)")
@speculate_option
def calibrate_command(spec: str, plan_path: str | None, checkpoint: str | None, rounds: int | None,
                      layers_only: bool, watch_s: float, output: str, speculate: str | None) -> None:
    """Measure what the simulator needs with the real engine and transport on the plan's local nodes: per node and
    layer kind, time over rows, attended positions (1, 2, 4 ... up to the spec's context_budget: a stream's length
    is set where a frame starts, so a long context costs one frame, no prefill) and distinct experts; the links;
    the host overheads; the cores of a shared host. Speculating as --speculate says, the pipeline's frames carry
    its drafts' state, and with MTP drafts the head's node is measured with the layer too."""
    from cascadia.measure.calibrate import format_calibration

    report = report_to(output)
    loaded = with_runtime(load_spec(spec), speculate=speculate)
    if layers_only and watch_s:
        raise click.UsageError("--watch times frames on the pipeline, which --layers-only does not start")
    measured = _calibrate(loaded, chosen_plan(loaded, plan_path), checkpoint, rounds, layers_only, watch_s)
    with writing(output) as f:
        f.write(measured.to_json())
    report(format_calibration(measured))
    say_written(report, output)


def _calibrate(loaded, chosen, checkpoint: str | None = None, rounds: int | None = None, layers_only: bool = False,
               watch_s: float = 0.0):
    """The measured calibration, with progress on stderr."""
    from pathlib import Path

    from cascadia.measure.calibrate import ROUNDS, calibrate

    return calibrate(loaded, chosen, Path(checkpoint) if checkpoint else None, rounds or ROUNDS,
                     progress=lambda text: click.echo(text, err=True), layers_only=layers_only, watch_s=watch_s)


@click.command("validate")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--calibration", "calibration_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="the calibration the simulator uses (`cascadia calibrate -o`)")
@workload_options
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="serve the workload this many times; the median is the measurement")
@click.option("--json", "json_path", type=OutputPath(),
              help="write both results and the errors here (after a failed run: the prediction and the runs so far)")
@click.option("--trace-dir", type=click.Path(file_okay=False, writable=True),
              help="write both timelines here (simulate.json, run.json: Chrome trace JSON) and compare each node's "
                   "time per frame, over the runs and phase by phase of each")
@emulate_links_option
@speculate_option
@click.option("--acceptance", type=click.FloatRange(0, 1), help="with --speculate: the chance the simulator gives "
              "a draft of being accepted once the drafts before it were [default: as in the first run, request by "
              "request and step by step]")
@click.option("--replay", is_flag=True, help="simulate each run again with its own frames' compute, from its trace "
                                             "(as `simulate --replay-trace`), and print that error too: the model's "
                                             "alone, without the machine's drift since calibrating")
@interval_options
def validate_command(spec: str, calibration_path: str, plan_path: str | None, checkpoint: str | None, choices: dict,
                     groups, repeats, json_path, trace_dir, emulate_links, speculate, acceptance, replay,
                     interval: float | None, samples: int) -> None:
    """Simulate and run the same workload on the same plan, and print per level and metric the measured and
    predicted values and the error, then each metric's median absolute error; with --trace-dir, each node's compute
    time per frame in both; with --replay, the error of each run's replay beside; with --interval, each figure's
    interval and how many runs it held."""
    import attrs

    from cascadia.sim.calibration import Calibration

    loaded = with_runtime(load_spec(spec), speculate=speculate, pipeline_groups=groups)
    _acceptance(loaded, acceptance)
    workload = workload_overrides(loaded, choices)
    calibration = Calibration.load(calibration_path)
    _validate_and_report(attrs.evolve(loaded, workload=workload), chosen_plan(loaded, plan_path), calibration,
                         checkpoint, repeats, json_path, emulate_links, trace_dir, acceptance, replay,
                         (interval, samples))


def _replay(path: str):
    """--replay-trace, read."""
    from cascadia.errors import CalibrationError
    from cascadia.files import read_json
    from cascadia.sim.replay import ReplayTimes
    from cascadia.trace import frame_timings

    try:
        nodes, frames = frame_timings(read_json(path, MAX_TRACE_BYTES, "a trace file"))
    except ValueError as e:  # the file's too (files.UnreadableFile)
        raise CalibrationError(f"{path}: {e}") from None
    return ReplayTimes(nodes, frames, path)


def _acceptance_trace(loaded, path: str | None, acceptance: float | None) -> dict | None:
    """--acceptance-trace, read: each request's [proposed, accepted] drafts per step."""
    from cascadia.files import UnreadableFile, read_json_lines
    from cascadia.sim.drafts import acceptance_trace

    if path is None:
        return None
    if not loaded.runtime.max_draft:
        raise click.UsageError("--acceptance-trace is the simulated drafts' acceptance: give --speculate with it")
    if acceptance is not None:
        raise click.UsageError("give --acceptance or --acceptance-trace, not both")
    try:
        return acceptance_trace(read_json_lines(path, MAX_TRACE_BYTES, "an outputs file"), path)
    except UnreadableFile as e:
        raise click.ClickException(f"{path}: {e}") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _acceptance(loaded, acceptance: float | None) -> float:
    """--acceptance, which only speculation reads."""
    if acceptance is not None and not loaded.runtime.max_draft:
        raise click.UsageError("--acceptance is the simulated drafts' acceptance: give --speculate with it")
    return DEFAULT_ACCEPTANCE if acceptance is None else acceptance


def _validate_and_report(loaded, chosen, calibration, checkpoint: str | None = None,
                         repeats: int = 1, json_path: str | None = None, emulate_links: bool = False,
                         trace_dir: str | None = None, acceptance: float | None = None, replay: bool = False,
                         interval: tuple[float | None, int] = (None, SAMPLES)) -> None:
    """Simulate and run with progress on stderr; print the comparison, write the JSON and the timelines."""
    import json
    from pathlib import Path

    from cascadia.measure.validate import ValidationFailed, format_comparison, validate
    from cascadia.pipeline.run import describe

    report = report_to(json_path)

    def write(result: dict) -> None:
        if json_path:
            with writing(json_path) as f:
                json.dump(result, f, indent=1)

    def phase_done(level: str, phase: str, records: list) -> None:
        click.echo(f"run: {level}, {phase}: {len(records)} requests", err=True)

    timelines = {} if trace_dir else None
    if trace_dir:
        try:  # before the work: a directory that cannot be made is said now
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.ClickException(f"{trace_dir}: cannot make the directory ({e.strerror})") from None
    try:
        result = validate(loaded, chosen, calibration, repeats=repeats,
                          checkpoint=Path(checkpoint) if checkpoint else None,
                          on_message=lambda node, message: click.echo(describe(node, message), err=True),
                          on_phase=phase_done, emulate_links=emulate_links, timelines=timelines,
                          acceptance=acceptance, replay=replay, interval=interval[0], interval_samples=interval[1])
    except ValidationFailed as e:
        write(e.result)
        raise click.ClickException(f"run failed: {e}") from None
    report(format_comparison(result))
    for name, (frames, backend_result, clock_error_s) in (timelines or {}).items():
        write_trace(str(Path(trace_dir) / f"{name}.json"), frames, backend_result,
                    [stage.node for stage in chosen.stages], clock_error_s)
    if trace_dir:
        report(f"wrote the timelines to {trace_dir}: {', '.join(f'{name}.json' for name in timelines)}")
    warnings = [f"warning (predicted): {w}" for w in result["predicted"]["warnings"]]
    warnings += dict.fromkeys(f"warning (measured): {w}" for run in result["measured"] for w in run["warnings"])
    for warning in warnings:
        click.echo(warning, err=True)
    write(result)
    say_written(report, json_path)


@click.command()
@click.option("--concurrency", type=IntList(), help="concurrency levels (default: the spec's, 1,2,4,8)")
def demo(concurrency) -> None:
    """The whole loop on the tiny trained model (specs/tiny-chat.yaml) and 3 local node processes: plan, calibrate
    with the real engine, simulate and run the same workload, compare the prediction with the measurement, and ask
    the model a question."""
    from pathlib import Path

    import attrs

    from cascadia.measure.calibrate import format_calibration

    specs = Path(__file__).resolve().parents[2] / "specs"
    if not (specs / "tiny-chat.yaml").is_file():
        raise click.ClickException(f"{specs}: not found (the demo runs from a source checkout)")
    _describe_paper_deployment(specs / "inkling-975b-11pc.yaml")
    loaded = load_spec(str(specs / "tiny-chat.yaml"))
    workload = workload_overrides(loaded, dict.fromkeys(WORKLOAD_CHOICES) | {"concurrency": concurrency})
    chosen = chosen_plan(loaded, None)
    click.echo("The tiny model, trained on Python's documentation, on 3 local node processes "
               f"(specs/tiny-chat.yaml)\n\nplan\n{chosen.table()}\n")
    calibration = _calibrate(loaded, chosen)
    click.echo(f"calibration, measured now (ms)\n{format_calibration(calibration)}\n")
    click.echo("simulated and measured")
    _validate_and_report(attrs.evolve(loaded, workload=workload), chosen, calibration)
    _ask(loaded.model.checkpoint, DEMO_QUESTION)


DEMO_QUESTION = "What is a generator?"


def _ask(checkpoint, question: str, new_tokens: int = 48) -> None:
    """The model's greedy answer to a question, from the engine in this process."""
    from cascadia.cli.engine import open_engine
    from cascadia.engine.generate import generate
    from cascadia.sampling import Sampling
    from cascadia.serve.chat import ChatTemplate
    from cascadia.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    prompt = tokenizer.encode(ChatTemplate.of_checkpoint(checkpoint).render([{"role": "user", "content": question}]))
    engine = open_engine(str(checkpoint), prompt.ids, new_tokens, "f32", False, "auto", None)
    answer = generate(engine, prompt.ids, new_tokens, Sampling(), engine.config.eos_ids)
    click.echo(f"\nasked {question!r}, the model answers (greedy, {len(answer.ids)} tokens):\n"
               f"{tokenizer.decode(list(answer.ids)).strip()}")  # the end-of-turn token, special, is not shown


def _describe_paper_deployment(path) -> None:
    """The paper's 11-PC Inkling deployment: its plan, and a simulation from the spec's hardware figures."""
    import attrs

    from cascadia.metrics import format_table
    from cascadia.sim.analytic import analytic_calibration
    from cascadia.sim.simulate import simulate
    from cascadia.workload import override

    paper = load_spec(str(path))
    paper = attrs.evolve(paper, workload=override(paper.workload, (1, 11, 44, 176)))
    chosen = chosen_plan(paper, None)
    click.echo(f"The Cascadia paper's deployment (specs/{path.name}): Inkling 975B on 11 PCs\n\n{chosen.table()}\n")
    click.echo(f"{format_table(simulate(paper, analytic_calibration(paper), chosen))}\n(analytic estimate)\n")
