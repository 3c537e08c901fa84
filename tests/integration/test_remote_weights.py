"""Remote weights, wired: a pipeline's WeightServer on tcp with its driver's key pair,
shards pulling with their own keys, and every bucket checked before it lands.

Real tcp sockets with CURVE, a real cache in shared memory and real sinks. A shard
"on another node" is one whose shared-memory directory does not hold the owner's
segment (``shm_dir``): that is what sends :func:`pull` over tcp, as on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.weights_owner import state

from rlix_async.protocol import RpcError
from rlix_async.security import ClientKeys, ServerKeys, keygen
from rlix_async.transport import CallContext, Reply
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.pull import pull
from rlix_async.weights.sinks import SyncError, TensorSink
from rlix_async.weights.tcp import BucketMeta, FetchBucket, WeightServer, sync_remote


def fresh() -> TensorSink:
    return TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    keygen(d, ["driver-p"], role="driver", pipelines=["p"])
    keygen(d, ["shard"], role="shard", pipelines=["p"])
    keygen(d, ["shard-other"], role="shard", pipelines=["other"])
    keygen(d, ["shard-any"], role="shard", pipelines=["*"])
    return d


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    """Pipeline ``p``'s cache with version 1 (segments named uniquely per test)."""
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=4096)
    cache.build(1, state(1))
    cache.promote(1)
    yield cache
    cache.close()


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A shared-memory directory without the owner's segments: another node's."""
    d = tmp_path / "other-node-shm"
    d.mkdir()
    return d


@contextlib.asynccontextmanager
async def serving(
    cache: WeightCache, keys: Path, cls: type[WeightServer] = WeightServer
) -> AsyncIterator[WeightServer]:
    """Serve ``cache`` as a trainer does (pipeline.Driver._serve_weights): tcp, with its
    driver's key pair, whose public key every ref then carries."""
    server_keys = ServerKeys.load(keys, "driver-p")
    server = await cls(cache, "tcp://127.0.0.1:0", keys=server_keys).start()
    cache.serve(server.endpoint, server_keys.public.decode())
    try:
        yield server
    finally:
        await server.close()


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
                    impostor.encode()), timeout=3,
            )  # fmt: skip
    assert sink.version is None


class LyingServer(WeightServer):
    """A test double of a confused or hostile owner: the real server with its bucket
    replies altered, which no correct owner can be made to send."""

    lie = "index"

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


@pytest.mark.parametrize(("lie", "said"), [("index", "index"), ("version", "version"),
                                           ("short", "bytes")])  # fmt: skip
async def test_a_bucket_other_than_the_one_asked_for_never_lands(
    cache: WeightCache, keys: Path, elsewhere: Path, lie: str, said: str
) -> None:
    sink = fresh()
    LyingServer.lie = lie
    async with serving(cache, keys, LyingServer):
        with pytest.raises(SyncError, match=f"refused: got .*{said}"):
            await pull(cache.ref(1), sink, keys=ClientKeys.load(keys, "shard"), shm_dir=elsewhere)
    assert sink.version is None
    assert all(not t.any() for t in sink.tensors.values())  # not one byte loaded
