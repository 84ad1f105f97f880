"""The `cascadia` command line: thin click commands over the Python API (argument handling and printing only), one
module per family of commands."""

from __future__ import annotations

import click

from cascadia import __version__
from cascadia.cli import engine, pipeline, simulator, specs


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="cascadia")
def cli() -> None:
    """Plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""


for command in (specs.spec, specs.graph, specs.plan, specs.init_model_command, specs.keys,
                engine.generate, engine.score,
                simulator.simulate, simulator.calibrate_command, simulator.validate_command, simulator.demo,
                pipeline.run_command, pipeline.node):
    cli.add_command(command)


def main() -> None:
    cli()
