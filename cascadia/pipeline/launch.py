"""Node processes on this machine for the plan's `local` nodes: `python -m cascadia node ...`, one per stage.

Each gets a free port on 127.0.0.1 (or, with emulated links, a network namespace of its own), its thread count
(for OpenVINO and OpenMP), and this process's pid, so it stops by itself if we die. They share this machine's memory,
so what they will allocate together is checked against it first (`check_host_memory`). Each node's own session keeps
a Ctrl-C in the terminal for us alone: we then shut the nodes down in order. Its output goes to a log file whose last
lines come with any error about it. `stop` asks nothing: the coordinator sends SHUTDOWN first; `stop` waits for the
processes to end and kills any left, so no node outlives the run (and removes the emulated links).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from cascadia.graph.plan import Plan
from cascadia.host_cpus import format_cpus
from cascadia.host_memory import shortfall
from cascadia.pipeline.coordinator import PipelineError
from cascadia.pipeline.emulated_links import EmulatedLinks
from cascadia.pipeline.places import NodePlace, loopback_places
from cascadia.spec.types import Spec
from cascadia.units import format_bytes

LOG_TAIL_LINES = 12


@attrs.frozen
class NodeCommand:
    """What every local node of a run shares."""

    spec_path: Path
    plan_path: Path
    checkpoint: Path
    with_logits: bool = False


def node_arguments(command: NodeCommand, name: str, place: NodePlace, successor: str | None, threads: int | None,
                   cpus: Sequence[int]) -> list[str]:
    """The command line that starts one node (its place's prefix, then `cascadia node ...`) on `cpus`; a spare
    has no successor."""
    args = [*place.prefix, sys.executable, "-m", "cascadia", "node", "--spec", str(command.spec_path), "--plan",
            str(command.plan_path), "--name", name, "--listen", place.listen, "--control", place.control,
            "--checkpoint", str(command.checkpoint), "--parent-pid", str(os.getpid()), "--cpus", format_cpus(cpus)]
    if successor is not None:
        args += ["--successor", successor]
    if threads is not None:
        args += ["--threads", str(threads)]
    if command.with_logits:
        args.append("--logits")
    return args


class LocalNodes:
    """The node processes of one run, in stage order then the spares, and the emulated links they run on, if any."""

    def __init__(self, names: Sequence[str], places: Sequence[NodePlace], logs: Sequence[Path],
                 links: EmulatedLinks | None):
        self.names, self.places, self.logs, self.links = list(names), list(places), list(logs), links
        self.processes: list[subprocess.Popen] = []
        self._commands: list[tuple[list[str], dict[str, str]]] = []  # each node's command line and environment
        self.restarts = 0

    @classmethod
    def start(cls, command: NodeCommand, names: Sequence[str], threads: Sequence[int | None],
              cpus: Sequence[Sequence[int]], log_dir: Path, control: str, tokens: str,
              link_rates: Sequence[float] | None = None, spares: int = 0) -> LocalNodes:
        """Start one node per name (stage order, then the last `spares` names: spares, which hold no stage), with
        its thread count and CPUs, reaching the coordinator at `control` and `tokens`: on 127.0.0.1,
        or with `link_rates` (bytes/s from each stage to the next) in network namespaces joined by links shaped to
        them (`cascadia.pipeline.emulated_links`; the coordinator must then bind every interface)."""
        links = None if link_rates is None else EmulatedLinks(link_rates, _port(control), _port(tokens))
        places = links.places if links else loopback_places(len(names), control, tokens)
        stages = len(names) - spares
        successors = [place.address for place in places[1:stages]] + [places[stages - 1].tokens] + [None] * spares
        nodes = cls(names, places, [log_dir / f"{name}.log" for name in names], links)
        try:
            for name, place, successor, count, ids in zip(names, places, successors, threads, cpus):
                nodes._commands.append((node_arguments(command, name, place, successor, count, ids),
                                        thread_env(count)))
                nodes.processes.append(nodes._spawn(len(nodes.processes), "w"))
        except BaseException:
            nodes.stop(timeout_s=0)
            raise
        return nodes

    def _spawn(self, index: int, log_mode: str, extra: Sequence[str] = ()) -> subprocess.Popen:
        args, env = self._commands[index]
        with self.logs[index].open(log_mode) as out:
            return subprocess.Popen([*args, *extra], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def restart(self, name: str, standby: bool = False) -> None:
        """Start node `name` again as it was started, or holding no stage (`standby`: another took its stage); its
        old process is killed first, if still there (a frozen node is as lost as a dead one); its log goes on in the
        same file."""
        index = self.names.index(name)
        self.kill(name)
        with self.logs[index].open("a") as out:
            out.write(f"\n--- {name} started again after its loss{', standing by' if standby else ''} ---\n")
        self.processes[index] = self._spawn(index, "a", ["--standby"] if standby else [])
        self.restarts += 1

    def kill(self, name: str) -> None:
        """End node `name`'s process, if it still runs (a lost node may only be frozen)."""
        process = self.processes[self.names.index(name)]
        if process.poll() is None:
            process.kill()
            process.wait()

    @property
    def addresses(self) -> dict[str, str]:
        """Where each node is reached."""
        return {name: place.address for name, place in zip(self.names, self.places)}

    def ended(self) -> list[tuple[str, str]]:
        """Each node whose process has ended (and is reaped by this look), with how: its exit and its log's end."""
        out = []
        for name, process, log in zip(self.names, self.processes, self.logs):
            if (status := process.poll()) is not None:
                how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
                out.append((name, f"the node process {how}{_tail(log)}"))
        return out

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every process to end (after SHUTDOWN), then kill the rest; remove the
        emulated links."""
        deadline = time.monotonic() + timeout_s
        try:
            for process in self.processes:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            if self.links is not None:
                self.links.close()


def check_host_memory(spec: Spec, plan: Plan) -> None:
    """Local nodes share this machine: what their stages allocate together (weights, every slot's own state and the
    K/V pool, as the plan counts them) must fit in its available memory, or they would start, serve, and be killed
    by the kernel once their streams filled the pools (the state's pages are only taken when written)."""
    needs = {stage.node: stage.allocated_bytes for stage in plan.stages}
    if short := shortfall(sum(needs.values())):
        each = ", ".join(f"{node} {format_bytes(need, digits=3)}" for node, need in needs.items())
        raise PipelineError(f"the plan's {len(needs)} local nodes need {format_bytes(sum(needs.values()), digits=3)} "
                            f"together ({each}: weights, {spec.runtime.max_streams} streams' slots and the K/V "
                            f"pools) {short}")


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment of a node: with a thread count, OpenMP keeps to it as OpenVINO does, so that nodes sharing a
    machine do not each start a thread per core (numpy's BLAS keeps to one thread: see `cascadia/__init__.py`)."""
    if threads is None:
        return dict(os.environ)
    return os.environ | {"OMP_NUM_THREADS": str(threads)}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "; its log ends:\n  " + "\n  ".join(lines) if lines else ""
