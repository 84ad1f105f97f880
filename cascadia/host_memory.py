"""How much memory this machine can still give a process, for the checks made before anything large is allocated.

The K/V and convolution state is allocated lazily (the pages of a zeroed array are only taken when written), so a
node whose state does not fit starts, serves, and is killed by the kernel once its contexts fill. Comparing what it
will need with what is available, before it loads, turns that into an error with numbers.

The figure is Linux's `MemAvailable` (/proc/meminfo: free memory plus what the kernel can reclaim at once), capped by
the memory limit of this process's control group when one is set (a container's); elsewhere it is unknown and the
checks are skipped.
"""

from __future__ import annotations

from pathlib import Path

from cascadia.units import format_bytes

MEMINFO = Path("/proc/meminfo")
# cgroup v2's limit, then v1's, as a container sees its own group
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def available_bytes() -> tuple[int, str] | None:
    """The bytes this machine can still give, and where that figure comes from; None where it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    for limit_file in CGROUP_LIMITS:
        try:
            limit = int(limit_file.read_text().strip())  # "max" (no limit) fails here
        except (OSError, ValueError):
            continue
        if limit < available:
            return limit, f"the memory limit of this control group ({limit_file})"
    return available, "MemAvailable in /proc/meminfo"


def shortfall(need: int) -> str | None:
    """Why `need` bytes do not fit in this machine's available memory ("... but this machine has X available"), or
    None when they fit or the figure is unknown."""
    have = available_bytes()
    if have is None or need <= have[0]:
        return None
    return f"but this machine has {format_bytes(have[0], digits=3)} available ({have[1]})"
