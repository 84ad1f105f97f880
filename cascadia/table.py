"""Aligned plain-text tables, as the commands and the benches print them."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def format_rows(rows: Sequence[Sequence[str]], left: Collection[int] = ()) -> str:
    """`rows` (the header first) as lines of cells two spaces apart, each column as wide as its widest cell: the
    columns numbered in `left` aligned left (names), the others right (numbers). No line ends in spaces."""
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "\n".join("  ".join(cell.ljust(width) if i in left else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows)
