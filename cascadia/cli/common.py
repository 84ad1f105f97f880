"""What the commands share: quantity, list and output-file parameters, sampling and workload
options, the plan to use."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO

import click

from cascadia.host_cpus import parse_cpus


class Quantity(click.ParamType):
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


class IntList(click.ParamType):
    """Comma-separated positive integers, each once, e.g. "1,2,4"."""

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
        if len(set(numbers)) != len(numbers):
            self.fail(f"{value!r}: values repeat", param, ctx)
        return numbers


class NodeAtSeconds(click.ParamType):
    """NODE@SECONDS, e.g. "pc3@20": a node and a moment."""

    name = "node@seconds"

    def convert(self, value, param, ctx):
        from cascadia.sim.loss import Loss

        if isinstance(value, Loss):
            return value
        node, _, seconds = value.rpartition("@")
        try:
            moment = float(seconds)
        except ValueError:
            moment = math.nan
        if not node or not moment >= 0:  # no "@" leaves node empty; NaN fails the comparison
            self.fail(f"{value!r} is not NODE@SECONDS (a node's name and a time, e.g. pc3@20)", param, ctx)
        return Loss(node, moment)


class TcpAddress(click.ParamType):
    """A ZeroMQ address, tcp://HOST:PORT (HOST may be * in an address `to_bind`): checked at once, not when the
    socket is first used."""

    name = "tcp://HOST:PORT"

    def __init__(self, to_bind: bool = False):
        self.to_bind = to_bind

    def convert(self, value, param, ctx):
        from cascadia.spec.types import is_tcp_address

        if not is_tcp_address(value, self.to_bind):
            self.fail(f"{value!r} is not an address like tcp://10.0.0.1:5555 (port 1-65535)", param, ctx)
        return value


class OutputPath(click.Path):
    """A file the command writes when its work is done, or "-" for standard output: checked before the work starts
    (its folder exists and may be written), so that a long run does not end unable to keep its results."""

    def __init__(self):
        super().__init__(dir_okay=False, writable=True, allow_dash=True)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        if path == "-":
            return path
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            self.fail(f"{path}: no such folder {folder}", param, ctx)
        if not os.path.exists(path) and not os.access(folder, os.W_OK):
            self.fail(f"{path}: cannot create files in {folder}", param, ctx)
        return path


@contextlib.contextmanager
def writing(path: str, binary: bool = False) -> Iterator[IO]:
    """`path` open for writing, or standard output for "-"; a failure to write is one error naming the file."""
    if path == "-":
        yield click.get_binary_stream("stdout") if binary else sys.stdout
        return
    try:
        with open(path, "wb" if binary else "w") as f:
            yield f
    except OSError as e:
        raise click.ClickException(f"{e.filename or path}: cannot write ({e.strerror})") from None


def say_written(report: Callable[..., None], *paths: str | None) -> None:
    """Name each file a command wrote, as the last lines of its report (standard output is not a file)."""
    for path in paths:
        if path and path != "-":
            report(f"wrote {path}")


def write_trace(path: str, frames, result: dict, nodes: list[str], clock_error_s: dict | None = None) -> None:
    """A run's or a simulation's timeline as Chrome trace JSON (`cascadia.trace`)."""
    import json

    from cascadia.trace import chrome_trace, records_of

    with writing(path) as f:
        json.dump(chrome_trace(frames, records_of(result), nodes, result["source"], clock_error_s), f)


def report_to(*paths: str | None) -> Callable[..., None]:
    """How a command prints its report for people: on standard output, or on standard error when one of its output
    files is standard output ("-"), which at most one may be."""
    if paths.count("-") > 1:
        raise click.UsageError("only one output may go to standard output ('-')")
    return functools.partial(click.echo, err="-" in paths)


def sampling_options(command):
    """--greedy | --temperature T --top-p P, and --seed: how tokens are picked (default: the spec's workload; for
    `generate`, greedy). Read them with `with_sampling`."""
    for option in reversed((
            click.option("--greedy", is_flag=True, default=None, help="take the most likely token"),
            click.option("--temperature", type=click.FloatRange(min=0, min_open=True),
                         help="sample at this temperature"),
            click.option("--top-p", type=click.FloatRange(0, 1, min_open=True),
                         help="sample from the most likely tokens holding this probability"),
            click.option("--top-k", type=click.IntRange(min=0), help="sample from this many most likely tokens"),
            click.option("--min-p", type=click.FloatRange(0, 1),
                         help="sample from the tokens at least this share as likely as the most likely"),
            click.option("--seed", type=int, help="seed of the random draws"))):
        command = option(command)
    return command


def with_sampling(workload, greedy: bool | None, temperature: float | None, top_p: float | None, seed: int | None,
                  top_k: int | None = None, min_p: float | None = None):
    import attrs

    drawing = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    if greedy and any(v is not None for v in drawing.values()):
        raise click.UsageError("give --greedy or --temperature/--top-p/--top-k/--min-p, not both")
    changes = {"greedy": True} if greedy else {}
    if any(v is not None for v in drawing.values()):
        changes["greedy"] = False
    changes.update({k: v for k, v in (*drawing.items(), ("seed", seed)) if v is not None})
    return attrs.evolve(workload, **changes)


class CpuList(click.ParamType):
    """CPU ids as `taskset` writes them, e.g. "0-3" or "0,2-3"."""

    name = "cpus"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_cpus(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class RateList(click.ParamType):
    """Comma-separated positive rates (requests per second), e.g. "0.5,2,8"."""

    name = "rates"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            rates = tuple(float(part) for part in value.split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of rates", param, ctx)
        if not all(math.isfinite(r) and r > 0 for r in rates) or len(set(rates)) != len(rates):
            self.fail(f"{value!r}: rates must be positive and distinct", param, ctx)
        return rates


class Slo(click.ParamType):
    """A service-level objective, "ttft=2s,tpot=200ms": both bounds, durations with units."""

    name = "ttft=T,tpot=T"

    def convert(self, value, param, ctx):
        from cascadia import units
        from cascadia.spec.types import SloSpec

        if not isinstance(value, str):
            return value
        parts = dict(part.split("=", 1) for part in value.split(",") if "=" in part)
        if set(parts) != {"ttft", "tpot"} or value.count("=") != 2:
            self.fail(f"{value!r} is not like ttft=2s,tpot=200ms", param, ctx)
        try:
            bounds = {key: units.parse_duration(text) for key, text in parts.items()}
        except units.UnitError as e:
            self.fail(f"{value!r}: {e}", param, ctx)
        if min(bounds.values()) <= 0:
            self.fail(f"{value!r}: the bounds must be more than zero", param, ctx)
        return SloSpec(**bounds)


WORKLOAD_CHOICES = ("concurrency", "rate", "requests", "prompts", "prompt_tokens", "max_new_tokens", "slo")


groups_option = click.option("--groups", type=click.IntRange(min=1),
                             help="pipeline groups: streams split into this many, each with one frame in flight "
                                  "(default: the spec's runtime.pipeline_groups, else one per stage)")


def workload_options(command):
    """The plan, checkpoint, workload and group options that `run`, `simulate` and `validate` share. The workload's
    reach the command gathered as one `choices` argument (a dict), for `workload_overrides`."""
    @functools.wraps(command)
    def gathered(*args, **kwargs):
        return command(*args, choices={key: kwargs.pop(key) for key in WORKLOAD_CHOICES}, **kwargs)

    for option in reversed((
            click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False),
                         help="a plan saved by `cascadia plan -o` (default: plan now)"),
            click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="default: the spec's"),
            click.option("--concurrency", type=IntList(),
                         help="closed-loop levels: clients each sending their next request when theirs is done, "
                              "e.g. 1,2,4 (default: the spec's)"),
            click.option("--rate", type=RateList(),
                         help="open-loop levels instead: requests arriving at Poisson times, this many per second "
                              "on average, e.g. 0.5,2,8"),
            click.option("--requests", type=click.IntRange(min=1),
                         help="requests per phase (default: the level's concurrency; 10 s of arrivals, at least 16)"),
            click.option("--prompts", type=click.Path(exists=True, dir_okay=False),
                         help='JSONL prompts, one {"ids": [...]} or {"text": "..."} per line; text needs the '
                              "checkpoint's tokenizer.json (default: the spec's prompts, or random ids)"),
            click.option("--prompt-tokens", type=click.IntRange(min=1), help="random prompts of this many tokens"),
            click.option("--max-new-tokens", type=click.IntRange(min=1), help="output tokens per request"),
            click.option("--slo", type=Slo(), help="count the requests meeting both bounds (goodput), e.g. "
                                                     "ttft=2s,tpot=200ms"),
            groups_option,
    )):
        gathered = option(gathered)
    return gathered


class Speculate(click.ParamType):
    """`ngram`, `mtp` or `ngram+mtp`, maybe with `:MAX_DRAFT` (`cascadia.speculation.speculate_setting`)."""

    name = "ngram|mtp|ngram+mtp[:MAX_DRAFT]"

    def convert(self, value, param, ctx):
        from cascadia.speculation import parse_speculate

        try:
            parse_speculate(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def speculate_option(command):
    """--speculate, for the commands that serve or simulate a workload. Apply it with `with_runtime`."""
    return click.option("--speculate", type=Speculate(),
                        help="speculative decoding: verify up to MAX_DRAFT drafts per stream as extra rows while "
                             "stages are idle, from prompt lookup (ngram, default 4), the checkpoint's multi-token-"
                             "prediction layer at the last stage (mtp, default 1) or both (ngram+mtp: prompt "
                             "lookup's where it finds some); the tokens are the same (default: the spec's "
                             "runtime.speculate, off)")(command)


def with_runtime(loaded, **settings):
    """The spec with the runtime settings given on the command line (--speculate, --groups) as its runtime's; those
    not given (None) stay the spec's."""
    import attrs

    if given := {key: value for key, value in settings.items() if value is not None}:
        runtime = attrs.evolve(loaded.runtime, **given)
        if misfit := runtime.drafting_misfit(loaded.model.config):
            raise click.UsageError(f"--speculate {misfit}")
        return attrs.evolve(loaded, runtime=runtime)
    return loaded


def emulate_links_option(command):
    """--emulate-links, for the commands that run local nodes."""
    return click.option("--emulate-links", is_flag=True,
                        help="local nodes: each in a network namespace of its own, its link to the next shaped to "
                             "the spec's bandwidth (Linux, root; latency is not emulated)")(command)


def workload_overrides(loaded, choices: dict):
    """The spec's workload with the command line's `choices` (`workload_options`), which must fit the spec's runtime
    as the spec's own workload must."""
    import attrs

    from cascadia.workload import misfits, override

    if choices["concurrency"] is not None and choices["rate"] is not None:
        raise click.UsageError("give --concurrency (closed loop) or --rate (open loop), not both")
    workload = override(loaded.workload, choices["concurrency"], choices["requests"], choices["max_new_tokens"],
                        choices["prompt_tokens"], choices["rate"], choices["slo"])
    prompts = choices["prompts"]
    workload = attrs.evolve(workload, prompts_file=prompts) if prompts else workload
    if problems := misfits(workload, loaded.runtime):
        raise click.UsageError("; ".join(message for _, message in problems))
    return workload


def chosen_plan(loaded, plan_path: str | None):
    """The saved plan, or the planner's."""
    from cascadia.graph.planner import InfeasiblePlan, load_plan
    from cascadia.graph.planner import plan as make_plan

    try:
        return load_plan(plan_path, loaded) if plan_path else make_plan(loaded)
    except InfeasiblePlan as e:
        raise InfeasiblePlan(f"{loaded.source}: no plan fits. {e}") from None
