"""Read a spec file into a tree of `Node`s that keep the file and line of every value, with the files its `include:`
names merged in first, in order (this file's keys win; paths are relative to the file that names them).

The YAML is read with `yaml.SafeLoader`, constructing nothing beyond plain scalars, within guards on file size, values,
depth and include nesting (only regular files are read: `cascadia.files`); an unreadable file, a bad include or a
cycle is recorded as a `Problem`, never raised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import yaml

from cascadia.files import UnreadableFile, read_text
from cascadia.spec.problems import Problem, shown

# Guards against inputs that are valid YAML but would take forever: alias bombs, self-referencing anchors,
# include chains.
_MAX_VALUES = 100_000
_MAX_DEPTH = 64
_MAX_INCLUDE_DEPTH = 32
# The paper's whole deployment takes under 2 KiB; PyYAML read a 1 MiB spec in 5.6 s on this project's VM (AMD EPYC,
# Zen 4), so a file of the limit is read in seconds, and one named by mistake is refused before it is read.
MAX_SPEC_FILE_BYTES = 1024**2


@attrs.frozen
class Node:
    """A YAML value and where it was written. Mappings hold `dict[str, Node]`, sequences `list[Node]`."""

    value: Any
    file: Path
    line: int  # of the key, for mapping values: the line a reader looks for

    def plain(self) -> Any:
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


class _Unreadable(Exception):
    """A YAML file that cannot be turned into a node tree; the message says why."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


class _Composer:
    """Turns PyYAML's node graph into `Node`s, constructing scalars only, within the size and depth guards."""

    def __init__(self, loader: yaml.SafeLoader, file: Path, problems: list[Problem]):
        self.loader, self.file, self.problems = loader, file, problems
        self.budget = _MAX_VALUES

    def convert(self, node: yaml.Node, line: int, path: str = "", depth: int = 0) -> Node:
        self.budget -= 1
        if self.budget < 0:
            raise _Unreadable(f"more than {_MAX_VALUES} values: far more than a spec holds (aliases expanding "
                              "without end?)")
        if depth > _MAX_DEPTH:
            raise _Unreadable(f"nested deeper than {_MAX_DEPTH} levels (a self-referencing alias?)", line)
        if isinstance(node, yaml.MappingNode):
            self._expect_tag(node, "map")
            return Node(self._mapping(node, path, depth), self.file, line)
        if isinstance(node, yaml.SequenceNode):
            self._expect_tag(node, "seq")
            items = [self.convert(item, item.start_mark.line + 1, f"{path}[{i}]", depth + 1)
                     for i, item in enumerate(node.value)]
            return Node(items, self.file, line)
        try:
            return Node(self.loader.construct_object(node), self.file, line)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:  # e.g. `!!int x`, `!!python/name:os`
            raise _Unreadable(f"cannot read value {node.value!r} tagged {node.tag}: {e}", line) from None

    def _expect_tag(self, node: yaml.Node, kind: str) -> None:
        if node.tag != f"tag:yaml.org,2002:{kind}":
            raise _Unreadable(f"unsupported YAML tag {node.tag}", node.start_mark.line + 1)

    def _mapping(self, node: yaml.MappingNode, path: str, depth: int) -> dict[str, Node]:
        out: dict[str, Node] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Unreadable("YAML merge keys (<<) are not supported: use include: or a node's count:", line)
            key = self.convert(key_node, line, path, depth + 1).plain()
            if not isinstance(key, str):
                self.problems.append(Problem(self.file, line, path, f"keys must be text, got {shown(key)}"))
                continue
            key_path = f"{path}.{key}" if path else key
            if key in out:
                first = f"duplicate key (first on line {out[key].line})"
                self.problems.append(Problem(self.file, line, key_path, first))
            out[key] = self.convert(value_node, line, key_path, depth + 1)
        return out


def _compose(path: Path, problems: list[Problem], text: str | None = None) -> Node:
    try:
        text = read_text(path, MAX_SPEC_FILE_BYTES, "a spec file") if text is None else text
    except UnreadableFile as e:
        raise _Unreadable(str(e)) from None
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        root = loader.get_single_node()
        if root is None:
            raise _Unreadable("the file is empty")
        return _Composer(loader, path, problems).convert(root, root.start_mark.line + 1)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise _Unreadable(f"not valid YAML: {e.problem or e.context}", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as e:  # e.g. a control character: its message has no line, and a second line we drop
        raise _Unreadable(f"not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise _Unreadable("not readable: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _merge(base: Node, over: Node) -> Node:
    """Deep merge of mappings; anything else (lists included) is replaced by `over`."""
    if not (isinstance(base.value, dict) and isinstance(over.value, dict)):
        return over
    merged = dict(base.value)
    for key, value in over.value.items():
        merged[key] = _merge(merged[key], value) if key in merged else value
    return Node(merged, over.file, over.line)


def read_document(path: Path, problems: list[Problem], chain: tuple[str, ...] = (),
                   cited_at: Node | None = None, text: str | None = None) -> Node | None:
    """The file's mapping with its includes merged in; None (with a problem recorded) when it cannot be read.
    `text`: the file's contents, read as if from `path` (a spec not yet written there)."""
    try:
        root = _compose(path, problems, text)
    except _Unreadable as e:
        if cited_at is None:
            problems.append(Problem(path, e.line, "", str(e)))
        else:
            problems.append(Problem(cited_at.file, cited_at.line, "include", f"{path}: {e}"))
        return None
    if not isinstance(root.value, dict):
        problems.append(Problem(path, root.line, "", "a spec is a mapping of sections (model, cluster, ...)"))
        return None
    chain = (*chain, os.path.realpath(path))
    merged = None
    for entry in _include_entries(root.value.get("include"), problems):
        target = Path(os.path.normpath(path.parent / entry.value))
        if os.path.realpath(target) in chain:
            cycle = " -> ".join(os.path.relpath(p) for p in (*chain, os.path.realpath(target)))
            problems.append(Problem(entry.file, entry.line, "include", f"include cycle: {cycle}"))
            continue
        if len(chain) >= _MAX_INCLUDE_DEPTH:
            problems.append(Problem(entry.file, entry.line, "include", f"includes nest deeper than {len(chain)} files"))
            continue
        included = read_document(target, problems, chain, cited_at=entry)
        if included is not None:
            merged = included if merged is None else _merge(merged, included)
    own = Node({k: v for k, v in root.value.items() if k != "include"}, root.file, root.line)
    return own if merged is None else _merge(merged, own)


def _include_entries(node: Node | None, problems: list[Problem]) -> list[Node]:
    if node is None or node.value is None:
        return []
    good = []
    for entry in node.value if isinstance(node.value, list) else [node]:
        if isinstance(entry.value, str) and entry.value.strip() and "\0" not in entry.value:
            good.append(entry)
        else:
            message = f"expected a file path, got {shown(entry.plain())}"
            problems.append(Problem(entry.file, entry.line, "include", message))
    return good
