"""`python -m cascadia`: the command line, as `cascadia` (how `cascadia run` starts its node processes)."""

from cascadia.cli import main

main()
