"""A node's announcement of itself over mDNS/DNS-SD (python-zeroconf), and the browsing that collects them.

A node announces one service of type `_cascadia._tcp` named after itself, at its input's port, on the addresses of
the interfaces it announces on. Its TXT record says what a coordinator needs before it plans over the node: its
state (standing by, serving, waiting for a run), Cascadia's and the wire protocol's versions, its Curve public key's
fingerprint (empty without keys) and its measured `Profile`. Discovery only finds: nothing here authenticates a
node; the Curve handshake does, when keys are in use.

mDNS is multicast on the local link: announcer and browser must share a network segment that passes multicast
(a switch does; a router between them, or a firewall that drops UDP port 5353, does not).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from cascadia import __version__
from cascadia.errors import CascadiaError
from cascadia.fleet.profile import Profile
from cascadia.pipeline.node import STATES
from cascadia.pipeline.wire import VERSION as PROTOCOL

SERVICE = "_cascadia._tcp.local."
LOOKUP_MS = 3000  # how long to wait for a found service's records


class FleetError(CascadiaError):
    """Announcing or browsing failed, or an announcement cannot be read; the text says which and why."""


@attrs.frozen
class Announcement:
    name: str
    state: str
    version: str  # Cascadia's
    protocol: int  # the wire protocol's
    key: str  # its Curve public key's fingerprint; "" without keys
    profile: Profile
    model: str = ""  # `model_digest` of its checkpoint's config; "" where it has none of its own
    door: int | None = None  # the port it takes invitations at (`fleet.standby`); None: it serves its own spec
    address: str = ""  # where it was found: its input's tcp://HOST:PORT (a browser fills it in)

    @property
    def door_address(self) -> str | None:
        return None if self.door is None else f"{self.address.rsplit(':', 1)[0]}:{self.door}"

    @property
    def compatible(self) -> bool:
        """Speaks this build's protocol."""
        return self.protocol == PROTOCOL

    def txt(self) -> dict[str, str]:
        """The TXT record: short keys, decimal numbers (each key=value well under DNS-SD's 255 bytes)."""
        p = self.profile
        return {"name": self.name, "state": self.state, "version": self.version, "protocol": str(self.protocol),
                "key": self.key, "model": self.model, "door": "" if self.door is None else str(self.door),
                "cores": str(p.cores), "memory": str(p.memory_bytes), "device": p.device,
                "precision": p.precision, "bandwidth": f"{p.memory_bandwidth:.0f}",
                "compute": f"{p.compute_flops:.0f}", "disk": "" if p.disk_bandwidth is None else
                f"{p.disk_bandwidth:.0f}"}

    @classmethod
    def from_txt(cls, txt: Mapping[str, str], address: str = "") -> Announcement:
        """Raises FleetError naming the field that is missing or malformed."""
        def field(key: str, parse=str, what: str = ""):
            if key not in txt:
                raise FleetError(f"its TXT record has no {key!r}")
            try:
                return parse(txt[key])
            except ValueError:
                raise FleetError(f"its TXT record's {key!r} is {txt[key]!r}, not {what}") from None

        state = field("state")
        if state not in STATES:
            raise FleetError(f"its TXT record's 'state' is {state!r}, not one of {', '.join(STATES)}")
        profile = Profile(cores=field("cores", int, "a whole number"),
                          memory_bytes=field("memory", int, "a whole number"), device=field("device"),
                          precision=field("precision"),
                          memory_bandwidth=field("bandwidth", float, "a number"),
                          compute_flops=field("compute", float, "a number"),
                          disk_bandwidth=field("disk", _optional(float), "a number or nothing"))
        return cls(field("name"), state, field("version"), field("protocol", int, "a whole number"), field("key"),
                   profile, field("model"), field("door", _optional(int), "a port or nothing"), address)


def _optional(parse):
    return lambda text: parse(text) if text else None


def key_fingerprint(curve_keys: Path | None, name: str) -> str:
    """The first 16 hex digits of the SHA-256 of `name`'s Curve public key (Z85), or "" without keys."""
    if curve_keys is None:
        return ""
    from cascadia.pipeline.transport import CurveKeys

    return hashlib.sha256(CurveKeys(curve_keys).public_key(name)).hexdigest()[:16]


def _zeroconf(interfaces: Iterable[str] | None):
    from zeroconf import InterfaceChoice, IPVersion, Zeroconf

    try:
        return Zeroconf(interfaces=list(interfaces) if interfaces else InterfaceChoice.All,
                        ip_version=IPVersion.V4Only)
    except OSError as e:
        where = ", ".join(interfaces) if interfaces else "every interface"
        raise FleetError(f"cannot open mDNS on {where}: {e.strerror or e}") from None


def local_addresses() -> list[str]:
    """This machine's IPv4 addresses but loopback: where an announcement on every interface is found."""
    import ifaddr

    return [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
            if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]


class Announcer:
    """Announces `announcement` at `port` on `interfaces` (IPv4 addresses; None: every one) until closed;
    `update_state` changes what it says. Raises FleetError when another service already holds the name."""

    def __init__(self, announcement: Announcement, port: int, interfaces: Iterable[str] | None = None):
        from zeroconf import NonUniqueNameException

        self.announcement, self.port = announcement, port
        self.addresses = list(interfaces) if interfaces else local_addresses()
        if not self.addresses:
            raise FleetError("this machine has no IPv4 address to announce on but loopback")
        self.info = self._service_info()
        self.zeroconf = _zeroconf(interfaces)
        try:
            self.zeroconf.register_service(self.info)
        except NonUniqueNameException:
            self.zeroconf.close()
            raise FleetError(f"another node on this network already announces the name {announcement.name!r}; "
                             "give each node a name of its own") from None

    def _service_info(self):
        from zeroconf import ServiceInfo

        name = self.announcement.name
        return ServiceInfo(SERVICE, f"{name}.{SERVICE}", port=self.port, properties=self.announcement.txt(),
                           server=f"cascadia-{name}.local.", addresses=[socket.inet_aton(a) for a in self.addresses])

    def update_state(self, state: str) -> None:
        if state == self.announcement.state:
            return
        self.announcement = attrs.evolve(self.announcement, state=state)
        self.info = self._service_info()
        self.zeroconf.update_service(self.info)

    def close(self) -> None:
        self.zeroconf.unregister_service(self.info)
        self.zeroconf.close()

    def __enter__(self) -> Announcer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@attrs.frozen
class Unreadable:
    """A service of Cascadia's type whose announcement could not be read, and why."""

    service: str
    reason: str


class Browser:
    """Collects the announcements on `interfaces` (None: every one) from when it opens until it closes."""

    def __init__(self, interfaces: Iterable[str] | None = None):
        from zeroconf import ServiceBrowser

        self.zeroconf = _zeroconf(interfaces)
        self.found: set[str] = set()
        self.changes = 0  # services found, changed or gone so far
        self.changed = threading.Condition()
        self.browser = ServiceBrowser(self.zeroconf, SERVICE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        with self.changed:
            if state_change is ServiceStateChange.Removed:
                self.found.discard(name)
            else:
                self.found.add(name)
            self.changes += 1
            self.changed.notify_all()

    def wait(self, seconds: float, count: int | None = None) -> None:
        """Wait `seconds`, or until `count` services have answered."""
        with self.changed:
            self.changed.wait_for(lambda: count is not None and len(self.found) >= count, seconds)

    def wait_change(self, since: int, seconds: float) -> int:
        """Wait `seconds`, or until a service is found, changes or goes after `since` changes; how many there have
        been."""
        with self.changed:
            self.changed.wait_for(lambda: self.changes != since, seconds)
            return self.changes

    def announcements(self) -> tuple[list[Announcement], list[Unreadable]]:
        """What the services found so far announce, by name; and the ones that could not be read."""
        from zeroconf import IPVersion, ServiceInfo

        with self.changed:
            names = sorted(self.found)
        read, unreadable = [], []
        for service in names:
            info = ServiceInfo(SERVICE, service)
            if not info.request(self.zeroconf, LOOKUP_MS):
                continue  # gone since it was found
            txt = {key.decode(errors="replace"): (value or b"").decode(errors="replace")
                   for key, value in info.properties.items()}
            hosts = info.parsed_addresses(IPVersion.V4Only)
            try:
                read.append(Announcement.from_txt(txt, f"tcp://{hosts[0]}:{info.port}" if hosts else ""))
            except FleetError as e:
                unreadable.append(Unreadable(service.removesuffix(f".{SERVICE}"), str(e)))
        return sorted(read, key=lambda a: a.name), unreadable

    def close(self) -> None:
        self.browser.cancel()
        self.zeroconf.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_digest(config) -> str:
    """16 hex digits that tell models apart: of the config's transformers fields (`ModelConfig.to_hf_dict`)."""
    return hashlib.sha256(json.dumps(config.to_hf_dict(), sort_keys=True).encode()).hexdigest()[:16]


def announcement_for(name: str, state: str, profile: Profile, curve_keys: Path | None, model: str = "",
                     door: int | None = None) -> Announcement:
    return Announcement(name, state, __version__, PROTOCOL, key_fingerprint(curve_keys, name), profile, model, door)
