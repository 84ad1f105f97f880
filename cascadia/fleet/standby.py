"""A node that stands by with no spec of its own (`cascadia node --standby --announce`, what a PC's service runs):
it announces itself and waits at its door for a coordinator that found it to invite it into a run.

The door is a ROUTER socket (with Curve keys, open to the coordinator's key and the other nodes'). Before it plans,
a coordinator may ask the node to time its link to another node's door (PROBE, answered TIMED: `fleet.form`). An
INVITE carries the spec and the plan; the node takes the spec's model as its checkpoint's (refusing, with ERROR, a
spec of another model or one that does not name it), answers HELLO, and serves its stage of the plan, or stands by
in it as a spare, exactly as a node started with those files would (`cascadia.pipeline.node`). When that run ends,
however it ends, it stands by at its door again; what came to the door during the run is dropped, as its senders
have given up on an answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import zmq

from cascadia.errors import CascadiaError, NodeError
from cascadia.fleet.announce import Announcer, FleetError
from cascadia.pipeline.node import STANDBY
from cascadia.pipeline.transport import COORDINATOR, CurveKeys, Transport, receive, receive_waiting, send
from cascadia.pipeline.wire import (COORDINATOR_SENDER, Encoder, Error, Hello, Invite, Probe, Timed, WireError,
                                    decode)

log = logging.getLogger(__name__)
DOOR_SENDER = COORDINATOR_SENDER + 1  # the sender id of what a door, or a node timing a link, sends
PROBE_REPEATS = 3
PROBE_TIMEOUT_S = 30.0


@attrs.frozen
class Standby:
    name: str
    listen: str  # tcp://HOST:PORT of the input it binds once invited
    door: str  # tcp://HOST:PORT it is invited at
    checkpoint: Path  # its copy of the model
    curve_keys: Path | None = None  # its key folder (its own secret key, the coordinator's public key)
    threads: int | None = None
    cpus: tuple[int, ...] | None = None


def stand_by(standby: Standby, announce: Callable[[], Announcer]) -> None:
    """Open the door, then announce the node (`announce`), wait at the door for invitations, and serve each run one
    brings, until stopped (Ctrl-C, SIGTERM); time the links to other nodes when a coordinator asks, and answer their
    probes. A door that cannot open (its port taken, a key missing) stops the node before it is announced."""
    with Transport(standby.name, standby.curve_keys) as transport, contextlib.ExitStack() as announced:
        door = transport.bind(zmq.ROUTER, standby.door, _door_senders(standby.curve_keys))
        announcer = announced.enter_context(announce())
        encoder = Encoder(DOOR_SENDER)
        log.info("%s: standing by at %s for a coordinator's invitation", standby.name, standby.door)
        while True:
            route, *frames = receive(door)
            try:
                message = decode(frames).message
            except WireError as e:
                log.warning("%s: dropped a message at the door: %s", standby.name, e)
                continue
            coordinator = transport.key_owner(frames[0]) in (None, COORDINATOR)  # None: no keys, no telling
            match message:
                case Probe(data=data) if data:  # another node timing its link to this one
                    send(door, [route, *encoder.encode(Timed(standby.name))])
                case Probe() if coordinator:
                    send(door, [route, *encoder.encode(time_link(transport, standby.name, message))])
                case Invite() if coordinator:
                    try:
                        spec, plan, settings = accept(standby, message, frames[0].get("Peer-Address"))
                    except CascadiaError as e:
                        log.warning("%s: refused an invitation: %s", standby.name, e)
                        send(door, [route, *encoder.encode(Error(standby.name, str(e)))])
                        continue
                    send(door, [route, *encoder.encode(Hello(standby.name, settings.first_layer,
                                                             settings.last_layer, settings.digest, ()))])
                    serve_invited(standby, spec, plan, attrs.evolve(settings, on_state=announcer.update_state))
                    announcer.update_state(STANDBY)
                    while receive_waiting(door) is not None:
                        pass  # what came during the run: its senders have given up on an answer
                case _:
                    log.warning("%s: dropped a %s at the door: not a coordinator's", standby.name,
                                type(message).__name__.upper())


def _door_senders(curve_keys: Path | None) -> list[str]:
    """Who may connect to the door with keys in use: the coordinator, and every node of the folder (to time its
    link to this one)."""
    if curve_keys is None:
        return [COORDINATOR]
    return [COORDINATOR, *sorted(key.stem for key in CurveKeys(curve_keys).public_dir.glob("*.key"))]


def time_link(transport: Transport, name: str, probe: Probe) -> Timed | Error:
    """The best of PROBE_REPEATS times each of `probe.sizes` bytes took to reach `probe.target` and be answered;
    ERROR naming the target when it does not answer."""
    peer = transport.connect(zmq.DEALER, probe.target, probe.peer)
    encoder = Encoder(DOOR_SENDER)

    def once(size: int) -> float:
        start = time.perf_counter()
        send(peer, encoder.encode(Probe("", name, (), bytes(size))))
        if not peer.poll(PROBE_TIMEOUT_S * 1000) or receive_waiting(peer) is None:
            raise NodeError(f"{probe.peer} at {probe.target} did not answer a probe within {PROBE_TIMEOUT_S:g} s")
        return time.perf_counter() - start

    try:
        once(1)  # the connection's handshake, not timed
        return Timed(name, tuple(min(once(size) for _ in range(PROBE_REPEATS)) for size in probe.sizes))
    except NodeError as e:
        return Error(name, str(e))
    finally:
        peer.close(linger=0)


def accept(standby: Standby, invite: Invite, coordinator_host: str):
    """The spec, plan and node settings an invitation gives this node; CascadiaError saying why it cannot take
    it."""
    from cascadia.graph.planner import plan_from_dict
    from cascadia.pipeline.settings import settings_digest
    from cascadia.pipeline.stage import node_settings

    spec = invited_spec(standby, invite.spec)
    try:
        plan = plan_from_dict(json.loads(invite.plan), spec, "the invitation's plan")
    except json.JSONDecodeError as e:
        raise FleetError(f"the invitation's plan is not JSON: {e}") from None

    def here(address: str) -> str:  # "tcp://*:PORT": the coordinator's host, as this node reached it
        return f"tcp://{coordinator_host}:{address.rsplit(':', 1)[1]}" if address.startswith("tcp://*:") else address

    last = plan.stages[-1].node == standby.name
    settings = node_settings(spec, plan, standby.name, standby.listen, here(invite.control),
                             here(invite.tokens) if last else None)
    return spec, plan, attrs.evolve(settings, digest=settings_digest(spec, plan, False))


def invited_spec(standby: Standby, text: str):
    """The spec a coordinator sends (YAML), as this node runs it: the model from its own checkpoint, its own keys;
    FleetError for a spec of another model."""
    from cascadia.models import read_config
    from cascadia.spec.load import load_spec

    spec = load_spec(standby.checkpoint / "invited-spec.yaml", text=text)  # never written: names its place
    own = read_config(standby.checkpoint / "config.json")
    if own.to_hf_dict() != spec.model.config.to_hf_dict():
        raise FleetError(f"its checkpoint {standby.checkpoint} holds another model than the invitation's "
                         f"{spec.model.name!r}")
    return attrs.evolve(spec, model=attrs.evolve(spec.model, checkpoint=standby.checkpoint),
                        cluster=attrs.evolve(spec.cluster, curve_keys=standby.curve_keys))


def serve_invited(standby: Standby, spec, plan, settings) -> None:
    """One run, as a node started with the invitation's spec and plan serves it (the spec as each ASSIGN carries it
    from then on); its end, whatever the cause, is logged and the node stands by again."""
    from cascadia.pipeline.stage import serve_node

    try:
        serve_node(spec, plan, settings, standby.checkpoint, standby.threads, False, standby.cpus,
                   respec=lambda text: invited_spec(standby, text))
    except CascadiaError as e:
        log.warning("%s: the run ended: %s", standby.name, e)
