"""`cascadia doctor`: what this PC has, against what a spec asks of it; with --fleet, the spec's fleet as a run
starts it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from cascadia.cli.common import TcpAddress, chosen_plan


@click.command()
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--node", help="the spec's node this PC is to be (default: every local node of the spec)")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="the plan the fleet runs (default: the planner's for the spec)")
@click.option("--fleet", is_flag=True, help="start the SPEC's fleet as `cascadia run` does, without a workload, and "
                                            "check every node of the plan (run it on the coordinator)")
@click.option("--control", type=TcpAddress(to_bind=True), help="--fleet, tcp nodes: the control address to bind")
@click.option("--tokens", type=TcpAddress(to_bind=True), help="--fleet, tcp nodes: the token address to bind")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False),
              help="--fleet, local nodes: the checkpoint (default: the spec's)")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="--fleet: seconds a starting node may stay silent")
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
def doctor(spec_path: str | None, node: str | None, plan_path: str | None, fleet: bool, control: str | None,
           tokens: str | None, checkpoint: str | None, wait_s: float, as_json: bool) -> None:
    """Check this PC before it serves: Python and packages, OpenVINO's devices and precisions, CPU, free memory and
    the memory's speed (measured in about a second); given a SPEC, what it asks of this PC as --node (memory,
    device and precision, bandwidth figure, port, Curve keys). With --fleet, on the coordinator: every node of the
    plan reached, started with this spec and plan, its stage loaded and its clock placed (the nodes are let go
    after). One line a check, OK, WARN or FAIL, with the fix; exit status 1 when any check fails."""
    from cascadia import doctor as checks
    from cascadia.engine.device import core
    from cascadia.pipeline.run import Addresses, describe
    from cascadia.spec.load import load_spec

    spec = load_spec(spec_path) if spec_path else None
    if spec is not None and node is not None:
        try:
            spec.cluster.node(node)
        except KeyError as e:
            raise click.BadParameter(str(e).strip('"'), param_hint="--node") from None
    if not fleet and (control, tokens, checkpoint) != (None, None, None):
        raise click.UsageError("--control, --tokens and --checkpoint go with --fleet")
    if fleet and spec is None:
        raise click.UsageError("--fleet needs a SPEC")
    if (control is None) != (tokens is None):
        raise click.UsageError("give both --control and --tokens, or neither")
    found, measured = checks.machine_checks(core())
    if spec is not None:
        plan = chosen_plan(spec, plan_path)
        local = all(member.is_local for member in spec.cluster.members)
        if not fleet or local or node is not None:  # a coordinator of tcp nodes is none of them
            found += list(checks.spec_checks(spec, plan, node, measured))
        if fleet and not local and control is None:
            raise click.UsageError("--fleet with tcp nodes: give --control and --tokens, the addresses they connect "
                                   "to (as for cascadia run)")
        if fleet:
            found += checks.fleet_checks(spec, plan, Addresses(control, tokens) if control else None,
                                         Path(checkpoint) if checkpoint else None, wait_s,
                                         lambda name, message: click.echo(describe(name, message), err=True))
    if as_json:
        click.echo(json.dumps({"ok": not checks.failed(found), "checks": [c.as_json() for c in found]}, indent=1))
    else:
        click.echo(checks.report(found))
    if checks.failed(found):
        raise SystemExit(1)
