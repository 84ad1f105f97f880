"""A `cascadia serve` process for the tests: started on 127.0.0.1, ready when its /health says so, stopped with
SIGTERM; and how to tell which processes it started and whether they live."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from cascadia.pipeline.transport import free_port

START_S = 120  # loading three nodes on a busy 2-core machine


class Served:
    """A `cascadia serve` process on 127.0.0.1, up and ready."""

    def __init__(self, tmp_path: Path, spec: Path, checkpoint: Path, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"serve-{self.port}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "cascadia", "serve", str(spec), "--checkpoint",
                                             str(checkpoint), "--port", str(self.port), *options],
                                            stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"not ready within {START_S} s: {self.log.read_text()[-3000:]}")

    def children(self) -> set[int]:
        return {int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                if parent_pid(stat) == self.process.pid}

    def stop(self) -> int:
        """SIGTERM, as systemd or a container would send: the server's exit status."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def scored_log_softmax(engine, prompt_ids, output_ids) -> np.ndarray:
    """What `cascadia score` gives a prompt and its reply: the log-softmax (float64) of the f32 logits, teacher-forced
    as serving feeds them (the prompt prefilled, the reply a decode step a token); row t is the distribution of
    token t + 1, for every token after the first."""
    logits = engine.score([*prompt_ids, *output_ids], prefill=len(prompt_ids)).astype(np.float64)[:-1]
    return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


def parent_pid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (a run's node processes name its temporary folder)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace") and alive(int(cmdline.parent.name)):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids

