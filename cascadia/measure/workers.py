"""The measuring processes of calibration: a Python process running one function of a `cascadia.measure` module,
which reports in JSON lines on its standard output (anything else there is some library talking)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from cascadia.errors import CalibrationError


class CalibrationFailed(CalibrationError):
    """A measurement could not be made; the text says which and why."""


def say(**message) -> None:
    """A measuring process's report to its parent: one JSON line."""
    print(json.dumps(message), flush=True)


class Worker:
    """A Python process running `module.function(args)`, which reports with `say`."""

    def __init__(self, module: str, function: str, args: Sequence[str], env: dict[str, str], log: Path) -> None:
        code = f"import sys; from {module} import {function}; {function}(sys.argv[1:])"
        self.log = log
        with log.open("w") as errors:
            self.process = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=errors, text=True, env=env)

    def messages(self) -> Iterator[dict]:
        """Its lines until it ends; one that fails without saying why is an error quoting its stderr."""
        for line in self.process.stdout:
            if line.startswith("{"):
                yield json.loads(line)
        if self.process.wait() != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise CalibrationFailed(f"a measuring process exited with status {self.process.returncode}: "
                                    + " / ".join(tail))

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()
