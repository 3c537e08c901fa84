"""The weight transports, and the one place a receiver's is chosen (:func:`transport_for`).

- ``shm`` (transports/shm.py): on the owner's node, its shared-memory slot.
- ``node`` (transports/node.py): on another node where a receiver runs for the
  pipeline, that node's own cache (one pull per version for the whole node).
- ``sealed``, ``zmq`` (transports/tcp.py): from another node, the owner's
  ``WeightServer``; which of the two is the ref's ``transport`` tag (the pipeline's
  ``weights.transport``).

Nothing else decides: receivers (``weights/staging.py``, engines, tests' engines) ask
:func:`transport_for`, or :func:`pull` which asks it.
"""

from __future__ import annotations

import socket
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError, WeightSink
from rlix_async.protocols.weight_transport import WeightTransport
from rlix_async.security import ClientKeys
from rlix_async.weights.node_link import is_node_ref, receiver_running
from rlix_async.weights.shm import SHM_DIR
from rlix_async.weights.transports.node import NodeCached
from rlix_async.weights.transports.shm import SharedMemory
from rlix_async.weights.transports.tcp import REMOTE_KINDS, Remote


def on_owner_node(ref: CacheRef, shm_dir: Path = SHM_DIR) -> bool:
    """Whether this is the owner's node, its slot in ``shm_dir``: then shared memory."""
    return ref.host == socket.gethostname() and (shm_dir / ref.segment).exists()


def unreachable(ref: CacheRef, shm_dir: Path = SHM_DIR) -> str | None:
    """Why the version ``ref`` names cannot be brought here, as far as the ref and this
    node tell (no keys needed, so an engine can ask before it starts an update); None:
    it can be tried. One line, the text of :func:`transport_for`'s SyncError."""
    if on_owner_node(ref, shm_dir):
        return None
    if ref.host == socket.gethostname() and not ref.server:
        return f"version {ref.version}: the owner's cache is gone (pipeline finished?)"
    if not ref.server:
        return (
            f"version {ref.version} lives on {ref.host} and its owner serves no endpoint "
            "(set the pipeline's weights_endpoint; `rlix-async launch --node` does)"
        )
    if ref.transport not in REMOTE_KINDS:
        return (
            f"version {ref.version}: transport {ref.transport[:40]!r} is not one this "
            f"receiver has ({', '.join(REMOTE_KINDS)})"
        )
    if ref.server.startswith("tcp://") and not ref.server_key:
        return f"version {ref.version}: {ref.server} comes without its public key"
    return None


def transport_for(
    ref: CacheRef, *, keys: ClientKeys | None = None, shm_dir: Path = SHM_DIR
) -> WeightTransport:
    """The transport that brings ``ref`` here: shared memory on the owner's node; on a
    node whose receiver runs for the pipeline (``rlix-async node-cache``), that node's
    cache; elsewhere the one the ref's tag names (:func:`remote_transport`). Raises a
    one-line SyncError if there is none."""
    if on_owner_node(ref, shm_dir):
        return SharedMemory(shm_dir)
    if is_node_ref(ref) or receiver_running(ref.pipeline):
        return NodeCached(shm_dir)
    return remote_transport(ref, keys=keys, shm_dir=shm_dir)


def remote_transport(
    ref: CacheRef, *, keys: ClientKeys | None = None, shm_dir: Path = SHM_DIR
) -> Remote:
    """The owner's server, by the transport the ref's tag names, with ``keys`` (this
    receiver's CURVE pair) set for the owner's public key: what a worker with no node
    cache, and a node cache's receiver, pull with. Raises a one-line SyncError if the
    owner's cache is gone, it serves no endpoint, the tag is unknown, or a tcp owner
    comes without its public key or this receiver has no keys."""
    why = unreachable(ref, shm_dir)
    if why is not None:
        raise SyncError(why)
    kind = next(k for k in REMOTE_KINDS if k == ref.transport)  # unreachable checked it
    if not ref.server.startswith("tcp://"):  # an ipc server: one machine, no CURVE
        return Remote(kind, keys)
    if keys is None:
        raise SyncError(
            f"version {ref.version} is served at {ref.server}, which needs CURVE keys; "
            "this shard has none (set keys=DIR)"
        )
    # our own pair, and the owner's public key as its driver published it
    return Remote(kind, keys.for_server(ref.server_key.encode()))


async def pull(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """``ref``'s version into ``sink`` by the transport chosen for it (its promises:
    :class:`~rlix_async.protocols.weight_transport.WeightTransport`)."""
    try:
        transport = transport_for(ref, keys=keys, shm_dir=shm_dir)
    except SyncError:
        sink.abort()  # as every transport leaves a sink it could not fill
        raise
    return await transport.pull(ref, sink, layout)


def pull_blocking(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """:func:`pull` for a caller with no running event loop in its thread."""
    try:
        transport = transport_for(ref, keys=keys, shm_dir=shm_dir)
    except SyncError:
        sink.abort()
        raise
    return transport.pull_blocking(ref, sink, layout)
