"""The documentation's command examples marked runnable (`<!-- runnable -->` on the line before the block) are run
as written, and what they print must have the shape the page shows: the same lines, with any number standing for
any number, and a line that starts with "..." standing for any lines (or none)."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- runnable -->\n```[a-z]*\n(.*?)```", re.DOTALL)


def examples() -> list[tuple[str, str, list[str]]]:
    """(where, command, the lines shown after it) for every command of every runnable block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in BLOCK.finditer(text):
            line = text[:block.start()].count("\n") + 3  # the block's first line, after the mark and the fence
            for chunk in re.split(r"^(?=\$ )", block[1], flags=re.MULTILINE):
                if chunk.startswith("$ "):
                    command, *shown = chunk.rstrip("\n").split("\n")
                    found.append((f"{page.relative_to(ROOT)}:{line}", command[2:], shown))
                line += chunk.count("\n")
    return found


def shape(line: str) -> str:
    """A line with its numbers (1,024; 4.28; 97%) as # and its runs of spaces as one."""
    return re.sub(r"\d[\d,.]*", "#", " ".join(line.split()))


def same_shape(shown: list[str], printed: list[str]) -> bool:
    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(shown):
            return j == len(printed)
        if shown[i].startswith("..."):
            return any(match(i + 1, k) for k in range(j, len(printed) + 1))
        return j < len(printed) and shape(shown[i]) == shape(printed[j]) and match(i + 1, j + 1)
    return match(0, 0)


EXAMPLES = examples()


def test_the_pages_mark_examples_to_run():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("where, command, shown", EXAMPLES, ids=[f"{w} {c.split()[1]}" for w, c, _ in EXAMPLES])
def test_a_runnable_example_prints_what_its_page_shows(tmp_path, where, command, shown):
    assert command.startswith("cascadia "), where
    (tmp_path / "specs").symlink_to(ROOT / "specs")  # the example's paths, and what it writes kept out of the tree
    done = subprocess.run(f"{sys.executable} -m {command}", shell=True, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr}"
    printed = done.stdout.rstrip("\n").split("\n")
    assert same_shape(shown, printed), f"{where}: {command} printed\n" + "\n".join(printed)


def test_shapes_stand_numbers_and_elisions_for_any():
    assert shape("pc0   0-5   35.00  49,166 x 64   97%") == shape("pc0 0-6 36.10 9 x 256 3%")
    assert same_shape(["a", "... (more)", "c"], ["a", "b1", "b2", "c"])
    assert same_shape(["a", "..."], ["a"]) and not same_shape(["a", "c"], ["a", "b", "c"])


def test_the_spec_guide_names_every_key_a_spec_may_hold():
    loader = (ROOT / "cascadia" / "spec" / "load.py").read_text()
    keys = set(re.findall(r'\.take\("([a-z_]+)"', loader)) | set(re.findall(r'\.get\("([a-z_]+)"', loader))
    guide = re.sub(r"```.*?```", "", (ROOT / "docs" / "specs.md").read_text(), flags=re.DOTALL)  # prose only
    named = {word for span in re.findall(r"`([^`]+)`", guide) for word in re.findall(r"[a-z_]+", span)}
    assert len(keys) > 40 and not keys - named, sorted(keys - named)
