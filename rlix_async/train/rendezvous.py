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
stands). So the trainer's ranks share one node: a torchrun job spanning nodes is
refused here (the launcher refuses it before starting anything). The store lives
in rank 0's process: when rank 0 leaves, the file goes, and a follower still
waiting on the store stops with one line (``train/batches.py``).

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
            f"the trainer's {world} ranks span nodes ({local_world} on this one): a "
            "pipeline's trainer runs on one node (its ranks meet on loopback)"
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
