"""A `cascadia serve` that cannot start says why in one line on standard error and exits 1, leaving no node behind:
its HTTP port taken, or a pipeline that cannot start (the line `cascadia run` prints for the same spec)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serving import START_S, processes_naming

from cascadia.pipeline.transport import free_port

SPECS = Path(__file__).parent.parent / "specs"

pytestmark = pytest.mark.slow


def spec_reading(tmp_path: Path, checkpoint: Path) -> Path:
    """specs/tiny-local.yaml with its checkpoint at `checkpoint`."""
    text = (SPECS / "tiny-local.yaml").read_text()
    text = text.replace("hf_config: tiny/config.json", f"hf_config: {SPECS / 'tiny' / 'config.json'}")
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace("checkpoint: tiny-checkpoint", f"checkpoint: {checkpoint}"))
    return path


def cascadia(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`cascadia ARGS` to its end (START_S bounds a hang, it times nothing), then no process of it may be left."""
    temporary = tmp_path / f"tmp-{args[0]}"
    temporary.mkdir()
    result = subprocess.run([sys.executable, "-m", "cascadia", *args], env=os.environ | {"TMPDIR": str(temporary)},
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_S)
    assert processes_naming(str(temporary)) == [] and list(temporary.iterdir()) == []
    return result


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.splitlines()[-1] if result.stderr else ""


@pytest.mark.parametrize("case", ["checkpoint missing", "checkpoint truncated", "control port taken"])
def test_a_pipeline_that_cannot_start_ends_serve_with_runs_error(tmp_path, checkpoint, case):
    options, taken = [], None
    if case == "checkpoint missing":
        spec = spec_reading(tmp_path, tmp_path / "not-there")
    elif case == "checkpoint truncated":
        broken = tmp_path / "broken"
        broken.mkdir()
        for part in checkpoint.iterdir():
            (broken / part.name).write_bytes(part.read_bytes())
        os.truncate(broken / "model.safetensors", 5000)
        spec = spec_reading(tmp_path, broken)
    else:
        spec = spec_reading(tmp_path, checkpoint)
        taken = socket.create_server(("127.0.0.1", free_port()))
        options = ["--control", f"tcp://127.0.0.1:{taken.getsockname()[1]}", "--tokens",
                   f"tcp://127.0.0.1:{free_port()}"]
    try:
        run = cascadia(tmp_path, "run", str(spec), *options)
        served = cascadia(tmp_path, "serve", str(spec), "--port", str(free_port()), *options)
    finally:
        if taken is not None:
            taken.close()
    assert run.returncode == served.returncode == 1, served.stderr
    assert last_line(run).startswith("Error: ")
    if case == "checkpoint truncated":  # whichever node reads it first says so
        same = re.compile(rf"Error: node\d: CheckpointError: {broken}/model.safetensors: not a readable safetensors")
        assert same.match(last_line(run)) and same.match(last_line(served)), served.stderr
    else:
        assert last_line(served) == last_line(run), served.stderr
    assert "Traceback" not in served.stderr


def test_a_taken_http_port_is_one_line_before_any_node_starts(tmp_path, checkpoint):
    with socket.create_server(("127.0.0.1", free_port())) as taken:
        port = taken.getsockname()[1]
        served = cascadia(tmp_path, "serve", str(spec_reading(tmp_path, checkpoint)), "--port", str(port))
    assert served.returncode == 1
    assert served.stderr == f"Error: cannot listen on http://127.0.0.1:{port}: address already in use\n"
