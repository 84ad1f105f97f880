"""What is wrong with a spec, and where: `Problem` records one, `SpecError` carries them all to the caller."""

from __future__ import annotations

from pathlib import Path

import attrs

from cascadia.errors import SpecError, shown

__all__ = ["Problem", "SpecError", "shown"]


@attrs.frozen
class Problem:
    file: Path | None
    line: int | None  # 1-based
    key: str  # dotted path, e.g. "cluster.nodes[3].memory"; "" for the whole file
    message: str

    def __str__(self) -> str:
        where = ":".join(str(part) for part in (self.file, self.line) if part is not None)
        return ": ".join(part for part in (where, self.key, self.message) if part)
