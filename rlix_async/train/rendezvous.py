"""Where a pipeline's trainer ranks meet: a sealed store of their own, on loopback only.

torchrun's agent store cannot be trusted with a step: its server binds every
interface whatever host it is given (TCPStore's server ignores it) and admits
anyone, so a peer on the network could post a batch or join a step's process
group. The ranks use it only to find rank 0's private store:

1. rank 0 starts a sealed store (``train/trainer_store.py``: only a process holding
   its fresh 32-byte secret can open a session) on 127.0.0.1, writes the port, the
   secret and a fresh nonce to a 0600 file in the run directory, puts the nonce in
   its own store, then posts the nonce on the agent store;
2. a follower waits for the agent store's nonce, reads the file, and goes on only if
   the file's nonce is the posted one (a file left by an earlier launch, or a nonce
   someone else posted, is refused in one line); it opens a session with the
   file's secret (which also proves the server holds it) and reads the nonce back
   from the store it reached.

Every per-step process group and the batch hand-over (``train/batches.py``) live
on that store, and the ranks' own gloo/NCCL links are pinned to the loopback
interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``; a value the user set
stands). A torchrun job spanning nodes is refused here. The store lives in rank 0's
process: when rank 0 leaves, the file goes, and a follower still waiting on the
store stops with one line (``train/batches.py``).

A trainer across nodes (:func:`meet_across`) is a ``--standalone`` torchrun job per
node, told by the launcher where its ranks stand; no torchrun store spans the nodes.
Rank 0 serves the sealed store on its node's address at a port the config fixes
(``trainer_endpoint``); every rank derives the same secret from the pipeline's
driver key and the run's job id (:func:`trainer_store_secret`), so no file has to
cross nodes, and the job id read back proves the store is this run's. The ranks'
links use the interface holding the node's address (:func:`pin_links_to`).

What this does not close: the nonce proves freshness, not who posted it (torchrun's
store hands it to anyone). An attacker who reaches torchrun's agent store can
disturb the launch (post a wrong or an old nonce, join its rendezvous): the
followers stop within ``RENDEZVOUS_S``, nothing is trained on. Any process on the
node can reach a loopback port, but without the secret (readable by the run's user
only) its connection is closed at its first frame and the ranks' sessions go on
(``tests/integration/test_trainer_store.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from rlix_async.train.trainer_store import SECRET_BYTES, SealedStore, StoreServer

STORE_FILE = ".trainer-store.json"
NONCE_KEY = "rlix/trainer-store"  # on the agent store: rank 0's store is up
OWN_NONCE_KEY = "rlix/nonce"  # on rank 0's store: a follower reached the right one
# every rank reaches the rendezvous right after torchrun starts it, before any model
# loads: a follower waiting longer has been sent somewhere wrong
RENDEZVOUS_S = 120.0


class RendezvousError(RuntimeError):
    """The ranks could not meet on their private store (one line says why)."""


def pin_links_to(address: str) -> None:
    """Across nodes: the collective links on the interface holding this node's address
    (the one the other nodes reach it by), unless the user chose one (loopback, which
    cannot reach another node, does not count as a choice here)."""
    name = interface_of(address)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if os.environ.get(var, "lo") in ("", "lo"):
            os.environ[var] = name


def interface_of(address: str) -> str:
    """The network interface whose IPv4 address is ``address`` (RendezvousError if none)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    raise RendezvousError(f"no network interface of this node holds {address}")


def trainer_store_secret(keys_dir: str, pipeline: str, job: str) -> bytes:
    """The sealed store's secret for a trainer spanning nodes: every node of it derives
    the same one from the pipeline's driver key (which each holds: launchers/README.md)
    and the run's job id; nobody without that key can (never the shared ``client``
    key, which shard hosts and the CLI may hold too)."""
    import hashlib
    import hmac

    from rlix_async.security import ClientKeys

    name = f"driver-{pipeline}"
    if not (Path(keys_dir) / f"{name}.key_secret").exists():  # never a shared key
        raise RendezvousError(
            f"{keys_dir}/{name}.key_secret: missing; a trainer across nodes derives its "
            "ranks' store secret from its pipeline's own driver key"
        )
    keys = ClientKeys.load(keys_dir, name)
    label = b"rlix-trainer-store\0" + pipeline.encode() + b"\0" + job.encode()
    return hmac.new(keys.secret, label, hashlib.sha256).digest()


def meet_across(
    endpoint: str,
    secret: bytes,
    rank: int,
    job: str,
    timeout_s: float,
    rendezvous_s: float = RENDEZVOUS_S,
) -> SealedStore:
    """The ranks of a trainer spanning nodes meet on rank 0's sealed store at
    ``endpoint`` (tcp://ADDRESS:PORT on rank 0's node), every one of them holding
    ``secret`` (:func:`trainer_store_secret`); the job id read back proves the store
    is this run's. A follower retries until rank 0's store admits it, at most
    ``rendezvous_s``."""
    host, _, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    port = int(port_text)
    if rank == 0:
        try:
            server = StoreServer(secret, host, port)
        except OSError as exc:
            raise RendezvousError(
                f"rank 0: cannot serve the ranks' store at {endpoint}: {exc}"
            ) from None
        store = SealedStore(host, port, secret, timedelta(seconds=timeout_s))
        store.server = server  # type: ignore[attr-defined]
        store.set(OWN_NONCE_KEY, job)
        return store
    deadline = time.monotonic() + rendezvous_s
    while True:
        try:
            store = SealedStore(host, port, secret, timedelta(seconds=rendezvous_s))
            break
        except dist.DistError as exc:
            if time.monotonic() > deadline:
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise RendezvousError(
                    f"rank {rank}: rank 0's store at {endpoint} did not admit it within "
                    f"{rendezvous_s:.0f} s (not up, or another run's secret): {why}"
                ) from None
            time.sleep(0.5)
    try:
        found = store.get(OWN_NONCE_KEY).decode(errors="replace")
    except dist.DistError as exc:
        raise RendezvousError(f"rank {rank}: rank 0's store at {endpoint}: {exc}") from None
    if found != job:
        raise RendezvousError(f"rank {rank}: the store at {endpoint} is job {found}'s, not {job}'s")
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def pin_links_to_loopback() -> None:
    """The ranks' collective links on ``lo`` (one node): unless the user chose."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def meet(
    agent: dist.Store,
    rank: int,
    world: int,
    local_world: int,
    run_dir: Path,
    timeout_s: float,
    rendezvous_s: float = RENDEZVOUS_S,
) -> SealedStore:
    """This rank's handle on rank 0's loopback store (``agent``: torchrun's). Finding
    it takes at most ``rendezvous_s``; ``timeout_s`` bounds each later blocking call."""
    if local_world != world:
        raise RendezvousError(
            f"the trainer's {world} ranks span nodes ({local_world} on this one) under one "
            "torchrun job: the launcher runs a trainer across nodes as a job per node"
        )
    path = run_dir / STORE_FILE
    try:
        if rank == 0:
            return _host(agent, world, path, timedelta(seconds=timeout_s))
        store = _join(agent, rank, world, path, timedelta(seconds=rendezvous_s))
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    except dist.DistError as exc:  # a timeout, or a store that went away
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(f"rank {rank}: meeting the other ranks failed: {why}") from None


def _host(agent: dist.Store, world: int, path: Path, timeout: timedelta) -> SealedStore:
    """Rank 0: its sealed store up on loopback, its port and secret in the file, then the
    nonce posted. The server lives as long as the store handle (rank 0's process)."""
    secret = secrets.token_bytes(SECRET_BYTES)
    server = StoreServer(secret, "127.0.0.1")
    store = SealedStore("127.0.0.1", server.port, secret, timeout)
    store.server = server  # type: ignore[attr-defined]
    nonce = secrets.token_hex(16)
    store.set(OWN_NONCE_KEY, nonce)
    _write_private(path, json.dumps({"port": server.port, "nonce": nonce, "secret": secret.hex()}))
    agent.set(NONCE_KEY, nonce)
    return store


def _join(agent: dist.Store, rank: int, world: int, path: Path, timeout: timedelta) -> SealedStore:
    """A follower: the posted nonce, the file that must carry it, the store it names."""
    agent.wait([NONCE_KEY], timeout)
    nonce = agent.get(NONCE_KEY).decode(errors="replace")
    try:
        found = json.loads(path.read_text())
        port, written = int(found["port"]), str(found["nonce"])
        secret = bytes.fromhex(found["secret"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RendezvousError(
            f"rank {rank}: cannot read rank 0's store file {path}: {exc}"
        ) from None
    if not secrets.compare_digest(written, nonce):
        raise RendezvousError(
            f"rank {rank}: the nonce on torchrun's store is not the one rank 0 wrote to "
            f"{path}: a stale file, or someone else wrote to torchrun's store"
        )
    store = SealedStore("127.0.0.1", port, secret, timeout)
    if store.get(OWN_NONCE_KEY).decode(errors="replace") != nonce:
        raise RendezvousError(f"rank {rank}: 127.0.0.1:{port} is not rank 0's store")
    return store


def forget(run_dir: Path) -> None:
    """Rank 0, leaving: its store goes with it, so the file naming it goes too."""
    (run_dir / STORE_FILE).unlink(missing_ok=True)


def _write_private(path: Path, text: str) -> None:
    """Owner-only, complete or absent (written aside, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
