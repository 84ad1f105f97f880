"""The errors a user can cause or fix. Each message names what is at fault and where (file, key, node, request);
the command line catches `CascadiaError` once, prints its message and exits with its `exit_status`.

    CascadiaError
    ├── SpecError         a spec, model config or command line that cannot describe a run (exit status 2)
    ├── CheckpointError   a checkpoint folder, weight file or tokenizer that cannot be read or does not fit
    ├── CalibrationError  a calibration file that cannot be used, or a measurement that could not be made
    ├── PlanError         no plan fits, or a saved plan does not fit its spec
    ├── NodeError         a node, device, link or the pipeline between them failed
    └── RequestError      a request, prompt or token ids that cannot be served

Anything else that escapes is a bug: the command line names it in one line and says how to see its traceback.
`Terminated` is no error: SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that both stop a command alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CascadiaError(Exception):
    exit_status = 1


class SpecError(CascadiaError):
    """One problem, or several (each shown on a line of its own, e.g. `FILE:LINE: key: message`)."""

    exit_status = 2

    def __init__(self, problems: str | Sequence[object]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(map(str, self.problems)))


class CheckpointError(CascadiaError):
    pass


class CalibrationError(CascadiaError):
    pass


class PlanError(CascadiaError):
    pass


class NodeError(CascadiaError):
    pass


class RequestError(CascadiaError):
    pass


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, systemd and container runtimes send), raised as Ctrl-C raises KeyboardInterrupt:
    whatever keeps results or cleans up on Ctrl-C does so on SIGTERM too. Its text says why the command stopped."""

    def __init__(self) -> None:
        super().__init__("terminated by SIGTERM")


def shown(value: Any) -> str:
    """`value` as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
