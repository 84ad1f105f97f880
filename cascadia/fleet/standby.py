"""A node that stands by with no spec of its own (`cascadia node --standby --announce`, what a PC's service runs):
it announces itself and waits at its door for a coordinator that found it to invite it into a run.

The door is a ROUTER socket (with Curve keys, open to the coordinator's key only). An INVITE carries the spec and
the plan; the node takes the spec's model as its checkpoint's (refusing, with ERROR, a spec of another model or one
that does not name it), answers HELLO, and serves its stage of the plan, or stands by in it as a spare, exactly as a
node started with those files would (`cascadia.pipeline.node`). When that run ends, however it ends, it stands by at
its door again; invitations that came during the run are dropped, as their coordinators have given up on them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import zmq

from cascadia.errors import CascadiaError
from cascadia.fleet.announce import Announcer, FleetError
from cascadia.pipeline.node import STANDBY
from cascadia.pipeline.transport import COORDINATOR, Transport, receive, receive_waiting, send
from cascadia.pipeline.wire import COORDINATOR_SENDER, Decoder, Encoder, Error, Hello, Invite, WireError

log = logging.getLogger(__name__)


@attrs.frozen
class Standby:
    name: str
    listen: str  # tcp://HOST:PORT of the input it binds once invited
    door: str  # tcp://HOST:PORT it is invited at
    checkpoint: Path  # its copy of the model
    curve_keys: Path | None = None  # its key folder (its own secret key, the coordinator's public key)
    threads: int | None = None
    cpus: tuple[int, ...] | None = None


def stand_by(standby: Standby, announcer: Announcer) -> None:
    """Wait for invitations and serve each run one brings, until stopped (Ctrl-C, SIGTERM)."""
    with Transport(standby.name, standby.curve_keys) as transport:
        door = transport.bind(zmq.ROUTER, standby.door, [COORDINATOR])
        encoder = Encoder(COORDINATOR_SENDER + 1)  # the door speaks for this node alone
        log.info("%s: standing by at %s for a coordinator's invitation", standby.name, standby.door)
        while True:
            route, *frames = receive(door)
            try:
                invite = Decoder(COORDINATOR_SENDER, (Invite,)).decode(frames).message
            except WireError as e:
                log.warning("%s: dropped a message at the door: %s", standby.name, e)
                continue
            try:
                spec, plan, settings = accept(standby, invite, frames[0].get("Peer-Address"))
            except CascadiaError as e:
                log.warning("%s: refused an invitation: %s", standby.name, e)
                send(door, [route, *encoder.encode(Error(standby.name, str(e)))])
                continue
            send(door, [route, *encoder.encode(Hello(standby.name, settings.first_layer, settings.last_layer,
                                                     settings.digest, ()))])
            serve_invited(standby, spec, plan, attrs.evolve(settings, on_state=announcer.update_state))
            announcer.update_state(STANDBY)
            while receive_waiting(door) is not None:
                pass  # invitations of coordinators that waited in vain


def accept(standby: Standby, invite: Invite, coordinator_host: str):
    """The spec, plan and node settings an invitation gives this node; CascadiaError saying why it cannot take
    it."""
    from cascadia.graph.planner import plan_from_dict
    from cascadia.models import read_config
    from cascadia.pipeline.settings import settings_digest
    from cascadia.pipeline.stage import node_settings
    from cascadia.spec.load import load_spec

    spec = load_spec(standby.checkpoint / "invited-spec.yaml", text=invite.spec)  # never written: names its place
    own = read_config(standby.checkpoint / "config.json")
    if own.to_hf_dict() != spec.model.config.to_hf_dict():
        raise FleetError(f"its checkpoint {standby.checkpoint} holds another model than the invitation's "
                         f"{spec.model.name!r}")
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, checkpoint=standby.checkpoint),
                        cluster=attrs.evolve(spec.cluster, curve_keys=standby.curve_keys))
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


def serve_invited(standby: Standby, spec, plan, settings) -> None:
    """One run, as a node started with the invitation's spec and plan serves it; its end, whatever the cause, is
    logged and the node stands by again."""
    from cascadia.pipeline.stage import serve_node

    try:
        serve_node(spec, plan, settings, standby.checkpoint, standby.threads, False, standby.cpus)
    except CascadiaError as e:
        log.warning("%s: the run ended: %s", standby.name, e)
