"""Reach a cached version the cheapest way: shared memory on the owner's node, else tcp."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError, WeightSink
from rlix_async.security import ClientKeys
from rlix_async.weights.shm import SHM_DIR, sync_local
from rlix_async.weights.tcp import sync_remote


def on_owner_node(ref: CacheRef, shm_dir: Path = SHM_DIR) -> bool:
    return ref.host == socket.gethostname() and (shm_dir / ref.segment).exists()


async def pull(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    if on_owner_node(ref, shm_dir):
        return sync_local(ref, sink, layout, shm_dir=shm_dir)
    if not ref.server:
        raise SyncError(
            f"version {ref.version} lives on {ref.host} and its owner serves no endpoint "
            "(set the pipeline's weights_endpoint; `rlix-async launch --node` does)"
        )
    if ref.server.startswith("tcp://"):
        if keys is None:
            raise SyncError(
                f"version {ref.version} is served at {ref.server}, which needs CURVE keys; "
                "this shard has none (set keys=DIR)"
            )
        if not ref.server_key:
            raise SyncError(f"version {ref.version}: {ref.server} comes without its public key")
        # our own pair, and the owner's public key as its driver published it
        keys = keys.for_server(ref.server_key.encode())
    return await sync_remote(ref, ref.server, sink, layout, keys=keys)


def pull_blocking(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """:func:`pull` for synchronous callers (e.g. inside an engine's worker)."""
    if on_owner_node(ref, shm_dir):  # no event loop needed for shared memory
        return sync_local(ref, sink, layout, shm_dir=shm_dir)
    return asyncio.run(pull(ref, sink, layout, keys=keys, shm_dir=shm_dir))
