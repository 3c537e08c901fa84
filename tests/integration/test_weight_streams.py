"""Several streams per transfer, and the plain transport.

Real tcp sockets, a real CURVE WeightServer granting streams, a real cache in shared
memory; the eavesdropper is a real tcp proxy on the stream's path.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch
from helpers.remote_weights import fresh, make_cache, make_keys, proxy, serving
from helpers.weights_owner import state
from msgspec.structs import replace

from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.transport import CallContext, RpcClient
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.stream import OpenStream, StreamGrant
from rlix_async.weights.stream_receiver import receive_stream
from rlix_async.weights.tcp import GetLayout, LayoutReply, WeightServer, sync_remote
from rlix_async.weights.transports import pull


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    cache = make_cache()  # five buckets of 8192, 2048, 8192, 512, 8192 bytes
    yield cache
    cache.close()


def shard_keys(keys: Path, cache: WeightCache) -> ClientKeys:
    return ClientKeys.load(keys, "shard").for_server(cache.server_key.encode())


async def ask_grant(cache: WeightCache, keys: Path, transport: str) -> tuple[StreamGrant, object]:
    client = RpcClient(cache.server, "p/weights/test", keys=shard_keys(keys, cache))
    await client.connect(timeout=10)
    try:
        layout = await client.call(GetLayout(fingerprint=cache.ref(1).fingerprint), timeout=10)
        grant = await client.call(OpenStream(version=1, transport=transport), timeout=10)
        assert isinstance(layout, LayoutReply) and isinstance(grant, StreamGrant)
        return grant, layout.layout
    finally:
        await client.close()


def recorder(got: dict[int, bytes]) -> Callable[[int, tuple[int, int, int, int], memoryview], None]:
    def land(index: int, header: tuple[int, int, int, int], data: memoryview) -> None:
        assert header[1] == index  # each stream's bucket is the one it says it is
        got[index] = bytes(data)

    return land


def buckets_of(cache: WeightCache) -> dict[int, bytes]:
    layout, data = cache.layout, bytes(cache.buffer(1))
    assert layout is not None
    return {
        i: data[o : o + n]
        for i, (o, n) in enumerate(zip(layout.bucket_offsets, layout.bucket_sizes, strict=True))
    }


@pytest.mark.parametrize("streams", [2, 3, 16])
async def test_several_streams_carry_every_bucket_once(
    cache: WeightCache, keys: Path, tmp_path: Path, streams: int
) -> None:
    """Stream j carries buckets j, j+S, ...: a sync lands every tensor, the owner sends
    one stream per ticket, and never more streams than buckets (16 asked: 5 sent)."""
    sink = fresh()
    async with serving(cache, keys, streams=streams) as server:
        await pull(cache.ref(1), sink, keys=ClientKeys.load(keys, "shard"), shm_dir=tmp_path)
        assert server.streamer is not None
        sent = min(streams, 5)
        assert await server.streamer.wait_sent(sent, timeout=10)
        assert server.streamer.streams_sent == sent
    assert sink.version == 1
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())


@pytest.fixture
def even() -> Iterator[WeightCache]:
    """Four buckets of exactly 4096 bytes: streams whose framing is the same."""
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=4096)
    cache.build(1, {f"w{i}": torch.full((1024,), float(i)) for i in range(4)})
    cache.promote(1)
    assert cache.layout is not None and cache.layout.bucket_sizes == (4096,) * 4
    yield cache
    cache.close()


async def test_a_stream_read_as_another_fails_authentication(even: WeightCache, keys: Path) -> None:
    """One key for all streams, each stream's nonces prefixed with its index: stream 1's
    bytes read where stream 0's belong (its ticket presented first; buckets of one size,
    so only the nonces can tell) never open, and nothing lands."""
    got: dict[int, bytes] = {}
    async with serving(even, keys, streams=2):
        grant, layout = await ask_grant(even, keys, "sealed")
        swapped = replace(grant, tickets=[grant.tickets[1], grant.tickets[0]])
        with pytest.raises(SyncError, match="failed authentication"):
            await receive_stream(
                f"tcp://127.0.0.1:{grant.port}", swapped, layout, 2, 10, recorder(got)
            )
    assert got == {}


async def test_sealed_streams_carry_no_plaintext_and_plain_ones_do(
    cache: WeightCache, keys: Path
) -> None:
    """Two streams through an eavesdropping proxy: sealed, no 32-byte window of the
    weights is on the wire; plain (the pipeline said its fabric is trusted), the
    buckets are there as they are in the slot. Both land every bucket."""
    plain_bytes = buckets_of(cache)
    for transport in ("sealed", "plain"):
        async with serving(cache, keys, streams=2, transport=transport):
            grant, layout = await ask_grant(cache, keys, transport)
            assert len(grant.tickets) == 2 and (transport == "sealed") == bool(grant.key)
            got: dict[int, bytes] = {}
            async with proxy(grant.port, lambda off, data: data) as (port, seen):
                await receive_stream(
                    "tcp://127.0.0.1:1", replace(grant, port=port), layout, 2, 10,
                    recorder(got), transport=transport,
                )  # fmt: skip
        assert got == plain_bytes
        on_wire = [b[o : o + 32] in seen for b in plain_bytes.values() for o in (0, len(b) - 32)]
        assert all(on_wire) if transport == "plain" else not any(on_wire), transport


async def test_an_owner_sends_plain_only_when_its_pipeline_says_so(
    cache: WeightCache, keys: Path
) -> None:
    """A receiver asking a sealed owner for plain streams gets a one-line refusal."""
    async with serving(cache, keys, streams=2):
        ref = cache.ref(1)
        with pytest.raises(SyncError, match="sends sealed streams only"):
            await sync_remote(
                ref, ref.server, fresh(), keys=shard_keys(keys, cache), transport="plain"
            )


class Downgrading(WeightServer):
    """An owner that answers a request for sealed streams with a plain grant."""

    def _open_stream(self, msg: OpenStream, ctx: CallContext) -> StreamGrant:
        assert self.streamer is not None
        return self.streamer.grant(msg.version, ctx.peer, "plain")


async def test_a_receiver_refuses_a_plain_grant_for_a_sealed_request(
    cache: WeightCache, keys: Path
) -> None:
    sink = fresh()
    async with serving(cache, keys, Downgrading):
        ref = cache.ref(1)
        with pytest.raises(SyncError, match="asked for a sealed stream, the owner granted 'plain'"):
            await sync_remote(
                ref, ref.server, sink, keys=shard_keys(keys, cache), transport="sealed"
            )
    assert sink.version is None


async def test_plain_streams_land_a_version_through_its_tag(
    cache: WeightCache, keys: Path, tmp_path: Path
) -> None:
    """A plain-tagged ref (the pipeline's weights.transport) is pulled plain."""
    sink = fresh()
    async with serving(cache, keys, streams=2, transport="plain") as server:
        ref = cache.ref(1)
        assert ref.transport == "plain"
        await pull(ref, sink, keys=ClientKeys.load(keys, "shard"), shm_dir=tmp_path)
        assert server.streamer is not None and await server.streamer.wait_sent(2, timeout=10)
    assert sink.version == 1
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())


async def test_one_stream_failing_ends_the_others_at_once_and_leaves_no_thread(
    even: WeightCache, keys: Path
) -> None:
    """Stream 0 stalls on the network (a proxy that holds what the owner sends) while
    stream 1's ticket is refused: the transfer fails at once, not at stream 0's 30 s
    timeout, nothing of stream 0 lands, and no reading thread outlives the call."""
    got: dict[int, bytes] = {}
    async with serving(even, keys, streams=2):
        grant, layout = await ask_grant(even, keys, "sealed")
        dead = replace(grant, tickets=[grant.tickets[0], b"x" * len(grant.tickets[1])])
        async with proxy(grant.port, lambda off, data: b"") as (port, _):  # holds all
            t0 = time.monotonic()
            with pytest.raises(SyncError, match="closed the weight stream early"):
                await receive_stream(
                    "tcp://127.0.0.1:1", replace(dead, port=port), layout, 2, 30, recorder(got)
                )
            waited = time.monotonic() - t0
            assert reading_threads() == 0  # at once: nothing reads into its buffers now
        assert waited < 10, waited
        assert got == {}


def reading_threads() -> int:
    """Threads of this process inside a stream's socket read."""
    count = 0
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_name == "_recv_exact":
                count += 1
                break
            f = f.f_back
    return count
