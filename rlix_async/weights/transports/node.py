"""This node's cache of a pipeline's weights (``weights/node_cache.py``): on a node
other than the owner's, where ``rlix-async node-cache`` runs for the pipeline. The
receiver pulls each version once for the whole node; a worker asks it for the version
(waiting while it arrives) and then reads the node's slot exactly as a worker on the
owner's node reads the owner's: mapped, under a reader's lease, no private copy."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError, WeightSink
from rlix_async.protocols.weight_transport import LeasedVersion
from rlix_async.weights.node_link import ensure_on_node, is_node_ref
from rlix_async.weights.shm import SHM_DIR
from rlix_async.weights.transports.shm import SharedMemory


class NodeCached:
    """Versions of another node's owner, read from this node's cache (a
    :class:`MappedTransport`). Its methods block (no event loop in the caller's thread)."""

    name = "node"

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self.local = SharedMemory(shm_dir)

    def here(self, ref: CacheRef) -> CacheRef:
        """This node's ref of ``ref``'s version (or of a newer one: the owner moved on),
        asked of the receiver, which pulls it first if the node does not hold it."""
        if is_node_ref(ref):  # already one of ours (a lease that followed the slot)
            return ref
        local = asyncio.run(ensure_on_node(ref))
        if local is None:
            raise SyncError(f"this node's cache has no version of {ref.pipeline}")
        return local

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        local = ref if is_node_ref(ref) else await ensure_on_node(ref)
        if local is None:
            raise SyncError(f"this node's cache has no version of {ref.pipeline}")
        return self.local.pull_blocking(local, sink, layout)

    def pull_blocking(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        try:
            local = self.here(ref)
        except BaseException:
            sink.abort()
            raise
        return self.local.pull_blocking(local, sink, layout)

    def leased(self, ref: CacheRef, layout: Layout | None) -> AbstractContextManager[LeasedVersion]:
        return self.local.leased(self.here(ref), layout)

    def current(self, ref: CacheRef) -> CacheRef | None:
        """The node's ref of the version the owner publishes now, if newer than
        ``ref``'s (pulled first): where a receiver goes when ``ref``'s version left."""
        if is_node_ref(ref):
            return self.local.current(ref)
        return asyncio.run(ensure_on_node(ref, newest=True))
