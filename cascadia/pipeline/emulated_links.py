"""Emulated links for local nodes: each node process in its own network namespace, the stages joined by veth pairs
whose sending side `tc tbf` shapes to the spec's link bandwidth, so that one machine runs the pipeline as PCs on a
network would (Linux, root, iproute2).

    coordinator (this namespace) ──ctl──┬── node0 ──data──> node1 ──data──> node2
                                        ├──────────ctl──────┘                │
                                        └──────────────────ctl───────────────┘

Every pair of peers shares a link of its own, so nothing is routed or bridged: a node's control link reaches the
coordinator (and carries the first node's frames in, the last node's tokens out, unshaped: one row of token ids),
and the data link from stage i to stage i + 1 carries the residual rows at `spec.cluster.link(a, b).bandwidth`.
Latency is not emulated (netem is not available everywhere); a veth hop adds tens of microseconds.

`EmulatedLan` is the other shape: machines on one switched segment (a bridge), where multicast reaches every one, for
a fleet that finds its nodes by mDNS (`cascadia.fleet`).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

import attrs

from cascadia.pipeline.coordinator import PipelineError
from cascadia.pipeline.places import NodePlace
from cascadia.pipeline.transport import tcp_address

NODE_PORT = 5601  # every node listens on it, each in its own namespace
_SECOND_OCTETS = range(200, 255)  # 10.X.0.0/16 for the emulated links: the first X this machine does not use
_made = itertools.count()  # tells apart the interfaces of several EmulatedLinks of one process
_NAMESPACE = re.compile(r"cascadia-(\d+)-\d+-\d+")  # cascadia-PID-MADE-NODE


class LinkEmulationError(PipelineError):
    """The links cannot be emulated here, so the pipeline cannot start; the text says why."""


class _Namespaces:
    """Owns `namespaces`; `close` removes them, and their veth pairs go with them."""

    namespaces: list[str]

    def close(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EmulatedLinks(_Namespaces):
    """Namespaces and links for `len(rates) + 1` nodes; `rates[i]` (bytes/s) shapes the link from stage i to i + 1.
    The coordinator binds `control_port` and `tokens_port` on every interface. `close` removes it all."""

    def __init__(self, rates: Sequence[float], control_port: int, tokens_port: int):
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise LinkEmulationError("emulating links needs root and iproute2 (ip, tc) on Linux")
        _remove_stale_namespaces()
        made = next(_made)
        self.tag = f"{os.getpid() % 10000}{made % 100}"  # interface names: 15 characters at most
        self.namespaces = [f"cascadia-{os.getpid()}-{made}-{i}" for i in range(len(rates) + 1)]
        net = _free_network()
        self.places: list[NodePlace] = []
        try:
            for i, namespace in enumerate(self.namespaces):
                _ip("netns", "add", namespace)
                _ip("-n", namespace, "link", "set", "lo", "up")
                here, there = f"{net}.{2 * i}.1", f"{net}.{2 * i}.2"  # the control link
                self._veth(f"cc{self.tag}r{i}", None, here, f"cc{self.tag}n{i}", namespace, there)
                self.places.append(NodePlace(tcp_address("0.0.0.0", NODE_PORT), tcp_address(there, NODE_PORT),
                                             tcp_address(here, control_port), tcp_address(here, tokens_port),
                                             ("ip", "netns", "exec", namespace)))
            for i, rate in enumerate(rates):
                sender, receiver = f"{net}.{2 * i + 1}.1", f"{net}.{2 * i + 1}.2"  # stage i -> stage i + 1
                self._veth(f"cd{self.tag}s{i}", self.namespaces[i], sender, f"cd{self.tag}r{i}",
                           self.namespaces[i + 1], receiver)
                _shape(self.namespaces[i], f"cd{self.tag}s{i}", rate)
                self.places[i + 1] = attrs.evolve(self.places[i + 1], address=tcp_address(receiver, NODE_PORT))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _veth(name: str, namespace: str | None, address: str, peer: str, peer_namespace: str,
              peer_address: str) -> None:
        """A veth pair, one end in `namespace` (None: this one), each end up with its /24 address."""
        _ip("link", "add", name, "type", "veth", "peer", "name", peer, "netns", peer_namespace)
        if namespace is not None:
            _ip("link", "set", name, "netns", namespace)
        for ns, device, ip in ((namespace, name, address), (peer_namespace, peer, peer_address)):
            where = ["-n", ns] if ns else []
            _ip(*where, "addr", "add", f"{ip}/24", "dev", device)
            _ip(*where, "link", "set", device, "up")


class EmulatedLan(_Namespaces):
    """`count` machines on one switched segment, as PCs on an office network: each in a namespace of its own,
    joined by veth pairs to a Linux bridge in one more namespace (the switch), which passes multicast (mDNS); the
    machines' addresses are `addresses[i]`, `run_in(i)` the prefix that runs a command on one, and `rates[i]`
    (bytes/s; None: unshaped) shapes what machine i sends. `close` removes it all."""

    def __init__(self, count: int, rates: Sequence[float | None] | None = None):
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise LinkEmulationError("emulating a network needs root and iproute2 (ip, tc) on Linux")
        _remove_stale_namespaces()
        made = next(_made)
        tag = f"{os.getpid() % 10000}{made % 100}"
        self.namespaces = [f"cascadia-{os.getpid()}-{made}-{i}" for i in range(count + 1)]  # the last: the switch
        switch = self.namespaces[-1]
        net = _free_network()
        self.addresses = [f"{net}.0.{i + 1}" for i in range(count)]
        try:
            for namespace in self.namespaces:
                _ip("netns", "add", namespace)
                _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
                port, device = f"ln{tag}p{i}", f"ln{tag}m{i}"
                _ip("link", "add", port, "netns", switch, "type", "veth", "peer", "name", device, "netns", namespace)
                _ip("-n", switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
                _ip("-n", namespace, "link", "set", device, "up")
                _ip("-n", namespace, "route", "add", "224.0.0.0/4", "dev", device)  # multicast leaves by the LAN
                if rates is not None and rates[i] is not None:
                    _shape(namespace, device, rates[i])
        except BaseException:
            self.close()
            raise

    def run_in(self, machine: int) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespaces[machine])


def namespaces() -> set[str]:
    """The names of this machine's network namespaces."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def made_here() -> set[str]:
    """The namespaces of this machine made by this process (its id is in their names), and not yet removed."""
    return {name for name in namespaces() if (match := _NAMESPACE.fullmatch(name)) and int(match.group(1)) ==
            os.getpid()}


def _remove_stale_namespaces() -> None:
    """Remove the namespaces of runs whose process is gone (killed before it could remove them)."""
    for name in namespaces():
        if (match := _NAMESPACE.fullmatch(name)) and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _shape(namespace: str, device: str, rate: float) -> None:
    """Token-bucket shaping of what `device` sends, to `rate` bytes/s, with up to 1 s of queue (TCP's bursts are
    held, not dropped and resent). The bucket holds 50 us at that rate, at least 4 KiB (under three packets; 1 Gbit/s
    still reaches 95% of its rate with it): a larger message crosses at the link's rate, as on a wire, but a smaller
    one on an idle link passes at once, which a token bucket cannot help."""
    burst = max(4 * 1024, round(rate * 50e-6))
    _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{round(rate * 8)}bit",
         "burst", str(burst), "latency", "1s")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise LinkEmulationError(f"{' '.join(command)}: {result.stderr.strip() or 'failed'}")


def _free_network() -> str:
    """"10.X" for the first X in 200..254 that no address of this machine uses."""
    used = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for x in _SECOND_OCTETS:
        if f" 10.{x}." not in used:
            return f"10.{x}"
    raise LinkEmulationError("no free 10.X.0.0/16 network for the emulated links (X in 200..254)")
