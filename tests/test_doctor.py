"""`cascadia doctor`, run as a user runs it: the machine's checks, a spec's asks of one node (memory, port, Curve
keys), and the fleet from the coordinator (local nodes started, tcp nodes reached over Curve and let go), each
failing where it should with its fix, exit status 1 on any FAIL."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cascadia import doctor
from serving import alive

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


def test_the_fleet_of_a_local_spec_is_started_checked_and_stopped(checkpoint):
    done = cascadia("doctor", str(ROOT / "specs" / "tiny-local.yaml"), "--fleet", "--checkpoint", str(checkpoint),
                    "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    checks = checks_of(done)
    for node, layers in [("node0", "0-1"), ("node1", "2-3"), ("node2", "4-5")]:
        check = checks[f"node {node}"]
        assert check["status"] == "OK" and f"layers {layers} ready" in check["found"]
        assert "settings as this spec and plan" in check["found"] and "control round trip" in check["found"]
    assert checks["fleet"]["status"] == "OK" and "started on this PC, and stopped again" in checks["fleet"]["found"]
    assert "node2: ready" in done.stderr  # the nodes' progress, as run shows it


def test_a_fleet_of_tcp_nodes_is_reached_over_curve_and_let_go_and_a_silent_node_fails(fleet, checkpoint, tmp_path):
    """Two nodes started by hand with --keep-serving (as the systemd unit runs them): doctor --fleet reaches both,
    and leaves them serving; with one stopped, it names the one that never spoke, and the fix."""
    spec, _, _ = fleet
    plan = tmp_path / "plan.json"
    assert cascadia("plan", str(spec), "-o", str(plan)).returncode == 0
    control, tokens = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    nodes = []
    for name, listen, last in [("pc0", spec_address(spec, 0), False), ("pc1", spec_address(spec, 1), True)]:
        with (tmp_path / f"{name}.log").open("w") as log:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "cascadia", "node", "--spec", str(spec), "--plan", str(plan), "--name", name,
                 "--listen", listen, "--control", control, "--checkpoint", str(checkpoint), "--keep-serving",
                 "--parent-pid", str(os.getpid()), *(["--successor", tokens] if last else [])],
                stdout=log, stderr=subprocess.STDOUT))
    try:
        fleet_of = ("doctor", str(spec), "--fleet", "--plan", str(plan), "--control", control, "--tokens", tokens,
                    "--json")
        done = cascadia(*fleet_of)
        assert done.returncode == 0, done.stdout + done.stderr
        checks = checks_of(done)
        assert checks["node pc0"]["status"] == checks["node pc1"]["status"] == "OK"
        assert f"reached at {control}, and let go" in checks["fleet"]["found"]
        assert "port" not in checks  # the coordinator is none of the nodes: their ports are theirs
        assert all(node.poll() is None for node in nodes)  # still serving, for the next run
        nodes[1].terminate()
        nodes[1].wait(60)
        done = cascadia(*fleet_of, "--wait", "3")
        assert done.returncode == 1
        checks = checks_of(done)
        assert checks["node pc0"]["status"] == "OK" and checks["fleet"]["status"] == "FAIL"
        assert checks["fleet"]["found"].startswith("pc1: no word within 3 s while starting")
        assert f"--control {control} --keep-serving" in checks["fleet"]["fix"]
        assert nodes[0].poll() is None
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(60)
    assert not any(alive(node.pid) for node in nodes)


def spec_address(spec: Path, index: int) -> str:
    import yaml

    return yaml.safe_load(spec.read_text())["cluster"]["nodes"][index]["address"]


def test_fleet_options_need_fleet_and_tcp_nodes_need_addresses(fleet):
    spec, _, _ = fleet
    done = cascadia("doctor", str(spec), "--control", "tcp://127.0.0.1:1")
    assert done.returncode == 2 and "--control, --tokens and --checkpoint go with --fleet" in done.stderr
    done = cascadia("doctor", str(spec), "--fleet")
    assert done.returncode == 2 and "--fleet with tcp nodes: give --control and --tokens" in done.stderr
    assert "Traceback" not in done.stderr
