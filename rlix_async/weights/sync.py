"""Move a cached weight version into a shard's engine, bucket by bucket.

- Same node: the shard maps the owner's shared-memory segment and hands each
  bucket's tensors (zero-copy views) to its sink. No socket is involved.
- Other node: the owner's :class:`WeightServer` streams buckets as zero-copy ZMQ
  frames straight out of the segment; the receiver keeps at most ``credits``
  buckets in flight, so its extra memory stays within ``credits x bucket``.

A sink (the engine's weight-update session) sees ``start``, one ``load`` per
bucket, then ``finish``; on any failure it gets ``abort`` and keeps its old
weights. Optional CRC32 checks catch a corrupted transfer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import msgspec
import torch

from rlix_async.protocol import Message, RpcError
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, Reply, RpcClient, RpcServer, TransportConfig
from rlix_async.weights.cache import (
    HEADER,
    SHM_DIR,
    CacheRef,
    Segment,
    WeightCache,
    read_header,
    read_layout,
)
from rlix_async.weights.packing import BucketView, Layout, buckets_of

log = logging.getLogger(__name__)


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


class SyncError(RuntimeError):
    """The sync did not complete; the sink was aborted and kept its old weights."""


class SlotOverwritten(SyncError):
    """The owner rewrote the slot mid-sync (it promoted two newer versions meanwhile)."""


def current_slot_ref(ref: CacheRef, shm_dir: Path = SHM_DIR) -> CacheRef | None:
    """The consistent version the slot of ``ref`` holds now (None while being written)."""
    gen, version, _ = read_header(_mapped_slot(ref.segment, shm_dir).buf)
    if gen % 2 or not version:
        return None
    return msgspec.structs.replace(ref, version=version, generation=gen)


class WeightSink(Protocol):
    def start(self, version: str, layout: Layout) -> None: ...
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None: ...
    def finish(self, version: str) -> None: ...
    def abort(self) -> None: ...


class TensorSink:
    """Copies into existing tensors by name (a model's parameters, or buffers).

    Stages nothing: each bucket is copied into place as it arrives. ``abort``
    cannot undo copies already made, so callers that must keep the old weights
    intact on failure (a serving engine) use a staging sink or the engine's own
    update session; this one records the version only once everything landed.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.version: str | None = None
        self._loading: str | None = None
        self._seen: set[str] = set()

    def start(self, version: str, layout: Layout) -> None:
        missing = [e.name for e in layout.entries if e.name not in self.tensors]
        if missing:
            raise SyncError(f"sink has no tensor for {missing[:3]} ({len(missing)} missing)")
        self._loading, self._seen = version, set()

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in named:
                self.tensors[name].copy_(t)
                self._seen.add(name)

    def finish(self, version: str) -> None:
        if len(self._seen) != len(self.tensors) and not set(self.tensors) <= self._seen:
            raise SyncError(
                f"version {version}: only {len(self._seen)} of {len(self.tensors)} tensors arrived"
            )
        self.version, self._loading = version, None

    def abort(self) -> None:
        self._loading = None


def bucket_checksums(layout: Layout, buf: memoryview) -> list[int]:
    return [zlib.crc32(b.data) for b in buckets_of(layout, buf)]


# --- same node ------------------------------------------------------------------------------

_MAPPED: dict[Path, Segment] = {}


def _mapped_slot(name: str, shm_dir: Path) -> Segment:
    """Slots are mapped once per process and reused by every later sync."""
    path = shm_dir / name
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        raise SyncError(f"{name} does not exist (owner gone or restarted)") from None
    seg = _MAPPED.get(path)
    if seg is None or seg.inode != inode:  # first use, or the owner re-created it
        if seg is not None:
            seg.close()
        seg = _MAPPED[path] = Segment(name, shm_dir=shm_dir)
    return seg


def forget_mappings() -> None:
    """Unmap every slot this process mapped (before sleeping or exiting)."""
    for seg in _MAPPED.values():
        seg.close()
    _MAPPED.clear()


def sync_local(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    checksums: list[int] | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """Load ``ref`` from the owner's shared memory. Returns the layout (keep it)."""
    if layout is None or layout.fingerprint() != ref.fingerprint:
        try:
            layout = read_layout(ref.pipeline, ref.owner, ref.fingerprint, shm_dir)
        except FileNotFoundError:
            raise SyncError(f"layout {ref.fingerprint} is not published (owner gone?)") from None
    seg = _mapped_slot(ref.segment, shm_dir)

    def check(when: str) -> None:
        gen, version, _ = read_header(seg.buf)
        if gen != ref.generation or version != ref.version:
            raise SlotOverwritten(
                f"{ref.version} was overwritten {when} the sync "
                f"(slot now holds {version or 'a version being written'})"
            )

    try:
        check("before")
        sink.start(ref.version, layout)
        data = seg.buf[HEADER : HEADER + layout.total_bytes]
        for bucket in buckets_of(layout, data):
            if checksums is not None and zlib.crc32(bucket.data) != checksums[bucket.index]:
                raise SyncError(f"bucket {bucket.index} of {ref.version}: checksum mismatch")
            sink.load(bucket.tensors(layout))
        check("during")  # seqlock: unchanged generation means nothing was torn
        sink.finish(ref.version)
    except BaseException:
        sink.abort()
        raise
    return layout


# --- other nodes ---------------------------------------------------------------------------


class GetLayout(Message):
    fingerprint: str


class LayoutReply(Message):
    layout: Layout


class FetchBucket(Message):
    version: str
    index: int


class BucketMeta(Message):
    version: str
    index: int
    nbytes: int
    generation: int
    crc32: int | None = None


class GetGeneration(Message):
    version: str


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
    import dataclasses

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
                    raise SyncError(f"bucket {index} of {ref.version}: checksum mismatch")
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
            raise SyncError(f"{ref.version} was overwritten during the sync")
        sink.finish(ref.version)
        return layout
    except SyncError:
        sink.abort()
        raise
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        raise SyncError(f"sync of {ref.version} from {endpoint} failed: {exc}") from exc
    finally:
        await client.close()


def _on_owner_node(ref: CacheRef, shm_dir: Path) -> bool:
    return ref.host == socket.gethostname() and (shm_dir / ref.segment).exists()


async def pull(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """Reach ``ref`` the cheapest way: shared memory on the owner's node, else tcp."""
    if _on_owner_node(ref, shm_dir):
        return sync_local(ref, sink, layout, shm_dir=shm_dir)
    if not ref.server:
        raise SyncError(f"{ref.version} lives on {ref.host} and its owner serves no endpoint")
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
    if _on_owner_node(ref, shm_dir):  # no event loop needed for shared memory
        return sync_local(ref, sink, layout, shm_dir=shm_dir)
    return asyncio.run(pull(ref, sink, layout, keys=keys, shm_dir=shm_dir))
