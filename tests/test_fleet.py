"""A node's profile and announcement, and `cascadia fleet` finding real nodes over real multicast on an emulated LAN
(network namespaces joined by a bridge; skipped where they cannot be made). mDNS never runs in this machine's own
namespace."""

import json
import signal
import subprocess
import sys

import pytest

from cascadia.fleet.announce import Announcement, FleetError, Unreadable, announcement_for, key_fingerprint
from cascadia.fleet.listing import fleet_json, fleet_table
from cascadia.fleet.profile import Profile, measure, measure_disk_read
from cascadia.pipeline.emulated_links import EmulatedLan, LinkEmulationError, namespaces
from cascadia.pipeline.transport import generate_keys
from cascadia.pipeline.wire import VERSION

PROFILE = Profile(cores=16, memory_bytes=60 * 2**30, device="GPU", precision="f16", memory_bandwidth=1.2e11,
                  compute_flops=4.5e13, disk_bandwidth=3.1e9)
TIMEOUT_S = 120  # generous bound on a wait; nothing here measures time


def test_an_announcement_reads_back_from_its_txt_record_each_entry_within_dns_sds_limit():
    announcement = announcement_for("pc-07", "standby", PROFILE, None)
    txt = announcement.txt()
    assert all(len(f"{key}={value}".encode()) < 255 for key, value in txt.items())
    assert Announcement.from_txt(txt, "tcp://10.0.0.7:5601") == Announcement(
        "pc-07", "standby", announcement.version, VERSION, "", PROFILE, "tcp://10.0.0.7:5601")
    unmeasured = Profile(2, 2**30, "CPU", "f32", 1e10, 1e11, None)
    assert Announcement.from_txt(announcement_for("x", "waiting", unmeasured, None).txt()).profile == unmeasured


@pytest.mark.parametrize("change, message", [
    ({"memory": None}, "its TXT record has no 'memory'"),
    ({"cores": "many"}, "its TXT record's 'cores' is 'many', not a int"),
    ({"state": "asleep"}, "its TXT record's 'state' is 'asleep', not one of standby, serving, waiting"),
])
def test_an_announcement_that_cannot_be_read_names_the_field(change, message):
    txt = announcement_for("pc", "serving", PROFILE, None).txt()
    for key, value in change.items():
        if value is None:
            del txt[key]
        else:
            txt[key] = value
    with pytest.raises(FleetError, match=message):
        Announcement.from_txt(txt)


def test_the_key_fingerprint_tells_key_pairs_apart(tmp_path):
    generate_keys(tmp_path / "a", ["pc"])
    generate_keys(tmp_path / "b", ["pc"])
    one, other = key_fingerprint(tmp_path / "a", "pc"), key_fingerprint(tmp_path / "b", "pc")
    assert len(one) == 16 and one != other and one == key_fingerprint(tmp_path / "a", "pc")
    assert key_fingerprint(None, "pc") == ""


def test_the_listing_says_what_each_node_has_and_which_cannot_work_with_this_build():
    found = [announcement_for("pc-1", "serving", PROFILE, None),
             Announcement("pc-2", "standby", "0.0.9", VERSION - 1, "ab12", PROFILE, "tcp://10.0.0.2:5601")]
    table = fleet_table(found, [Unreadable("junk", "its TXT record has no 'memory'")])
    assert "pc-1" in table and "GPU f16" in table and "60 GiB" in table and "120 GB/s" in table
    assert f"0.0.9 (protocol {VERSION - 1};" in table and f"speaks {VERSION})" in table
    assert table.splitlines()[-1] == "junk: cannot read its announcement: its TXT record has no 'memory'"
    listed = fleet_json(found, [])
    assert [node["compatible"] for node in listed["nodes"]] == [True, False]
    assert listed["nodes"][1]["profile"]["memory_bandwidth"] == 1.2e11
    assert fleet_table([], []) == "no Cascadia node answered"


def test_a_machine_measures_itself(tmp_path):
    profile = measure(tmp_path)
    assert profile.cores >= 1 and profile.memory_bytes > 0 and profile.device in ("CPU", "GPU")
    assert profile.memory_bandwidth > 1e8 and profile.compute_flops > 1e8 and profile.disk_bandwidth > 1e6
    assert not list(tmp_path.iterdir())  # the disk probe is gone


def test_a_disk_that_cannot_take_the_probe_is_left_unmeasured():
    assert measure_disk_read("/proc") is None


# ---- an emulated LAN -----------------------------------------------------------------------------------------------
def _can_make_a_lan() -> bool:
    try:
        EmulatedLan(1).close()
    except (LinkEmulationError, OSError):
        return False
    return True


needs_a_lan = pytest.mark.skipif(not _can_make_a_lan(), reason="needs root and network namespaces")


@needs_a_lan
def test_a_lan_shapes_what_each_machine_sends_and_leaves_nothing_behind():
    before = namespaces()
    with EmulatedLan(2, rates=[1e6, None]) as lan:
        assert len(set(lan.namespaces) - before) == 3  # two machines and the switch
        shaping = [subprocess.run(["tc", "-n", ns, "qdisc", "show"], capture_output=True, text=True).stdout
                   for ns in lan.namespaces[:2]]
        assert "tbf" in shaping[0] and "rate 8Mbit" in shaping[0] and "tbf" not in shaping[1]
        reach = subprocess.run([*lan.run_in(0), sys.executable, "-c", PROBE, lan.addresses[1]], capture_output=True,
                               text=True)
        assert reach.returncode == 0 and "refused" in reach.stdout  # reached machine 1, where nothing listens
    assert namespaces() == before


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=10)
except ConnectionRefusedError:
    print("refused")
"""


def cascadia(lan: EmulatedLan, machine: int, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([*lan.run_in(machine), sys.executable, "-m", "cascadia", *args], text=True, **popen)


@needs_a_lan
def test_fleet_lists_the_nodes_announced_on_the_lan_and_a_taken_name_is_refused(tmp_path):
    """Three nodes of the tiny spec, each on a machine of its own: two hold their stages (waiting for a run), one
    stands by; `cascadia fleet` on a fourth machine lists them with their measured profiles. A fifth node under a
    name already announced stops, saying so."""
    spec = "specs/tiny-local.yaml"
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "cascadia", "plan", spec, "-o", str(plan)], check=True, capture_output=True)
    before = namespaces()
    with EmulatedLan(5) as lan:
        control = f"tcp://{lan.addresses[3]}:5555"  # nobody binds it: the nodes wait for a coordinator

        def node(machine: int, name: str, *extra: str) -> subprocess.Popen:
            return cascadia(lan, machine, "node", "--spec", spec, "--plan", str(plan), "--name", name, "--listen",
                            "tcp://0.0.0.0:5601", "--control", control, "--keep-serving", "--announce",
                            "--interface", lan.addresses[machine], "--checkpoint", str(tmp_path), *extra,
                            stderr=subprocess.PIPE)

        nodes = [node(0, "node0", "--successor", f"tcp://{lan.addresses[1]}:5601"),
                 node(1, "node1", "--successor", f"tcp://{lan.addresses[2]}:5601"), node(2, "node2", "--standby")]
        try:
            listing = cascadia(lan, 3, "fleet", "--json", "--expect", "3", "--seconds", str(TIMEOUT_S),
                               "--interface", lan.addresses[3], stdout=subprocess.PIPE)
            out, _ = listing.communicate(timeout=TIMEOUT_S + 30)
            assert listing.returncode == 0, [process.communicate()[1] for process in nodes if process.poll()]
            found = json.loads(out)["nodes"]
            assert [(n["name"], n["address"], n["state"]) for n in found] == [
                ("node0", f"tcp://{lan.addresses[0]}:5601", "waiting"),
                ("node1", f"tcp://{lan.addresses[1]}:5601", "waiting"),
                ("node2", f"tcp://{lan.addresses[2]}:5601", "standby")]
            assert all(n["compatible"] and n["profile"]["memory_bandwidth"] > 1e8 for n in found)

            twin = node(4, "node1", "--successor", f"tcp://{lan.addresses[2]}:5601")
            _, err = twin.communicate(timeout=TIMEOUT_S)
            assert twin.returncode == 1
            assert "another node on this network already announces the name 'node1'" in err
            assert "Traceback" not in err
        finally:
            for process in nodes:
                process.send_signal(signal.SIGINT)
            for process in nodes:
                try:
                    process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()
    assert namespaces() == before


@needs_a_lan
def test_fleet_expecting_more_nodes_than_answer_says_how_many_did():
    with EmulatedLan(1) as lan:
        listing = cascadia(lan, 0, "fleet", "--expect", "2", "--seconds", "0.5", "--interface", lan.addresses[0],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = listing.communicate(timeout=TIMEOUT_S)
    assert listing.returncode == 1 and out.strip() == "no Cascadia node answered"
    assert err.startswith("Error: 2 nodes expected, 0 answered within 0.5 s")
