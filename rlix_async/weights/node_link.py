"""What a node's workers and its weight receiver share (``weights/node_cache.py``): the
receiver's ipc endpoint on this node, the names of the node's cache, and the worker's
request for a version. Small and free of the receiver's imports, so that the transports
(``weights/transports/``) can ask whether a receiver runs without importing it."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid

from rlix_async.protocol import Message, RpcError
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ipc_endpoint
from rlix_async.transport import RpcClient, TransportConfig

NODE_OWNER_SUFFIX = ".node"
# A worker's wait for its version: one whole transfer over a slow link (140 GB at
# 1.2 GiB/s is ~110 s), with room for a pull already under way ahead of it.
ENSURE_TIMEOUT_S = float(os.environ.get("RLIX_NODE_CACHE_TIMEOUT_S", "900"))
# The workers' link to the receiver is local (ipc), and both ends use these heartbeats
# (the server and its clients must agree). The control plane's 1 s / 2.5 s declared idle
# workers dead when a loaded host held the receiver's loop for a few seconds while
# versions streamed in (bench weights --hosts 3 on 2 cores).
LINK = TransportConfig.with_heartbeat(5.0)


def node_owner(owner: str) -> str:
    """The owner name a node's cache of ``owner``'s versions has (its segment names)."""
    return f"{owner}{NODE_OWNER_SUFFIX}"


def is_node_ref(ref: CacheRef) -> bool:
    """Whether ``ref`` names a version in this node's cache (not the owner's)."""
    return ref.owner.endswith(NODE_OWNER_SUFFIX)


def node_cache_endpoint(pipeline: str, host: str | None = None) -> str:
    """The ipc endpoint of ``pipeline``'s receiver on this node."""
    host = host or socket.gethostname()
    job = os.environ.get("RLIX_JOB", "")
    tag = hashlib.sha1(f"{job}/{pipeline}/{host}".encode()).hexdigest()[:16]
    return ipc_endpoint(f"node-{tag}")


def receiver_running(pipeline: str) -> bool:
    """Whether this node has a receiver for ``pipeline`` (its socket exists)."""
    return os.path.exists(node_cache_endpoint(pipeline).removeprefix("ipc://"))


class EnsureVersion(Message):
    """From a worker: have the owner's version ``ref`` names (or a newer one) in this
    node's cache. ``newest``: rather the version the owner publishes now, if newer."""

    ref: CacheRef
    newest: bool = False


class NodeVersion(Message):
    ref: CacheRef | None  # in this node's cache; None: nothing newer (``newest``)


async def ensure_on_node(
    ref: CacheRef, *, newest: bool = False, timeout: float = ENSURE_TIMEOUT_S
) -> CacheRef | None:
    """Ask this node's receiver for ``ref``'s version (a worker's side). Raises a
    one-line SyncError when it cannot have it, or does not answer within ``timeout``."""
    endpoint = node_cache_endpoint(ref.pipeline)
    identity = (
        f"{ref.pipeline}/weights/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    )
    client = RpcClient(endpoint, identity, config=LINK)
    try:
        await client.connect(timeout=10.0)
        reply = await client.call(EnsureVersion(ref=ref, newest=newest), timeout=timeout)
    except RpcError as exc:
        raise SyncError(f"this node's cache of {ref.pipeline}: {exc.detail}") from None
    except Exception as exc:
        raise SyncError(f"this node's cache of {ref.pipeline} ({endpoint}): {exc}") from None
    finally:
        await client.close()
    if not isinstance(reply, NodeVersion):
        raise SyncError(f"{endpoint} answered with {type(reply).__name__}")
    return reply.ref
