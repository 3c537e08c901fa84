"""Weights for shards on other nodes: the owner's :class:`WeightServer` and ``sync_remote``.

The server streams buckets as zero-copy ZMQ frames straight out of the owner's
shared-memory slot; the receiver keeps at most ``credits`` buckets in flight,
so its extra memory stays within ``credits x bucket``. Optional CRC32 checks
catch a corrupted transfer; a generation check after the last bucket (a
seqlock over the wire) proves the slot was not rewritten meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import zlib

from rlix_async.protocol import Message, RpcError
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, Reply, RpcClient, RpcServer, TransportConfig
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.packing import BucketView, Layout
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.sinks import SyncError, WeightSink

_MALLOC_TUNED = False


def return_freed_buffers_to_os() -> None:
    """Pin glibc's mmap threshold at 1 MiB in this process.

    glibc raises the threshold to the size of the last freed mmapped block (up
    to 32 MiB), after which bucket-sized receive buffers come from the heap and
    stay resident when freed: the receiver's memory would grow to several
    buckets although at most ``credits`` are alive. A fixed threshold keeps
    every bucket buffer an mmap that goes back to the OS on free.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 1 << 20)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


class GetLayout(Message):
    fingerprint: str


class LayoutReply(Message):
    layout: Layout


class FetchBucket(Message):
    version: int
    index: int


class BucketMeta(Message):
    version: int
    index: int
    nbytes: int
    generation: int
    crc32: int | None = None


class GetGeneration(Message):
    version: int


class Generation(Message):
    generation: int  # -1: no longer cached


class WeightServer:
    """Serves one cache's buckets to shards on other nodes (data plane, not the coordinator)."""

    def __init__(
        self,
        cache: WeightCache,
        endpoint: str,
        *,
        keys: ServerKeys | None = None,
        config: TransportConfig | None = None,
        checksums: bool = False,
    ) -> None:
        self.cache = cache
        self.checksums = checksums
        self.server = RpcServer(endpoint, keys=keys, config=config, name="weight-server")
        self.server.on(GetLayout, self._layout)
        self.server.on(FetchBucket, self._fetch)
        self.server.on(GetGeneration, self._generation)

    async def start(self) -> WeightServer:
        await self.server.start()
        return self

    async def close(self) -> None:
        await self.server.close()

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def _layout(self, msg: GetLayout, ctx: CallContext) -> LayoutReply:
        layout = self.cache.layout
        if layout is None or layout.fingerprint() != msg.fingerprint:
            raise RpcError("unknown_layout", f"no layout {msg.fingerprint} (owner restarted?)")
        return LayoutReply(layout=layout)

    def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:
        cache = self.cache
        if msg.version not in cache.versions or cache.layout is None:
            raise RpcError("unknown_version", f"version {msg.version} is not cached")
        layout = cache.layout
        if not 0 <= msg.index < len(layout.bucket_sizes):
            raise RpcError("bad_bucket", f"bucket {msg.index} out of range")
        start = layout.bucket_offsets[msg.index]
        data = cache.buffer(msg.version)[start : start + layout.bucket_sizes[msg.index]]
        meta = BucketMeta(
            version=msg.version,
            index=msg.index,
            nbytes=len(data),
            generation=cache.ref(msg.version).generation,
            crc32=zlib.crc32(data) if self.checksums else None,
        )
        # Zero-copy out of the slot; build() waits for these sends before reusing it.
        return Reply(meta, [data], on_sent=lambda tracker: cache.track(msg.version, tracker))

    def _generation(self, msg: GetGeneration, ctx: CallContext) -> Generation:
        if msg.version not in self.cache.versions:
            return Generation(generation=-1)
        return Generation(generation=self.cache.ref(msg.version).generation)


def _fits_buckets(config: TransportConfig | None, layout: Layout | None) -> TransportConfig:
    """A data-plane config whose message limit admits the largest bucket."""
    config = config or TransportConfig()
    biggest = max(layout.bucket_sizes, default=0) if layout is not None else 1 << 30
    need = biggest + (1 << 20)
    if config.max_message_bytes >= need:
        return config
    return dataclasses.replace(config, max_message_bytes=need)


async def sync_remote(
    ref: CacheRef,
    endpoint: str,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    credits: int = 2,
    keys: ClientKeys | None = None,
    identity: str | None = None,
    timeout: float = 60.0,
    config: TransportConfig | None = None,
) -> Layout:
    """Stream ``ref`` from the owner's WeightServer with ``credits`` buckets in flight."""
    if credits < 1:
        raise ValueError("credits must be >= 1")
    return_freed_buffers_to_os()
    ident = identity or f"{ref.pipeline}/weights/{socket.gethostname()}-{id(sink) & 0xFFFF}"
    client = RpcClient(endpoint, ident, keys=keys, config=_fits_buckets(config, layout))
    try:
        await client.connect(timeout=timeout)
        if layout is None or layout.fingerprint() != ref.fingerprint:
            reply = await client.call(GetLayout(fingerprint=ref.fingerprint), timeout=timeout)
            assert isinstance(reply, LayoutReply)
            layout = reply.layout
        sink.start(ref.version, layout)
        window = asyncio.Semaphore(credits)

        async def fetch(index: int) -> None:
            async with window:
                meta, frames = await client.call_with_frames(
                    FetchBucket(version=ref.version, index=index), timeout=timeout
                )
                assert isinstance(meta, BucketMeta)
                data = frames[0]
                if meta.crc32 is not None and zlib.crc32(data) != meta.crc32:
                    raise SyncError(f"bucket {index} of version {ref.version}: checksum mismatch")
                sink.load(BucketView(index, data).tensors(layout))
                del data, frames

        tasks = [asyncio.ensure_future(fetch(i)) for i in range(len(layout.bucket_sizes))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        # Seqlock over the wire: frames leave the owner's memory zero-copy, so make
        # sure the slot was not rewritten while they were in flight.
        after = await client.call(GetGeneration(version=ref.version), timeout=timeout)
        assert isinstance(after, Generation)
        if after.generation != ref.generation:
            raise SyncError(f"version {ref.version} was overwritten during the sync")
        sink.finish(ref.version)
        return layout
    except SyncError:
        sink.abort()
        raise
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        raise SyncError(f"sync of version {ref.version} from {endpoint} failed: {exc}") from exc
    finally:
        await client.close()
