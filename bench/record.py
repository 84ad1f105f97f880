"""What every bench keeps of a run: its tables as JSON in bench/results/, with the command, the machine and the spread.

A bench builds `Table`s as it measures, prints each (`Table.text`) and ends with `write(...)`: one file
bench/results/NAME.json holding the command as typed, the machine (CPU and its instruction sets, cores, memory,
OpenVINO's version), when it started and ended, the tables, and whatever raw figures the bench keeps beside them.
`bench/render.py` turns those files into the documentation's tables, with the same cell formats as the console's.
A cell is text, a number, None (not measured) or a spread {"median", "min", "max", "n"} of repeated measurements.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from attrs import define, field

from cascadia.host_cpus import available, describe, identity
from cascadia.table import format_rows

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def spread(values: Iterable[float]) -> dict:
    """The median of repeated measurements and their range."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def figure(value: float) -> str:
    """A measured number to about three significant figures (two below 0.1)."""
    if isinstance(value, int):
        return f"{value:,}"
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 0.1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.2g}"


def cell(value) -> str:
    """A table cell as text: a spread as "median (min-max)", None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        between = " to " if value["min"] < 0 else "-"  # "-5.9-11.7" would read as a subtraction
        return f"{figure(value['median'])} ({figure(value['min'])}{between}{figure(value['max'])})"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    return figure(value)


@define
class Table:
    """One table of a bench: the first column names the row, the others hold its figures."""

    title: str
    columns: list[str]
    rows: list[list] = field(factory=list)
    note: str = ""

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: a row of {len(cells)} cells under {len(self.columns)} columns")
        self.rows.append(list(cells))

    def text(self) -> str:
        """The table as the console shows it."""
        lines = format_rows([self.columns, *([cell(c) for c in row] for row in self.rows)], left={0})
        return f"{self.title}\n{lines}" + (f"\n{self.note}" if self.note else "")

    def as_json(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "note": self.note}


def machine() -> dict:
    """The machine a bench ran on, as its results name it."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": describe(identity()), "cores": len(available()), "memory_gib": round(memory, 1),
            "openvino": version("openvino"), "cascadia": version("cascadia"), "python": platform.python_version()}


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def shown(path: Path) -> str:
    """A path as a reader finds it: from the repository's root where it is inside."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def command() -> str:
    """This process's command line as typed from the repository's root."""
    return " ".join(["python", shown(Path(sys.argv[0])), *sys.argv[1:]])


def write(name: str, title: str, started: str, tables: list[Table], out: Path | None = None, quick: bool = False,
          **details) -> Path | None:
    """bench/results/NAME.json (or `out`): the run's tables and `details` beside the command and the machine. A
    `quick` run (a smaller model, to check the bench) is written only to an `out` given."""
    if quick and out is None:
        print("a --quick run is not kept in bench/results/ (--out FILE writes it)")
        return None
    out = out or RESULTS / f"{name}.json"
    document = {"bench": name, "title": title, "command": command(), "machine": machine(), "started": started,
                "finished": now(), "tables": [t.as_json() for t in tables], **details}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {out}")
    return out


def calibrate(spec: str | Path, folder: Path, *options: str) -> Path:
    """A calibration of `spec` measured now by `cascadia calibrate [options]`, as a user measures one, into
    `folder`: for the benches that set the simulator's prediction beside what they measure."""
    out = Path(folder) / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "cascadia", "calibrate", str(spec), "--rounds", "3", *options, "-o",
                           str(out)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cascadia calibrate failed with status {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return out
