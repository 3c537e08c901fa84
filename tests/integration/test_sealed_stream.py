"""Sealed weight streams: the default remote path, and what it refuses.

Real tcp sockets, a real CURVE WeightServer granting streams, a real cache in shared
memory. The man in the middle is a real tcp proxy between the shard and the owner's
stream listener, which sees (and may alter) every byte the network carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from helpers.remote_weights import fresh, make_cache, make_keys, proxy, serving
from helpers.weights_owner import state
from msgspec.structs import replace

from rlix_async.protocols.cache_ref import Layout
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.transport import RpcClient
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.stream import (
    MAGIC,
    TAG,
    TICKET_BYTES,
    OpenStream,
    StreamGrant,
    WeightStreamer,
)
from rlix_async.weights.stream_receiver import receive_stream
from rlix_async.weights.tcp import GetLayout, LayoutReply, WeightServer, sync_remote
from rlix_async.weights.transports import pull


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    cache = make_cache()
    yield cache
    cache.close()


def shard_keys(keys: Path, cache: WeightCache) -> ClientKeys:
    return ClientKeys.load(keys, "shard").for_server(cache.server_key.encode())


@contextlib.asynccontextmanager
async def granted(cache: WeightCache, keys: Path) -> AsyncIterator[tuple[StreamGrant, Layout]]:
    """A grant for version 1, asked for on the CURVE socket as sync_remote does."""
    client = RpcClient(cache.server, "p/weights/test", keys=shard_keys(keys, cache))
    await client.connect(timeout=10)
    try:
        layout = await client.call(GetLayout(fingerprint=cache.ref(1).fingerprint), timeout=10)
        grant = await client.call(OpenStream(version=1), timeout=10)
        assert isinstance(layout, LayoutReply) and isinstance(grant, StreamGrant)
        yield grant, layout.layout
    finally:
        await client.close()


async def test_sealed_is_the_default_on_tcp_and_lands_every_byte(
    cache: WeightCache, keys: Path, tmp_path: Path
) -> None:
    sink = fresh()
    async with serving(cache, keys) as server:
        await pull(cache.ref(1), sink, keys=ClientKeys.load(keys, "shard"), shm_dir=tmp_path)
        streamer = server.streamer
        assert streamer is not None
        assert await streamer.wait_sent(1, timeout=10)
        assert streamer.streams_sent == 1
    assert sink.version == 1
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())


@pytest.mark.parametrize("buffers", [1, 2])
async def test_the_wire_carries_no_plaintext_and_every_bucket_arrives(
    cache: WeightCache, keys: Path, buffers: int
) -> None:
    """An eavesdropper on the network sees none of the weights' bytes."""
    got: list[bytes] = []
    async with (
        serving(cache, keys),
        granted(cache, keys) as (grant, layout),
        proxy(grant.port, lambda off, data: data) as (port, seen),
    ):
        await receive_stream(
                "tcp://127.0.0.1:1", replace(grant, port=port), layout, buffers, 10,
                lambda i, header, data: got.append(bytes(data)),
            )  # fmt: skip
    plain = bytes(cache.buffer(1))
    assert b"".join(got) == b"".join(
        plain[o : o + n] for o, n in zip(layout.bucket_offsets, layout.bucket_sizes, strict=True)
    )
    for o in range(0, len(plain) - 32, 256):  # no 32-byte window of the weights is on the wire
        window = plain[o : o + 32]
        if window.strip(b"\x00"):
            assert window not in seen


@pytest.mark.parametrize("where", ["data", "header", "last"])
async def test_one_altered_byte_fails_authentication_and_lands_nothing_from_there(
    cache: WeightCache, keys: Path, where: str
) -> None:
    """One bit flipped in bucket 1's bytes, in bucket 1's header, or in the stream's
    last byte: the buckets before it land, that one and any after it never do."""
    loads: list[int] = []
    async with serving(cache, keys), granted(cache, keys) as (grant, layout):
        # each bucket on the wire: a sealed 32-byte header, then its bytes sealed in one chunk
        starts = [0]
        for n in layout.bucket_sizes:
            starts.append(starts[-1] + 32 + TAG + n + TAG)
        flipped_bucket = {"data": 1, "header": 1, "last": len(layout.bucket_sizes) - 1}[where]
        at = {"data": starts[1] + 48 + 100, "header": starts[1] + 5, "last": starts[-1] - 1}[where]

        def flip(off: int, data: bytes) -> bytes:
            if off <= at < off + len(data):
                data = data[: at - off] + bytes([data[at - off] ^ 1]) + data[at - off + 1 :]
            return data

        async with proxy(grant.port, flip) as (port, seen):
            with pytest.raises(SyncError, match="failed authentication"):
                await receive_stream(
                    "tcp://127.0.0.1:1", replace(grant, port=port), layout, 2, 10,
                    lambda i, header, data: loads.append(i),
                )  # fmt: skip
    assert len(layout.bucket_sizes) >= 3 and len(seen) >= at
    assert loads == list(range(flipped_bucket))


async def test_a_stream_cut_short_is_refused(cache: WeightCache, keys: Path) -> None:
    def cut(off: int, data: bytes) -> bytes | None:
        return None if off + len(data) > 3000 else data

    async with (
        serving(cache, keys),
        granted(cache, keys) as (grant, layout),
        proxy(grant.port, cut) as (port, _),
    ):
        with pytest.raises(SyncError, match="closed the weight stream early"):
            await receive_stream(
                "tcp://127.0.0.1:1", replace(grant, port=port), layout, 2, 10, lambda *a: None
            )


async def test_a_ticket_opens_one_stream_once_and_a_guessed_one_none(
    cache: WeightCache, keys: Path
) -> None:
    async with serving(cache, keys) as server, granted(cache, keys) as (grant, layout):
        assert server.streamer is not None
        await receive_stream(f"tcp://127.0.0.1:{grant.port}", grant, layout, 2, 10, lambda *a: None)
        for ticket in (grant.tickets[0], secrets.token_bytes(TICKET_BYTES)):
            with pytest.raises(SyncError, match="closed the weight stream early"):
                await receive_stream(
                    "tcp://127.0.0.1:1", replace(grant, tickets=[ticket]), layout,
                    2, 10, lambda *a: None,
                )  # fmt: skip

        # a raw client that skips the protocol altogether gets nothing either
        def raw_client() -> bytes:
            with socket.create_connection(("127.0.0.1", grant.port), timeout=5) as raw:
                raw.sendall(MAGIC + b"x" * TICKET_BYTES)
                return raw.recv(1)

        assert await asyncio.to_thread(raw_client) == b""
        streamer = server.streamer
        assert await streamer.wait_sent(1, timeout=10)
        assert streamer.streams_sent == 1


async def test_an_expired_ticket_opens_nothing(cache: WeightCache, keys: Path) -> None:
    async with serving(cache, keys) as server:
        assert server.streamer is not None
        server.streamer.grant_ttl_s = 0.2
        async with granted(cache, keys) as (grant, layout):
            await asyncio.sleep(0.4)
            with pytest.raises(SyncError, match="closed the weight stream early"):
                await receive_stream(
                    f"tcp://127.0.0.1:{grant.port}", grant, layout, 2, 10, lambda *a: None
                )


async def test_a_slot_rewritten_during_the_stream_is_refused(
    cache: WeightCache, keys: Path, tmp_path: Path
) -> None:
    """The receiver is slow (its first load rewrites the slot being streamed, as a
    trainer promoting two versions meanwhile would): the generation check refuses it."""

    class Slow(TensorSink):
        def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
            if cache.current == 1:
                cache.build(2, state(2))
                cache.promote(2)
                cache.build(3, state(3))  # version 1's slot: waits for the stream first
            super().load(named)

    sink = Slow({k: torch.zeros_like(v) for k, v in state(1).items()})
    async with serving(cache, keys):
        ref = cache.ref(1)
        with pytest.raises(SyncError, match="overwritten"):
            await sync_remote(
                ref, ref.server, sink, keys=shard_keys(keys, cache), transport="sealed"
            )
    assert sink.version is None


async def test_sealed_streams_are_for_tcp_servers_only(cache: WeightCache, tmp_path: Path) -> None:
    from rlix_async.security import ipc_endpoint

    server = await WeightServer(cache, ipc_endpoint(f"wtest-{uuid.uuid4().hex[:8]}")).start()
    try:
        assert server.streamer is None
        with pytest.raises(SyncError, match="not served"):
            await sync_remote(cache.ref(1), server.endpoint, fresh(), transport="sealed")
        sink = fresh()  # what an ipc server speaks: zmq frames
        await sync_remote(cache.ref(1), server.endpoint, sink, transport="zmq")
        assert sink.version == 1
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def small_chunks(server: WeightServer, chunk: int = 1000) -> AsyncIterator[None]:
    """The server's streamer with chunks smaller than a bucket (a bucket in several)."""
    assert server.streamer is not None
    await server.streamer.close()
    server.streamer = await WeightStreamer(server.cache, "127.0.0.1", chunk_bytes=chunk).start()
    yield


async def test_buckets_in_several_chunks_land_whole_and_reordered_chunks_never(
    cache: WeightCache, keys: Path, tmp_path: Path
) -> None:
    """Chunks of 1,000 bytes: each 4 KiB bucket in five, the last one short. In order
    every byte lands; two chunks of bucket 0 swapped on the wire (each intact, only
    their order changed) fail authentication, because each nonce counts its place."""
    sink = fresh()
    async with serving(cache, keys) as server, small_chunks(server):
        ref = cache.ref(1)
        await sync_remote(ref, ref.server, sink, keys=shard_keys(keys, cache), transport="sealed")
        assert sink.version == 1
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())
        assert cache.layout is not None and cache.layout.bucket_sizes[0] > 2000

        first, second = 48, 48 + 1016  # bucket 0's first two sealed chunks on the wire

        held = bytearray()  # bucket 0's first two chunks may arrive in several reads

        def swap(off: int, data: bytes) -> bytes:
            if off + len(data) <= len(held) or len(held) >= second + 1016:
                return data  # past the swap
            held.extend(data)
            if len(held) < second + 1016:
                return b""
            out = bytes(held)
            return (
                out[:first] + out[second : second + 1016] + out[first:second] + out[second + 1016 :]
            )

        loads: list[int] = []
        async with (
            granted(cache, keys) as (grant, layout),
            proxy(grant.port, swap) as (port, _),
        ):
            with pytest.raises(SyncError, match="failed authentication"):
                await receive_stream(
                    "tcp://127.0.0.1:1", replace(grant, port=port), layout, 2, 10,
                    lambda i, header, data: loads.append(i),
                )  # fmt: skip
        assert loads == []


async def test_a_stream_in_flight_holds_its_slot_until_it_is_cut(
    keys: Path, tmp_path: Path
) -> None:
    """A receiver that stops reading: the owner's next build into that slot waits for
    the stream instead of rewriting bytes under it, and the stream is cut at
    stream_timeout_s, so the build goes on (a stalled shard never stalls the trainer)."""
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: more than the sockets buffer
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=4 << 20, send_wait_s=30)
    try:
        cache.build(1, big)
        cache.promote(1)
        async with serving(cache, keys) as server, granted(cache, keys) as (grant, _):
            assert server.streamer is not None
            server.streamer.stream_timeout_s = 1.5

            def stalled_receiver() -> socket.socket:
                raw = socket.create_connection(("127.0.0.1", grant.port), timeout=5)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                raw.sendall(MAGIC + grant.tickets[0])
                raw.recv(1000)  # the stream has begun
                return raw

            raw = await asyncio.to_thread(stalled_receiver)
            try:
                cache.build(2, big)  # the other slot: free
                cache.promote(2)
                t0 = time.monotonic()
                await asyncio.to_thread(cache.build, 3, big)  # version 1's slot
                waited = time.monotonic() - t0
            finally:
                raw.close()
        assert 1.0 < waited < 10, waited
    finally:
        cache.close()


async def test_a_connection_without_a_hello_is_dropped(cache: WeightCache, keys: Path) -> None:
    async with serving(cache, keys) as server:
        assert server.streamer is not None
        server.streamer.hello_timeout_s = 0.3

        def silent() -> tuple[bytes, float]:
            with socket.create_connection(("127.0.0.1", server.streamer.port), timeout=5) as raw:
                t0 = time.monotonic()
                return raw.recv(1), time.monotonic() - t0

        got, waited = await asyncio.to_thread(silent)
        assert got == b"" and waited < 3
        assert server.streamer.refused == 1


async def test_the_listener_survives_hostile_connections_and_then_serves_intact() -> None:
    """The fuzz bench's stream target, a few hundred inputs (``rlix-async bench fuzz``
    runs 10,000): garbage, truncated, guessed and replayed tickets, a slow loris and
    silent connections are each refused without a byte of the weights, and a granted
    stream afterwards lands every byte."""
    from rlix_async.bench.fuzz import KINDS, fuzz_stream

    r = await fuzz_stream(240, seed=1)
    assert set(r["kinds"]) == set(KINDS) and all(n > 0 for n in r["kinds"].values())
    assert r["refused"] == 240 and r["bytes_to_hostile"] == 0
    assert r["then_served_intact"] and r["streams_sent"] == 2 and r["ok"]
