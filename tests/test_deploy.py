"""The systemd unit that keeps a node up on each PC: systemd's own checker accepts it, and its command line is one
`cascadia node` takes."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cascadia.cli.pipeline import node

UNIT = Path(__file__).resolve().parent.parent / "deploy" / "systemd" / "cascadia-node@.service"
INSTALLED = "/opt/cascadia/.venv/bin/cascadia"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verifies_the_node_unit(tmp_path):
    beside = Path(sys.executable).parent / "cascadia"  # where pip put the command, whatever PATH says
    cascadia = str(beside) if beside.exists() else shutil.which("cascadia")
    assert cascadia, "the cascadia command is installed with the package"
    instance = tmp_path / "cascadia-node@pc0.service"  # a template is verified as one of its instances
    instance.write_text(UNIT.read_text().replace(INSTALLED, cascadia))
    done = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_units_options_are_cascadia_nodes():
    text = UNIT.read_text()
    command = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert command.startswith(f"ExecStart={INSTALLED} node ") and "--keep-serving" in command
    accepted = {option for param in node.params for option in param.opts}
    suggested = next(line for line in text.splitlines() if "CASCADIA_NODE_OPTIONS=" in line)
    used = set(re.findall(r"--[a-z-]+", command + suggested))  # the command's and those the comment suggests
    assert used and used <= accepted, used - accepted
