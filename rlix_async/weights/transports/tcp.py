"""From another node: the owner's ``WeightServer`` (``weights/tcp.py``), reached over
CURVE with this receiver's own key pair and the owner's public key as its driver
published it. ``sealed``: the buckets stream as AES-256-GCM chunks on a plain tcp
listener, keyed and ticketed over CURVE (``weights/stream.py``); ``zmq``: each bucket
as frames on the CURVE socket itself (slower; no second port to reach)."""

from __future__ import annotations

import asyncio

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import WeightSink
from rlix_async.security import ClientKeys
from rlix_async.weights.tcp import TRANSPORTS, Transport, current_remote, sync_remote

REMOTE_KINDS: tuple[Transport, ...] = TRANSPORTS


class Remote:
    """Pulls from the server the ref names, by exactly the ``kind`` it was made with
    (the ref's tag, as ``transport_for`` read it): an owner that does not serve that
    kind fails the sync in one line rather than being reached some other way."""

    def __init__(self, kind: Transport, keys: ClientKeys | None, timeout: float = 60.0) -> None:
        """``timeout``: the longest the server may stay silent (a call unanswered, a
        stream with nothing to read) before the pull fails."""
        self.kind = kind
        self.name: str = kind
        # this receiver's pair, set for the owner's public key (None: an ipc server)
        self.keys = keys
        self.timeout = timeout

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        return await sync_remote(
            ref, ref.server, sink, layout, keys=self.keys, transport=self.kind, timeout=self.timeout
        )

    def pull_blocking(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        """On an event loop of its own (the caller's thread must have none running)."""
        return asyncio.run(self.pull(ref, sink, layout))

    def current(self, ref: CacheRef) -> CacheRef | None:
        """The newer version the owner publishes now (None: none newer), asked of its
        server: where a receiver goes when ``ref``'s version left the owner's slots."""
        return asyncio.run(current_remote(ref, keys=self.keys))
