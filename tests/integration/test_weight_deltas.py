"""Weight versions as deltas on the wire: a node cache that holds the version before
takes the next one as deltas (weights/delta_source.py, weights/stream.py) and ends
with the owner's bytes exactly; a wrong base falls back to the whole version; a delta
cut halfway never lands; the owner's next build waits for its encoding; auto switches
itself off where every element moves.

Real tcp sockets, a real CURVE WeightServer and sealed streams, real caches in shared
memory."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.remote_weights import machine_dirs, make_keys, relaying_node, serving

from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.weights import delta_source
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.delta_source import PROBE_EVERY, VersionDeltas, WireRows
from rlix_async.weights.tcp import sync_remote

BUCKET = 64 << 10


def weights(seed: int) -> dict[str, torch.Tensor]:
    """bf16 parameters (several buckets, one of them a tensor alone) and a float32 norm."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": (torch.randn(50_000, generator=g) * 0.02).to(torch.bfloat16),
        "layer.w": (torch.randn(20_000, generator=g) * 0.02).to(torch.bfloat16),
        "layer.norm": torch.randn(3000, generator=g),
        "head": (torch.randn(30_000, generator=g) * 0.02).to(torch.bfloat16),
    }


def stepped(w: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``w`` after a step that moves about ``fraction`` of its elements by one ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in w.items():
        bits = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()
        moved = torch.rand(t.shape, generator=g) < fraction
        bits[moved] ^= 1
        out[name] = bits.view(t.dtype)
    return out


def slow_encoding(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """Each bucket's encoding takes ``seconds`` longer (a model larger than these, a
    busier host); the event is set when the first one starts."""
    real, started = delta_source.encode, threading.Event()

    def slow(*args):  # type: ignore[no-untyped-def]
        started.set()
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(delta_source, "encode", slow)
    return started


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


@pytest.fixture
def owner() -> Iterator[WeightCache]:
    cache = WeightCache("p", f"o{uuid.uuid4().hex[:6]}", bucket_bytes=BUCKET, send_wait_s=10.0)
    yield cache
    cache.close()


@pytest.fixture
def node() -> Iterator[WeightCache]:
    cache = WeightCache("p", f"n{uuid.uuid4().hex[:6]}", bucket_bytes=BUCKET, send_wait_s=10.0)
    yield cache
    cache.close()


def publish(owner: WeightCache, deltas: VersionDeltas, version: int, w: dict) -> None:
    """What the trainer's driver does: end the last encoding, build, start this one's,
    promote."""
    deltas.stop()
    owner.build(version, w)
    deltas.encode(version)
    owner.promote(version)


async def pull(owner: WeightCache, node: WeightCache, keys: Path, version: int):  # type: ignore[no-untyped-def]
    """The node cache's pull: into its spare slot, checked against the owner's manifest."""
    sink = node.receive(owner.manifest(version).digests)
    shard = ClientKeys.load(keys, "shard").for_server(owner.server_key.encode())
    ref = owner.ref(version)
    await sync_remote(ref, ref.server, sink, None, keys=shard, transport="sealed")
    return sink


@pytest.mark.parametrize("streams", [1, 3])
async def test_a_node_holding_the_last_version_takes_the_next_as_deltas(
    owner: WeightCache, node: WeightCache, keys: Path, streams: int
) -> None:
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    async with serving(owner, keys, deltas=deltas, streams=streams) as server:
        streamer = server.streamer
        assert streamer is not None
        first = await pull(owner, node, keys, 1)  # nothing to build on: whole
        assert first.wire_bytes == streamer.wire_bytes == streamer.full_bytes
        assert streamer.whole_grants == 1  # (counted: it held no base)
        assert bytes(node.buffer(1)) == bytes(owner.buffer(1))
        publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
        sent = streamer.wire_bytes
        second = await pull(owner, node, keys, 2)
        assert node.current == 2 and bytes(node.buffer(2)) == bytes(owner.buffer(2))
        assert owner.layout is not None
        wire = streamer.wire_bytes - sent
        assert wire == second.wire_bytes < 0.1 * owner.layout.total_bytes
        assert second.delta_fallbacks == 0 and streamer.delta_fallbacks == 0
        assert streamer.whole_grants == 1
        rows = WireRows(streamer, deltas)  # what the trainer's step rows read
        row = rows.row()
        assert row["sync_bytes_wire"] == streamer.wire_bytes  # since the start: both pulls
        assert row["sync_bytes_full"] == 2 * owner.layout.total_bytes
        assert row["delta_version"] == 2 and row["delta_whole_grants"] == 1
        assert row["delta_wire_per_full"] == pytest.approx(
            wire / owner.layout.total_bytes, abs=1e-6
        )
        assert 0.005 < row["delta_changed_fraction"] < 0.02
        again = rows.row()  # the next row: nothing sent since, no new encoding
        assert again["sync_bytes_wire"] == again["sync_bytes_full"] == 0
        assert "delta_version" not in again


async def test_a_wrong_base_falls_back_to_the_whole_version(
    owner: WeightCache, node: WeightCache, keys: Path
) -> None:
    """The node holds a version 1 that is not the owner's (its slot bytes differ): the
    deltas decode to buckets the manifest refuses, and the node takes version 2 whole,
    exactly, counted on both sides."""
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    node.build(1, stepped(v1, 0.3, seed=9))  # "version 1", not the owner's
    node.promote(1)
    publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
    async with serving(owner, keys, deltas=deltas) as server:
        sink = await pull(owner, node, keys, 2)
        assert node.current == 2 and bytes(node.buffer(2)) == bytes(owner.buffer(2))
        assert sink.delta_fallbacks == 1
        assert server.streamer is not None and server.streamer.delta_fallbacks == 1


async def test_an_owner_without_deltas_on_the_nodes_base_sends_whole(
    owner: WeightCache, node: WeightCache, keys: Path
) -> None:
    """The node holds version 1; the owner encoded version 3 on 2: version 3 goes whole."""
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    async with serving(owner, keys, deltas=deltas) as server:
        await pull(owner, node, keys, 1)
        publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
        publish(owner, deltas, 3, stepped(v1, 0.02, seed=3))
        sink = await pull(owner, node, keys, 3)
        assert owner.layout is not None
        assert sink.wire_bytes == owner.layout.total_bytes and sink.delta_fallbacks == 0
        assert bytes(node.buffer(3)) == bytes(owner.buffer(3))
        assert server.streamer is not None


class CutAfterFirst:
    """The owner's deltas, but the stream dies at its second bucket (an owner that
    fails mid-version): stands in for a connection cut halfway."""

    def __init__(self, real: VersionDeltas) -> None:
        self.real = real
        self.given = 0

    def offers(self, version: int, base: int) -> bool:
        return self.real.offers(version, base)

    def bucket(
        self, version: int, base: int, index: int, timeout: float
    ) -> tuple[int, bytes | memoryview] | None:
        self.given += 1
        if self.given > 1:
            raise ConnectionResetError("cut")
        return self.real.bucket(version, base, index, timeout)


async def test_a_delta_cut_halfway_never_lands(
    owner: WeightCache, node: WeightCache, keys: Path
) -> None:
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    async with serving(owner, keys, deltas=deltas):
        await pull(owner, node, keys, 1)
    cut = CutAfterFirst(deltas)
    publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
    async with serving(owner, keys, deltas=cut):
        with pytest.raises(SyncError):
            await pull(owner, node, keys, 2)
    assert cut.given == 2
    assert node.current == 1 and node.versions == [1]  # the half-written slot: not offered
    assert bytes(node.buffer(1)) == bytes(owner.buffer(1))


def test_the_next_build_waits_for_the_encoding(
    owner: WeightCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoding reads the base's slot: the build that would rewrite it waits."""
    started = slow_encoding(monkeypatch, 0.2)
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
    assert started.wait(5)
    t0 = time.monotonic()
    owner.build(3, stepped(v1, 0.02, seed=3))  # rewrites version 1's slot
    assert time.monotonic() - t0 > 0.2  # it waited for the buckets still to encode
    stats = deltas.take_stats()
    assert stats is not None and stats.version == 2  # done before version 1 went


async def test_a_node_with_a_damaged_base_in_a_relay_chain_takes_it_whole(
    owner: WeightCache, keys: Path, tmp_path: Path
) -> None:
    """Node A's version 1 is damaged in one bucket. Version 2 goes down the chain to A
    and B at once: A's delta for that bucket does not decode to the owner's bytes, so A
    takes the version again whole, into the same slot (counted), without holding up
    the node relaying to or from it; both end with the owner's bytes. Node C, which
    holds nothing, then takes it whole from its relay."""
    deltas = VersionDeltas(owner)
    a, b, c = (relaying_node(keys, d) for d in machine_dirs(tmp_path, 3))
    try:
        v1 = weights(1)
        publish(owner, deltas, 1, v1)
        async with serving(owner, keys, deltas=deltas):
            await a.ensure(owner.ref(1))
            await b.ensure(owner.ref(1))
            a.caches[owner.owner].buffer(1)[10] ^= 0xFF  # no longer the owner's version 1
            publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
            t0 = time.monotonic()
            await asyncio.gather(a.ensure(owner.ref(2)), b.ensure(owner.ref(2)))
            assert time.monotonic() - t0 < 30  # no relay waited out a stream's timeout
            await c.ensure(owner.ref(2))
            assert owner.layout is not None
            for n in (a, b, c):
                assert bytes(n.caches[owner.owner].buffer(2)) == bytes(owner.buffer(2))
            pa, pb, pc = a.pulls[-1], b.pulls[-1], c.pulls[-1]
            assert sorted([pa["source"], pb["source"]]).count("owner") == 1  # a chain
            assert pa["delta_fallbacks"] == 1 and pb["delta_fallbacks"] == 0
            if pb["source"] == "owner":  # B took deltas; from A, what A had decoded by then
                assert pb["wire_bytes"] < 0.1 * owner.layout.total_bytes
            assert pc["wire_bytes"] == owner.layout.total_bytes and pc["delta_fallbacks"] == 0
    finally:
        for n in (a, b, c):
            await n.aclose()


def test_stop_ends_an_encoding_at_its_next_bucket(
    owner: WeightCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step faster than the encoding: the driver's stop() before its build ends the
    encoding after the bucket under way; the buckets it did not reach go whole."""
    slow_encoding(monkeypatch, 0.3)
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
    assert owner.layout is not None and len(owner.layout.bucket_sizes) >= 3
    time.sleep(0.1)  # the first bucket under way
    t0 = time.monotonic()
    deltas.stop()
    assert time.monotonic() - t0 < 0.5  # one bucket's encoding, not all of them
    owner.build(3, stepped(v1, 0.02, seed=3))  # nothing holds version 1's slot now
    assert deltas.offers(2, 1)  # what it encoded still goes as deltas,
    assert deltas.bucket(2, 1, 0, timeout=0) is not None
    assert deltas.bucket(2, 1, len(owner.layout.bucket_sizes) - 1, timeout=5) is None  # not
    assert deltas.take_stats() is None  # not a whole version's figures


def test_auto_switches_itself_off_while_everything_moves(owner: WeightCache) -> None:
    """Versions with nothing in common (every bit as likely to move): deltas would be
    the whole version, so after one such version auto stops encoding for a while."""
    deltas = VersionDeltas(owner, max_cost_share=None)  # the size alone decides here
    g = torch.Generator().manual_seed(0)

    def noise(v: int) -> dict[str, torch.Tensor]:
        return {"w": torch.randn(40_000, generator=g)}

    owner.build(0, noise(0))
    owner.promote(0)
    encoded = []
    for v in range(1, 2 + PROBE_EVERY):
        owner.build(v, noise(v))
        encoded.append(deltas.encode(v))
        owner.promote(v)
        if encoded[-1]:
            assert deltas.join(timeout=30)
            stats = deltas.take_stats()
            assert stats is not None and stats.wire_per_full > 0.9
    # encoded once, then not for PROBE_EVERY - 1 versions, then once more to look again
    assert encoded == [True, *[False] * (PROBE_EVERY - 1), True]


def test_auto_switches_itself_off_where_encoding_costs_over_a_tenth_of_a_step(
    owner: WeightCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small deltas, but each took longer than a tenth of the time between two builds:
    auto stops encoding for the next PROBE_EVERY - 1 versions."""
    slow_encoding(monkeypatch, 0.1)
    deltas = VersionDeltas(owner)
    v1 = weights(1)
    publish(owner, deltas, 1, v1)  # nothing before it: not encoded, the clock starts
    publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))  # builds 0.0x s apart
    assert deltas.join(timeout=30)
    stats = deltas.take_stats()
    assert stats is not None and stats.wire_per_full < 0.1  # worth it on the wire...
    owner.build(3, stepped(v1, 0.01, seed=3))
    assert not deltas.encode(3)  # ...but not at that price


def test_off_never_encodes(owner: WeightCache) -> None:
    deltas = VersionDeltas(owner, "off")
    v1 = weights(1)
    publish(owner, deltas, 1, v1)
    owner.build(2, stepped(v1, 0.01, seed=2))
    assert not deltas.encode(2) and not deltas.offers(2, 1)


async def test_deltas_cross_every_hop_of_a_relay_chain(
    owner: WeightCache, keys: Path, tmp_path: Path
) -> None:
    """Three node caches on the owner's chain, each holding version 1: version 2 reaches
    each as deltas (the relays forward the payloads they received), every node ends with
    the owner's bytes, and a node joining with no base takes it whole from its relay."""
    deltas = VersionDeltas(owner)
    dirs = machine_dirs(tmp_path, 4)
    nodes = [relaying_node(keys, d) for d in dirs[:3]]
    try:
        v1 = weights(1)
        publish(owner, deltas, 1, v1)
        async with serving(owner, keys, deltas=deltas) as server:
            for n in nodes:  # one after another: each takes it from the one before
                await n.ensure(owner.ref(1))
            publish(owner, deltas, 2, stepped(v1, 0.01, seed=2))
            for n in nodes:
                await n.ensure(owner.ref(2))
            late = relaying_node(keys, dirs[3])
            nodes.append(late)
            await late.ensure(owner.ref(2))
            assert owner.layout is not None
            total = owner.layout.total_bytes
            for n in nodes:
                assert bytes(n.caches[owner.owner].buffer(2)) == bytes(owner.buffer(2))
            pulls = [n.pulls[-1] for n in nodes]
            assert [p["source"] == "owner" for p in pulls] == [True, False, False, False]
            for p in pulls[:3]:  # every hop: the delta's bytes, not the version's
                assert p["wire_bytes"] < 0.1 * total and p["delta_fallbacks"] == 0, pulls
            assert pulls[3]["wire_bytes"] == total  # nothing to build on: whole
            assert server.streamer is not None
            assert server.streamer.wire_bytes < 2.1 * total  # version 1 once, then a delta
    finally:
        for n in nodes:
            await n.aclose()


def test_a_real_trainers_consecutive_versions_decode_exactly(owner: WeightCache) -> None:
    """The torch trainer at bf16 (float32 main weights), lr 1e-5: each version's deltas
    decode onto the one before to the version's exact bytes, and they are smaller than
    the version (most bf16 elements keep their value)."""
    from rlix_async.config import ModelConfig, TorchTrainConfig
    from rlix_async.protocols.batch import Group
    from rlix_async.train.trainer import TorchTrainer
    from rlix_async.weights.delta import decode

    small = ModelConfig(vocab_size=64, layers=1, hidden=64)
    batch = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])]
    trainer = TorchTrainer(
        TorchTrainConfig(lr=1e-5, dtype="bfloat16", minibatches=1), small, seed=0
    )
    deltas = VersionDeltas(owner, max_cost_share=None)  # (steps of milliseconds here)
    publish(owner, deltas, 0, trainer.weights_for_cache())
    assert owner.layout is not None
    for version in (1, 2, 3):
        trainer.train_step(batch * 2)
        publish(owner, deltas, version, trainer.weights_for_cache())
        base, new = owner.buffer(version - 1), owner.buffer(version)
        sent = 0
        for i, (start, size) in enumerate(
            zip(owner.layout.bucket_offsets, owner.layout.bucket_sizes, strict=True)
        ):
            encoded = deltas.bucket(version, version - 1, i, timeout=30)
            assert encoded is not None
            out = bytearray(size)
            decode(base[start : start + size], encoded[0], encoded[1], memoryview(out))
            assert bytes(out) == bytes(new[start : start + size])
            sent += len(encoded[1])
        assert 0 < sent < owner.layout.total_bytes
