"""The weight transports, and the one place a receiver's is chosen (:func:`transport_for`).

- ``shm`` (transports/shm.py): on the owner's node, its shared-memory slot.
- ``sealed``, ``zmq`` (transports/tcp.py): from another node, the owner's
  ``WeightServer``; which of the two is the ref's ``transport`` tag (the pipeline's
  ``weights.transport``).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError, WeightSink
from rlix_async.protocols.weight_transport import WeightTransport
from rlix_async.security import ClientKeys
from rlix_async.weights.shm import SHM_DIR
from rlix_async.weights.transports.shm import SharedMemory
from rlix_async.weights.transports.tcp import REMOTE_KINDS, Remote


def on_owner_node(ref: CacheRef, shm_dir: Path = SHM_DIR) -> bool:
    return ref.host == socket.gethostname() and (shm_dir / ref.segment).exists()


def unreachable(ref: CacheRef, shm_dir: Path = SHM_DIR) -> str | None:
    """Why the version ``ref`` names cannot be reached from here (None: it can be tried)."""
    if on_owner_node(ref, shm_dir):
        return None
    if ref.host == socket.gethostname() and not ref.server:
        return f"version {ref.version}: the owner's cache is gone (pipeline finished?)"
    if not ref.server:
        return (
            f"version {ref.version} lives on {ref.host} and its owner serves no endpoint "
            "(set the pipeline's weights_endpoint; `rlix-async launch --node` does)"
        )
    return None


def transport_for(
    ref: CacheRef, *, keys: ClientKeys | None = None, shm_dir: Path = SHM_DIR
) -> WeightTransport:
    """The transport that brings ``ref`` here: shared memory on the owner's node,
    elsewhere the one the ref's tag names (a one-line SyncError if there is none)."""
    if on_owner_node(ref, shm_dir):
        return SharedMemory(shm_dir)
    why = unreachable(ref, shm_dir)
    if why is not None:
        raise SyncError(why)
    for kind in REMOTE_KINDS:
        if ref.transport == kind:
            return Remote(kind, keys)
    raise SyncError(
        f"version {ref.version}: transport {ref.transport!r} is not one this receiver "
        f"has ({', '.join(REMOTE_KINDS)})"
    )


async def pull(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """``ref``'s version into ``sink`` by the transport chosen for it."""
    return await transport_for(ref, keys=keys, shm_dir=shm_dir).pull(ref, sink, layout)


def pull_blocking(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """:func:`pull` for synchronous callers (e.g. inside an engine's worker process)."""
    transport = transport_for(ref, keys=keys, shm_dir=shm_dir)
    if isinstance(transport, SharedMemory):  # no event loop needed for shared memory
        return transport.pull_blocking(ref, sink, layout)
    return asyncio.run(transport.pull(ref, sink, layout))
