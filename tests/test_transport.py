import shutil

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

from cascadia.cli import cli
from cascadia.pipeline.transport import (_FIRST_PORT, Transport, TransportError, _ephemeral_ports, free_port,
                                         generate_keys, receive, send, tcp_address)
from cascadia.pipeline.wire import Encoder, Frame, Shutdown, decode

NO_DELIVERY_WAIT_MS = 500  # how long a refused client is given to (wrongly) get a message through


@pytest.fixture
def transports():
    """Make Transports that are closed when the test ends, however it ends."""
    made = []

    def make(*args, **kwargs) -> Transport:
        made.append(Transport(*args, **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture
def address():
    return tcp_address("127.0.0.1", free_port())


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    generate_keys(folder, ["server", "client"])
    return folder


def test_free_ports_are_distinct_and_outside_the_kernels_ephemeral_range():
    """A port the kernel may give an outgoing connection, or one handed out twice, lets a node's listener lose its
    port between choosing and binding (CI saw it: two links' ends, "address already in use")."""
    ports = [free_port() for _ in range(300)]  # from ~20k ports at random, 300 draws repeat one 6 times in 7
    assert len(set(ports)) == len(ports)
    low, high = _ephemeral_ports()
    if low - _FIRST_PORT >= 1000:  # room below the range (Linux's default starts at 32768); else the kernel picks
        assert not any(low <= port <= high for port in ports)


def test_frame_crosses_a_push_pull_hop(transports, address):
    server, client = transports("server"), transports("client")
    pull = server.bind(zmq.PULL, address, ["client"])
    push = client.connect(zmq.PUSH, address, "server")
    residual = np.arange(3 * 1024, dtype=np.float32).reshape(3, 1024)  # above ZeroMQ's copy threshold
    frame = Frame(9, 2, [0, 1, 2], [5, 6, 7], [1, 2, 3], [False, False, True], residual)
    send(push, Encoder(sender=7, start=0).encode(frame))
    assert pull.poll(5000)
    received = decode(receive(pull))
    assert (received.sender, received.seq, received.message.frame_id) == (7, 1, 9)
    np.testing.assert_array_equal(received.message.residual, residual)


def test_address_in_use_is_named(transports, address):
    taken = transports("first").bind(zmq.PULL, address, [])  # noqa: F841 (kept: a collected socket would free the port)
    with pytest.raises(TransportError, match=f"cannot listen on {address}: address already in use"):
        transports("second").bind(zmq.PULL, address, [])


def test_unreachable_peer_is_named(transports, address):
    push = transports("client", send_timeout_s=0.2).connect(zmq.PUSH, address, "nobody")
    with pytest.raises(TransportError, match=f"{address} unreachable"):
        send(push, Encoder(0).encode(Shutdown()))


def test_router_names_a_peer_that_is_not_connected(transports, address):
    router = transports("coordinator").bind(zmq.ROUTER, address, [])
    with pytest.raises(TransportError, match="ghost is not connected"):
        send(router, [b"ghost", *Encoder(0).encode(Shutdown())])


def test_curve_client_with_a_known_key_talks(transports, address, keys):
    pull = transports("server", keys).bind(zmq.PULL, address, ["client"])
    push = transports("client", keys).connect(zmq.PUSH, address, "server")
    send(push, [b"hello"])
    assert pull.poll(5000)
    assert receive(pull)[0].bytes == b"hello"


@pytest.fixture
def stranger_keys(tmp_path, keys):
    """A key folder holding a "client" key the server has never seen, and the server's real public key."""
    generate_keys(tmp_path, ["client"])
    shutil.copy(keys / "public" / "server.key", tmp_path / "public" / "server.key")
    return tmp_path


@pytest.mark.parametrize("client_keys", ["stranger", "none"])
def test_curve_server_refuses_clients_without_a_known_key(transports, address, keys, stranger_keys, client_keys):
    pull = transports("server", keys).bind(zmq.PULL, address, ["client"])
    client = transports("client", stranger_keys if client_keys == "stranger" else None, send_timeout_s=0.3)
    push = client.connect(zmq.PUSH, address, "server")
    with pytest.raises(TransportError, match="unreachable"):
        send(push, [b"let me in"])
    assert not pull.poll(NO_DELIVERY_WAIT_MS)


def test_missing_key_file_is_named(keys):
    with pytest.raises(TransportError, match=r"secret/stranger\.key_secret: cannot read Curve key"):
        Transport("stranger", keys)


def test_keys_generate_command(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["keys", "generate", str(tmp_path / "k"), "--nodes", "a,b"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "k" / "public").iterdir()) == ["a.key", "b.key", "coordinator.key"]
    assert (tmp_path / "k" / "secret" / "b.key_secret").stat().st_mode & 0o077 == 0
    again = runner.invoke(cli, ["keys", "generate", str(tmp_path / "k"), "--nodes", "b"])
    assert again.exit_code == 1 and "b.key: already exists" in again.output
    bad = runner.invoke(cli, ["keys", "generate", str(tmp_path / "k2"), "--nodes", "a,../x"])
    assert bad.exit_code == 1 and "'../x': a key name is" in bad.output


@pytest.mark.parametrize("folder, reason", [("/proc/nope", "No such file or directory"),
                                            ("{file}/keys", "Not a directory")])
def test_keys_where_none_can_be_written_is_one_error(tmp_path, folder, reason):
    (tmp_path / "file").write_text("")
    folder = folder.format(file=tmp_path / "file")
    result = CliRunner().invoke(cli, ["keys", "generate", folder, "--nodes", "a"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and f"cannot write keys ({reason})" in result.stderr
    assert isinstance(result.exception, SystemExit)  # a message, not a traceback
