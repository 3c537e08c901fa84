"""A node cache's relay: it serves the version it is receiving to the next node of the
chain (``WeightServer._plan_source``, the owner's rule) bucket by bucket, each as soon
as it landed and matched the owner's manifest, so a version reaches N nodes in about
one transfer plus a bucket per hop while the owner sends it about once.

It serves the version as the owner does: streams (sealed or plain, as the owner's
pipeline says; ``weights/stream.py``, each stream's sending thread waiting for its next
bucket to land) or bucket frames on its CURVE socket, with the node's own key pair,
and the owner's signed manifest as it received it: the nodes
behind it check every bucket against that manifest (``weights/manifest.py``), so a relay
cannot alter what it forwards. A relay that fails a node (its pull broke, it died) makes
that node ask the owner again, which then sends it the version itself.

Deltas: a relay that takes a version as deltas on the version it held keeps each
bucket's payload as it lands (:class:`RelayedDeltas`) and forwards the payloads to a node
behind it that holds the same base, so a delta's few bytes cross every hop, not the
whole version; a bucket that came whole goes whole. The node behind checks what it
decodes against the same signed manifest.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

from rlix_async.protocol import Message, RpcError
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.security import ServerKeys
from rlix_async.transport import CallContext, Reply
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.manifest import Manifest
from rlix_async.weights.stream import StreamSource, WeightStreamer, host_of
from rlix_async.weights.tcp import (
    BucketMeta,
    FetchBucket,
    Generation,
    GetGeneration,
    GetManifest,
    ManifestReply,
    PlanSource,
    Source,
    WeightServer,
)

BUCKET_WAIT_S = 300.0  # a bucket not landed by then: the relay's upstream is stuck


class GetRelayed(Message):
    version: int


class Relayed(Message):
    ref: CacheRef  # the relay's own ref of the version: its generation once whole


@dataclass
class InFlight:
    """A version the relay is receiving: where, and which buckets are here. Registered
    before the node asks the owner for its source (from then on the owner may name this
    node to others), ready once the owner's manifest is here and the slot is open."""

    version: int
    manifest: Manifest | None = None
    landed: list[asyncio.Event] = field(default_factory=list)
    slot: int = -1
    generation: int = -1  # the slot's once the version is whole
    failed: bool = False
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # the same landings for the streams' sending threads
    arrived: list[threading.Event] = field(default_factory=list)
    base: int = -1  # the version it may arrive as deltas on (the node's promoted one)
    payloads: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # bucket: delta


class RelayedDeltas:
    """The deltas a relay received, for the streams it serves (a
    :class:`~rlix_async.weights.stream.DeltaProvider`): the version in flight or the
    newest held whole, each bucket's payload as it came (none: it came whole)."""

    def __init__(self) -> None:
        self.flights: dict[int, InFlight] = {}  # in flight, and the newest kept after

    def offers(self, version: int, base: int) -> bool:
        fl = self.flights.get(version)
        return fl is not None and not fl.failed and base >= 0 and fl.base == base

    def bucket(
        self, version: int, base: int, index: int, timeout: float
    ) -> tuple[int, bytes | memoryview] | None:
        # the stream waited for the bucket to land (its source's wait_bucket) first
        fl = self.flights.get(version)
        if fl is None or fl.base != base:
            return None
        return fl.payloads.get(index)


class RelayServer(WeightServer):
    """Serves one node cache (``cache``) to the nodes behind it."""

    def __init__(
        self, cache: WeightCache, endpoint: str, keys: ServerKeys | None, streams: int = 2
    ) -> None:
        self.relayed_deltas = RelayedDeltas()
        super().__init__(cache, endpoint, keys=keys, streams=streams, deltas=self.relayed_deltas)
        self.server.on(GetRelayed, self._relayed)
        self.inflight: dict[int, InFlight] = {}
        self.manifests: dict[int, Manifest] = {}  # the owner's, per version held whole
        self.public_key = keys.public.decode() if keys is not None else ""
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> RelayServer:
        self._loop = asyncio.get_running_loop()
        await self.server.start()
        if self.server.endpoint.startswith("tcp://"):
            self.streamer = await WeightStreamer(
                self.cache,
                host_of(self.endpoint),
                streams=self.streams,
                source=self._source_of,
                deltas=self.relayed_deltas,
            ).start()
        return self

    # --- the receiving side (NodeCache) --------------------------------------------

    def expect(self, version: int) -> InFlight:
        fl = InFlight(version)
        self.inflight[version] = fl
        return fl

    def begin(self, fl: InFlight, manifest: Manifest) -> None:
        """The owner's manifest is here: the version's buckets can be waited for."""
        fl.manifest = manifest
        fl.landed = [asyncio.Event() for _ in manifest.digests]
        fl.arrived = [threading.Event() for _ in manifest.digests]

    def opened(self, fl: InFlight, slot: int, generation: int) -> None:
        """(The writer's thread.) The slot the version is written into; the version the
        node holds whole beside it is what it may arrive as deltas on."""
        assert self._loop is not None
        fl.slot, fl.generation = slot, generation
        current = self.cache.current
        fl.base = current if current is not None and current in self.cache.versions else -1
        self.relayed_deltas.flights[fl.version] = fl
        self._loop.call_soon_threadsafe(fl.ready.set)

    def delta_landed(self, fl: InFlight, bucket: int, kind: int, payload: Any) -> None:
        """(The writer's thread.) Bucket ``bucket`` came as a delta: kept to forward."""
        fl.payloads[bucket] = (kind, bytes(payload))  # the receive buffer is reused

    def landed(self, fl: InFlight, bucket: int) -> None:
        """(The writer's thread.) A bucket is here and matched the manifest."""
        assert self._loop is not None
        fl.arrived[bucket].set()
        self._loop.call_soon_threadsafe(fl.landed[bucket].set)

    def end(self, fl: InFlight, whole: bool) -> None:
        """The pull ended: the version is whole in the cache, or it failed (the nodes
        waiting on its buckets are told, and go to the owner)."""
        if whole and fl.manifest is not None:
            self.manifests[fl.version] = fl.manifest
            for old in [v for v in self.manifests if v not in self.cache.versions]:
                del self.manifests[old]
        flights = self.relayed_deltas.flights  # (pulls run one at a time: none newer)
        if whole:  # its deltas stay, for nodes that come later; the older ones go
            for old in [v for v, f in flights.items() if f is not fl]:
                del flights[old]
        elif flights.get(fl.version) is fl:
            del flights[fl.version]
        fl.failed = not whole
        for event in (fl.ready, *fl.landed):
            event.set()
        for arrived in fl.arrived:  # (failed: the sending threads see it and end)
            arrived.set()
        if self.inflight.get(fl.version) is fl:
            del self.inflight[fl.version]

    # --- what the nodes behind it ask ----------------------------------------------

    async def _ready(self, version: int) -> InFlight | None:
        """The version's in-flight record once ready (None: not in flight here)."""
        fl = self.inflight.get(version)
        if fl is None:
            return None
        try:
            await asyncio.wait_for(fl.ready.wait(), BUCKET_WAIT_S)
        except TimeoutError:
            raise RpcError("stuck", f"version {version} did not start here") from None
        if fl.failed:
            raise RpcError("unknown_version", f"version {version}: its pull failed")
        return fl

    async def _relayed(self, msg: GetRelayed, ctx: CallContext) -> Relayed:
        fl = await self._ready(msg.version)
        if fl is not None:
            return Relayed(ref=self._ref(msg.version, fl.slot, fl.generation))
        try:  # (the receiving thread may move the cache on meanwhile)
            slot = self.cache._slot_of(msg.version)
            generation = self.cache.ref(msg.version).generation
        except KeyError:
            raise RpcError("unknown_version", f"version {msg.version} is not here") from None
        return Relayed(ref=self._ref(msg.version, slot, generation))

    def _ref(self, version: int, slot: int, generation: int) -> CacheRef:
        c = self.cache
        assert c.layout is not None
        return CacheRef(
            c.pipeline,
            c.owner,
            version,
            c.slots[slot].name,
            generation,
            c.layout.fingerprint(),
            c.layout.total_bytes,
            "",
            self.endpoint,
            self.public_key,
            c.transport,
            c.incarnation,
        )

    async def _manifest(self, msg: GetManifest, ctx: CallContext) -> ManifestReply:
        fl = await self._ready(msg.version)
        manifest = fl.manifest if fl is not None else self.manifests.get(msg.version)
        if manifest is None:
            raise RpcError("unknown_version", f"version {msg.version} is not here")
        return ManifestReply(manifest=manifest)

    async def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:  # type: ignore[override]
        fl = await self._ready(msg.version)
        if fl is None:  # whole here (or gone): served as an owner serves its own slots
            try:
                return super()._fetch(msg, ctx)
            except KeyError:  # (moved on by the receiving thread meanwhile)
                raise RpcError("unknown_version", f"version {msg.version} is not here") from None
        if not 0 <= msg.index < len(fl.landed):
            raise RpcError("bad_bucket", f"bucket {msg.index} out of range")
        try:
            await asyncio.wait_for(fl.landed[msg.index].wait(), BUCKET_WAIT_S)
        except TimeoutError:
            raise RpcError("stuck", f"bucket {msg.index} did not arrive here") from None
        if fl.failed:
            raise RpcError("unknown_version", f"version {msg.version}: its pull failed")
        layout = self.cache.layout
        assert layout is not None
        start = layout.bucket_offsets[msg.index]
        data = self.cache.slot_data(fl.slot)[start : start + layout.bucket_sizes[msg.index]]
        meta = BucketMeta(
            version=msg.version,
            index=msg.index,
            nbytes=len(data),
            generation=fl.generation,
            crc32=zlib.crc32(data) if self.checksums else None,
        )
        slot = fl.slot
        return Reply(meta, [data], on_sent=lambda tracker: self.cache.track_slot(slot, tracker))

    def _generation(self, msg: GetGeneration, ctx: CallContext) -> Generation:
        fl = self.inflight.get(msg.version)
        if fl is not None:
            return Generation(generation=-1 if fl.failed else fl.generation)
        return super()._generation(msg, ctx)

    def _streamable(self, version: int) -> bool:
        return version in self.inflight or super()._streamable(version)

    async def _source_of(self, version: int) -> StreamSource | None:
        """What a stream of ``version`` reads here: the slot it is arriving in, each
        bucket once it landed and matched the manifest; or the version whole."""
        try:
            fl = await self._ready(version)
        except RpcError:
            return None  # its pull failed here: the stream ends, the node asks the owner
        if fl is None:
            assert self.streamer is not None
            return await self.streamer.cached(version)
        slot = fl.slot
        data = self.cache.slot_data(slot)

        def wait_bucket(index: int, left: float) -> None:
            if not fl.arrived[index].wait(min(left, BUCKET_WAIT_S)) or fl.failed:
                raise OSError(f"bucket {index} of version {version} never arrived here")

        return StreamSource(
            data, fl.generation, lambda tracker: self.cache.track_slot(slot, tracker), wait_bucket
        )

    def _plan_source(self, msg: PlanSource, ctx: CallContext) -> Source:
        raise RpcError("not_owner", "a relay does not plan: ask the owner")
