"""Node caches relaying a version along the owner's chain (weights/relay.py), in one
process: three node caches, each with a shared-memory directory of its own (as three
machines), a real owner (WeightCache + WeightServer over tcp with CURVE keys), real
relay servers on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.remote_weights import machine_dirs, make_cache, make_keys, relaying_node, serving
from helpers.weights_owner import state

from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, Reply
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.node_cache import NodeCache
from rlix_async.weights.relay import RelayServer
from rlix_async.weights.stream import OpenStream, StreamGrant, StreamSource
from rlix_async.weights.tcp import FetchBucket, WeightServer


class CountingServer(WeightServer):
    """Counts the owner's sends: sealed streams granted, bucket frames."""

    grants = 0
    frames = 0

    def _open_stream(self, msg: OpenStream, ctx: CallContext) -> StreamGrant:
        self.grants += 1
        return super()._open_stream(msg, ctx)

    def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:
        self.frames += 1
        return super()._fetch(msg, ctx)


class FlippingRelay(RelayServer):
    """A relay that alters what it forwards: one byte of bucket 1, every time, in the
    frames it serves and in the streams (from a private copy it fills as the buckets
    land, bucket 1 altered)."""

    async def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:  # type: ignore[override]
        reply = await super()._fetch(msg, ctx)
        if msg.index != 1:
            return reply
        bad = bytearray(reply.frames[0])
        bad[len(bad) // 2] ^= 0x01
        return Reply(reply.msg, [bytes(bad)])

    async def _source_of(self, version: int) -> StreamSource | None:
        real = await super()._source_of(version)
        layout = self.cache.layout
        if real is None or layout is None:
            return real
        copy = bytearray(real.data)

        def wait_bucket(index: int, left: float) -> None:
            if real.wait_bucket is not None:
                real.wait_bucket(index, left)
            start, size = layout.bucket_offsets[index], layout.bucket_sizes[index]
            copy[start : start + size] = real.data[start : start + size]
            if index == 1:
                copy[start + size // 2] ^= 0x01

        if real.wait_bucket is None:  # whole here already: alter it now
            for index in range(len(layout.bucket_sizes)):
                wait_bucket(index, 0.0)
        return StreamSource(memoryview(copy), real.generation, real.track, wait_bucket)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    return machine_dirs(tmp_path, 3)


async def _close(nodes: list[NodeCache]) -> None:
    for node in nodes:
        await node.aclose()


async def test_three_nodes_take_a_version_the_owner_sent_once(keys: Path, dirs: list[Path]) -> None:
    owner = make_cache()
    nodes = [relaying_node(keys, d) for d in dirs]
    try:
        async with serving(owner, keys, CountingServer) as server:
            assert isinstance(server, CountingServer)
            for version in (1, 2):
                if version == 2:
                    owner.build(2, state(2))
                    owner.promote(2)
                ref = owner.ref(version)
                await asyncio.gather(*(node.ensure(ref) for node in nodes))
                for node in nodes:  # every node holds the owner's bytes exactly
                    held = node.caches[owner.owner]
                    assert bytes(held.buffer(version)) == bytes(owner.buffer(version))
                sources = [node.pulls[-1]["source"] for node in nodes]
                assert sorted(sources).count("owner") == 1, sources  # the others: relays
                relays = {n.relays[owner.owner].endpoint for n in nodes}
                assert all(s in relays for s in sources if s != "owner"), sources
            assert server.grants == 2 and server.frames == 0  # once per version
            # and each hop streamed (sealed, as the owner's pipeline sends), no frames
            relayed = [n.relays[owner.owner].streamer for n in nodes]
            assert sum(r.streams_sent for r in relayed if r is not None) >= 4
    finally:
        await _close(nodes)
        owner.close()


@pytest.mark.parametrize("transport", ["sealed", "zmq"])
async def test_a_relay_that_alters_a_bucket_is_caught_and_the_owner_sends_instead(
    keys: Path, dirs: list[Path], transport: str
) -> None:
    """Through the relay's streams (the owner's pipeline streams) or its frames."""
    owner = make_cache()
    bad = _node_with(FlippingRelay, keys, dirs[0])
    good = relaying_node(keys, dirs[1])
    try:
        async with serving(owner, keys, CountingServer, transport=transport) as server:
            assert isinstance(server, CountingServer)
            ref = owner.ref(1)
            await bad.ensure(ref)  # first to ask: from the owner; then it relays, badly
            assert bad.pulls[-1]["source"] == "owner"
            await good.ensure(ref)  # the owner names the bad relay; its bucket 1 fails
            assert good.pulls[-1]["source"] == "owner"
            held = good.caches[owner.owner]
            assert held.versions == [1]
            assert bytes(held.buffer(1)) == bytes(owner.buffer(1))
            assert (server.grants, server.frames > 0) == (
                (2, False) if transport == "sealed" else (0, True)
            )
    finally:
        await _close([bad, good])
        owner.close()


async def test_a_node_may_offer_itself_as_a_relay_only_under_its_own_key(keys: Path) -> None:
    """Else a node could name another's relay endpoint with a key it holds, and be the
    one the owner points the next nodes to under that name."""
    from rlix_async.protocol import RpcError
    from rlix_async.transport import RpcClient
    from rlix_async.weights.tcp import PlanSource, Source, receiver_identity

    owner = make_cache()
    try:
        async with serving(owner, keys) as server:
            ref = owner.ref(1)
            mine = ClientKeys.load(keys, "shard")
            other = ServerKeys.load(keys, "shard-any").public.decode()
            client = RpcClient(
                server.endpoint,
                receiver_identity(ref),
                keys=mine.for_server(ref.server_key.encode()),
            )
            await client.connect(timeout=10)
            try:
                with pytest.raises(RpcError, match="relay key other than its own"):
                    await client.call(
                        PlanSource(version=1, relay="tcp://10.0.0.9:1", relay_key=other), timeout=10
                    )
                answer = await client.call(
                    PlanSource(version=1, relay="tcp://10.0.0.9:1", relay_key=mine.public.decode()),
                    timeout=10,
                )
                assert isinstance(answer, Source) and answer.endpoint == ""  # first: from us
            finally:
                await client.close()
    finally:
        owner.close()


class ForgingRelay(RelayServer):
    """A relay that serves the owner's bytes with a manifest it signed itself."""

    async def _manifest(self, msg, ctx):  # type: ignore[no-untyped-def]
        import msgspec

        from rlix_async.weights.manifest import ManifestSigner

        reply = await super()._manifest(msg, ctx)
        forged = ManifestSigner()._key.sign(reply.manifest.payload())
        return type(reply)(manifest=msgspec.structs.replace(reply.manifest, signature=forged))


class LyingRelay(RelayServer):
    """A relay that names another version than the one asked for, and serves the
    owner's bytes under it (without the check, a node would hold version 101)."""

    async def _fetch(self, msg, ctx):  # type: ignore[no-untyped-def]
        import msgspec

        real = msgspec.structs.replace(msg, version=msg.version % 100)
        reply = await super()._fetch(real, ctx)
        meta = msgspec.structs.replace(reply.msg, version=msg.version)
        return Reply(meta, reply.frames, on_sent=reply.on_sent)

    def _generation(self, msg, ctx):  # type: ignore[no-untyped-def]
        import msgspec

        return super()._generation(msgspec.structs.replace(msg, version=msg.version % 100), ctx)

    async def _relayed(self, msg, ctx):  # type: ignore[no-untyped-def]
        import msgspec

        reply = await super()._relayed(msg, ctx)
        return type(reply)(ref=msgspec.structs.replace(reply.ref, version=reply.ref.version + 100))


def _node_with(relay_cls: type[RelayServer], keys: Path, shm_dir: Path) -> NodeCache:
    class Node(NodeCache):
        async def _relay_for(self, owner: str, cache: WeightCache) -> RelayServer | None:
            relay = self.relays.get(owner)
            if relay is None or relay.cache is not cache:
                relay = await relay_cls(cache, "tcp://127.0.0.1:0", self.server_keys).start()
                self.relays[owner] = relay
            return relay

    return relaying_node(keys, shm_dir, Node)


@pytest.mark.parametrize("relay_cls", [ForgingRelay, LyingRelay])
async def test_a_relay_forging_the_manifest_or_the_version_is_refused(
    relay_cls: type[RelayServer], keys: Path, dirs: list[Path]
) -> None:
    """Only the owner's key (from the coordinator's ref, never from a relay) signs a
    manifest a node accepts, and only the owner's ref names the version."""
    owner = make_cache()
    bad = _node_with(relay_cls, keys, dirs[0])
    good = relaying_node(keys, dirs[1])
    try:
        async with serving(owner, keys):
            ref = owner.ref(1)
            await bad.ensure(ref)
            await good.ensure(ref)  # named the bad relay first, then the owner
            assert good.pulls[-1]["source"] == "owner", good.pulls
            assert good.caches[owner.owner].versions == [1]
    finally:
        await _close([bad, good])
        owner.close()
