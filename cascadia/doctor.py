"""`cascadia doctor`: what a PC must have before it serves, checked on the PC itself; and the fleet, checked from
the coordinator.

Each check answers OK, WARN or FAIL with what it found and, where it is not OK, the fix. Without a spec: Python and
the packages, OpenVINO's devices and their precisions (and why no GPU shows, where none does), the CPU, the memory
free, and the memory's speed measured in about a second. With a spec, for the node this machine is to be (`node`;
without one, every `local` node of the spec, which share this machine): the memory the plan gives it against what
is free, the device and precision it asks for, its spec figure for memory bandwidth against the measured one, its
port, and the Curve keys it needs. The fleet (`fleet_checks`) is started as `cascadia run` starts it, without a
workload: every node of the plan reached (a tcp node connects to the coordinator's control address), started with
this spec and plan (its settings digest), its stage loaded, and its clock placed on the coordinator's; then it is
let go (a `--keep-serving` node, as the systemd unit runs it, keeps its stage for the next run).
"""

from __future__ import annotations

import errno
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import numpy as np

from cascadia.host_cpus import available, format_cpus, identity
from cascadia.host_memory import available_bytes
from cascadia.units import format_bytes

OK, WARN, FAIL = "OK", "WARN", "FAIL"
PACKAGES = ("openvino", "numpy", "pyzmq", "networkx", "simpy", "tokenizers", "safetensors", "fastapi", "uvicorn")
RENDER_NODES = Path("/dev/dri")
BANDWIDTH_ARRAY_BYTES = 256 * 2**20
SPEC_BANDWIDTH_FLOOR = 0.5  # a measured read below this share of the spec's figure is worth a warning


@attrs.frozen
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    found: str
    fix: str = ""

    def as_json(self) -> dict:
        return {"check": self.name, "status": self.status, "found": self.found, "fix": self.fix or None}


def python_check() -> Check:
    found = f"{sys.version.split()[0]} at {sys.executable}"
    if sys.version_info < (3, 10):
        return Check("python", FAIL, found, "Cascadia needs Python 3.10 or newer")
    return Check("python", OK, found)


def packages_check() -> Check:
    found, missing = [], []
    for name in PACKAGES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            missing.append(name)
    if missing:
        return Check("packages", FAIL, f"missing {', '.join(missing)}",
                     "install Cascadia with its dependencies: pip install -e . (in its virtual environment)")
    return Check("packages", OK, ", ".join(found))


def device_checks(core) -> list[Check]:
    """Every OpenVINO device with the precisions it computes in; why no GPU shows, where none does."""
    checks = []
    for device in core.available_devices:
        capabilities = core.get_property(device, "OPTIMIZATION_CAPABILITIES")
        checks.append(Check(f"device {device}", OK, f"{core.get_property(device, 'FULL_DEVICE_NAME')}: "
                                                  f"{', '.join(capabilities)}"))
    if not any(device.startswith("GPU") for device in core.available_devices):
        checks.append(gpu_absent())
    return checks


def gpu_absent(render_nodes: Path = RENDER_NODES) -> Check:
    nodes = sorted(render_nodes.glob("renderD*")) if render_nodes.is_dir() else []
    if nodes:
        return Check("GPU", WARN, f"{nodes[0]} exists, but OpenVINO lists no GPU",
                     "install Intel's GPU compute runtime (the intel-opencl-icd or level-zero GPU packages), add "
                     "this user to the render group, then run cascadia doctor again")
    return Check("GPU", WARN, f"no GPU render node in {render_nodes}: nodes will compute on the CPU",
                 "on a PC with an Intel GPU, install its kernel driver (i915 or xe) and compute runtime")


def cpu_check() -> Check:
    cpu = identity()
    found = f"{cpu['model']}; {', '.join(cpu['isa']) or 'none of AVX2, AVX-512, AMX'}; {len(available())} cores"
    if "AVX2" not in cpu["isa"]:
        return Check("CPU", WARN, found, "OpenVINO's CPU kernels are built for AVX2 and later: expect slow nodes")
    return Check("CPU", OK, found)


def memory_check(need: int | None = None, who: str = "") -> Check:
    """Memory free; with `need`, against what `who` will allocate."""
    name = "memory" if need is None else "memory for the plan"
    free = available_bytes()
    if free is None:
        return Check(name, WARN, "this system does not say how much memory is free")
    have, source = free
    found = f"{format_bytes(have, digits=3)} free ({source})"
    if need is None:
        return Check(name, OK, found)
    found += f"; {who} will allocate {format_bytes(need, digits=3)} (weights, slots and K/V pool)"
    if need > have:
        return Check(name, FAIL, found, "free memory on this PC, or lower the node's memory (or "
                                        "runtime.max_streams, context_budget) in the spec and plan again")
    return Check(name, OK, found)


def measure_bandwidth(array_bytes: int = BANDWIDTH_ARRAY_BYTES) -> float:
    """Bytes/s of a streaming read on every core this process may use: the sum of an array split among them, best
    of 3 (numpy releases the GIL while it sums)."""
    data = np.ones(array_bytes // 8)
    cores = len(available())
    chunks = np.array_split(data, cores)
    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(np.sum, chunks))  # the pages are touched once before any timing
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def bandwidth_check(measured: float, spec_figure: float | None = None, who: str = "") -> Check:
    found = f"{measured / 1e9:.1f} GB/s streaming read on {len(available())} cores"
    if spec_figure is None:
        return Check("memory bandwidth", OK, found)
    found += f"; the spec gives {who} {spec_figure / 1e9:.1f} GB/s"
    if measured < SPEC_BANDWIDTH_FLOOR * spec_figure:
        return Check("memory bandwidth", WARN, found,
                     "plans and analytic estimates assume the spec's figure: set memory_bandwidth in the spec to "
                     "what this PC reads, or simulate with a calibration measured here (cascadia calibrate)")
    return Check("memory bandwidth", OK, found)


def port_check(address: str, who: str) -> Check:
    """Whether this machine can bind the port of `who`'s tcp://HOST:PORT."""
    port = urlsplit(address).port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return Check("port", FAIL, f"{who}'s port {port} is taken on this machine",
                             f"stop what listens there (ss -ltnp 'sport = :{port}') or give {who} another port")
            return Check("port", FAIL, f"cannot bind {who}'s port {port}: {e.strerror}", "")
    return Check("port", OK, f"{who}'s port {port} is free")


def keys_check(folder: Path, own: list[str], nodes: list[str]) -> Check:
    """The Curve key folder: each of `own`'s secret key readable and matching its public key, every node's and the
    coordinator's public key there."""
    from cascadia.pipeline.transport import COORDINATOR, CurveKeys, TransportError

    keys = CurveKeys(folder)
    fix = (f"copy the cluster's key folder here (its public/ and this PC's secret key), or make new keys with "
           f"cascadia keys generate {folder} --nodes {','.join(nodes)}")
    try:
        publics = {name: keys.public_key(name) for name in [*nodes, COORDINATOR]}
        for name in own:
            public, _ = keys.keypair(name)
            if public != publics[name]:
                return Check("Curve keys", FAIL, f"{name}'s secret key in {folder} does not match its public key "
                                                 "there", fix)
    except TransportError as e:
        return Check("Curve keys", FAIL, str(e), fix)
    return Check("Curve keys", OK, f"{folder}: {', '.join(own)}'s secret key and every participant's public key")


def machine_checks(core) -> tuple[list[Check], float]:
    """The checks that need no spec, and the bandwidth measured."""
    measured = measure_bandwidth()
    checks = [python_check(), packages_check(), *device_checks(core), cpu_check(), memory_check(),
              bandwidth_check(measured)]
    return checks, measured


def spec_checks(spec, plan, node: str | None, measured: float) -> Iterator[Check]:
    """The checks of this machine as the spec's `node` (None: as every local node of the spec)."""
    from cascadia.engine.device import DeviceError, pick_device, runs_as

    members = [spec.cluster.node(node)] if node else [n for n in spec.cluster.members if n.is_local]
    if not members:
        yield Check("spec", FAIL, f"{spec.source} has no local node, so this PC must be one of its tcp nodes",
                    f"name the node this PC is to be: cascadia doctor {spec.source} --node NAME")
        return
    who = members[0].name if len(members) == 1 else f"its {len(members)} local nodes"
    stages = {stage.node: stage for stage in plan.stages}
    need = sum(stages[n.name].allocated_bytes for n in members if n.name in stages)
    if need:  # a spare holds no stage until it is given one
        yield memory_check(need, who)
    devices: dict[str, list[str]] = {}  # what each node computes on and as, to the nodes that do
    for member in members:
        try:
            device = pick_device(member.device)
        except DeviceError as e:  # a device the spec names that OpenVINO does not list
            yield Check("device", FAIL, f"{member.name}: {e}", "install its driver, or set the node's device to auto")
            continue
        devices.setdefault(device, []).append(member.name)
    for device, names in devices.items():
        computes = runs_as(spec.runtime.precision, device)
        found = f"{', '.join(names)} on {device}: runtime.precision {spec.runtime.precision} computes as {computes}"
        if computes == spec.runtime.precision:
            yield Check("device", OK, found)
        else:
            yield Check("device", WARN, found, f"this {device} lacks {spec.runtime.precision} arithmetic: expect "
                                               f"{computes}'s speed, and set runtime.precision: {computes} to say so")
    figures = {m.memory_bandwidth for m in members if m.memory_bandwidth}
    if figures:
        yield bandwidth_check(measured, max(figures), who)
    for member in members:
        if not member.is_local:
            yield port_check(member.address, member.name)
    if spec.cluster.curve_keys is not None:
        yield keys_check(spec.cluster.curve_keys, [m.name for m in members], [m.name for m in spec.cluster.members])


def fleet_checks(spec, plan, addresses=None, checkpoint: Path | None = None, wait_s: float = 120.0,
                 on_message=lambda node, message: None) -> list[Check]:
    """The plan's nodes started as a run starts them (local ones here; tcp ones waited for at `addresses`, which
    they must reach), each a check of what it said and how long it took; a node silent for `wait_s`, one started
    with other settings, or one that fails to load is the fleet's FAIL, named."""
    from cascadia.errors import CascadiaError
    from cascadia.pipeline.run import Pipeline
    from cascadia.pipeline.settings import settings_digest
    from cascadia.pipeline.wire import Hello, Ready

    start, heard = time.monotonic(), {}

    def note(node, message) -> None:
        if isinstance(message, Hello):
            heard[node] = {"hello": message, "up_s": time.monotonic() - start}
        elif isinstance(message, Ready) and node in heard:
            heard[node]["ready_s"] = time.monotonic() - start
        on_message(node, message)

    def node_check(node: str, clock=None) -> Check:
        hello = heard[node]["hello"]
        found = (f"up on CPUs {format_cpus(hello.cpus)} {heard[node]['up_s']:.1f} s in, layers {hello.first_layer}-"
                 f"{hello.last_layer} ready {heard[node]['ready_s']:.1f} s in; settings as this spec and plan")
        if clock is not None:
            found += (f"; its clock placed on the coordinator's within {clock.error_bound * 1e3:.2f} ms (control "
                      f"round trip {clock.round_trip * 1e3:.2f} ms)")
        return Check(f"node {node}", OK, found)

    local = all(spec.cluster.node(stage.node).is_local for stage in plan.stages)
    try:
        pipeline = Pipeline.start(spec, plan, checkpoint=checkpoint, addresses=addresses, node_timeout_s=wait_s,
                                  on_message=note)
    except CascadiaError as e:
        if local:
            fix = ("the message names the node and what stopped it; cascadia doctor SPEC (without --fleet) checks "
                   "this PC's memory, devices and CPUs against the spec")
        else:
            control = addresses.control if addresses else "the --control address"
            fix = (f"start each node on its PC with this spec and plan: cascadia node --spec SPEC --plan PLAN --name "
                   f"NAME --listen ITS_ADDRESS --control {control} --keep-serving (deploy/systemd runs it so), and "
                   "let its PC reach that address through any firewall")
        ready = [node_check(node) for node in heard if "ready_s" in heard[node]]
        return [*ready, Check("fleet", FAIL, str(e), fix)]
    try:
        clocks = pipeline.coordinator.clocks
        checks = [node_check(stage.node, clocks[stage.node]) for stage in plan.stages]
        digest = settings_digest(spec, plan, False)
    finally:
        pipeline.close()
    what = "started on this PC, and stopped again" if local else \
        f"reached at {addresses.control}, and let go (a --keep-serving node waits for the next run)"
    checks.append(Check("fleet", OK, f"the plan's {len(plan.stages)} nodes, settings digest {digest}, {what}"))
    return checks


def failed(checks: list[Check]) -> bool:
    return any(check.status == FAIL for check in checks)


def report(checks: list[Check]) -> str:
    """One line a check, its fix on the next."""
    lines = []
    for check in checks:
        lines.append(f"{check.status:<4}  {check.name}: {check.found}")
        if check.fix:
            lines.append(f"      fix: {check.fix}")
    counts = {status: sum(c.status == status for c in checks) for status in (OK, WARN, FAIL)}
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()))
    return "\n".join(lines)
