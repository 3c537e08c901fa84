"""Remote weights, wired: a pipeline's WeightServer on tcp with its driver's key pair,
shards pulling with their own keys, and every bucket checked before it lands.

Real tcp sockets with CURVE, a real cache in shared memory and real sinks. A shard
"on another node" is one whose shared-memory directory does not hold the owner's
segment (``shm_dir``): that is what sends :func:`pull` over tcp, as on a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.remote_weights import fresh, make_cache, make_keys, serving
from helpers.weights_owner import state

from rlix_async.protocol import RpcError
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import CallContext, Reply
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.stream import WeightStreamer
from rlix_async.weights.tcp import BucketMeta, FetchBucket, WeightServer, sync_remote
from rlix_async.weights.transports import pull


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    cache = make_cache()
    yield cache
    cache.close()


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A shared-memory directory without the owner's segments: another node's."""
    d = tmp_path / "other-node-shm"
    d.mkdir()
    return d


async def test_a_shard_on_another_node_pulls_with_its_own_key(
    cache: WeightCache, keys: Path, elsewhere: Path
) -> None:
    async with serving(cache, keys):
        ref = cache.ref(1)
        assert ref.server.startswith("tcp://") and ref.server_key  # published with the ref
        sink = fresh()
        await pull(ref, sink, keys=ClientKeys.load(keys, "shard"), shm_dir=elsewhere)
    assert sink.version == 1
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())


async def test_four_receivers_at_once_never_share_an_identity(
    cache: WeightCache, keys: Path, elsewhere: Path
) -> None:
    """Identities are unique by construction (host, pid and a random part), not by
    luck: four receivers at once in one process each get their own, and all land
    (without handover a second receiver under a live identity would be refused)."""
    sinks = [fresh() for _ in range(4)]
    shard = ClientKeys.load(keys, "shard")
    admitted: list[str] = []
    async with serving(cache, keys) as server:
        admit = server.server.admit_peer
        assert admit is not None

        def recording(identity: str, info: dict[str, object]) -> None:
            admit(identity, info)
            admitted.append(identity)

        server.server.admit_peer = recording
        ref = cache.ref(1)
        await asyncio.gather(*(pull(ref, s, keys=shard, shm_dir=elsewhere) for s in sinks))
    assert [s.version for s in sinks] == [1, 1, 1, 1]
    assert len(set(admitted)) == len(admitted) == 4, admitted


@pytest.mark.parametrize(
    ("key", "pipeline", "message"),
    [
        (None, "p", "needs CURVE keys"),
        ("shard-other", "p", "may not"),  # a shard key of another pipeline
        # a key that may pull any pipeline's weights, asking this server for another's
        ("shard-any", "other", "may not pull p's weights"),
    ],
)
async def test_pulls_the_owner_must_not_serve_are_refused(
    cache: WeightCache, keys: Path, elsewhere: Path, key: str | None, pipeline: str, message: str
) -> None:
    sink = fresh()
    async with serving(cache, keys):
        ref = msgspec.structs.replace(cache.ref(1), pipeline=pipeline)
        client = ClientKeys.load(keys, key) if key else None
        with pytest.raises(SyncError, match=message):
            await pull(ref, sink, keys=client, shm_dir=elsewhere)
    assert sink.version is None


async def test_a_server_with_another_key_than_the_published_one_is_never_trusted(
    cache: WeightCache, keys: Path, elsewhere: Path
) -> None:
    """The shard authenticates the server with the key its driver published: a server
    holding another pair never completes the handshake, so nothing is pulled."""
    sink = fresh()
    async with serving(cache, keys):
        impostor = ServerKeys.load(keys, "shard").public.decode()
        ref = msgspec.structs.replace(cache.ref(1), server_key=impostor)
        with pytest.raises(SyncError, match="failed"):
            await sync_remote(
                ref, ref.server, sink, keys=ClientKeys.load(keys, "shard").for_server(
                    impostor.encode()), timeout=3, transport="sealed",
            )  # fmt: skip
    assert sink.version is None


class LyingStreamer(WeightStreamer):
    """The sealed stream's half of :class:`LyingServer`: real sealing, altered headers."""

    lie = "index"

    def bucket_header(
        self, version: int, index: int, nbytes: int, generation: int
    ) -> tuple[int, int, int, int]:
        if self.lie == "index":
            return version, (index + 1) % 3, nbytes, generation
        if self.lie == "version":
            return version + 1, index, nbytes, generation
        return version, index, nbytes - 512, generation


class LyingServer(WeightServer):
    """A test double of a confused or hostile owner: the real server with its bucket
    replies (ZMQ frames or sealed stream headers) altered, which no correct owner can
    be made to send."""

    lie = "index"

    async def start(self) -> WeightServer:
        await super().start()
        assert self.streamer is not None
        await self.streamer.close()
        self.streamer = await LyingStreamer(self.cache, "127.0.0.1").start()
        self.streamer.lie = self.lie
        return self

    def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:
        reply = super()._fetch(msg, ctx)
        meta = reply.msg
        assert isinstance(meta, BucketMeta)
        frames = list(reply.frames)
        if self.lie == "index":
            meta = msgspec.structs.replace(meta, index=(msg.index + 1) % 3)
        elif self.lie == "version":
            meta = msgspec.structs.replace(meta, version=msg.version + 1)
        elif self.lie == "short":
            frames = [bytes(frames[0])[:-512]]
            meta = msgspec.structs.replace(meta, nbytes=len(frames[0]))
        else:
            raise RpcError("bad", self.lie)
        return Reply(meta, frames)


@pytest.mark.parametrize("transport", ["sealed", "zmq"])
@pytest.mark.parametrize(("lie", "said"), [("index", "index"), ("version", "version"),
                                           ("short", "bytes")])  # fmt: skip
async def test_a_bucket_other_than_the_one_asked_for_never_lands(
    cache: WeightCache, keys: Path, lie: str, said: str, transport: str
) -> None:
    sink = fresh()
    LyingServer.lie = lie
    async with serving(cache, keys, LyingServer):
        ref = cache.ref(1)
        client = ClientKeys.load(keys, "shard").for_server(ref.server_key.encode())
        with pytest.raises(SyncError, match=f"refused: got .*{said}"):
            await sync_remote(ref, ref.server, sink, keys=client, transport=transport)
    assert sink.version is None
    assert all(not t.any() for t in sink.tensors.values())  # not one byte loaded
