"""This machine's CPUs: what they are, which a process may run on, and pinning a node or the coordinator to the ones
its spec names.

A node pinned to its own cores behaves like a machine of its own: its OpenVINO threads (one per CPU unless the spec
says otherwise) never wait for a neighbour's, and the kernel does not move them about. Pinning is by
`os.sched_setaffinity` before OpenVINO compiles anything (its thread pool reads the affinity it finds): for a node,
of each of its process's threads; for the coordinator, of its thread (Linux sets a thread's affinity, and a new
thread takes its creator's).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from cascadia.errors import SpecError

MAX_CPUS = 65_536  # CPU ids one range may name: a guard against "0-1000000000"
ONLINE = Path("/sys/devices/system/cpu/online")


def parse_cpus(value: object) -> tuple[int, ...]:
    """CPU ids, distinct, as `taskset` and /proc write them: `[0, 1]`, `"0-3"`, `"0,2-3"` or `2`; ValueError saying
    what is wrong."""
    shown = repr(value)[:80]
    ids: list[int] = []
    for part in value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]:
        low, _, high = part.partition("-") if isinstance(part, str) else (part, "", "")
        try:
            first, last = int(low), int(high or low)
        except (TypeError, ValueError):
            raise ValueError(f"expected CPU ids like [0, 1] or '0-3', got {shown}") from None
        if not isinstance(part, (int, str)) or isinstance(part, bool) or first < 0 or not 0 <= last - first < MAX_CPUS:
            raise ValueError(f"expected CPU ids like [0, 1] or '0-3', got {shown}")
        ids += range(first, last + 1)
    if not ids:
        raise ValueError("expected at least one CPU id")
    if len(set(ids)) != len(ids):
        raise ValueError(f"CPU ids repeat: {shown}")
    return tuple(ids)


def online() -> tuple[int, ...]:
    """The machine's CPUs that are online (all of `os.cpu_count()` where the kernel does not say)."""
    try:
        return tuple(sorted(parse_cpus(ONLINE.read_text().strip())))
    except (OSError, ValueError):
        return tuple(range(os.cpu_count() or 1))


# /proc/cpuinfo flags that decide which kernels OpenVINO runs, and what a calibration calls them.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16", "amx_tile": "AMX",
             "amx_bf16": "AMX BF16", "amx_int8": "AMX INT8"}
CPUINFO = Path("/proc/cpuinfo")


def identity() -> dict[str, object]:
    """This machine's CPU as a calibration records it: {"model": its name, family and model numbers, "isa": the
    instruction sets of ISA_FLAGS it has}; the model is "unknown" where /proc/cpuinfo does not say."""
    try:
        first = CPUINFO.read_text(errors="replace").split("\n\n", 1)[0]
    except OSError:
        first = ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    name = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    return {"model": name, "isa": [label for flag, label in ISA_FLAGS.items() if flag in flags]}


def describe(cpu: dict) -> str:
    """"AMD EPYC (family 25, model 17) with AVX2, AVX-512, AVX-512 BF16"."""
    return f"{cpu.get('model')} with {', '.join(cpu.get('isa') or ['none of ' + ', '.join(ISA_FLAGS.values())])}"


def available() -> tuple[int, ...]:
    """The CPUs this process may run on (the machine's, less any a container or cpuset keeps from it)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def format_cpus(cpus: Iterable[int]) -> str:
    """CPU ids as /proc and `taskset` write them: "0-3,6"."""
    ids, runs = sorted(cpus), []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def check(cpus: Iterable[int] | None, who: str) -> None:
    """SpecError naming `who` when it asks for CPUs this machine does not have (online)."""
    if cpus is None:
        return
    have = online()
    if missing := sorted(set(cpus) - set(have)):
        raise SpecError(f"{who}: cpus {format_cpus(missing)} are not on this machine, which has "
                        f"{format_cpus(have)}")


def pin(cpus: Iterable[int] | None, who: str, whole_process: bool = False) -> tuple[int, ...]:
    """Keep the calling thread, or with `whole_process` every thread of this process (those numpy and OpenVINO
    started on import too), and the threads they start later, to `cpus` (None: leave it be); the CPUs the calling
    thread may run on from now on."""
    if cpus is not None:
        check(cpus, who)
        threads = [int(task.name) for task in Path("/proc/self/task").iterdir()] if whole_process else [0]
        try:
            for thread in threads:
                os.sched_setaffinity(thread, set(cpus))
        except OSError as e:  # a container's cpuset, say
            raise SpecError(f"{who}: cannot run on cpus {format_cpus(cpus)} ({e.strerror})") from None
    return available()


def restore(cpus: Iterable[int]) -> None:
    """Let the calling thread run on `cpus` again, as `available()` gave them before it was pinned."""
    os.sched_setaffinity(0, set(cpus))
