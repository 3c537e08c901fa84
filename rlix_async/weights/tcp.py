"""Weights for shards on other nodes: the owner's :class:`WeightServer` and ``sync_remote``.

The server is the only door: on tcp it is CURVE, and it admits only receivers
of its own pipeline. The bytes then move one of two ways (``transport``, which the
caller names: the ref's tag, chosen in ``weights/transports/``):

- ``sealed``: the server grants a key and a ticket per stream, and the buckets
  stream as AES-256-GCM chunks over plain tcp sockets next to it, about 3.3x faster
  than through CURVE here (see :mod:`rlix_async.weights.stream`); a server on tcp only;
- ``plain``: the same streams, unsealed (a fabric the operator trusts; only from an
  owner whose pipeline says ``weights.transport: plain``);
- ``zmq``: the buckets come as zero-copy ZMQ frames on the server's own socket
  (CURVE on tcp), with optional CRC32 checks; any server.

Either way the receiver keeps at most ``credits`` buckets in flight, so its
extra memory stays within ``credits x bucket``; every bucket is checked against
the request and the layout before it reaches the sink; and a generation check
after the last bucket (a seqlock over the wire) proves the slot was not
rewritten meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import uuid
import zlib
from functools import partial
from typing import Literal

import msgspec

from rlix_async.protocol import ErrorCode, Message, RpcError
from rlix_async.protocols.cache_ref import BadRef, CacheRef, Layout
from rlix_async.protocols.sinks import (
    DeltaMismatch,
    DeltaSink,
    SlotOverwritten,
    SyncError,
    WeightSink,
)
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, Reply, RpcClient, RpcServer, TransportConfig
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.manifest import Manifest
from rlix_async.weights.packing import BucketView
from rlix_async.weights.stream import (
    STREAM_KINDS,
    DeltaProvider,
    OpenStream,
    StreamGrant,
    WeightStreamer,
    host_of,
)
from rlix_async.weights.stream_receiver import receive_stream

log = logging.getLogger(__name__)

# What a WeightServer speaks to a receiver on another node (CacheRef.transport's tags).
Transport = Literal["sealed", "plain", "zmq"]
TRANSPORTS: tuple[Transport, ...] = ("sealed", "plain", "zmq")

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


class GetCurrent(Message):
    """Which version the owner publishes now: where a receiver whose version left the
    owner's two slots goes instead (the local path follows a moved slot the same way)."""


class CurrentVersion(Message):
    ref: CacheRef | None  # None: nothing promoted (the owner restarted, or is closing)


class GetManifest(Message):
    version: int


class ManifestReply(Message):
    manifest: Manifest


class PlanSource(Message):
    """From a node's cache: where should it take ``version`` from? ``relay``/``relay_key``:
    where it serves what it receives to the nodes behind it (its own key: checked)."""

    version: int
    relay: str
    relay_key: str
    exclude: list[str] = []  # relays that failed this node: never offered again to it


class Source(Message):
    endpoint: str  # "": the owner itself
    key: str = ""  # the relay's public key (z85)


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
        streams: int = 1,
        deltas: DeltaProvider | None = None,
    ) -> None:
        """``streams``: tcp streams per transfer (sealed, plain); ``deltas``: each
        version encoded against the one before it, for streams to receivers that hold
        that one (``weights/delta_source.py``; None: always whole)."""
        self.cache = cache
        self.deltas = deltas
        self.checksums = checksums
        self.streams = streams
        self.server = RpcServer(endpoint, keys=keys, config=config, name="weight-server")
        self.server.on(GetLayout, self._layout)
        self.server.on(FetchBucket, self._fetch)
        self.server.on(GetGeneration, self._generation)
        self.server.on(OpenStream, self._open_stream)
        self.server.on(GetCurrent, self._current)
        self.server.on(GetManifest, self._manifest)
        self.server.on(PlanSource, self._plan_source)
        self.server.admit_peer = self._admit
        # per version, the nodes' relays in the order they asked for it (a chain: each
        # node takes the version from the one that asked before it, the first from us)
        self._chains: dict[int, list[tuple[str, str]]] = {}
        self._signing: dict[int, asyncio.Future[Manifest]] = {}  # manifests being made
        self.streamer: WeightStreamer | None = None

    async def start(self) -> WeightServer:
        await self.server.start()
        if self.server.endpoint.startswith("tcp://"):
            self.streamer = await WeightStreamer(
                self.cache, host_of(self.endpoint), streams=self.streams, deltas=self.deltas
            ).start()
        return self

    async def close(self) -> None:
        await self.server.close()
        if self.streamer is not None:
            await self.streamer.close()

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def _admit(self, identity: str, info: dict[str, object]) -> None:
        """Only receivers of this cache's pipeline (``PIPELINE/weights/*``): a shard key
        of another pipeline that may connect at all still gets nothing of ours."""
        pipeline, kind = [*identity.split("/"), "", ""][:2]
        if (pipeline, kind) != (self.cache.pipeline, "weights"):
            raise RpcError(
                ErrorCode.FORBIDDEN, f"{identity} may not pull {self.cache.pipeline}'s weights"
            )

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

    def _open_stream(self, msg: OpenStream, ctx: CallContext) -> StreamGrant:
        if msg.transport not in STREAM_KINDS or self.streamer is None:
            raise RpcError(
                "unknown_transport",
                f"transport {msg.transport[:40]!r} is not served at {self.endpoint} "
                + ("(streams are for tcp endpoints)" if self.streamer is None else ""),
            )
        if msg.transport == "plain" and self.cache.transport != "plain":
            # the owner's pipeline did not say its fabric is trusted: never unsealed
            raise RpcError(
                ErrorCode.FORBIDDEN,
                f"{self.cache.pipeline} sends sealed streams only (weights.transport: "
                f"{self.cache.transport})",
            )
        if not self._streamable(msg.version):
            raise RpcError("unknown_version", f"version {msg.version} is not cached")
        return self.streamer.grant(
            msg.version, ctx.peer, msg.transport, msg.base, msg.after_failed_delta
        )

    def _streamable(self, version: int) -> bool:
        """Whether a stream of ``version`` may be granted (a relay: arriving, too)."""
        return version in self.cache.versions

    def _current(self, msg: GetCurrent, ctx: CallContext) -> CurrentVersion:
        cache = self.cache
        if cache.current is None or cache.layout is None:
            return CurrentVersion(ref=None)
        return CurrentVersion(ref=cache.ref(cache.current))

    async def _manifest(self, msg: GetManifest, ctx: CallContext) -> ManifestReply:
        # digests of the whole version: seconds for a large model, off the loop, and once
        # for all the nodes asking at the same time
        pending = self._signing.get(msg.version)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self.cache.manifest, msg.version))
            self._signing[msg.version] = pending
            pending.add_done_callback(lambda _: self._signing.pop(msg.version, None))
        try:
            return ManifestReply(manifest=await asyncio.shield(pending))
        except KeyError:
            raise RpcError("unknown_version", f"version {msg.version} is not cached") from None

    def _plan_source(self, msg: PlanSource, ctx: CallContext) -> Source:
        """The relay chain's one rule, kept here by the owner: a node takes a version from
        the node that asked for it last (pipelined: a relay forwards each bucket as it
        lands), the first node from the owner; a node that lost its relay, from the
        owner. A relay must serve with the key it connected with."""
        peer = self.server.peers.get(ctx.peer)
        keyed = peer is not None and peer.key is not None
        if msg.relay and keyed and peer is not None and peer.key != msg.relay_key.encode():
            raise RpcError(ErrorCode.FORBIDDEN, f"{ctx.peer}: a relay key other than its own")
        if msg.version not in self.cache.versions:
            raise RpcError("unknown_version", f"version {msg.version} is not cached")
        for old in [v for v in self._chains if v not in self.cache.versions]:
            del self._chains[old]
        chain = self._chains.setdefault(msg.version, [])
        if msg.exclude:
            # its relay failed it: straight from us; the failed relays leave the chain,
            # and the asker (which now takes it whole from us) joins its end
            chain[:] = [(r, k) for r, k in chain if r not in msg.exclude and r != msg.relay]
            if msg.relay:
                chain.append((msg.relay, msg.relay_key))
            return Source(endpoint="")
        if any(relay == msg.relay for relay, _ in chain):
            # it asks again: straight from us (never from one behind it: no cycle)
            return Source(endpoint="")
        source = Source(endpoint=chain[-1][0], key=chain[-1][1]) if chain else Source("")
        if msg.relay:
            chain.append((msg.relay, msg.relay_key))
        return source

    def _generation(self, msg: GetGeneration, ctx: CallContext) -> Generation:
        if msg.version not in self.cache.versions:
            return Generation(generation=-1)
        return Generation(generation=self.cache.ref(msg.version).generation)


def check_bucket(
    meta: BucketMeta, nbytes: int, ref: CacheRef, layout: Layout, index: int, encoded: bool = False
) -> None:
    """Refuse a bucket that is not the one asked for before it reaches the sink: its
    index, version, slot generation and size must match the request and the layout
    (a confused or hostile owner must not load the wrong bytes into a model). An
    ``encoded`` bucket (a delta) is at most the layout's size."""
    expected = layout.bucket_sizes[index]
    size_ok = nbytes == meta.nbytes and (nbytes <= expected if encoded else nbytes == expected)
    problems = [
        f"index {meta.index}" if meta.index != index else "",
        f"version {meta.version}" if meta.version != ref.version else "",
        f"{nbytes} bytes ({meta.nbytes} announced, layout says {expected})" if not size_ok else "",
    ]
    rewritten = meta.generation != ref.generation
    if rewritten:
        problems.append(f"generation {meta.generation} (slot rewritten)")
    if any(problems):
        why = f"bucket {index} of version {ref.version} refused: got " + ", ".join(
            p for p in problems if p
        )
        # only the slot's generation differs: the owner rewrote it, a receiver may follow
        only_rewritten = rewritten and not any(problems[:-1])
        raise (SlotOverwritten if only_rewritten else SyncError)(why)


def _fits_buckets(config: TransportConfig | None, layout: Layout | None) -> TransportConfig:
    """A data-plane config whose message limit admits the largest bucket."""
    config = config or TransportConfig()
    biggest = max(layout.bucket_sizes, default=0) if layout is not None else 1 << 30
    need = biggest + (1 << 20)
    if config.max_message_bytes >= need:
        return config
    return dataclasses.replace(config, max_message_bytes=need)


def receiver_identity(ref: CacheRef) -> str:
    """A new identity for one receiver of ``ref``'s pipeline. Unique by construction:
    two receivers never share an identity (and so never each other's replies),
    whatever their host, process or sink."""
    return f"{ref.pipeline}/weights/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


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
    transport: str,
) -> Layout:
    """Stream ``ref`` from the owner's WeightServer with ``credits`` buckets in flight,
    by ``transport`` (one of :data:`TRANSPORTS`; the caller's choice, never guessed
    here from the endpoint)."""
    if credits < 1:
        raise ValueError("credits must be >= 1")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    return_freed_buffers_to_os()
    ident = identity or receiver_identity(ref)
    client = RpcClient(endpoint, ident, keys=keys, config=_fits_buckets(config, layout))
    try:
        await client.connect(timeout=timeout)
        if layout is None or layout.fingerprint() != ref.fingerprint:
            reply = await client.call(GetLayout(fingerprint=ref.fingerprint), timeout=timeout)
            if not isinstance(reply, LayoutReply) or reply.layout.fingerprint() != ref.fingerprint:
                raise SyncError(f"{endpoint} sent a layout other than {ref.fingerprint}")
            layout = reply.layout
        sink.start(ref.version, layout)
        if transport in STREAM_KINDS:
            base = sink.delta_base() if isinstance(sink, DeltaSink) else None
            stream = partial(_receive_stream, client, ref, endpoint, sink, layout, credits, timeout)
            try:
                await stream(transport, -1 if base is None else base)
            except DeltaMismatch as exc:  # whole, then: the owner counts it too
                assert isinstance(sink, DeltaSink)
                log.warning("%s; taking version %d whole", exc, ref.version)
                sink.retry_whole()
                await stream(transport, -1, after_failed_delta=True)
        else:
            await _receive_frames(client, ref, sink, layout, credits, timeout)
        # Seqlock over the wire: the bytes leave the owner's memory without a copy,
        # so make sure the slot was not rewritten while they were in flight.
        after = await client.call(GetGeneration(version=ref.version), timeout=timeout)
        if not isinstance(after, Generation) or after.generation != ref.generation:
            raise SlotOverwritten(f"version {ref.version} was overwritten during the sync")
        sink.finish(ref.version)
        return layout
    except SyncError:
        sink.abort()
        raise
    except RpcError as exc:
        sink.abort()
        if exc.code == "unknown_version":  # the owner's two slots moved past it
            raise SlotOverwritten(
                f"version {ref.version} left the cache at {endpoint} before it was sent"
            ) from exc
        raise SyncError(f"sync of version {ref.version} from {endpoint} failed: {exc}") from exc
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            raise
        raise SyncError(f"sync of version {ref.version} from {endpoint} failed: {exc}") from exc
    finally:
        await client.close()


async def _receive_stream(
    client: RpcClient,
    ref: CacheRef,
    endpoint: str,
    sink: WeightSink,
    layout: Layout,
    credits: int,
    timeout: float,
    transport: str,
    base: int = -1,
    *,
    after_failed_delta: bool = False,
) -> None:
    """``base``: the version the sink holds whole (-1: none), which the owner may send
    this one as deltas on."""
    ask = OpenStream(
        version=ref.version, transport=transport, base=base, after_failed_delta=after_failed_delta
    )
    grant = await client.call(ask, timeout=timeout)
    if not isinstance(grant, StreamGrant):
        raise SyncError(f"{endpoint} answered a stream request with {type(grant).__name__}")
    if grant.delta_base not in (-1, base):  # (base >= 0 only from a DeltaSink)
        raise SyncError(f"{endpoint} granted deltas on version {grant.delta_base}, not {base}")
    deltas = sink if grant.delta_base >= 0 else None
    assert deltas is None or isinstance(deltas, DeltaSink)

    def land(index: int, header: tuple[int, ...], data: memoryview) -> None:
        version, got_index, nbytes, generation = header[:4]
        meta = BucketMeta(version=version, index=got_index, nbytes=nbytes, generation=generation)
        check_bucket(meta, len(data), ref, layout, index, encoded=deltas is not None)
        if deltas is not None:
            deltas.load_delta(index, header[4], data)
        else:
            sink.load(BucketView(index, data).tensors(layout))

    # exactly the transport asked for (the ref's tag): a plain grant is never taken for sealed
    await receive_stream(endpoint, grant, layout, credits, timeout, land, transport=transport)


async def _receive_frames(
    client: RpcClient,
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout,
    credits: int,
    timeout: float,
) -> None:
    window = asyncio.Semaphore(credits)

    async def fetch(index: int) -> None:
        async with window:
            meta, frames = await client.call_with_frames(
                FetchBucket(version=ref.version, index=index), timeout=timeout
            )
            if not isinstance(meta, BucketMeta) or len(frames) != 1:
                raise SyncError(f"bucket {index} of version {ref.version}: malformed reply")
            data = frames[0]
            check_bucket(meta, memoryview(data).nbytes, ref, layout, index)
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


async def current_remote(
    ref: CacheRef,
    *,
    keys: ClientKeys | None = None,
    timeout: float = 10.0,
    config: TransportConfig | None = None,
) -> CacheRef | None:
    """The version the owner that served ``ref`` publishes now, if newer than ``ref``'s
    (None: nothing newer). Only what names a version is taken from the reply: the
    server, its key and the transport stay ``ref``'s, so an owner cannot send a
    receiver anywhere else, and it must be the same pipeline's."""
    client = RpcClient(ref.server, receiver_identity(ref), keys=keys, config=config)
    try:
        await client.connect(timeout=timeout)
        reply = await client.call(GetCurrent(), timeout=timeout)
    except Exception as exc:
        raise SyncError(f"asking {ref.server} for its current version failed: {exc}") from exc
    finally:
        await client.close()
    if not isinstance(reply, CurrentVersion) or reply.ref is None:
        return None
    now = reply.ref
    if now.pipeline != ref.pipeline or now.owner != ref.owner:
        raise SyncError(
            f"{ref.server} answered with {now.pipeline}'s version, not {ref.pipeline}'s"
        )
    if now.version <= ref.version:
        return None
    try:
        now.check_names()  # its segment name becomes a file name on the owner's node only
    except BadRef as exc:
        raise SyncError(f"{ref.server} answered with a bad ref: {exc}") from None
    return msgspec.structs.replace(
        ref,
        version=now.version,
        segment=now.segment,
        generation=now.generation,
        fingerprint=now.fingerprint,
        total_bytes=now.total_bytes,
        incarnation=now.incarnation,  # the same server, started again: its versions
        manifest_key=now.manifest_key,  # and the key it signs them with
    )
