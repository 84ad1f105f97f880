"""Where a local node process runs: on 127.0.0.1, or in a network namespace of its own (`emulated_links`)."""

from __future__ import annotations

import attrs

from cascadia.pipeline.transport import free_port, tcp_address

LOCALHOST = "127.0.0.1"


@attrs.frozen
class NodePlace:
    """Where a local node runs: what it binds, where it is reached, how it reaches the coordinator."""

    listen: str
    address: str  # where its predecessor (the coordinator, for the first node) reaches it
    control: str  # the coordinator's control socket, as this node reaches it
    tokens: str  # the coordinator's token socket, as this node reaches it (the last node's successor)
    prefix: tuple[str, ...] = ()  # the start of its command line, e.g. to run it in a network namespace


def loopback_places(count: int, control: str, tokens: str) -> list[NodePlace]:
    """Nodes on 127.0.0.1, each on a free port."""
    addresses = [tcp_address(LOCALHOST, free_port()) for _ in range(count)]
    return [NodePlace(address, address, control, tokens) for address in addresses]
