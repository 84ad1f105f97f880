"""`cascadia serve`: an OpenAI-compatible server on the spec's pipeline."""

from __future__ import annotations

import contextlib

import click

from cascadia.cli.common import Quantity, TcpAddress, chosen_plan, groups_option, speculate_option, with_runtime
from cascadia.spec.load import load_spec

DISCOVER_S = 10.0  # how long `serve --discover` listens for nodes, unless told


@click.command("serve")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="a plan saved by `cascadia plan -o` (default: plan now)")
@click.option("--host", default="127.0.0.1", show_default=True, help="the address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model-name", help="the model's name in the API (default: the spec's model name)")
@click.option("--max-waiting", type=click.IntRange(min=0),
              help="requests that may wait for a stream slot; more get 429 (default: twice runtime.max_streams)")
@click.option("--api-key-file", type=click.File("r"), help="require `Authorization: Bearer KEY` on /v1/ (the "
                                                           "file's first line is the key)")
@click.option("--max-body", type=Quantity("size"), default="4MiB", show_default=True,
              help="the largest request body")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="seconds open requests may take to finish after SIGTERM or Ctrl-C, before they are cancelled")
@groups_option
@click.option("--control", type=TcpAddress(to_bind=True),
              help="tcp nodes: the control address to bind, e.g. tcp://0.0.0.0:5555")
@click.option("--tokens", type=TcpAddress(to_bind=True),
              help="tcp nodes: the token address to bind (the last node's --successor)")
@click.option("--node-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="seconds a starting node may stay silent")
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="seconds a node may leave the coordinator's heartbeats unanswered before it is lost (a stopped "
                   "process, a vanished machine); a node computing a long frame still answers them, for up to "
                   "60 s without tokens")
@click.option("--replace-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="seconds a lost tcp node may take to come back before its stage is down (open requests fail, "
                   "new ones get 503, until it does)")
@speculate_option
@click.option("--discover", type=click.FloatRange(min=0, min_open=True), metavar="[SECONDS]", is_flag=False,
              flag_value=DISCOVER_S,
              help=f"form the cluster of the nodes that announce themselves within SECONDS ({DISCOVER_S:g} when not "
                   "given; `cascadia node --standby --announce`), in place of the spec's nodes, and invite them "
                   "(a spec with `cluster: {discover: true}` does so without it)")
@click.option("--expect", type=click.IntRange(min=1), help="--discover: stop listening once this many nodes answered")
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="--discover: how many of the nodes found (those with the least memory) stand by as spares")
@click.option("--interface", "interfaces", multiple=True, metavar="IP",
              help="--discover: listen on the interface with this IPv4 address (repeatable; default: every one)")
@click.option("--save-spec", type=click.Path(dir_okay=False, writable=True),
              help="--discover: write the spec of the fleet as it formed here (`cascadia serve` takes it again, "
                   "`cascadia simulate` predicts it)")
def serve(spec: str, checkpoint: str | None, plan_path: str | None, host: str, port: int, model_name: str | None,
          max_waiting: int | None, api_key_file, max_body: int, shutdown_timeout: float, groups: int | None,
          control: str | None, tokens: str | None, node_timeout: float, stall_timeout: float,
          replace_timeout: float, speculate: str | None, discover: float | None, expect: int | None, spares: int,
          interfaces: tuple[str, ...], save_spec: str | None) -> None:
    """Serve the spec's model with an OpenAI-compatible API (chat and text completions, streamed or not; /v1/models,
    /health, /metrics, and a status page at /) until SIGTERM or Ctrl-C.

    Local nodes are started here; nodes with tcp addresses are started on their machines, as for `cascadia run`.
    /health answers 503 while the nodes load. A lost node is taken back: a local one is started again, a tcp one
    waited for; its streams are rebuilt from their tokens and go on where they were."""
    import logging
    from pathlib import Path

    from cascadia.pipeline.run import Addresses
    from cascadia.serve.app import ServeSettings
    from cascadia.serve.server import serve as run_server

    if (control is None) != (tokens is None):
        raise click.UsageError("give both --control and --tokens, or neither")
    key = None
    if api_key_file is not None:
        key = api_key_file.readline().strip()
        if not key:
            raise click.BadParameter("the file's first line is empty", param_hint="--api-key-file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    loaded = with_runtime(load_spec(spec), speculate=speculate, pipeline_groups=groups)
    runtime = loaded.runtime
    settings = ServeSettings(model_name or loaded.model.name, runtime.context_budget,
                             2 * runtime.max_streams if max_waiting is None else max_waiting, max_body, key)
    if discover is None and loaded.cluster.discover:
        discover = DISCOVER_S
    if discover is not None and plan_path is not None:
        raise click.UsageError("--discover plans over the nodes it finds: leave out --plan")
    with contextlib.ExitStack() as fleet:
        beside = None
        if discover is not None:
            from cascadia.fleet.announce import Browser
            from cascadia.fleet.form import LateJoiner, measure_links
            from cascadia.fleet.form import discover as form_fleet
            from cascadia.spec.dump import write_spec

            browser = fleet.enter_context(Browser(interfaces or None))  # open while serving: late nodes join
            loaded = measure_links(form_fleet(loaded, browser, discover, expect, spares), node_timeout).spec
            if save_spec:
                write_spec(loaded, Path(save_spec))
        chosen = chosen_plan(loaded, plan_path)
        if any(node.door for node in loaded.cluster.members):  # nodes standing by, to be invited
            from cascadia.fleet.form import invite

            control, tokens = control or "tcp://0.0.0.0:5555", tokens or "tcp://0.0.0.0:5556"
            invite(loaded, chosen, control, tokens, node_timeout)
            if discover is not None:
                def beside(service):
                    return LateJoiner(browser, service, control, tokens, node_timeout)
        run_server(loaded, chosen, settings, host=host, port=port,
                   checkpoint=Path(checkpoint) if checkpoint else None, shutdown_timeout_s=shutdown_timeout,
                   addresses=Addresses(control, tokens) if control else None, node_timeout_s=node_timeout,
                   stall_s=stall_timeout, replace_timeout_s=replace_timeout, beside=beside)
