"""A node's cache of another node's weights (weights/node_cache.py): the receiver is a
real ``rlix-async node-cache`` process, the owner a real WeightServer over tcp with
CURVE keys, the workers real loads (``weights/staging.py``) in threads of this
process. "Another node" is a shared-memory directory of its own (the owner's slots
are not in it), as on a second machine; the multinode tier runs it across network
namespaces."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.remote_weights import make_cache, make_keys, serving
from helpers.waits import until
from helpers.weights_owner import state

from rlix_async.protocol import RpcError
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.transport import CallContext, Reply
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.node_link import node_cache_endpoint, node_owner
from rlix_async.weights.packing import buckets_of
from rlix_async.weights.shm import sync_local
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.staging import Fetched, load_version
from rlix_async.weights.stream import OpenStream, StreamGrant
from rlix_async.weights.tcp import FetchBucket, WeightServer
from rlix_async.weights.transports import transport_for
from rlix_async.weights.transports.node import NodeCached


class CountingServer(WeightServer):
    """Counts what leaves the owner: stream grants, buckets sent as frames;
    ``lose_bucket``: the next frame reply of that bucket is an error instead (a
    stream that breaks halfway)."""

    grants = 0
    frames = 0
    lose_bucket: int | None = None

    def _open_stream(self, msg: OpenStream, ctx: CallContext) -> StreamGrant:
        self.grants += 1
        return super()._open_stream(msg, ctx)

    def _fetch(self, msg: FetchBucket, ctx: CallContext) -> Reply:
        if msg.index == self.lose_bucket:
            self.lose_bucket = None
            raise RpcError("injected", f"bucket {msg.index} lost")
        self.frames += 1
        return super()._fetch(msg, ctx)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This "node"'s shared-memory directory, and a job of its own (the receiver's
    ipc endpoint and segment names are per job)."""
    monkeypatch.setenv("RLIX_JOB", f"t{uuid.uuid4().hex[:8]}")
    d = tmp_path / "node-shm"
    d.mkdir(mode=0o700)
    yield d


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return make_keys(tmp_path)


class Receiver:
    def __init__(self, keys: Path, shm_dir: Path, log: Path, prefetch: bool = True) -> None:
        self.args = [sys.executable, "-m", "rlix_async.cli", "node-cache", "--pipeline", "p"]
        self.args += ["--keys", str(keys), *([] if prefetch else ["--no-prefetch"])]
        self.env = {**os.environ, "RLIX_SHM_DIR": str(shm_dir)}
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT
        )

    async def ready(self) -> None:
        await until(
            lambda: (
                self.log.read_bytes().count(b"READY node-cache") >= 1
                and os.path.exists(node_cache_endpoint("p").removeprefix("ipc://"))
            ),
            timeout=30,
        )

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        finally:
            self.proc = None


@pytest.fixture
def receiver(keys: Path, node: Path, tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(keys, node, tmp_path / "receiver.log")
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def lazy_receiver(keys: Path, node: Path, tmp_path: Path) -> Iterator[Receiver]:
    """A receiver that pulls only what a worker asks for (weights.prefetch: false)."""
    r = Receiver(keys, node, tmp_path / "receiver.log", prefetch=False)
    r.start()
    try:
        yield r
    finally:
        r.stop()


def _worker_load(ref: CacheRef, keys: Path, node: Path) -> tuple[Fetched, dict[str, torch.Tensor]]:
    """One worker's sync on this node, by the transport chosen for it."""
    got: dict[str, torch.Tensor] = {}

    def load(named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            got[name] = t.clone()

    fetched = load_version(ref, None, load, keys=ClientKeys.load(keys, "shard"), shm_dir=node)
    return fetched, got


async def test_a_version_crosses_once_per_node_and_every_worker_reads_the_node_slot(
    keys: Path, node: Path, receiver: Receiver
) -> None:
    await receiver.ready()
    cache = make_cache()
    try:
        async with serving(cache, keys, CountingServer) as server:
            assert isinstance(server, CountingServer)
            ref = cache.ref(1)
            assert isinstance(transport_for(ref, shm_dir=node), NodeCached)
            loads = await asyncio.gather(
                *(asyncio.to_thread(_worker_load, ref, keys, node) for _ in range(4))
            )
            for fetched, got in loads:
                assert fetched.ref.version == 1 and fetched.staged_bytes == 0  # no private copy
                for name, t in state(1).items():
                    assert torch.equal(got[name], t), name
            assert server.grants == 1  # one transfer for four workers

            cache.build(2, state(2))
            cache.promote(2)
            fetched, got = await asyncio.to_thread(_worker_load, cache.ref(2), keys, node)
            assert fetched.ref.version == 2 and torch.equal(
                got["embed.weight"], state(2)["embed.weight"]
            )
            fetched, _ = await asyncio.to_thread(_worker_load, cache.ref(2), keys, node)
            assert server.grants == 2
            # the node's two slots, in the node's directory, named for the node's cache
            slots = sorted(n for n in os.listdir(node) if "slot" in n)
            assert len(slots) == 2 and all(node_owner(cache.owner) in s for s in slots)
    finally:
        cache.close()
    assert receiver.stop() == 0
    assert not os.listdir(node), "the receiver left segments behind"


async def test_a_stream_broken_halfway_leaves_the_node_on_the_previous_version(
    keys: Path, node: Path, lazy_receiver: Receiver
) -> None:
    await lazy_receiver.ready()
    cache = make_cache()
    try:
        async with serving(cache, keys, CountingServer) as server:
            assert isinstance(server, CountingServer)
            cache.serve(server.endpoint, cache.server_key, transport="zmq")  # frames: countable
            fetched, _ = await asyncio.to_thread(_worker_load, cache.ref(1), keys, node)
            assert fetched.ref.version == 1
            cache.build(2, state(2))
            cache.promote(2)
            server.lose_bucket = 1
            with pytest.raises(SyncError, match="bucket 1 lost"):
                await asyncio.to_thread(_worker_load, cache.ref(2), keys, node)
            # the node still offers version 1 whole; nothing of 2 is offered
            fetched, got = await asyncio.to_thread(_worker_load, cache.ref(1), keys, node)
            assert fetched.ref.version == 1 and torch.equal(
                got["embed.weight"], state(1)["embed.weight"]
            )
            # the next try pulls version 2 whole
            fetched, got = await asyncio.to_thread(_worker_load, cache.ref(2), keys, node)
            assert fetched.ref.version == 2 and torch.equal(
                got["embed.weight"], state(2)["embed.weight"]
            )
    finally:
        cache.close()


def test_a_node_slot_is_offered_only_once_its_whole_version_arrived() -> None:
    """The node cache's slot writer (no processes: the buckets come from an owner's
    cache in this process): a stream that breaks halfway, or ends short, leaves the
    promoted version where it was and readable whole."""
    owner = make_cache()
    node_cache = WeightCache("p", f"n{uuid.uuid4().hex[:6]}", bucket_bytes=4096)
    try:
        layout = owner.layout
        assert layout is not None and len(layout.bucket_sizes) > 2

        def stream(version: int, buckets: int | None = None, finish: bool = True) -> None:
            writer = node_cache.receive()
            writer.start(version, layout)
            for bucket in buckets_of(layout, owner.buffer(version))[:buckets]:
                writer.load(bucket.tensors(layout))
            if finish:
                writer.finish(version)
            else:
                writer.abort()

        stream(1)
        assert node_cache.current == 1
        owner.build(2, state(2))
        owner.promote(2)
        stream(2, buckets=1, finish=False)  # broke after its first bucket
        assert node_cache.versions == [1] and node_cache.current == 1
        with pytest.raises(SyncError, match="never arrived"):
            stream(2, buckets=2)  # ended short, yet said it was done
        node_cache.receive().abort()  # (an abort before start is harmless)
        sink = TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})
        sync_local(node_cache.ref(1), sink, None, shm_dir=node_cache.shm_dir)
        for name, t in state(1).items():
            assert torch.equal(sink.tensors[name], t), name
        stream(2)
        assert node_cache.current == 2 and sorted(node_cache.versions) == [1, 2]
    finally:
        owner.close()
        node_cache.close()


async def test_an_owner_started_again_is_not_served_its_predecessors_version(
    keys: Path, node: Path, receiver: Receiver
) -> None:
    """A restarted trainer numbers its versions from its checkpoint again: the node's
    version 1 of the first start must not answer the second start's version 1."""
    await receiver.ready()
    first = make_cache()
    try:
        async with serving(first, keys):
            fetched, got = await asyncio.to_thread(_worker_load, first.ref(1), keys, node)
            assert torch.equal(got["embed.weight"], state(1)["embed.weight"])
    finally:
        first.close()
    again = WeightCache("p", first.owner, bucket_bytes=4096)  # the same owner, started again
    try:
        again.build(1, state(3))
        again.promote(1)
        async with serving(again, keys, CountingServer) as server:
            assert isinstance(server, CountingServer)
            fetched, got = await asyncio.to_thread(_worker_load, again.ref(1), keys, node)
            assert fetched.ref.version == 1 and server.grants == 1
            assert torch.equal(got["embed.weight"], state(3)["embed.weight"])
    finally:
        again.close()


@pytest.mark.parametrize("prefetch", [True, False])
async def test_a_prefetching_node_takes_each_new_version_before_any_worker_asks(
    keys: Path, node: Path, tmp_path: Path, prefetch: bool
) -> None:
    """Its shards asleep, the node still receives version 2 as the owner publishes it,
    and a worker waking later reads it from the node's slot with no transfer; with
    prefetch off, nothing moves until a worker asks."""
    receiver = Receiver(keys, node, tmp_path / "receiver.log", prefetch=prefetch)
    receiver.start()
    cache = make_cache()
    try:
        await receiver.ready()
        async with serving(cache, keys, CountingServer) as server:
            assert isinstance(server, CountingServer)
            await asyncio.to_thread(_worker_load, cache.ref(1), keys, node)  # names the owner
            cache.build(2, state(2))
            cache.promote(2)
            received = b"received version 2 of p"
            if prefetch:
                await until(lambda: received in receiver.log.read_bytes(), timeout=20)
            else:
                await asyncio.sleep(3.0)  # three of a prefetcher's polls
                assert received not in receiver.log.read_bytes()
            assert server.grants == (2 if prefetch else 1)
            fetched, got = await asyncio.to_thread(_worker_load, cache.ref(2), keys, node)
            assert fetched.ref.version == 2 and fetched.staged_bytes == 0
            assert torch.equal(got["embed.weight"], state(2)["embed.weight"])
            assert server.grants == 2  # the wake's load moved nothing when prefetched
    finally:
        cache.close()
        assert receiver.stop() == 0


async def test_a_receiver_started_again_after_a_kill_prefetches_at_once(
    keys: Path, node: Path, receiver: Receiver
) -> None:
    """A receiver killed mid-run (the launcher starts another): its successor knows the
    owner from what the first remembered, and takes the next version before any worker
    on the node asks (their shards may all sleep)."""
    cache = make_cache()
    try:
        await receiver.ready()
        async with serving(cache, keys):
            await asyncio.to_thread(_worker_load, cache.ref(1), keys, node)  # names the owner
            assert receiver.proc is not None
            receiver.proc.kill()
            receiver.proc.wait(10)
            receiver.proc = None
            receiver.start()  # as the launcher does
            await until(lambda: receiver.log.read_bytes().count(b"READY node-cache") == 2, 30)
            cache.build(2, state(2))
            cache.promote(2)
            await until(lambda: b"received version 2 of p" in receiver.log.read_bytes(), 20)
    finally:
        cache.close()
    assert receiver.stop() == 0
    remembered = Path(node_cache_endpoint("p").removeprefix("ipc://")).with_suffix(".ref")
    assert not remembered.exists(), "a clean stop leaves nothing to resume"
