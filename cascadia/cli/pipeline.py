"""The real pipeline: `run` (the coordinator) and `node` (one stage, on its machine)."""

from __future__ import annotations

import contextlib

import click

from cascadia.cli.common import (CpuList, OutputPath, Quantity, TcpAddress, chosen_plan, emulate_links_option,
                                 report_to, sampling_options, speculate_option, with_sampling, with_runtime,
                                 workload_options, say_written, workload_overrides, write_trace, writing)
from cascadia.spec.load import load_spec


@click.command()
@click.option("--spec", "spec_path", type=click.Path(exists=True, dir_okay=False),
              help="the spec the coordinator runs (without it: stand by to be invited, with --standby --announce)")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="the plan the coordinator runs (`cascadia plan -o`)")
@click.option("--name", required=True, help="this node's name in the plan")
@click.option("--listen", type=TcpAddress(to_bind=True), required=True,
              help="address to bind this node's input, e.g. tcp://0.0.0.0:5601")
@click.option("--control", type=TcpAddress(), help="the coordinator's control address, e.g. tcp://10.0.0.1:5555")
@click.option("--successor", type=TcpAddress(),
              help="where this node sends its results (default: the next node's address in the "
                                  "spec; the last node: the coordinator's token address)")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--threads", type=click.IntRange(min=1), help="inference threads (default: the node's, in the spec)")
@click.option("--logits", is_flag=True,
              help="last node: send the logits of sampled rows back too, and what the head read (scoring, draft-eval)")
@click.option("--cpus", type=CpuList(), help="the CPUs to run on, e.g. 0-3 (default: the node's cpus in the spec, "
                                             "else wherever it is started)")
@click.option("--parent-pid", type=int, help="stop when this process is no longer our parent")
@click.option("--keep-serving", is_flag=True,
              help="serve run after run: when a run ends, keep the compiled stage and wait for the next coordinator")
@click.option("--standby", is_flag=True,
              help="hold no stage, whatever the plan says, until the coordinator assigns one (as a spare does)")
@click.option("--wait-coordinator", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="seconds to wait at start for the coordinator to accept this node (--keep-serving: for ever)")
@click.option("--announce", is_flag=True,
              help="measure this PC (about 2 s) and announce the node over mDNS until it stops (`cascadia fleet` "
                   "lists it)")
@click.option("--interface", "interfaces", multiple=True, metavar="IP",
              help="--announce: announce on the interface with this IPv4 address (repeatable; default: every one)")
@click.option("--door", type=TcpAddress(to_bind=True),
              help="without --spec: the address to take invitations at (default: --listen's port + 1)")
@click.option("--keys", "keys", type=click.Path(exists=True, file_okay=False),
              help="without --spec: the Curve key folder (`cascadia keys`; default: no keys)")
@click.option("--memory", type=Quantity("size"),
              help="without --spec: offer at most this much memory (default: all this PC has free when it starts)")
def node(spec_path: str | None, plan_path: str | None, name: str, listen: str, control: str | None,
         successor: str | None, checkpoint: str | None, threads: int | None, logits: bool,
         cpus: tuple[int, ...] | None, parent_pid: int | None, keep_serving: bool, standby: bool,
         wait_coordinator: float, announce: bool, interfaces: tuple[str, ...], door: str | None,
         keys: str | None, memory: int | None) -> None:
    """Serve one stage of a plan: load its layers, then compute frames until the coordinator says stop.

    `cascadia run` starts these itself for `local` nodes; on other machines, start one per node, before or after
    `cascadia run`, with the same spec and plan files. With --keep-serving a node loads once and serves every
    later run too, until stopped with Ctrl-C. A spare (`cluster.spares`), or a node started with --standby,
    loads nothing until `cascadia serve` gives it a lost node's stage.

    Without --spec (with --standby --announce --checkpoint): the node announces itself and waits for a
    `cascadia serve --discover` that finds it to invite it, run after run."""
    import logging
    from pathlib import Path

    import attrs

    from cascadia.cli.fleet import announcer, stand_by_invited
    from cascadia.graph.planner import load_plan
    from cascadia.pipeline.stage import node_settings, serve_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if spec_path is None:
        given = [flag for flag, value in (("--plan", plan_path), ("--control", control), ("--successor", successor),
                                          ("--logits", logits), ("--keep-serving", keep_serving)) if value]
        if not (standby and announce and checkpoint) or given:
            raise click.UsageError("without --spec a node stands by to be invited: give --standby, --announce and "
                                   f"--checkpoint{', and not ' + ', '.join(given) if given else ''}")
        stand_by_invited(name, listen, door, Path(checkpoint), Path(keys) if keys else None, memory, threads, cpus,
                         interfaces)
        return
    if plan_path is None or control is None:
        raise click.UsageError("a node started with --spec needs --plan and --control too")
    loaded = load_spec(spec_path)
    chosen = load_plan(plan_path, loaded)
    settings = attrs.evolve(node_settings(loaded, chosen, name, listen, control, successor, parent_pid, standby),
                            keep_serving=keep_serving, coordinator_wait_s=None if keep_serving else wait_coordinator)
    folder = Path(checkpoint) if checkpoint else loaded.model.checkpoint
    if folder is None:
        raise click.UsageError(f"{spec_path}: the model names no checkpoint; give --checkpoint")
    with contextlib.ExitStack() as announced:
        if announce:
            settings = attrs.evolve(settings, on_state=announced.enter_context(
                announcer(loaded, settings, folder, interfaces)).update_state)
        try:
            serve_node(loaded, chosen, settings, folder, threads, logits, cpus)
        except Exception as e:  # already reported to the coordinator by the node loop; say it here too, briefly
            raise click.ClickException(f"{name}: {type(e).__name__}: {e}") from None


@click.command("run")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@workload_options
@sampling_options
@click.option("--json", "json_path", type=OutputPath(), help="write the metrics JSON here")
@click.option("--outputs", "outputs_path", type=OutputPath(),
              help="write each request's prompt and output token ids here (JSONL)")
@click.option("--trace", "trace_path", type=OutputPath(),
              help="write the run's timeline here (Chrome trace JSON, for Perfetto or chrome://tracing)")
@click.option("--control", type=TcpAddress(to_bind=True),
              help="tcp nodes: the control address to bind, e.g. tcp://0.0.0.0:5555")
@click.option("--tokens", type=TcpAddress(to_bind=True),
              help="tcp nodes: the token address to bind (the last node's --successor)")
@click.option("--node-timeout", type=click.FloatRange(min=0, min_open=True),
              help="seconds a starting node may stay silent [default: 120]")
@emulate_links_option
@click.option("--url", help="instead of starting the pipeline, send the workload to this live OpenAI-compatible "
                            "server (e.g. http://127.0.0.1:8000), timed on the client side")
@click.option("--api-key-file", type=click.File("r"), help="with --url: the server's key (the file's first line)")
@click.option("--model", help="with --url: the model to ask for (default: the server's only one)")
@speculate_option
def run_command(spec: str, plan_path: str | None, checkpoint: str | None, choices: dict, greedy, temperature, top_p,
                top_k, min_p, seed, groups, json_path, outputs_path, trace_path, control, tokens, node_timeout,
                emulate_links, url, api_key_file, model, speculate) -> None:
    """Run the spec's workload through the real pipeline and print throughput and latency per level.

    Local nodes are started here, on 127.0.0.1. Nodes with tcp addresses are started on their machines with
    `cascadia node ... --control ADDRESS` (the last one also with --successor set to the --tokens address). With
    --url the workload goes to a running server through its OpenAI API instead: the load generator for a
    deployment."""
    loaded = with_runtime(load_spec(spec), speculate=speculate, pipeline_groups=groups)
    workload = with_sampling(workload_overrides(loaded, choices), greedy, temperature, top_p, seed, top_k, min_p)
    if url is not None:
        pipeline_only = {"--plan": plan_path, "--groups": groups, "--outputs": outputs_path, "--trace": trace_path,
                         "--control": control, "--tokens": tokens, "--node-timeout": node_timeout,
                         "--emulate-links": emulate_links or None, "--speculate": speculate}
        if given := [name for name, value in pipeline_only.items() if value is not None]:
            raise click.UsageError(f"{', '.join(given)}: for the pipeline `run` starts, not with --url")
        _load_and_report(loaded, workload, url, api_key_file, model, checkpoint, json_path)
        return
    if api_key_file is not None or model is not None:
        raise click.UsageError("--api-key-file and --model go with --url")
    _run_and_report(loaded, plan_path, workload, checkpoint=checkpoint, json_path=json_path,
                    outputs_path=outputs_path, trace_path=trace_path, control=control, tokens=tokens,
                    node_timeout=node_timeout, emulate_links=emulate_links)


def _load_and_report(loaded, workload, url: str, api_key_file, model: str | None, checkpoint: str | None,
                     json_path: str | None) -> None:
    """`run --url`: the workload against a live server, with progress on stderr; the table, the JSON."""
    import json
    from pathlib import Path

    from cascadia.metrics import format_table
    from cascadia.serve.load import Target, run_url
    from cascadia.tokenizer import workload_prompts
    from cascadia.workload import describe as describe_workload

    report = report_to(json_path)
    key = api_key_file.readline().strip() if api_key_file is not None else None
    prompts = workload_prompts(workload, Path(checkpoint) if checkpoint else loaded.model.checkpoint,
                               loaded.model.config)
    result = run_url(loaded, workload, Target(url, key, model), prompts, on_phase=lambda level, phase, records:
                     click.echo(f"{level}, {phase}: {len(records)} requests", err=True))
    report(describe_workload(workload))
    report(format_table(result))
    if json_path:
        with writing(json_path) as f:
            json.dump(result, f, indent=1)
    say_written(report, json_path)


def _run_and_report(loaded, plan_path: str | None, workload, *, checkpoint: str | None = None,
                    json_path: str | None = None, outputs_path: str | None = None,
                    trace_path: str | None = None, control: str | None = None, tokens: str | None = None,
                    node_timeout: float | None = None, emulate_links: bool = False) -> None:
    """Run the workload through the pipeline, with progress on stderr; print the table, write the files."""
    import json
    from pathlib import Path

    from cascadia.metrics import format_table
    from cascadia.pipeline.run import NODE_TIMEOUT_S, Addresses, RunFailed, describe, run
    from cascadia.workload import describe as describe_workload

    report = report_to(json_path, outputs_path, trace_path)

    def write(result: dict, outputs: list[dict]) -> None:
        if outputs_path:  # first: the generated tokens are what a failure to write the other would lose
            with writing(outputs_path) as f:
                f.writelines(json.dumps(line) + "\n" for line in outputs)
        if json_path:
            with writing(json_path) as f:
                json.dump(result, f, indent=1)

    def phase_done(level: str, phase: str, records: list) -> None:
        tokens_out = sum(r.output_tokens for r in records)
        click.echo(f"{level}, {phase}: {len(records)} requests, {tokens_out} tokens", err=True)

    if (control is None) != (tokens is None):
        raise click.UsageError("give both --control and --tokens, or neither")
    chosen = chosen_plan(loaded, plan_path)
    try:
        done = run(loaded, chosen, workload, checkpoint=Path(checkpoint) if checkpoint else None,
                   addresses=Addresses(control, tokens) if control else None,
                   node_timeout_s=node_timeout or NODE_TIMEOUT_S,
                   on_message=lambda node, message: click.echo(describe(node, message), err=True),
                   on_phase=phase_done, emulate_links=emulate_links, trace=trace_path is not None)
    except RunFailed as e:
        write(e.result, e.outputs)
        raise click.ClickException(f"run failed: {e}") from None
    report(describe_workload(workload))
    report(format_table(done.result))
    for warning in done.result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    write(done.result, done.outputs)
    if trace_path:
        write_trace(trace_path, done.frames, done.result, [s.node for s in chosen.stages], done.clock_error_s)
    say_written(report, json_path, outputs_path, trace_path)
