"""What `cascadia fleet` prints of the announcements it found: a table, or JSON."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from cascadia import __version__
from cascadia.fleet.announce import Announcement, Unreadable
from cascadia.pipeline.wire import VERSION as PROTOCOL
from cascadia.table import format_rows
from cascadia.units import format_bytes, format_flops, format_rate

HEADER = ("node", "address", "state", "device", "cores", "memory free", "memory read", "compute", "disk read",
          "version", "key")


def version_note(announcement: Announcement) -> str:
    """Its version, and why this build cannot work with it where it speaks another protocol."""
    if announcement.compatible:
        return announcement.version
    return f"{announcement.version} (protocol {announcement.protocol}; this {__version__} speaks {PROTOCOL})"


def fleet_table(found: Sequence[Announcement], unreadable: Sequence[Unreadable]) -> str:
    if not found and not unreadable:
        return "no Cascadia node answered"
    rows = [HEADER]
    for a in found:
        p = a.profile
        rows.append((a.name, a.address.removeprefix("tcp://") or "-", a.state, f"{p.device} {p.precision}",
                     str(p.cores), format_bytes(p.memory_bytes, digits=3), format_rate(p.memory_bandwidth, digits=3),
                     format_flops(p.compute_flops, digits=3),
                     format_rate(p.disk_bandwidth, digits=3) if p.disk_bandwidth else "-", version_note(a),
                     a.key or "-"))
    lines = [format_rows(rows, left=(0, 1, 2, 3, 9, 10))] if found else []
    lines += [f"{u.service}: cannot read its announcement: {u.reason}" for u in unreadable]
    return "\n".join(lines)


def fleet_json(found: Sequence[Announcement], unreadable: Sequence[Unreadable]) -> dict:
    return {"nodes": [{**attrs.asdict(a, recurse=False), "profile": attrs.asdict(a.profile),
                       "compatible": a.compatible} for a in found],
            "unreadable": [attrs.asdict(u) for u in unreadable]}
