"""A fleet that forms itself: `fleet` (what announces itself on this network), and the announcing side of `node`."""

from __future__ import annotations

import logging
from pathlib import Path

import click

log = logging.getLogger(__name__)


def _measured(checkpoint: Path, name: str):
    from cascadia.fleet.profile import measure

    profile = measure(checkpoint)
    log.info("%s: %s; announcing it", name, profile.describe())
    return profile


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def announcer(spec, settings, checkpoint: Path, interfaces: tuple[str, ...]):
    """The announcement of a node started with a spec, about to serve: its state before any run."""
    from cascadia.fleet.announce import Announcer, announcement_for, model_digest
    from cascadia.pipeline.node import STANDBY, WAITING

    state = WAITING if settings.holds_stage else STANDBY
    return Announcer(announcement_for(settings.name, state, _measured(checkpoint, settings.name),
                                      spec.cluster.curve_keys, model_digest(spec.model.config)),
                     _port(settings.listen), interfaces or None)


def stand_by_invited(name: str, listen: str, door: str | None, checkpoint: Path, keys: Path | None,
                     memory: int | None, threads: int | None, cpus: tuple[int, ...] | None,
                     interfaces: tuple[str, ...]) -> None:
    """A node with no spec: announced (offering at most `memory` bytes), at its door, until stopped."""
    import attrs

    from cascadia.fleet.announce import Announcer, announcement_for, model_digest
    from cascadia.fleet.standby import Standby, stand_by
    from cascadia.models import read_config
    from cascadia.pipeline.node import STANDBY

    model = model_digest(read_config(checkpoint / "config.json"))
    door = door or f"{listen.rsplit(':', 1)[0]}:{_port(listen) + 1}"
    profile = _measured(checkpoint, name)
    if memory is not None:
        profile = attrs.evolve(profile, memory_bytes=min(memory, profile.memory_bytes))
    announcement = announcement_for(name, STANDBY, profile, keys, model, _port(door))
    stand_by(Standby(name, listen, door, checkpoint, keys, threads, cpus),
             lambda: Announcer(announcement, _port(listen), interfaces or None))


@click.command("fleet")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=3.0, show_default=True,
              help="how long to listen for announcements")
@click.option("--expect", type=click.IntRange(min=1),
              help="stop listening once this many nodes answered; fewer within --seconds is an error")
@click.option("--interface", "interfaces", multiple=True, metavar="IP",
              help="listen on the interface with this IPv4 address (repeatable; default: every one)")
@click.option("--json", "as_json", is_flag=True, help="print the nodes as JSON")
def fleet(seconds: float, expect: int | None, interfaces: tuple[str, ...], as_json: bool) -> None:
    """List the Cascadia nodes that announce themselves on this network (`cascadia node --announce`): name,
    address, what it does (standing by, serving a run, waiting for one), device and precision, cores, free memory,
    measured memory and disk speeds and compute, Cascadia version and Curve key fingerprint."""
    import json

    from cascadia.errors import CascadiaError
    from cascadia.fleet.announce import Browser
    from cascadia.fleet.listing import fleet_json, fleet_table

    with Browser(interfaces or None) as browser:
        browser.wait(seconds, expect)
        found, unreadable = browser.announcements()
    click.echo(json.dumps(fleet_json(found, unreadable), indent=2) if as_json else fleet_table(found, unreadable))
    if expect is not None and len(found) < expect:
        raise CascadiaError(f"{expect} nodes expected, {len(found)} answered within {seconds:g} s (see `cascadia "
                            "fleet --help` and the fleet guide for what keeps a node from showing)")

