"""The `cascadia` command line: thin click commands over the Python API (argument handling and printing only), one
module per family of commands.

Errors: a `CascadiaError` (something the user can fix) is printed as one line, `Error: MESSAGE`, with its exit status
(2 for a bad spec, 1 otherwise); click's own usage errors exit 2. Anything else is a bug: one line naming it and how to
see the traceback (`cascadia --debug COMMAND ...` or CASCADIA_DEBUG=1), exit status 1.

SIGTERM is taken as Ctrl-C is (`cascadia.errors.Terminated`): a run stops, writes what finished and removes its
temporary files; any command then says why it stopped, with exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import click

from cascadia import __version__
from cascadia.cli import doctor, drafts, engine, fleet, pipeline, search, serving, simulator, specs
from cascadia.errors import CascadiaError, Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While a command runs, SIGTERM raises `Terminated` (once: a second SIGTERM would only cut short the stopping
    the first began). Signal handlers belong to the main thread; elsewhere SIGTERM keeps its default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Cli(click.Group):
    """The root group: every command's errors are handled here, once."""

    def invoke(self, ctx: click.Context):
        try:
            with _sigterm_as_interrupt():
                return super().invoke(ctx)
        except Terminated as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(1)
        except CascadiaError as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(e.exit_status)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:
            if ctx.obj or os.environ.get("CASCADIA_DEBUG") == "1":
                raise
            command = " ".join(filter(None, ["cascadia", ctx.invoked_subcommand]))
            click.echo(f"Error: unexpected {type(e).__name__} in `{command}`: {e} (this is a bug; for its traceback "
                       "run again with `cascadia --debug ...` or CASCADIA_DEBUG=1)", err=True)
            ctx.exit(1)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="cascadia")
@click.option("--debug", is_flag=True, help="show the traceback of an unexpected error")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""
    ctx.obj = debug


for command in (specs.spec, specs.graph, specs.plan, specs.init_model_command, specs.keys,
                engine.generate, engine.score, drafts.draft_eval,
                simulator.simulate, simulator.calibrate_command, simulator.validate_command, simulator.demo,
                search.search,
                pipeline.run_command, pipeline.node, fleet.fleet, doctor.doctor, serving.serve):
    cli.add_command(command)


def main() -> None:
    cli()
