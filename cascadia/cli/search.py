"""Deciding before buying: `search`, the machines a catalogue offers against a model, a workload and a latency
objective."""

from __future__ import annotations

import click

from cascadia.cli.common import say_written


class Objective(click.ParamType):
    """A latency objective, "ttft_p90=10s,tpot_p99=400ms" (`cascadia.search.slo.LatencySlo`)."""

    name = "ttft_pNN=T[,tpot_pNN=T]"

    def convert(self, value, param, ctx):
        from cascadia.search.slo import LatencySlo

        if not isinstance(value, str):
            return value
        try:
            return LatencySlo.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--catalogue", "catalogue_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="YAML list of the machine types to consider (specs/catalogues/ai-pcs.yaml: AI PCs and mini PCs)")
@click.option("--slo", type=Objective(), required=True,
              help="what every fleet must meet: percentiles of the first-token time and of the time per later "
                   "token, e.g. ttft_p90=10s,tpot_p99=400ms")
@click.option("--machines", help="only these machine types of the catalogue, comma-separated")
@click.option("--load", type=click.FloatRange(min=0, min_open=True),
              help="requests a second to carry: the cheapest fleet that carries them is named")
@click.option("--tolerance", type=click.FloatRange(0.001, 1), default=0.05, show_default=True,
              help="relative width of each capacity's boundary when the bisection stops")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="folder to write search.json into (made if missing)")
def search(spec: str, catalogue_path: str, slo, machines: str | None, load: float | None, tolerance: float,
           out_dir: str | None) -> None:
    """Which machines to buy: for each machine type of the catalogue, the fewest that hold the spec's model at its
    runtime, and the highest rate of its workload they serve within the objective (simulated from the catalogue's
    figures), with their price. The spec's cluster is not used."""
    import json
    import os

    from cascadia.search.search import cheapest, report
    from cascadia.search.search import search as evaluations
    from cascadia.spec.load import load_catalogue, load_spec

    loaded, catalogue = load_spec(spec), load_catalogue(catalogue_path)
    names = [name.strip() for name in machines.split(",")] if machines else []
    known = {machine.name for machine in catalogue.machines}
    if unknown := [name for name in names if name not in known]:
        raise click.BadParameter(f"{', '.join(unknown)} not in {catalogue_path} (it lists {', '.join(sorted(known))})",
                                 param_hint="--machines")
    if out_dir:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise click.BadParameter(f"{out_dir}: cannot make it ({e.strerror})", param_hint="--out") from None
    total = len(names) or len(catalogue.machines)
    evaluated, complete = [], False
    try:
        for each in evaluations(loaded, catalogue, slo, names, tolerance):
            evaluated.append(each)
            click.echo(f"[{len(evaluated)}/{total}] {each.machine.name}: {_outcome(each)} "
                       f"({each.seconds:.1f} s)", err=True)
        complete = True
    finally:
        if out_dir:
            path = os.path.join(out_dir, "search.json")
            with open(path, "w") as f:
                json.dump(report(loaded, catalogue, slo, evaluated, tolerance, load, complete), f, indent=1)
            if not complete:
                click.echo(f"interrupted: wrote the {len(evaluated)} of {total} machine types evaluated to {path}",
                           err=True)
    prompts = loaded.workload.prompt_tokens
    lengths = str(prompts.low) if prompts.low == prompts.high else f"{prompts.low}-{prompts.high}"
    click.echo(f"{slo}; prompts of {lengths} tokens, {loaded.workload.output_tokens} out; an analytic estimate from "
               "the catalogue's figures")
    click.echo(_table(evaluated, slo, catalogue.currency))
    if load is not None:
        best = cheapest(evaluated, load)
        click.echo(f"cheapest carrying {load:g} requests/s: {best.fleet.count} x {best.machine.name}, "
                   f"{best.fleet.price:,.0f} {catalogue.currency}" if best else
                   f"no fleet here carries {load:g} requests/s within {slo}")
    if out_dir:
        say_written(click.echo, os.path.join(out_dir, "search.json"))
    if not any(each.rate > 0 for each in evaluated):
        raise click.ClickException(f"no machine type meets {slo} at any load: see each one's reason above")


def _outcome(each) -> str:
    if each.pruned:
        return f"pruned: {each.pruned}"
    if not each.rate:
        return f"{_machines(each.fleet.count)}; {each.capacity.reason}"
    more = "" if each.capacity.bounded else " or more"
    return f"{_machines(each.fleet.count)} carry {each.rate:.3g} requests/s{more}"


def _machines(count: int) -> str:
    return f"{count} machine{'s' if count > 1 else ''}"


def _table(evaluated, slo, currency: str) -> str:
    from cascadia.table import format_rows

    header = ["machine", "count", f"price {currency}", "power W", "capacity req/s",
              *(f"{b.metric.upper()} p{b.percentile:g} ms" for b in slo.bounds), "goodput",
              f"{currency} per req/s", "note"]
    rows = [header]
    for each in evaluated:
        fleet, at = each.fleet, each.capacity.at_rate if each.capacity else None
        rate = each.rate
        rows.append([
            each.machine.name, str(fleet.count) if fleet else "-", f"{fleet.price:,.0f}" if fleet else "-",
            f"{fleet.power_w:,.0f}" if fleet and fleet.power_w is not None else "-",
            (f"{rate:.3g}" + ("" if each.capacity.bounded else "+")) if rate else "-",
            *(f"{at.quantiles[b.metric] * 1e3:.1f}" if at and at.quantiles[b.metric] is not None else "-"
              for b in slo.bounds),
            f"{at.goodput:.0%}" if at else "-",
            f"{fleet.price / rate:.3g}" if fleet and rate else "-",
            each.pruned or (each.capacity.reason if each.capacity and not rate else ""),
        ])
    return format_rows(rows, left={0, len(header) - 1})
