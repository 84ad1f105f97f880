"""`cascadia doctor`: what this PC has, against what a spec asks of it."""

from __future__ import annotations

import json

import click

from cascadia.cli.common import chosen_plan


@click.command()
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--node", help="the spec's node this PC is to be (default: every local node of the spec)")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
              help="the plan the fleet runs (default: the planner's for the spec)")
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
def doctor(spec_path: str | None, node: str | None, plan_path: str | None, as_json: bool) -> None:
    """Check this PC before it serves: Python and packages, OpenVINO's devices and precisions, CPU, free memory and
    the memory's speed (measured in about a second); given a SPEC, what it asks of this PC as --node (memory,
    device and precision, bandwidth figure, port, Curve keys). One line a check, OK, WARN or FAIL, with the fix;
    exit status 1 when any check fails."""
    from cascadia import doctor as checks
    from cascadia.engine.device import core
    from cascadia.spec.load import load_spec

    spec = load_spec(spec_path) if spec_path else None
    if spec is not None and node is not None:
        try:
            spec.cluster.node(node)
        except KeyError as e:
            raise click.BadParameter(str(e).strip('"'), param_hint="--node") from None
    found, measured = checks.machine_checks(core())
    if spec is not None:
        found += list(checks.spec_checks(spec, chosen_plan(spec, plan_path), node, measured))
    if as_json:
        click.echo(json.dumps({"ok": not checks.failed(found), "checks": [c.as_json() for c in found]}, indent=1))
    else:
        click.echo(checks.report(found))
    if checks.failed(found):
        raise SystemExit(1)
