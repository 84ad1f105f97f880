"""Deciding before buying: `search`, the fleets a catalogue's machines make against a model, a workload and a
latency objective."""

from __future__ import annotations

import click

from cascadia.cli.common import IntList, Speculate, say_written


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


class RowBuckets(click.ParamType):
    """One set of row buckets, "1,2,8,32", as runtime.row_buckets."""

    name = "1,2,8,..."

    def convert(self, value, param, ctx):
        from cascadia.spec.load import parse_row_buckets

        if isinstance(value, tuple):
            return value
        try:
            return parse_row_buckets(value)
        except ValueError as e:
            self.fail(f"{value!r}: {e}", param, ctx)


class Speculations(click.ParamType):
    """Comma-separated speculation settings, each "off" or as runtime.speculate (`cascadia.cli.common.Speculate`)."""

    name = "off,ngram:K"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        return tuple(Speculate().convert(choice.strip(), param, ctx) for choice in value.split(","))


def _names(value: str | None, known: list[str], option: str) -> list[str]:
    """A comma-separated choice among `known` (empty: none given)."""
    names = [name.strip() for name in value.split(",")] if value else []
    if unknown := [name for name in names if name not in known]:
        raise click.BadParameter(f"{', '.join(unknown)}: not one of {', '.join(known)}", param_hint=option)
    return names


@click.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--catalogue", "catalogue_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="YAML list of the machine types to consider (specs/catalogues/ai-pcs.yaml: AI PCs and mini PCs)")
@click.option("--slo", type=Objective(), required=True,
              help="what every fleet must meet: percentiles of the first-token time and of the time per later "
                   "token, e.g. ttft_p90=10s,tpot_p99=400ms")
@click.option("--machines", help="only these machine types of the catalogue, comma-separated")
@click.option("--formats", "presets", default="spec", show_default=True,
              help="weight-format presets to weigh, comma-separated: spec (the spec's own), paper, int8, int4")
@click.option("--max-streams", type=IntList(),
              help="runtime max_streams to weigh, comma-separated (each sizes the K/V pool a fleet must hold, and "
                   "its largest frames) [default: the spec's]")
@click.option("--prefill-window", "prefill_windows", type=IntList(),
              help="runtime prefill_window to weigh, comma-separated: prompt rows admitted a step [default: the "
                   "spec's]")
@click.option("--speculate", "drafts", type=Speculations(), default=(),
              help="speculative decoding to weigh, comma-separated: off, or n-gram drafts of up to K tokens "
                   "[default: the spec's]")
@click.option("--row-buckets", type=RowBuckets(), multiple=True,
              help="runtime row_buckets to weigh, one set each time it is given, e.g. --row-buckets 1,8,32 "
                   "--row-buckets 1,2,8,16,24,32 (the row counts an engine call is padded to) [default: the spec's]")
@click.option("--groups", "pipeline_groups", type=IntList(),
              help="runtime pipeline_groups to weigh, comma-separated: groups of streams, each with one frame in "
                   "flight [default: the spec's, one per stage]")
@click.option("--acceptance", type=click.FloatRange(0, 1),
              help="with speculation: the chance the simulator gives each draft token of being accepted (how "
                   "predictable the workload's text is) [default: 0.5]")
@click.option("--mixes", is_flag=True,
              help="weigh mixes of two machine types too: k of one (short of the fewest that hold the model alone) "
                   "and the fewest of the other that make up the rest")
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="machines each fleet keeps standing by to take a lost one's stage (priced, not serving)")
@click.option("--most", type=click.IntRange(min=1),
              help="the most machines of a fleet [default: twice the fewest that hold the model]")
@click.option("--load", type=click.FloatRange(min=0, min_open=True),
              help="requests a second to carry: the cheapest fleet that carries them is named")
@click.option("--users", type=click.IntRange(min=1),
              help="clients to serve at once, each sending its next request when its last is done: the cheapest "
                   "fleet that serves them within the objective is named")
@click.option("--tolerance", type=click.FloatRange(0.001, 1), default=0.05, show_default=True,
              help="relative width of each capacity's boundary when the bisection stops")
@click.option("--probe-requests", type=click.IntRange(min=8),
              help="the fewest requests a probe simulates: at low rates, more make a capacity less scattered, "
                   "fewer read it high (bench/search_scatter.py) [default: 25 beyond the first-token bound's "
                   "percentile, 250 for p90, at least 64]")
@click.option("--no-prune", "keep_all", is_flag=True,
              help="simulate every fleet, even those the bounds rule out (slower; the same frontier)")
@click.option("--jobs", type=click.IntRange(min=1),
              help="fleets evaluated at once, each in a process of its own [default: this process's CPUs]")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="evaluate on the workers of this Ray cluster instead ('auto': the one this machine is in; "
                   "'local': a new one here): pip install 'cascadia[ray]'")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="folder for search.json, pareto.png and a spec per frontier fleet (made if missing)")
def search(spec: str, catalogue_path: str, slo, machines: str | None, presets: str, max_streams, prefill_windows,
           drafts: tuple[str, ...], row_buckets: tuple[tuple[int, ...], ...], pipeline_groups,
           acceptance: float | None, mixes: bool, spares: int, most: int | None, load: float | None,
           users: int | None, tolerance: float, probe_requests: int | None, keep_all: bool, jobs: int | None,
           ray_address: str | None, out_dir: str | None) -> None:
    """Which machines to buy: the fleets of each machine type in the catalogue, from the fewest that hold the spec's
    model at its runtime up to --most (with --mixes, and mixes of two types that just hold it), in each weight-format
    preset and with each combination of the runtime settings given (--max-streams, --prefill-window, --speculate,
    --row-buckets, --groups); for each, the highest rate of the spec's workload it serves within the objective
    (simulated from the catalogue's figures, or from times measured on one of its machines where the catalogue
    names a calibration) and its price. Prints the frontier of price against capacity and, with --load or --users,
    the cheapest fleet that carries it. The spec's cluster is not used."""
    import os

    from cascadia.search.search import cheapest_for_users
    from cascadia.search.search import search as evaluations
    from cascadia.search.space import PRESETS, settings_grid, space
    from cascadia.sim.drafts import DEFAULT_ACCEPTANCE
    from cascadia.spec.load import load_catalogue, load_spec

    loaded, catalogue = load_spec(spec), load_catalogue(catalogue_path)
    names = _names(machines, [m.name for m in catalogue.machines], "--machines")
    chosen_presets = _names(presets, list(PRESETS), "--formats") or ["spec"]
    if out_dir:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise click.BadParameter(f"{out_dir}: cannot make it ({e.strerror})", param_hint="--out") from None
    if jobs is not None and ray_address is not None:
        raise click.UsageError("give --jobs or --ray, not both")
    if acceptance is not None and not (loaded.runtime.max_draft or any(d != "off" for d in drafts)):
        raise click.UsageError("--acceptance is the simulated drafts' acceptance: weigh speculation (--speculate) "
                               "with it")
    settings = settings_grid(max_streams, prefill_windows, drafts, row_buckets, pipeline_groups)
    speculates = any(each.apply(loaded).runtime.max_draft for each in settings)
    accepted = DEFAULT_ACCEPTANCE if acceptance is None else acceptance  # where any fleet speculates
    fleets = list(space(loaded, catalogue, names, chosen_presets, most, settings, mixes, spares))
    pool = _pool(jobs, ray_address)  # before anything is written: a cluster it cannot join is an error of its own
    evaluated, complete, for_users = [], False, None
    try:
        for each in evaluations(loaded, fleets, slo, tolerance, prune=not keep_all, pool=pool, acceptance=accepted,
                                least_requests=probe_requests):
            evaluated.append(each)
            click.echo(f"[{len(evaluated)}/{len(fleets)}] {_outcome(each)} ({each.seconds:.1f} s)", err=True)
        if users is not None:
            click.echo(f"trying the fleets for {users} users, cheapest first", err=True)
            for_users = cheapest_for_users(loaded, evaluated, slo, users, accepted)
        complete = True
    finally:
        written = _write(out_dir, loaded, catalogue, slo, evaluated, tolerance, load, complete, for_users,
                         accepted if speculates else None, probe_requests) \
            if out_dir else []
        if not complete and written:
            click.echo(f"interrupted: wrote the {len(evaluated)} of {len(fleets)} fleets evaluated to {written[0]}",
                       err=True)
    _print(loaded, catalogue, slo, evaluated, load, for_users)
    say_written(click.echo, *written)
    if not any(each.rate > 0 for each in evaluated):
        raise click.ClickException(f"no fleet meets {slo} at any load: see each one's reason above")


def _pool(jobs: int | None, ray_address: str | None):
    from cascadia.host_cpus import available
    from cascadia.search.fanout import InProcess, Processes, RayCluster

    if ray_address is not None:
        return RayCluster(ray_address)
    jobs = jobs or len(available())
    return InProcess() if jobs == 1 else Processes(jobs)


def _outcome(each) -> str:
    where = each.candidate.describe() if each.candidate else \
        ", ".join(filter(None, [each.machine.name, each.formats, each.settings.describe()]))
    if each.pruned or not each.rate:
        return f"{where}: {'not simulated: ' if each.pruned else ''}{each.why}"
    more = "" if each.capacity.bounded else " or more"
    return f"{where}: carries {each.rate:.3g} requests/s{more}"


def _print(spec, catalogue, slo, evaluated, load: float | None, for_users) -> None:
    from collections import Counter

    from cascadia.search.search import BOUNDS, DOMINATED, MEMORY, cheapest, frontier
    from cascadia.table import format_rows

    prompts = spec.workload.prompt_tokens
    lengths = str(prompts.low) if prompts.low == prompts.high else f"{prompts.low}-{prompts.high}"
    measured = sorted({each.machine.name for each in evaluated if each.machine.calibration is not None})
    estimated = any(each.machine.calibration is None for each in evaluated)
    times = "; ".join(([f"times measured on {', '.join(measured)}"] if measured else []) +
                      (["an analytic estimate from the catalogue's figures"] if estimated else []))
    click.echo(f"{slo}; prompts of {lengths} tokens, {spec.workload.output_tokens} out; {times}")
    pruned = Counter(each.pruned for each in evaluated)
    fleets = sum(each.candidate is not None for each in evaluated)
    click.echo(f"{fleets} fleets: {pruned[None]} simulated, {pruned[BOUNDS]} ruled out by their bounds, "
               f"{pruned[DOMINATED]} by a cheaper fleet's capacity" +
               (f"; {pruned[MEMORY]} machine types (by format) hold no layer" if pruned[MEMORY] else ""))
    front = frontier(evaluated)
    if not front:
        return
    currency = catalogue.currency
    settings = any(each.settings.describe() for each in front)  # a column for them where some were given
    header = ["fleet", "formats", *(["settings"] if settings else []), f"price {currency}", "power W",
              "capacity req/s", *(f"{b.metric.upper()} p{b.percentile:g} ms" for b in slo.bounds), "goodput",
              f"{currency} per req/s"]
    rows = [header]
    for each in front:
        fleet, at = each.candidate, each.capacity.at_rate
        rows.append([fleet.fleet(), fleet.formats,
                     *([fleet.settings.describe() or "the spec's"] if settings else []), f"{fleet.price:,.0f}",
                     f"{fleet.power_w:,.0f}" if fleet.power_w is not None else "-",
                     f"{each.rate:.3g}" + ("" if each.capacity.bounded else "+"),
                     *(f"{at.quantiles[b.metric] * 1e3:.1f}" if at.quantiles[b.metric] is not None else "-"
                       for b in slo.bounds),
                     f"{at.goodput:.0%}", f"{fleet.price / each.rate:.3g}"])
    click.echo("the frontier: each fleet carries more than every cheaper one")
    click.echo(format_rows(rows, left={0, 1, 2} if settings else {0, 1}))
    if load is not None:
        best = cheapest(evaluated, load)
        click.echo(f"cheapest carrying {load:g} requests/s: {best.candidate.describe()}, {best.candidate.price:,.0f} "
                   f"{currency}" if best else f"no fleet here carries {load:g} requests/s within {slo}")
    if for_users is not None:
        if (best := for_users.fleet) is None:
            click.echo(f"no fleet here serves {for_users.users} users within {slo} ({len(for_users.tried)} tried)")
        else:
            verdict = for_users.tried[-1][1]
            seen = ", ".join(f"{b.metric.upper()} p{b.percentile:g} {verdict.quantiles[b.metric] * 1e3:.0f} ms"
                             for b in slo.bounds if verdict.quantiles[b.metric] is not None)
            click.echo(f"cheapest serving {for_users.users} users: {best.candidate.describe()}, "
                       f"{best.candidate.price:,.0f} {currency} ({seen}; the {len(for_users.tried) - 1} cheaper "
                       "fleets tried did not)")


def _write(out_dir: str, spec, catalogue, slo, evaluated, tolerance: float, load: float | None, complete: bool,
           for_users, acceptance: float | None, least_requests: int | None) -> list[str]:
    """search.json, pareto.png (where matplotlib is installed) and frontier-N.yaml; the paths written."""
    import json
    import os
    from pathlib import Path

    import attrs

    from cascadia.search.capacity import probe_requests
    from cascadia.search.search import frontier, report
    from cascadia.spec.dump import write_spec

    path = os.path.join(out_dir, "search.json")
    with open(path, "w") as f:
        json.dump(report(spec, catalogue, slo, evaluated, tolerance, load, complete, for_users, acceptance,
                         least_requests), f, indent=1)
    written = [path]
    for i, each in enumerate(frontier(evaluated)):
        # the fleet's spec, its workload arriving at the capacity as the search's probe did, goodput counted
        requests = probe_requests(each.rate, slo, tolerance, least_requests)
        workload = attrs.evolve(spec.workload, rate=(each.rate,), requests=requests, slo=slo.per_request())
        fleet_spec = attrs.evolve(each.candidate.spec(spec), workload=workload)
        written.append(str(write_spec(fleet_spec, Path(out_dir) / f"frontier-{i}.yaml")))
        if each.machine.calibration is not None:  # what `simulate --calibration` and `validate` take beside it
            written.append(os.path.join(out_dir, f"frontier-{i}.calibration.json"))
            each.candidate.calibration(fleet_spec).save(written[-1])
    try:
        from cascadia.search.plot import pareto
    except ImportError:
        click.echo("no pareto.png: plotting needs matplotlib (pip install 'cascadia[plot]')", err=True)
    else:
        written.insert(1, pareto(evaluated, slo, catalogue.currency, os.path.join(out_dir, "pareto.png")))
    return written
