"""A node's own copy of a pipeline's weights, pulled once per version for every shard
and tensor-parallel worker on the node.

Without it each vLLM worker on a node other than the owner's pulls the whole version
over its own stream into a private copy: a tp=8 shard receives eight copies per
version and holds eight in host memory while loading. With it one receiver per
(pipeline, node) (:class:`NodeCache`, served by ``rlix-async node-cache``, which
``rlix-async launch --node K`` starts and restarts) pulls each version once into the
node's two-slot shared-memory cache (a :class:`~rlix_async.weights.cache.WeightCache`
whose owner is ``<owner>.node``: the same seqlock, generations and reader leases as
the owner's slots), and every worker on the node then reads it exactly as workers on
the owner's node read the owner's slots: mapped, leased, each rank its own slices,
no private copy (``weights/transports/node.py``).

A version is offered in the node's cache only once the whole of it arrived
(:class:`~rlix_async.weights.cache.SlotWriter`): a stream that breaks halfway leaves
the previous version in place, and a worker's sync fails on the old weights (the
engine's SyncError) instead of loading part of a version. A newer version than the
one asked for is answered where the owner moved on, as every receiver follows it.

The receiver speaks to this node's workers on an ipc socket named by job, pipeline
and host (hosts in network namespaces of one machine share the ipc directory), and to
the owner's ``WeightServer`` with the node's shard key (``P/weights/*`` identities).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

from rlix_async.protocol import ErrorCode, Message, RpcError
from rlix_async.protocols.cache_ref import BadRef, CacheRef
from rlix_async.protocols.sinks import SlotOverwritten, SyncError
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, RpcClient, RpcServer
from rlix_async.weights.cache import SlotWriter, WeightCache
from rlix_async.weights.manifest import Manifest, verify
from rlix_async.weights.node_link import (
    LINK,
    EnsureVersion,
    NodeVersion,
    is_node_ref,
    node_cache_endpoint,
    node_owner,
)
from rlix_async.weights.relay import GetRelayed, Relayed, RelayServer
from rlix_async.weights.shm import SHM_DIR
from rlix_async.weights.tcp import (
    GetManifest,
    ManifestReply,
    PlanSource,
    Source,
    Transport,
    current_remote,
    receiver_identity,
)
from rlix_async.weights.transports import remote_transport
from rlix_async.weights.transports.tcp import Remote

log = logging.getLogger(__name__)
PULL_ATTEMPTS = 7  # the owner moving on, or relays failing us: this many pulls at most
MANIFEST_WAIT_S = 600.0
PREFETCH_POLL_S = 1.0  # how often a prefetching node asks the owner for a newer version
# A relay silent this long fails the node (which then asks the owner): a hung relay, or
# one whose own upstream stalled, costs the nodes behind it this much and no more. A
# healthy relay is silent while its next bucket for a stream arrives from upstream (two
# buckets' time with two streams) or a frame is sent whole: so the bound grows with the
# largest bucket, at a floor rate (a 64 MiB bucket: 15 + 7 s; a 2 GiB tensor: 230 s).
RELAY_STALL_S = 15.0
RELAY_FLOOR_BYTES_S = 10e6  # 80 Mbit/s: a relay chain slower than this per bucket fails over


class RelayFailed(SyncError):
    """The relay a pull came from failed it (the node then asks the owner)."""

    def __init__(self, endpoint: str, why: str) -> None:
        super().__init__(f"the relay at {endpoint} failed: {why}")
        self.endpoint = endpoint


class NodeCache:
    """The receiver's state: one node cache per owner of ``pipeline``, filled one pull
    at a time (a second worker asking for the same version waits for the first pull
    and then reads it: one transfer per version per node)."""

    def __init__(
        self,
        pipeline: str,
        *,
        keys: ClientKeys | None = None,
        shm_dir: Path = SHM_DIR,
        send_wait_s: float = 120.0,
        report: Callable[[dict[str, object]], None] | None = None,
        relay_address: str = "",
        server_keys: ServerKeys | None = None,
        remember: Path | None = None,
    ) -> None:
        """``report``: called with each transfer's record (version, bytes, seconds,
        source) and as each pull begins (event "pulling", version, source).
        ``relay_address``: where this node relays what it receives to the nodes
        behind it (its address as they reach it; "": it does not relay), with
        ``server_keys`` (the node's own pair). ``remember``: a file of ours where the
        owner's newest ref is kept for a successor (a receiver that died and was
        started again prefetches at once, before any worker asks)."""
        self.report = report
        self.relay_address = relay_address
        self.server_keys = server_keys
        self.relays: dict[str, RelayServer] = {}  # per owner
        self._writer: SlotWriter | None = None  # the pull under way
        self.pipeline = pipeline
        self.keys = keys
        self.shm_dir = shm_dir
        self.send_wait_s = send_wait_s
        self.caches: dict[str, WeightCache] = {}  # per owner
        self.incarnations: dict[str, str] = {}  # per owner: whose versions its cache holds
        self._lock = asyncio.Lock()
        self.pulls: list[dict[str, object]] = []  # each transfer: version, bytes, seconds
        # the owner's newest ref this node has seen (from a worker, or a prefetch): what
        # a prefetching node asks the owner about
        self.remember = remember
        self.latest: CacheRef | None = self._recalled()

    def _cache(self, ref: CacheRef) -> WeightCache:
        """The node's cache of ``ref``'s owner, emptied if that owner started again
        since (its version numbers restart from its checkpoint: what the node holds
        under a number may not be what the owner means by it now)."""
        cache = self.caches.get(ref.owner)
        if cache is not None and self.incarnations.get(ref.owner) != ref.incarnation:
            log.warning(
                "the owner of %s started again: dropping this node's versions %s",
                self.pipeline,
                sorted(cache.versions),
            )
            cache.close()
            cache = None
        if cache is None:
            cache = WeightCache(
                self.pipeline,
                node_owner(ref.owner),
                shm_dir=self.shm_dir,
                send_wait_s=self.send_wait_s,
            )
            self.caches[ref.owner] = cache
            self.incarnations[ref.owner] = ref.incarnation
        return cache

    def _check(self, ref: CacheRef) -> None:
        if ref.pipeline != self.pipeline:
            raise SyncError(f"this node's receiver serves {self.pipeline}, not {ref.pipeline}")
        if is_node_ref(ref):
            raise SyncError(f"version {ref.version} is a node cache's, not its owner's")
        try:
            ref.check_names()
        except BadRef as exc:
            raise SyncError(str(exc)) from None

    async def ensure(self, ref: CacheRef, *, newest: bool = False) -> CacheRef | None:
        """This node's ref of ``ref``'s version, or of a newer one where the owner moved
        on (pulled now if the node does not hold it); with ``newest``, of the version
        the owner publishes now, None if that is not newer than ``ref``'s."""
        self._check(ref)
        transport = remote_transport(ref, keys=self.keys)  # a SyncError if none
        self._saw(ref)
        if not newest and self._holds(ref):
            # held already: answered without waiting for a pull under way (a prefetch)
            cache = self.caches[ref.owner]
            return cache.ref(max(cache.versions))
        async with self._lock:
            if newest:
                now = await current_remote(ref, keys=transport.keys)
                if now is None:
                    return None
                ref = now
            cache = self._cache(ref)
            held = max(cache.versions, default=None)
            if held is not None and held >= ref.version:
                return cache.ref(ref.version if ref.version in cache.versions else held)
            relay = await self._relay_for(ref.owner, cache)
            failed_relays: list[str] = []
            for _ in range(PULL_ATTEMPTS):
                t0 = time.perf_counter()
                try:
                    source = await self._pull(ref, cache, transport, relay, failed_relays)
                except SlotOverwritten as exc:
                    log.warning("%s; pulling the owner's newer version", exc)
                    ref = await current_remote(ref, keys=transport.keys) or ref
                    cache = self._cache(ref)  # (a restarted owner: its own cache)
                    relay = await self._relay_for(ref.owner, cache)
                    await asyncio.sleep(0.05)
                    continue
                except RelayFailed as exc:
                    log.warning("%s; taking the version from the owner", exc)
                    failed_relays.append(exc.endpoint)
                    continue
                assert cache.layout is not None and self._writer is not None
                pulled: dict[str, object] = {
                    "version": ref.version,
                    "bytes": cache.layout.total_bytes,
                    # what crossed the network: less where it came as deltas
                    "wire_bytes": self._writer.wire_bytes,
                    "delta_fallbacks": self._writer.delta_fallbacks,
                    "seconds": round(time.perf_counter() - t0, 4),
                    "source": source or "owner",
                }
                self.pulls.append(pulled)
                if self.report is not None:
                    self.report(pulled)
                return cache.ref(ref.version)
            raise SyncError(
                f"no consistent version of {self.pipeline} from {ref.server} "
                f"after {PULL_ATTEMPTS} tries (the owner keeps moving on)"
            )

    def _recalled(self) -> CacheRef | None:
        """What a predecessor on this node remembered (None: nothing, or not ours)."""
        if self.remember is None or not self.remember.exists():
            return None
        try:
            ref = msgspec.json.decode(self.remember.read_bytes(), type=CacheRef)
            ref.check_names()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, BadRef) as exc:
            log.warning("ignoring %s: %s", self.remember, exc)
            return None
        return ref if ref.pipeline == self.pipeline and not is_node_ref(ref) else None

    def _saw(self, ref: CacheRef) -> None:
        last = self.latest
        if last is None or ref.incarnation != last.incarnation or ref.version > last.version:
            self.latest = ref
            if self.remember is not None:
                tmp = self.remember.with_suffix(".tmp")
                try:
                    tmp.write_bytes(msgspec.json.encode(ref))
                    tmp.replace(self.remember)  # whole or not at all, for a successor
                except OSError as exc:  # only a successor's head start is lost
                    log.warning("could not remember the owner's ref in %s: %s", tmp, exc)

    async def prefetch(self, poll_s: float = PREFETCH_POLL_S) -> None:
        """Take each version the owner publishes as it appears, whether or not a worker
        here asks (its shards may sleep: a later wake then loads at local speed instead
        of waiting for the network). Runs until cancelled; asks the owner every
        ``poll_s`` once a worker's first request (or a predecessor's memory) named it,
        and pulls whenever the owner's current version is not the one this node holds
        (a failed pull is tried again at the next poll; a worker asking meanwhile pulls
        as always). Never ends on a failure: it is logged once per outage."""
        failing = False
        while True:
            await asyncio.sleep(poll_s)
            ref = self.latest
            if ref is None:
                continue
            try:
                transport = remote_transport(ref, keys=self.keys)
                # the owner's current version, whatever its number (not under the lock)
                now = await current_remote(
                    msgspec.structs.replace(ref, version=-1), keys=transport.keys
                )
                if now is not None and not self._holds(now):
                    await self.ensure(now)
                if failing:
                    log.info("prefetch of %s: the owner answers again", self.pipeline)
                failing = False
            except Exception as exc:  # a receiver outlives any one failed pull
                if not failing:  # once per outage, not once per poll
                    log.warning("prefetch of %s: %s (trying again)", self.pipeline, exc)
                failing = True

    def _holds(self, ref: CacheRef) -> bool:
        """Whether this node holds ``ref``'s version, or a newer one, of the same start
        of its owner."""
        cache = self.caches.get(ref.owner)
        if cache is None or self.incarnations.get(ref.owner) != ref.incarnation:
            return False
        return max(cache.versions, default=-1) >= ref.version

    async def _relay_for(self, owner: str, cache: WeightCache) -> RelayServer | None:
        """This node's relay of ``cache`` (None: no address to serve on)."""
        if not self.relay_address:
            return None
        relay = self.relays.get(owner)
        if relay is not None and relay.cache is cache:
            return relay
        if relay is not None:  # the owner started again: a new cache, a new relay
            await relay.close()
        relay = await RelayServer(cache, f"tcp://{self.relay_address}:0", self.server_keys).start()
        # what it may send: what the owner's pipeline sends (plain only where it says so)
        cache.transport = self.latest.transport if self.latest is not None else "sealed"
        self.relays[owner] = relay
        return relay

    async def _ask(
        self, ref: CacheRef, endpoint: str, keys: ClientKeys | None, msg: Message
    ) -> Message:
        client = RpcClient(endpoint, receiver_identity(ref), keys=keys)
        try:
            await client.connect(timeout=10.0)
            return await client.call(msg, timeout=60.0)
        finally:
            await client.close()

    async def _pull(
        self,
        ref: CacheRef,
        cache: WeightCache,
        owner: Remote,
        relay: RelayServer | None,
        failed_relays: list[str],
    ) -> str:
        """One pull of ``ref``'s version into ``cache``: from the node the owner names
        (the relay chain) or from the owner, checked against the owner's signed
        manifest where the owner signs, and relayed on as it lands. Returns the relay
        it came from ("" for the owner). RelayFailed: that relay failed us."""
        # From the moment it asks the owner, the owner may name this node as the source
        # of the nodes asking after it: they wait here until the version starts landing.
        inflight = relay.expect(ref.version) if relay is not None and ref.manifest_key else None
        whole = False
        try:
            biggest = max(cache.layout.bucket_sizes) if cache.layout else ref.total_bytes
            stall_s = RELAY_STALL_S + biggest / RELAY_FLOOR_BYTES_S
            source, transport, pull_ref, manifest = await self._source(
                ref, owner, relay, failed_relays, stall_s
            )
            if self.report is not None:
                self.report({"event": "pulling", "version": ref.version, "source": source})
            if relay is not None and inflight is not None and manifest is not None:
                relay.begin(inflight, manifest)
            writer = self._writer = cache.receive(
                manifest.digests if manifest is not None else None,
                on_open=partial(relay.opened, inflight) if relay and inflight else None,
                on_landed=partial(relay.landed, inflight) if relay and inflight else None,
                on_delta=partial(relay.delta_landed, inflight) if relay and inflight else None,
            )
            # On a thread with its own loop: receiving and copying into the slot take
            # whole seconds, and this loop must keep answering its workers (their
            # heartbeats) and the nodes behind it meanwhile. The lock keeps the cache
            # to that thread until the pull ends.
            pulling = asyncio.ensure_future(
                asyncio.to_thread(transport.pull_blocking, pull_ref, writer, cache.layout)
            )
            try:
                await asyncio.shield(pulling)
            except asyncio.CancelledError:
                # stopping: end the pull at its next bucket and wait for the thread to
                # let go of the slot before the lock (and the segments) can go
                writer.stopping = True
                await asyncio.wait([pulling], timeout=self.send_wait_s)
                raise
            except SyncError as exc:
                if source and not isinstance(exc, SlotOverwritten):
                    raise RelayFailed(source, str(exc)) from None
                raise
            whole = True
            return source
        finally:
            if relay is not None and inflight is not None:
                relay.end(inflight, whole)

    async def _source(
        self,
        ref: CacheRef,
        owner: Remote,
        relay: RelayServer | None,
        failed_relays: list[str],
        stall_s: float,
    ) -> tuple[str, Remote, CacheRef, Manifest | None]:
        """Where to pull ``ref``'s version from (the relay the owner names, "" for the
        owner), the transport and ref to pull with, and the owner's checked manifest
        (None from an owner that signs none)."""
        source = Source(endpoint="")
        if ref.manifest_key:
            plan = PlanSource(
                version=ref.version,
                relay=relay.endpoint if relay is not None else "",
                relay_key=relay.public_key if relay is not None else "",
                exclude=failed_relays,
            )
            try:
                answer = await self._ask(ref, ref.server, owner.keys, plan)
            except RpcError as exc:
                if exc.code == "unknown_version":
                    raise SlotOverwritten(f"version {ref.version} left the owner") from None
                raise SyncError(f"asking {ref.server} where to pull from: {exc.detail}") from None
            except Exception as exc:
                raise SyncError(f"asking {ref.server} where to pull from: {exc}") from None
            if isinstance(answer, Source):
                source = answer
        reply: Message | None = None
        transport, pull_ref = owner, ref
        try:
            if source.endpoint:
                transport, pull_ref = await self._relayed(ref, source, stall_s)
                reply = await self._ask(
                    ref, source.endpoint, transport.keys, GetManifest(version=ref.version)
                )
            elif ref.manifest_key:
                reply = await self._ask(
                    ref, ref.server, owner.keys, GetManifest(version=ref.version)
                )
            if not ref.manifest_key:
                return "", transport, pull_ref, None
            if not isinstance(reply, ManifestReply):
                raise SyncError(f"a manifest request was answered {type(reply).__name__}")
            verify(reply.manifest, ref)
            return source.endpoint, transport, pull_ref, reply.manifest
        except (RpcError, SyncError, OSError, TimeoutError) as exc:
            if source.endpoint:
                raise RelayFailed(source.endpoint, str(exc)) from None
            if isinstance(exc, RpcError) and exc.code == "unknown_version":
                raise SlotOverwritten(f"version {ref.version} left the owner") from None
            raise SyncError(f"the manifest of version {ref.version}: {exc}") from None

    async def _relayed(
        self, ref: CacheRef, source: Source, stall_s: float
    ) -> tuple[Remote, CacheRef]:
        """The transport and ref to pull ``ref``'s version from the relay ``source``
        with: the relay's slot, named by the owner's version and layout only."""
        keys = self.keys.for_server(source.key.encode()) if self.keys else None
        relayed = await self._ask(ref, source.endpoint, keys, GetRelayed(version=ref.version))
        if not isinstance(relayed, Relayed):
            raise SyncError(f"{source.endpoint} answered {type(relayed).__name__}")
        theirs = relayed.ref
        # What names the weights is the owner's (the coordinator's ref), never the
        # relay's: its layout (the fingerprint hashes it whole) and version.
        if (theirs.version, theirs.fingerprint, theirs.total_bytes) != (
            ref.version,
            ref.fingerprint,
            ref.total_bytes,
        ) or theirs.pipeline != ref.pipeline:
            raise SyncError(f"{source.endpoint} offered another version or layout")
        # the relay serves as the owner does: its streams where the owner's pipeline
        # streams (sealed or plain), else frames
        kind: Transport = "zmq"
        if ref.transport == "sealed":
            kind = "sealed"
        elif ref.transport == "plain":
            kind = "plain"
        pull_ref = msgspec.structs.replace(
            ref,
            segment=theirs.segment,
            generation=theirs.generation,
            server=source.endpoint,
            server_key=source.key,
            transport=kind,
        )
        return Remote(kind, keys, timeout=stall_s), pull_ref

    async def aclose(self, wait_s: float = 30.0, *, forget: bool = True) -> None:
        """Stop: end a pull under way at its next bucket, wait for its thread to let go of
        the cache (at most ``wait_s``), then close the relays and remove the segments
        (``forget``: and what a successor would resume from; not when this receiver
        ends on a failure, to be started again)."""
        if self._writer is not None:
            self._writer.stopping = True
        try:
            await asyncio.wait_for(self._lock.acquire(), wait_s)
        except TimeoutError:
            log.warning("a pull still runs after %.0f s; removing the segments anyway", wait_s)
        for relay in self.relays.values():
            await relay.close()
        self.relays.clear()
        self.close()
        if forget and self.remember is not None:  # the pipeline ended: nothing to resume
            self.remember.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the node's segments (the pipeline ended, or the receiver stops)."""
        for cache in self.caches.values():
            cache.close()
        self.caches.clear()


class NodeCacheServer:
    """The receiver's ipc endpoint for this node's workers."""

    def __init__(self, cache: NodeCache, endpoint: str | None = None) -> None:
        self.cache = cache
        # the local link's heartbeats, as its workers' clients have them (node_link.LINK)
        self.server = RpcServer(
            endpoint or node_cache_endpoint(cache.pipeline), name="node-cache", config=LINK
        )
        self.server.on(EnsureVersion, self._ensure)
        self.server.admit_peer = self._admit

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    async def start(self) -> NodeCacheServer:
        await self.server.start()
        return self

    async def close(self) -> None:
        await self.server.close()

    def _admit(self, identity: str, info: dict[str, object]) -> None:
        if identity.split("/")[:2] != [self.cache.pipeline, "weights"]:
            raise RpcError(
                ErrorCode.FORBIDDEN, f"{identity} may not read {self.cache.pipeline}'s weights"
            )

    async def _ensure(self, msg: EnsureVersion, ctx: CallContext) -> NodeVersion:
        try:
            return NodeVersion(ref=await self.cache.ensure(msg.ref, newest=msg.newest))
        except SyncError as exc:
            raise RpcError("sync_failed", str(exc)) from None
