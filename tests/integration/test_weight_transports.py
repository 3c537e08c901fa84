"""The weight-transport seam: one place chooses how a version reaches a receiver
(weights/transports/), from the CacheRef alone: shared memory on the owner's node,
elsewhere the transport the ref's tag names (the pipeline's weights.transport); and
what any engine's load does with it (weights/staging.py), shown with plain tensors
(a TensorSink), no vLLM.

Real tcp sockets, a real CURVE WeightServer, a real cache in shared memory."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.remote_weights import fresh, make_cache, make_keys, serving
from helpers.weights_owner import state
from msgspec.structs import replace

from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.staging import load_version, stage_version
from rlix_async.weights.tcp import WeightServer
from rlix_async.weights.transports import pull, transport_for, unreachable
from rlix_async.weights.transports.shm import SharedMemory
from rlix_async.weights.transports.tcp import Remote


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


def refused(ref: CacheRef, shm_dir: Path, keys: ClientKeys | None = None) -> str:
    """transport_for's one-line refusal of ``ref``."""
    with pytest.raises(SyncError) as info:
        transport_for(ref, keys=keys, shm_dir=shm_dir)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_transport_is_chosen_from_the_ref(
    cache: WeightCache, tmp_path: Path, elsewhere: Path
) -> None:
    keys = ClientKeys.load(make_keys(tmp_path), "shard")
    ref = cache.ref(1)
    # The owner's node: shared memory, whatever the tag says of other nodes.
    for tag in ("sealed", "plain", "zmq", "nccl"):
        assert isinstance(transport_for(replace(ref, transport=tag)), SharedMemory)
    assert "the owner's cache is gone" in refused(ref, elsewhere)  # this host, no slot
    assert "lives on other-host and its owner serves no endpoint" in refused(
        replace(ref, host="other-host"), elsewhere
    )
    served = replace(ref, server="tcp://10.0.0.1:5000", server_key="k" * 40)
    for tag in ("sealed", "plain", "zmq"):  # elsewhere: the ref's tag, with the owner's key
        chosen = transport_for(replace(served, transport=tag), keys=keys, shm_dir=elsewhere)
        assert isinstance(chosen, Remote) and chosen.name == tag
        assert chosen.keys is not None and chosen.keys.server_public == b"k" * 40
    assert "needs CURVE keys" in refused(served, elsewhere)
    assert "comes without its public key" in refused(
        replace(served, server_key=""), elsewhere, keys
    )
    nccl = replace(served, transport="nccl")
    why = "version 1: transport 'nccl' is not one this receiver has (sealed, plain, zmq)"
    assert refused(nccl, elsewhere, keys) == why
    assert unreachable(nccl, elsewhere) == why  # what an engine asks before an update
    assert unreachable(served, elsewhere) is None
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
    cache: WeightCache, tmp_path: Path, elsewhere: Path, tag: str
) -> None:
    keys = make_keys(tmp_path)
    sink = fresh()
    async with serving(cache, keys, CountingServer) as server:
        server.calls = {"frames": 0, "sealed": 0}  # type: ignore[attr-defined]
        cache.serve(cache.server, cache.server_key, tag)
        ref = cache.ref(1)
        await pull(ref, sink, keys=ClientKeys.load(keys, "shard"), shm_dir=elsewhere)
        calls = server.calls  # type: ignore[attr-defined]
    buckets = len(layout_of(cache).bucket_sizes)
    want = {"frames": 0, "sealed": 1} if tag == "sealed" else {"frames": buckets, "sealed": 0}
    assert calls == want
    assert sink.version == 1
    for name, value in state(1).items():
        assert torch.equal(sink.tensors[name], value), name


def layout_of(cache: WeightCache) -> Any:
    assert cache.layout is not None
    return cache.layout


async def test_an_owner_without_sealed_streams_serves_zmq_refs_and_refuses_sealed_ones(
    cache: WeightCache, tmp_path: Path, elsewhere: Path
) -> None:
    """zmq really is frames on the CURVE socket: a tcp WeightServer whose sealed
    streamer is gone still serves a zmq-tagged ref. A sealed-tagged ref is not quietly
    sent another way: the sync fails in one line, and the sink keeps its old weights."""
    keys = make_keys(tmp_path)
    shard = ClientKeys.load(keys, "shard")
    sink = fresh()
    async with serving(cache, keys) as server:
        assert server.streamer is not None
        await server.streamer.close()
        server.streamer = None
        cache.serve(cache.server, cache.server_key, "zmq")
        await pull(cache.ref(1), sink, keys=shard, shm_dir=elsewhere)
        assert sink.version == 1
        cache.build(2, state(2))
        cache.serve(cache.server, cache.server_key, "sealed")
        with pytest.raises(SyncError, match="transport 'sealed' is not served") as info:
            await pull(cache.promote(2), sink, keys=shard, shm_dir=elsewhere)
    assert "\n" not in str(info.value)
    assert sink.version == 1
    for name, value in state(1).items():
        assert torch.equal(sink.tensors[name], value), name


async def test_a_staged_copy_follows_the_transport_for_any_engine(
    cache: WeightCache, tmp_path: Path, elsewhere: Path
) -> None:
    """stage_version (what a non-vLLM engine loads from) over shared memory and over tcp
    gives the same version, byte for byte."""
    keys = make_keys(tmp_path)
    local_ref, _, local = stage_version(cache.ref(1), None)
    async with serving(cache, keys):
        remote_ref, _, remote = await asyncio.to_thread(
            stage_version,
            cache.ref(1),
            None,
            keys=ClientKeys.load(keys, "shard"),
            shm_dir=elsewhere,
        )
    assert local_ref.version == remote_ref.version == 1
    assert [n for n, _ in local] == [n for n, _ in remote]
    for (name, a), (_, b) in zip(local, remote, strict=True):
        assert torch.equal(a, b) and torch.equal(a, state(1)[name]), name


def test_a_staged_copy_follows_the_owner_when_it_moved_on(cache: WeightCache) -> None:
    """The owner promoted two newer versions after the ref was sent: the ref's slot now
    holds version 3. The copy is of version 3, whole, and the ref returned says so."""
    stale = cache.ref(1)
    cache.build(2, state(2))
    cache.promote(2)
    cache.build(3, state(3))  # into version 1's slot
    got, layout, named = stage_version(stale, None)
    assert (got.version, got.segment) == (3, stale.segment)
    assert got.generation > stale.generation and layout.fingerprint() == got.fingerprint
    assert {n: t for n, t in named}.keys() == state(3).keys()
    for name, t in named:
        assert torch.equal(t, state(3)[name]), name


def into(sink: TensorSink, seen: list[int]) -> Any:
    """An engine's load over plain tensors: what it was handed, copied into ``sink``."""

    def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(named)
        seen.append(len(batch))
        sink.load(batch)

    return load


async def test_an_engines_load_reads_the_mapped_slot_here_and_a_whole_copy_elsewhere(
    cache: WeightCache, tmp_path: Path, elsewhere: Path
) -> None:
    """load_version, the load any engine runs: on the owner's node its ``load`` gets the
    slot in place (no private copy); elsewhere a private copy, once, after the whole
    version arrived, and never anything when the transfer fails."""
    keys = make_keys(tmp_path)
    shard = ClientKeys.load(keys, "shard")
    total = sum(t.numel() * t.element_size() for t in state(1).values())
    here, seen_here = fresh(), []
    loaded = load_version(cache.ref(1), None, into(here, seen_here))
    assert (loaded.ref.version, loaded.staged_bytes, seen_here) == (1, 0, [len(state(1))])
    there, seen_there = fresh(), []
    async with serving(cache, keys) as server:
        got = await asyncio.to_thread(
            load_version, cache.ref(1), None, into(there, seen_there), keys=shard, shm_dir=elsewhere
        )
        assert (got.ref.version, got.staged_bytes, seen_there) == (1, total, [len(state(1))])
        assert server.streamer is not None
        await server.streamer.close()
        server.streamer = None  # a sealed-tagged ref can no longer be served
        with pytest.raises(SyncError, match="not served"):
            await asyncio.to_thread(
                load_version, cache.ref(1), got.layout, into(there, seen_there), keys=shard,
                shm_dir=elsewhere,
            )  # fmt: skip
    assert seen_there == [len(state(1))]  # the failed transfer never reached the load
    for sink in (here, there):
        for name, value in state(1).items():
            assert torch.equal(sink.tensors[name], value), name


async def test_a_remote_copy_of_a_version_gone_from_the_owner_follows_to_its_newest(
    cache: WeightCache, tmp_path: Path, elsewhere: Path
) -> None:
    """Over tcp, the version asked for left the owner's two slots before the copy began
    (it promoted 2 and 3): the copy is of version 3, whole, and says so, where the
    receiver used to fail with "version 1 is not cached". What the owner answers is
    taken only as a version: the server, its key and the transport stay the ref's."""
    keys = make_keys(tmp_path)
    async with serving(cache, keys):
        stale = cache.ref(1)
        for v in (2, 3):
            cache.build(v, state(v))
            cache.promote(v)
        assert 1 not in cache.versions
        got, _, named = await asyncio.to_thread(
            stage_version, stale, None, keys=ClientKeys.load(keys, "shard"), shm_dir=elsewhere
        )
    assert got.version == 3
    assert (got.server, got.server_key, got.transport, got.host) == (
        stale.server,
        stale.server_key,
        stale.transport,
        stale.host,
    )
    for name, t in named:
        assert torch.equal(t, state(3)[name]), name
