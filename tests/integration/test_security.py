"""Keys, private ipc directories and CURVE authentication over real tcp sockets."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from rlix_async.protocol import Kind, Ping, Pong, encode, hello
from rlix_async.security import (
    ClientKeys,
    SecurityError,
    ServerKeys,
    check_endpoint,
    ipc_dir,
    keygen,
)
from rlix_async.transport import RpcClient, RpcServer


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_keygen_files_are_private(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    written = keygen(keys, ["driver", "worker"])
    assert mode(keys) == 0o700 and mode(keys / "authorized") == 0o700
    assert {p.name for p in written} >= {"server.key_secret", "driver.key", "worker.key_secret"}
    assert all(mode(p) == 0o600 for p in written)
    assert {p.name for p in (keys / "authorized").iterdir()} == {
        "driver.key",
        "driver.role",
        "worker.key",
        "worker.role",
    }
    assert (keys / "authorized" / "driver.role").read_text() == "admin\n"  # the default role
    assert keygen(keys, ["driver"]) == []  # idempotent: never overwrites a key or role
    written = keygen(keys, ["drv-a"], role="driver", pipelines=["a", "b"])
    assert (keys / "authorized" / "drv-a.role").read_text() == "driver a,b\n"
    with pytest.raises(SecurityError, match="expected one of"):
        keygen(keys, ["x"], role="root")


def test_loose_secret_key_refused(tmp_path: Path) -> None:
    keygen(tmp_path / "k")
    os.chmod(tmp_path / "k" / "server.key_secret", 0o644)
    with pytest.raises(SecurityError, match="must be 0600"):
        ServerKeys.load(tmp_path / "k")


def test_tcp_without_keys_refused() -> None:
    with pytest.raises(SecurityError, match="rlix-async keygen"):
        RpcServer("tcp://127.0.0.1:0")
    with pytest.raises(SecurityError, match="tcp endpoints need CURVE keys"):
        RpcClient("tcp://127.0.0.1:5555", "a/b/0")


def test_ipc_dir_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert mode(ipc_dir()) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(SecurityError, match="must be private"):
        check_endpoint(f"ipc://{shared}/coord.sock", None)
    monkeypatch.setenv("RLIX_IPC_DIR", str(shared))
    with pytest.raises(SecurityError):
        ipc_dir()


async def test_curve_authenticated_client_works(spawn, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keygen(keys)
    server = spawn("server", "tcp://127.0.0.1:0", "--keys", str(keys))
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    async with RpcClient(server.endpoint, "n1/driver/0", keys=ClientKeys.load(keys)) as client:
        assert await client.call(Ping(seq=5)) == Pong(seq=5)


async def test_unauthenticated_tcp_peer_refused(spawn, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keygen(keys, ["client", "intruder"])
    (keys / "authorized" / "intruder.key").unlink()  # a key the server does not accept
    server = spawn("server", "tcp://127.0.0.1:0", "--keys", str(keys))

    intruder = RpcClient(server.endpoint, "evil/driver/0", keys=ClientKeys.load(keys, "intruder"))
    with pytest.raises(ConnectionError, match="refused our key"):
        await intruder.connect(timeout=5)
    await intruder.close()

    # A plain socket without CURVE never completes the handshake: it gets nothing.
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.IDENTITY, b"evil/raw/0")
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(server.endpoint)
    plain.send(encode(Kind.REQUEST, 1, hello("evil/raw/0")))
    assert plain.poll(1500) == 0
    plain.close()
    ctx.term()

    # The legitimate client is still served.
    async with RpcClient(server.endpoint, "n1/driver/0", keys=ClientKeys.load(keys)) as client:
        assert await client.call(Ping(seq=1)) == Pong(seq=1)


async def test_keys_are_for_tcp_only_an_ipc_peer_speaks_plain(
    spawn, tmp_path: Path, ipc_ep: str
) -> None:
    """A client holding keys (a router of a pipeline whose coordinator is on tcp) reaches
    a keyless ipc server on its own node: the transport uses CURVE on tcp only, where a
    CURVE handshake against a plain ipc peer would fail."""
    keys = tmp_path / "keys"
    keygen(keys)
    server = spawn("server", ipc_ep)
    async with RpcClient(server.endpoint, "n1/router/0", keys=ClientKeys.load(keys)) as client:
        assert await client.call(Ping(seq=7), timeout=10) == Pong(seq=7)
