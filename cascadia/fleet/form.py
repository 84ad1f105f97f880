"""`serve --discover`: a fleet formed from the nodes that announce themselves, instead of one written by hand.

The coordinator listens for announcements (`fleet.announce`), keeps the nodes it can use (`why_not`: standing by at
a door, this build's protocol, a checkpoint of the spec's model, and with Curve keys in use the key the keys folder
holds under the node's name), and writes them into the spec's cluster as they measured themselves: address, door,
free memory, memory bandwidth, compute and disk speed (`choose`). The `spares` with the least memory stand by as
spares; the others hold stages, in name order, each timing its link to the next (`measure_links`), as the planner
places layers on them. Then it invites each node (`invite`, answered at `fleet.standby`'s door) with the spec and
plan, and the run starts as one over nodes started by hand does; while it serves, a node that announces itself
later joins as a spare (`LateJoiner`). Nodes it cannot use are named with why. A spec saved of a fleet that formed
names each node's door, so it is served again as it is: every node with a door is invited.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Collection, Sequence

import attrs
import zmq

from cascadia.errors import CascadiaError, NodeError
from cascadia.fleet.announce import Announcement, Browser, FleetError, key_fingerprint, model_digest
from cascadia.fleet.profile import significant
from cascadia.fleet.standby import DOOR_SENDER
from cascadia.graph.plan import Plan
from cascadia.pipeline.node import STANDBY
from cascadia.pipeline.coordinator import PipelineError
from cascadia.pipeline.transport import COORDINATOR, Transport, receive_waiting, send
from cascadia.pipeline.wire import (COORDINATOR_SENDER, VERSION, Decoder, Encoder, Error, Hello, Invite, Probe, Timed,
                                    WireError)
from cascadia.spec.dump import spec_for_nodes
from cascadia.spec.types import LinkSpec, NodeSpec, Spec
from cascadia.units import format_duration, format_rate

log = logging.getLogger(__name__)
PROBE_SIZES = (2**16, 2**20)  # bytes; 1 MiB crosses gigabit Ethernet in 8 ms
JOIN_POLL_S = 1.0  # how often a late node that could not join yet (the pipeline was not serving) is looked at again
JOIN_TIMEOUT_S = 10.0  # how long taking a late node in, and its answer to the invitation, may take


@attrs.frozen
class Formed:
    spec: Spec  # its cluster: the nodes chosen, then the spares
    chosen: tuple[Announcement, ...]  # in the cluster's order of members
    passed_over: tuple[tuple[str, str], ...]  # (name, why) of the nodes found but not used


def why_not(spec: Spec, found: Announcement) -> str | None:
    """Why this spec's run cannot use a node that announced itself, or None when it can."""
    keys = spec.cluster.curve_keys
    if not found.compatible:
        return f"it runs Cascadia {found.version}, protocol {found.protocol}; this build speaks protocol {VERSION}"
    if found.door is None:
        return "it serves a spec of its own (started with --spec), not standing by for an invitation"
    if found.state != STANDBY:
        return f"it is {found.state} in another coordinator's run"
    if found.model != model_digest(spec.model.config):
        return (f"its checkpoint holds another model (digest {found.model or 'none'}; {spec.model.name}'s is "
                f"{model_digest(spec.model.config)})")
    if keys is None:
        return "it uses Curve keys and this spec's cluster names none" if found.key else None
    try:
        expected = key_fingerprint(keys, found.name)
    except CascadiaError:
        return f"its name has no public key in {keys / 'public'}"
    if found.key != expected:
        return f"its Curve key (fingerprint {found.key or 'none'}) is not the one {keys / 'public'} holds ({expected})"
    return None


def choose(spec: Spec, found: Sequence[Announcement], spares: int) -> Formed:
    """The spec with the usable nodes of `found` as its cluster, `spares` of them (the least memory) as spares.
    FleetError when fewer than `spares` + 1 are usable."""
    passed_over = tuple((a.name, why) for a in found if (why := why_not(spec, a)) is not None)
    usable = [a for a in found if a.name not in dict(passed_over)]
    if len(usable) <= spares:
        also = "".join(f"; {name}: {why}" for name, why in passed_over)
        raise FleetError(f"{len(usable)} usable nodes answered, and {spares} are to stand by as spares: none is left "
                         f"to hold the model{also}")
    by_memory = sorted(usable, key=lambda a: (-a.profile.memory_bytes, a.name))
    holders = sorted(by_memory[:len(usable) - spares], key=lambda a: a.name)
    standing_by = sorted(by_memory[len(usable) - spares:], key=lambda a: a.name)
    cluster = attrs.evolve(spec.cluster, nodes=tuple(map(node_spec, holders)),
                           spares=tuple(map(node_spec, standing_by)), links={}, discover=False)
    return Formed(attrs.evolve(spec, cluster=cluster), tuple(holders + standing_by), passed_over)


def node_spec(found: Announcement) -> NodeSpec:
    p = found.profile
    return NodeSpec(found.name, address=found.address, device=p.device, memory_bytes=p.memory_bytes,
                    memory_bandwidth=p.memory_bandwidth, compute_flops=p.compute_flops, disk_bandwidth=p.disk_bandwidth,
                    door=found.door_address)


def discover(spec: Spec, browser: Browser, seconds: float, expect: int | None, spares: int) -> Formed:
    """Listen `seconds` (or until `expect` nodes answered) and form the fleet of what answered."""
    browser.wait(seconds, expect)
    found, unreadable = browser.announcements()
    for u in unreadable:
        log.warning("%s: cannot read its announcement: %s", u.service, u.reason)
    if not found:
        raise FleetError(f"no Cascadia node answered within {seconds:g} s (is each PC's node started with "
                         "--standby --announce, and on this network segment?)")
    formed = choose(spec, found, spares)
    for name, why in formed.passed_over:
        log.warning("%s: not used: %s", name, why)
    log.info("formed a fleet of %s", ", ".join(f"{a.name} at {a.address}" for a in formed.chosen))
    return formed


def measure_links(formed: Formed, timeout_s: float) -> Formed:
    """`formed` with the link between each pair of consecutive nodes (in the cluster's order) as measured: the first
    node times PROBE_SIZES bytes to the second's door (`fleet.standby.time_link`), one pair at a time. Of the two
    sizes' times t = 2 * latency + size / bandwidth."""
    doors = {node.name: node.door for node in formed.spec.cluster.members}
    nodes = [node.name for node in formed.spec.cluster.nodes]
    links = {}
    with Transport(COORDINATOR, formed.spec.cluster.curve_keys) as transport:
        for a, b in itertools.pairwise(nodes):
            (timed,) = _ask(transport, {a: doors[a]}, Probe(doors[b], b, PROBE_SIZES), timeout_s,
                            f"the probe of its link to {b}").values()
            link = links[tuple(sorted((a, b)))] = link_of(PROBE_SIZES, timed.seconds)
            log.info("link %s -> %s: %s, %s one way", a, b, format_rate(link.bandwidth, bits=True, digits=3),
                     format_duration(link.latency, digits=2))
    return attrs.evolve(formed, spec=attrs.evolve(formed.spec, cluster=attrs.evolve(formed.spec.cluster,
                                                                                    links=links)))


def link_of(sizes: tuple[int, int], seconds: tuple[float, float]) -> LinkSpec:
    """The link whose round trips took `seconds` for `sizes` bytes there (and a few back)."""
    (small, large), (t_small, t_large) = sizes, seconds
    bandwidth = (large - small) / (t_large - t_small) if t_large > t_small else large / t_large
    return LinkSpec(significant(bandwidth), significant(max(t_small - small / bandwidth, 0.0) / 2))


def invite(spec: Spec, plan: Plan, control: str, tokens: str, timeout_s: float,
           only: Collection[str] | None = None) -> None:
    """Invite every member of the spec's cluster with a door (or those of them named in `only`) into the run of
    `spec` and `plan`, whose coordinator binds `control` and `tokens` (tcp://0.0.0.0:PORT: each node reaches it at
    the host it reached the invitation from). NodeError naming the node that refuses or does not answer within
    `timeout_s`."""
    only = {node.name for node in spec.cluster.members} if only is None else only
    message = Invite(spec_for_nodes(spec), json.dumps(plan.to_dict()), _any_host(control), _any_host(tokens))
    with Transport(COORDINATOR, spec.cluster.curve_keys) as transport:
        _ask(transport, {node.name: node.door for node in spec.cluster.members if node.door and node.name in only},
             message, timeout_s, "the invitation")


def _ask(transport: Transport, doors: dict[str, str], message: Invite | Probe, timeout_s: float,
         what: str) -> dict[str, Hello | Timed]:
    """Send `message` to each node's door and wait for every answer; NodeError naming a node that refuses (ERROR)
    or does not answer within `timeout_s`."""
    sockets = {name: transport.connect(zmq.DEALER, door, name) for name, door in doors.items()}
    poller = zmq.Poller()
    for sock in sockets.values():
        send(sock, Encoder(COORDINATOR_SENDER).encode(message))
        poller.register(sock, zmq.POLLIN)
    answers, deadline = {}, time.monotonic() + timeout_s
    while len(answers) < len(sockets) and (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(left * 1000))
        for name, sock in sockets.items():
            if name not in answers and sock in ready and (frames := receive_waiting(sock)) is not None:
                answers[name] = _answer(name, frames, what)
    for sock in sockets.values():
        sock.close(linger=0)
    if missing := sorted(set(sockets) - set(answers)):
        raise NodeError(f"{', '.join(missing)} did not answer {what} within {timeout_s:g} s")
    return answers


def _answer(name: str, frames, what: str) -> Hello | Timed:
    try:
        answer = Decoder(DOOR_SENDER, (Hello, Timed, Error)).decode(frames).message
    except WireError as e:
        raise NodeError(f"{name}: its answer to {what} does not decode: {e}") from None
    if isinstance(answer, Error):
        raise NodeError(f"{name} refused {what}: {answer.text}")
    return answer


def _any_host(address: str) -> str:
    """tcp://*:PORT for an address bound on every interface, which each node reaches at a host of its own."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return f"tcp://*:{port}" if host in ("0.0.0.0", "*") else address


class LateJoiner:
    """While a fleet that formed itself serves: a node that announces itself later, and that the run can use
    (`why_not`), joins as a spare: taken into the cluster (`PipelineService.add_spare`), then invited with the spec
    that names it. One that does not take the invitation is logged, and never given a stage."""

    def __init__(self, browser: Browser, service, control: str, tokens: str, timeout_s: float):
        self.browser, self.service = browser, service
        self.control, self.tokens = control, tokens
        self.timeout_s = min(timeout_s, JOIN_TIMEOUT_S)  # what a stopping server may wait on a late node
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="cascadia-late-joiner", daemon=True)

    def _watch(self) -> None:
        seen, pending = -1, True
        while not self.stopped.is_set():
            changes = self.browser.wait_change(seen, JOIN_POLL_S)
            pending, seen = pending or changes != seen, changes
            if not pending or not self.service.status().ready:
                continue  # nothing new; or not serving yet (a start, a recovery): looked at once it is again
            pending = False
            found, _ = self.browser.announcements()
            members = {node.name for node in self.service.spec.cluster.members}
            for late in found:
                if late.name in members or why_not(self.service.spec, late) is not None:
                    continue
                try:
                    spec, plan = self.service.add_spare(node_spec(late), self.timeout_s)
                except PipelineError:  # no longer serving (a stage lost meanwhile): looked at again once it is
                    pending = True
                    continue
                try:
                    invite(spec, plan, self.control, self.tokens, self.timeout_s, only={late.name})
                    log.info("%s joined the fleet as a spare", late.name)
                except CascadiaError as e:  # a member now, which never says READY: it is not given a stage
                    log.warning("%s: could not join the fleet: %s", late.name, e)

    def __enter__(self) -> LateJoiner:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
