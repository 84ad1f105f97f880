"""`cascadia doctor`, run as a user runs it: the machine's checks, and a spec's asks of one node (memory, port, Curve
keys), each failing where it should with its fix, exit status 1 on any FAIL."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cascadia import doctor

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = ROOT / "specs" / "tiny" / "config.json"


def cascadia(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cascadia", *args], capture_output=True, text=True, timeout=300)


def checks_of(done: subprocess.CompletedProcess) -> dict[str, dict]:
    return {check["check"]: check for check in json.loads(done.stdout)["checks"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fleet_spec(folder: Path, memory: str = "1GiB") -> tuple[Path, Path, int]:
    """A spec of two tcp nodes on this machine with Curve keys, each given `memory`; its key folder, and the port of
    the first node."""
    keys = folder / "keys"
    if not keys.exists():
        assert cascadia("keys", "generate", str(keys), "--nodes", "pc0,pc1").returncode == 0
    port = free_port()
    spec = folder / "fleet.yaml"
    spec.write_text(f"""\
model: {{name: tiny, hf_config: {TINY_CONFIG}, formats: f32}}
cluster:
  reserve: 64MiB
  curve_keys: keys
  nodes:
    - {{name: pc0, address: "tcp://127.0.0.1:{port}", memory: {memory}}}
    - {{name: pc1, address: "tcp://127.0.0.1:{free_port()}", memory: {memory}}}
runtime: {{context_budget: 64, max_streams: 4, precision: f32}}
""")
    return spec, keys, port


@pytest.fixture
def fleet(tmp_path):
    return fleet_spec(tmp_path)


def test_the_machine_alone_is_checked_and_nothing_fails_here():
    done = cascadia("doctor", "--json")
    assert done.returncode == 0, done.stderr
    checks = checks_of(done)
    assert {"python", "packages", "device CPU", "CPU", "memory", "memory bandwidth"} <= set(checks)
    assert all(check["status"] in ("OK", "WARN") for check in checks.values())
    assert "GB/s" in checks["memory bandwidth"]["found"]


def test_a_plan_that_needs_more_memory_than_is_free_fails_with_the_figures(tmp_path):
    spec, _, _ = fleet_spec(tmp_path, memory="64TiB")  # the K/V pool takes what the node's memory leaves
    done = cascadia("doctor", str(spec), "--node", "pc0")
    assert done.returncode == 1
    memory = next(line for line in done.stdout.splitlines() if "memory for the plan" in line)
    assert memory.startswith("FAIL") and "pc0 will allocate" in memory
    assert "fix: " in done.stdout and done.stderr == ""


def test_a_node_of_a_fleet_with_its_port_free_and_its_keys_in_place_passes(fleet):
    spec, _, port = fleet
    done = cascadia("doctor", str(spec), "--node", "pc0", "--json")
    assert done.returncode == 0, done.stdout
    checks = checks_of(done)
    assert checks["port"]["status"] == "OK" and str(port) in checks["port"]["found"]
    assert checks["Curve keys"]["status"] == "OK"
    assert checks["memory for the plan"]["status"] == "OK"


def test_a_taken_port_fails_naming_it(fleet):
    spec, _, port = fleet
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        done = cascadia("doctor", str(spec), "--node", "pc0", "--json")
    assert done.returncode == 1
    check = checks_of(done)["port"]
    assert check["status"] == "FAIL" and f"port {port} is taken" in check["found"] and check["fix"]


def test_a_missing_or_mismatched_secret_key_fails(fleet):
    spec, keys, _ = fleet
    (keys / "public" / "pc0.key").write_bytes((keys / "public" / "pc1.key").read_bytes())
    check = checks_of(cascadia("doctor", str(spec), "--node", "pc0", "--json"))["Curve keys"]
    assert check["status"] == "FAIL" and "does not match" in check["found"]
    assert "cascadia keys generate" in check["fix"]
    (keys / "secret" / "pc0.key_secret").unlink()
    done = cascadia("doctor", str(spec), "--node", "pc0", "--json")
    assert done.returncode == 1
    assert "pc0.key_secret" in checks_of(done)["Curve keys"]["found"]


def test_a_node_the_spec_lacks_is_a_usage_error(fleet):
    spec, _, _ = fleet
    done = cascadia("doctor", str(spec), "--node", "pc9")
    assert done.returncode == 2
    assert "no node named 'pc9' (the cluster has pc0, pc1)" in done.stderr and "Traceback" not in done.stderr


def test_why_no_gpu_shows(tmp_path):
    assert "no GPU render node" in doctor.gpu_absent(tmp_path).found
    (tmp_path / "renderD128").touch()
    check = doctor.gpu_absent(tmp_path)
    assert check.status == "WARN" and "exists, but OpenVINO lists no GPU" in check.found
    assert "compute runtime" in check.fix


def test_a_bandwidth_far_below_the_specs_figure_is_a_warning():
    assert doctor.bandwidth_check(30e9, 120e9, "pc3").status == "WARN"
    assert doctor.bandwidth_check(100e9, 120e9, "pc3").status == "OK"
    assert doctor.bandwidth_check(30e9).status == "OK"


def test_the_report_gives_a_line_a_check_and_the_fix_below():
    checks = [doctor.Check("python", "OK", "3.11"), doctor.Check("port", "FAIL", "taken", "stop it")]
    assert doctor.report(checks).splitlines() == [
        "OK    python: 3.11", "FAIL  port: taken", "      fix: stop it", "1 OK, 0 WARN, 1 FAIL"]
    assert doctor.failed(checks)
