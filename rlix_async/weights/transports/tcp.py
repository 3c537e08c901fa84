"""From another node: the owner's ``WeightServer`` (``weights/tcp.py``), reached over
CURVE with this receiver's own key pair and the owner's public key as its driver
published it. ``sealed``: the buckets stream as AES-256-GCM chunks on a plain tcp
listener, keyed and ticketed over CURVE (``weights/stream.py``); ``zmq``: each bucket
as frames on the CURVE socket itself (slower; no second port to reach)."""

from __future__ import annotations

from typing import Literal

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError, WeightSink
from rlix_async.security import ClientKeys
from rlix_async.weights.tcp import sync_remote

RemoteKind = Literal["sealed", "zmq"]
REMOTE_KINDS: tuple[RemoteKind, ...] = ("sealed", "zmq")


class Remote:
    def __init__(self, kind: RemoteKind, keys: ClientKeys | None) -> None:
        self.kind = kind
        self.name: str = kind
        self.keys = keys

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        keys = self.keys
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
        # a sealed stream needs a tcp listener: an ipc server (one machine) sends frames
        kind = self.kind if ref.server.startswith("tcp://") else "zmq"
        return await sync_remote(ref, ref.server, sink, layout, keys=keys, transport=kind)
