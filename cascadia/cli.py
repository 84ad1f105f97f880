"""The `cascadia` command line: thin click commands over the Python API (argument handling and printing only)."""

from __future__ import annotations

import click

from cascadia import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="cascadia")
def cli() -> None:
    """Plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""


def main() -> None:
    cli()
