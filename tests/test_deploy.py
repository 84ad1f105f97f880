"""The systemd units that keep a node up on each PC (one with the fleet's spec and plan, one standing by to be
found): systemd's own checker accepts each, and its command line is one `cascadia node` takes."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cascadia.cli.pipeline import node

UNITS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "systemd").glob("*.service"))
INSTALLED = "/opt/cascadia/.venv/bin/cascadia"


def test_both_units_ship():
    assert [unit.name for unit in UNITS] == ["cascadia-node@.service", "cascadia-standby@.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_systemd_analyze_verifies_the_unit(tmp_path, unit):
    beside = Path(sys.executable).parent / "cascadia"  # where pip put the command, whatever PATH says
    cascadia = str(beside) if beside.exists() else shutil.which("cascadia")
    assert cascadia, "the cascadia command is installed with the package"
    instance = tmp_path / unit.name.replace("@", "@pc0")  # a template is verified as one of its instances
    instance.write_text(unit.read_text().replace(INSTALLED, cascadia))
    done = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("unit, mode", list(zip(UNITS, ["--keep-serving", "--standby --announce"])),
                         ids=lambda value: getattr(value, "name", value))
def test_the_units_options_are_cascadia_nodes(unit, mode):
    text = unit.read_text()
    command = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert command.startswith(f"ExecStart={INSTALLED} node ") and mode in command
    accepted = {option for param in node.params for option in param.opts}
    suggested = next(line for line in text.splitlines() if "CASCADIA_NODE_OPTIONS=" in line)
    used = set(re.findall(r"--[a-z-]+", command + suggested))  # the command's and those the comment suggests
    assert used and used <= accepted, used - accepted
