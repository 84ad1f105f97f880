"""ZeroMQ sockets for the pipeline, optionally authenticated and encrypted with CurveZMQ.

Each node binds a PULL socket for its input and connects a PUSH socket to its successor (the last node's successor
is the coordinator's token socket); the coordinator binds a ROUTER for control and each node connects a DEALER
named after itself. The binding side is the Curve server, and a client must know the public key of the server it
connects to. With keys, each bound socket accepts only the peers that send there, by their public keys in the key
folder's `public/` directory: a node's input only the previous stage's node (the first's: the coordinator), the
token socket only the last node, the control socket only the members, each under its own name. Anyone else's
handshake is refused, whichever key of the folder it holds. On the control socket (a ROUTER) a peer is known by the
key it made its connection with (`key_owner`, from ZAP's User-Id), never by a name it gives itself: with keys the
DEALERs give none, the ROUTER numbers their connections, and a connection that names itself is an impostor's.

Without keys nothing is authenticated or encrypted: whoever reaches a port can read what passes and send what a
peer would (see the README's security paragraph).

Key folder layout (made by `generate_keys`, named by `ClusterSpec.curve_keys`):
  public/NAME.key          every participant's public key; copy the whole folder to every machine
  secret/NAME.key_secret   each participant's secret key; a machine needs only its own
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cascadia.errors import NodeError
from cascadia.pipeline.wire import DEFAULT_MAX_MESSAGE_BYTES

COORDINATOR = "coordinator"  # the name under which the coordinator holds Curve keys
_KEY_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_LINGER_MS = 1000  # on close, how long queued messages may still go out before they are dropped
# A connecting socket pings its peer this often, and drops the connection after this long without an answer (the
# peer's ZeroMQ answers by itself, however busy its process): a machine that vanished without closing its
# connections is noticed too.
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0


class TransportError(NodeError):
    """A socket could not be bound, connected, or could not deliver; the text names the address."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago and that this process has not handed out before (for tests
    and local nodes). It lies below the kernel's ephemeral range where there is room: a port from that range can be
    taken between choosing and binding it by any outgoing connection, even by a peer's connection to itself (TCP's
    simultaneous open, when it connects before the listener is up)."""
    first, end = _FIRST_PORT, _ephemeral_ports()[0]
    for _ in range(1000):
        with socket.socket() as s:
            try:
                s.bind((host, _draw.randrange(first, end) if end - first >= 1000 else 0))
            except OSError:  # taken: draw again
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise TransportError(f"no free TCP port on {host}")


_FIRST_PORT = 10000  # below: the ports services commonly listen on
_handed_out: set[int] = set()
_draw = random.SystemRandom()  # the OS's randomness: no seed that processes could share, so no shared sequence


@functools.cache  # read once a process, not on every port
def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; elsewhere the IANA range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


@attrs.frozen
class CurveKeys:
    folder: Path = attrs.field(converter=Path)

    @property
    def public_dir(self) -> Path:
        return self.folder / "public"

    def public_key(self, name: str) -> bytes:
        return self._load(self.public_dir / f"{name}.key")[0]

    def keypair(self, name: str) -> tuple[bytes, bytes]:
        public, secret = self._load(self.folder / "secret" / f"{name}.key_secret")
        if secret is None:
            raise TransportError(f"{self.folder / 'secret' / f'{name}.key_secret'}: no secret key in this file")
        return public, secret

    @staticmethod
    def _load(path: Path) -> tuple[bytes, bytes | None]:
        try:
            return zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise TransportError(f"{path}: cannot read Curve key ({e})") from None


def generate_keys(folder: str | Path, names: Iterable[str]) -> list[Path]:
    """Make a Curve key pair for each name in `folder` (public/ and secret/); refuse to overwrite existing keys."""
    folder = Path(folder)
    public_dir, secret_dir = folder / "public", folder / "secret"
    names = list(dict.fromkeys(names))
    for name in names:
        if not _KEY_NAME.fullmatch(name):
            raise TransportError(f"{name!r}: a key name is letters, digits, '_', '-' or '.', not starting with '.'")
        for path in (public_dir / f"{name}.key", secret_dir / f"{name}.key_secret"):
            if path.exists():
                raise TransportError(f"{path}: already exists; remove it to make new keys")
    written = []
    try:
        public_dir.mkdir(parents=True, exist_ok=True)
        secret_dir.mkdir(parents=True, exist_ok=True)
        secret_dir.chmod(0o700)
        for name in names:
            public, secret = zmq.auth.create_certificates(secret_dir, name)
            os.chmod(secret, 0o600)
            written += [Path(shutil.move(public, public_dir / f"{name}.key")), Path(secret)]
    except OSError as e:
        raise TransportError(f"{e.filename or folder}: cannot write keys ({e.strerror or e})") from None
    return written


class _AllowedKeys:
    """The ZAP check of one bound socket: a client's (Z85-encoded) public key must be one of its senders'."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class Transport:
    """One process's ZeroMQ context and sockets. `name` is whose Curve keys to use when `curve_keys` is given."""

    def __init__(self, name: str, curve_keys: str | Path | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, send_timeout_s: float = 10.0):
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.send_timeout_s = send_timeout_s
        self.curve = None if curve_keys is None else CurveKeys(curve_keys)
        self._keypair = None if self.curve is None else self.curve.keypair(name)
        self.context = zmq.Context()
        self._authenticator = None
        self._allowed: dict[str, _AllowedKeys] = {}  # by bound address: whose keys may connect there
        self._key_owners: dict[str, str] = {}  # Z85 public key -> its name in the folder, as they are looked up
        if self.curve is not None:
            if not zmq.has("curve"):
                raise TransportError("this libzmq was built without CurveZMQ; cannot use curve_keys")
            if not self.curve.public_dir.is_dir():
                raise TransportError(f"{self.curve.public_dir}: no such folder of public keys")
            # Without a running authenticator a Curve server would accept any client key. Each bound socket gets a
            # ZAP domain of its own, allowing only its senders' keys (`bind`); no other domain allows any.
            self._authenticator = ThreadAuthenticator(self.context)
            self._authenticator.start()

    def bind(self, socket_type: int, address: str, senders: Sequence[str],
             heartbeat_timeout_s: float | None = None) -> zmq.Socket:
        """A socket bound to `address`, the Curve server side when keys are in use, accepting connections only from
        `senders` (names in the key folder; without keys, from anyone). With `heartbeat_timeout_s` it pings each peer
        and drops the connection of one that answers nothing for that long: a stopped process, a vanished machine
        (ZeroMQ's I/O thread answers, so a peer busy in its own code still does)."""
        return self.bind_watched(socket_type, address, senders, 0, heartbeat_timeout_s)[0]

    def bind_watched(self, socket_type: int, address: str, senders: Sequence[str], events: int,
                     heartbeat_timeout_s: float | None = None) -> tuple[zmq.Socket, zmq.Socket | None]:
        """`bind`, with a monitor socket reporting the connections' `events` (none: no monitor)."""
        sock = self._socket(socket_type)
        if heartbeat_timeout_s is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, round(heartbeat_timeout_s * 250)))  # four pings a timeout
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(heartbeat_timeout_s * 1000))
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an unknown peer raises instead of vanishing
            # Without keys a node started again takes its name over from its lost self (with keys a peer has no name
            # of its own choosing: see the module's text).
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._keypair is not None:
            sock.curve_publickey, sock.curve_secretkey = self._keypair
            sock.curve_server = True
            sock.zap_domain = address.encode()  # one socket binds an address: its domain is its own
            self._allowed[address] = _AllowedKeys({self.curve.public_key(name) for name in senders})
            self._authenticator.configure_curve_callback(address, self._allowed[address])
        monitor = sock.get_monitor_socket(events) if events else None
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            reason = "address already in use" if e.errno == zmq.EADDRINUSE else e.strerror
            raise TransportError(f"cannot listen on {address}: {reason}") from None
        return sock, monitor

    def allow(self, address: str, senders: Sequence[str]) -> None:
        """From now on, the socket bound to `address` accepts new connections only from `senders` (without keys,
        from anyone, as before)."""
        if address in self._allowed:
            self._allowed[address].keys = {self.curve.public_key(name) for name in senders}

    def key_owner(self, frame: zmq.Frame) -> str | None:
        """The name whose Curve key made the connection a message (`frame`, one of its parts) came over, from ZAP's
        User-Id (the key in Z85); None without keys, or for a key under no name of the folder."""
        if self.curve is None:
            return None
        try:
            key = frame.get("User-Id")
        except zmq.ZMQError:  # no such property: not over a Curve connection
            return None
        if key not in self._key_owners:
            for path in self.curve.public_dir.glob("*.key"):
                try:
                    self._key_owners[self.curve.public_key(path.stem).decode()] = path.stem
                except TransportError:  # an unreadable key file names no one
                    continue
        return self._key_owners.get(key)

    def connect(self, socket_type: int, address: str, peer: str) -> zmq.Socket:
        """A socket connected to `address`, where `peer` (a name in the key folder) listens. Messages are queued
        only for a completed connection, so a send to an absent or refusing peer times out (see `send`)."""
        return self.connect_watched(socket_type, address, peer, 0)[0]

    def connect_watched(self, socket_type: int, address: str, peer: str, events: int,
                        send_timeout_s: float | None = None) -> tuple[zmq.Socket, zmq.Socket | None]:
        """`connect`, with its own send timeout (default: the transport's), and a monitor socket reporting the
        connection's `events` (none: no monitor), attached before the connection is made: a monitor attached
        afterwards can miss a handshake that was quick."""
        sock = self._socket(socket_type)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, round((send_timeout_s or self.send_timeout_s) * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, round(HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(HEARTBEAT_TIMEOUT_S * 1000))
        if socket_type == zmq.DEALER and self._keypair is None:  # with keys the ROUTER knows us by our key
            sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        if self._keypair is not None:
            sock.curve_publickey, sock.curve_secretkey = self._keypair
            sock.curve_serverkey = self.curve.public_key(peer)
        monitor = sock.get_monitor_socket(events) if events else None
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {peer} at {address}: {e.strerror}") from None
        return sock, monitor

    def _socket(self, socket_type: int) -> zmq.Socket:
        sock = self.context.socket(socket_type)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        # ZeroMQ drops (and disconnects) any single frame above the limit before it is held in memory.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return sock

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.destroy(linger=_LINGER_MS)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unreachable(sock: zmq.Socket) -> TransportError:
    where = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    timeout_s = sock.getsockopt(zmq.SNDTIMEO) / 1000
    return TransportError(f"{where} unreachable: no connection accepted the message within {timeout_s:g} s "
                          "(not listening, or refusing our Curve key)")


def send(sock: zmq.Socket, frames: Sequence) -> None:
    """Send one message's frames without copying large buffers; raise TransportError naming the peer's address
    when it cannot be delivered within the socket's send timeout."""
    try:
        sock.send_multipart(frames, copy=False)
    except zmq.Again:
        raise _unreachable(sock) from None
    except zmq.ZMQError as e:
        if e.errno != zmq.EHOSTUNREACH:
            raise
        # A ROUTER addressed a peer (the first frame) that is not connected.
        raise TransportError(f"{bytes(frames[0]).decode(errors='replace')} is not connected to "
                             f"{sock.getsockopt_string(zmq.LAST_ENDPOINT)}") from None


def send_watching(sock: zmq.Socket, frames: Sequence, watch: Callable[[], bool], poll_s: float) -> bool:
    """`send` on a connecting socket (its connection made with IMMEDIATE), calling `watch()` every `poll_s` while
    no connection takes the message: `watch` may raise, or return False to give the message up (then False is
    returned). So a process waiting on a peer that is gone still hears of its run ending or its parent dying."""
    deadline = time.monotonic() + sock.getsockopt(zmq.SNDTIMEO) / 1000
    while not sock.poll(round(poll_s * 1000), zmq.POLLOUT):
        if not watch():
            return False
        if time.monotonic() > deadline:
            raise _unreachable(sock)
    send(sock, frames)
    return True


def receive(sock: zmq.Socket) -> list[zmq.Frame]:
    """One message's frames, without copying them; waits for one."""
    return sock.recv_multipart(copy=False)


def receive_waiting(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """The frames of a message already waiting, or None: what to call after a poll, which can report a socket
    readable with nothing to take (seen with CurveZMQ; a receive that waits would then wait for ever)."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
