"""The weight-transport seam: one place chooses how a version reaches a receiver
(weights/transports/), from the CacheRef alone: shared memory on the owner's node,
elsewhere the transport the ref's tag names (the pipeline's weights.transport).

Real tcp sockets, a real CURVE WeightServer, a real cache in shared memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.remote_weights import fresh, make_cache, make_keys, serving
from helpers.weights_owner import state
from msgspec.structs import replace

from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.staging import stage_version
from rlix_async.weights.tcp import WeightServer
from rlix_async.weights.transports import pull, transport_for
from rlix_async.weights.transports.shm import SharedMemory
from rlix_async.weights.transports.tcp import Remote


@pytest.fixture
def cache() -> Iterator[WeightCache]:
    cache = make_cache()
    yield cache
    cache.close()


def test_the_transport_is_chosen_from_the_ref(cache: WeightCache, tmp_path: Path) -> None:
    ref = cache.ref(1)
    assert isinstance(transport_for(ref), SharedMemory)  # the owner's node
    elsewhere = tmp_path  # another node: the slot is not in this /dev/shm
    with pytest.raises(SyncError, match="the owner's cache is gone"):
        transport_for(ref, shm_dir=elsewhere)  # this host, no slot, no server
    with pytest.raises(SyncError, match="lives on other-host and its owner serves no endpoint"):
        transport_for(replace(ref, host="other-host"), shm_dir=elsewhere)
    served = replace(ref, server="tcp://10.0.0.1:5000", server_key="k")
    for tag in ("sealed", "zmq"):
        chosen = transport_for(replace(served, transport=tag), shm_dir=elsewhere)
        assert isinstance(chosen, Remote) and chosen.name == tag
    with pytest.raises(SyncError, match="transport 'nccl' is not one this receiver has"):
        transport_for(replace(served, transport="nccl"), shm_dir=elsewhere)
    cache.serve("tcp://10.0.0.1:5000", "k", "zmq")  # the owner's choice travels in its refs
    assert cache.ref(1).transport == "zmq"


class CountingServer(WeightServer):
    """A real WeightServer that counts how it was asked for the bytes."""

    calls: dict[str, int]

    def _fetch(self, msg: Any, ctx: Any) -> Any:  # a bucket as frames on the CURVE socket
        self.calls["frames"] += 1
        return super()._fetch(msg, ctx)

    def _open_stream(self, msg: Any, ctx: Any) -> Any:  # a sealed stream's grant
        self.calls["sealed"] += 1
        return super()._open_stream(msg, ctx)


@pytest.mark.parametrize("tag", ["sealed", "zmq"])
async def test_a_remote_pull_uses_the_transport_the_ref_names(
    cache: WeightCache, tmp_path: Path, tag: str
) -> None:
    keys = make_keys(tmp_path)
    sink = fresh()
    async with serving(cache, keys, CountingServer) as server:
        server.calls = {"frames": 0, "sealed": 0}  # type: ignore[attr-defined]
        cache.serve(cache.server, cache.server_key, tag)
        ref = cache.ref(1)
        # another node: this receiver's /dev/shm does not hold the slot
        await pull(ref, sink, keys=ClientKeys.load(keys, "shard"), shm_dir=tmp_path)
        calls = server.calls  # type: ignore[attr-defined]
    buckets = len(ref_layout(cache).bucket_sizes)
    want = {"frames": 0, "sealed": 1} if tag == "sealed" else {"frames": buckets, "sealed": 0}
    assert calls == want
    assert sink.version == 1
    for name, value in state(1).items():
        assert torch.equal(sink.tensors[name], value), name


def ref_layout(cache: WeightCache) -> Any:
    assert cache.layout is not None
    return cache.layout


async def test_a_staged_copy_follows_the_transport_for_any_engine(
    cache: WeightCache, tmp_path: Path
) -> None:
    """stage_version (what a non-vLLM engine loads from) over shared memory and over tcp
    gives the same version, byte for byte."""
    import asyncio

    keys = make_keys(tmp_path)
    local_ref, _, local = stage_version(cache.ref(1), None)
    async with serving(cache, keys):
        remote_ref, _, remote = await asyncio.to_thread(
            stage_version,
            cache.ref(1),
            None,
            keys=ClientKeys.load(keys, "shard"),
            shm_dir=tmp_path,
        )
    assert local_ref.version == remote_ref.version == 1
    assert [n for n, _ in local] == [n for n, _ in remote]
    for (name, a), (_, b) in zip(local, remote, strict=True):
        assert torch.equal(a, b) and torch.equal(a, state(1)[name]), name
