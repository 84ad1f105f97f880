"""Reading the files a user names: regular files only, up to a size each reader states.

A FIFO would block a read for ever, a device (/dev/zero, /dev/urandom) never ends, and a multi-gigabyte file named by
mistake would fill memory before any check could refuse it: all are refused here from the file's metadata, before a
byte is read. The messages say what is wrong without the path, which each reader puts in front with its own error
type.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from cascadia.units import format_bytes


class UnreadableFile(ValueError):
    """A file that cannot be read as asked; the message says why (without the path)."""


def regular_file_size(path: str | Path) -> int:
    """The size of regular file `path`; UnreadableFile for anything else (a folder, a device, a FIFO)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise UnreadableFile("no such file") from None
    except (OSError, ValueError) as e:  # permissions, a name too long or with a NUL byte
        raise UnreadableFile(f"cannot read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UnreadableFile("is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise UnreadableFile("is not a regular file (a device, FIFO or socket cannot be read as one)")
    return info.st_size


def read_bytes(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of regular file `path`, refused when larger than `limit` (`what` names the kind of file for the
    message, e.g. "a spec file")."""
    size = regular_file_size(path)
    too_large = f"holds more than the {format_bytes(limit)} {what} may hold"
    if size > limit:
        raise UnreadableFile(f"{format_bytes(size, digits=3)}: {too_large}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # the file may have grown since
    except OSError as e:
        raise UnreadableFile(f"cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise UnreadableFile(too_large)
    return data


def read_text(path: str | Path, limit: int, what: str) -> str:
    """`read_bytes` as UTF-8 text."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json_lines(path: str | Path, limit: int, what: str) -> list[Any]:
    """`read_text` parsed as JSON Lines (blank lines skipped); a bad line is named by its number."""
    values = []
    for number, line in enumerate(read_text(path, limit, what).splitlines(), 1):
        if line.strip():
            try:
                values.append(json.loads(line))
            except (ValueError, RecursionError) as e:
                raise UnreadableFile(f"line {number}: not valid JSON ({e})") from None
    return values


def read_json(path: str | Path, limit: int, what: str) -> Any:
    """`read_text` parsed as JSON."""
    text = read_text(path, limit, what)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; RecursionError: nested too deeply
        raise UnreadableFile(f"not valid JSON ({e})") from None
