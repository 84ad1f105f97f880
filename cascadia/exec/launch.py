"""Node processes on this machine for the plan's `local` nodes: `python -m cascadia node ...`, one per stage.

Each gets a free port on 127.0.0.1, its thread count (for OpenVINO and OpenMP), and this process's pid, so it
stops by itself if we die. Its own session keeps a Ctrl-C in the terminal for us alone: we then shut the nodes down
in order. Its output goes to a log file whose last lines come with any error about it. `stop` asks nothing: the
coordinator sends SHUTDOWN first; `stop` waits for the processes to end and kills any left, so no node outlives the
run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from cascadia.exec.coordinator import PipelineError
from cascadia.exec.sampling import Sampling
from cascadia.exec.transport import free_port, tcp_address

LOCALHOST = "127.0.0.1"
LOG_TAIL_LINES = 12


@attrs.frozen
class NodeCommand:
    """What every local node of a run shares."""

    spec_path: Path
    plan_path: Path
    control: str
    tokens: str  # the coordinator's token socket: the last node's successor
    checkpoint: Path
    sampling: Sampling
    with_logits: bool = False


def node_arguments(command: NodeCommand, name: str, listen: str, successor: str, threads: int | None) -> list[str]:
    """The `cascadia node` command line of one node."""
    s = command.sampling
    args = [sys.executable, "-m", "cascadia", "node", "--spec", str(command.spec_path), "--plan",
            str(command.plan_path), "--name", name, "--listen", listen, "--successor", successor, "--control",
            command.control, "--checkpoint", str(command.checkpoint), "--parent-pid", str(os.getpid())]
    args += ["--greedy"] if s.greedy else ["--temperature", repr(s.temperature), "--top-p", repr(s.top_p)]
    args += ["--seed", str(s.seed)]
    if threads is not None:
        args += ["--threads", str(threads)]
    if command.with_logits:
        args.append("--logits")
    return args


class LocalNodes:
    """The node processes of one run, in stage order."""

    def __init__(self, names: Sequence[str], listens: Sequence[str], processes: Sequence[subprocess.Popen],
                 logs: Sequence[Path]):
        self.names, self.listens = list(names), list(listens)
        self.processes, self.logs = list(processes), list(logs)

    @classmethod
    def start(cls, command: NodeCommand, names: Sequence[str], threads: Sequence[int | None],
              log_dir: Path) -> LocalNodes:
        """Start one node per name (stage order), each on a free local port."""
        listens = [tcp_address(LOCALHOST, free_port()) for _ in names]
        successors = listens[1:] + [command.tokens]
        nodes = cls(names, listens, [], [log_dir / f"{name}.log" for name in names])
        try:
            for name, listen, successor, count, log in zip(names, listens, successors, threads, nodes.logs):
                with log.open("w") as out:
                    nodes.processes.append(subprocess.Popen(
                        node_arguments(command, name, listen, successor, count), env=thread_env(count),
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        except BaseException:
            nodes.stop(timeout_s=0)
            raise
        return nodes

    def check(self) -> None:
        """Raise PipelineError naming the first node process that has exited."""
        for name, process, log in zip(self.names, self.processes, self.logs):
            if (status := process.poll()) is not None:
                how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
                raise PipelineError(f"{name}: the node process {how}{_tail(log)}")

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every process to end (after SHUTDOWN), then kill the rest."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment of a node: with a thread count, OpenMP keeps to it as OpenVINO does, so that nodes sharing a
    machine do not each start a thread per core (numpy's BLAS keeps to one thread: see `cascadia/__init__.py`)."""
    if threads is None:
        return dict(os.environ)
    return os.environ | {"OMP_NUM_THREADS": str(threads)}


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "; its log ends:\n  " + "\n  ".join(lines) if lines else ""
