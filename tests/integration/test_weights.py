"""Weight packing, the shared-memory cache, and sync across real processes."""

from __future__ import annotations

import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.weights_owner import state
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.aio import run
from rlix_async.security import ipc_endpoint
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.packing import ALIGN, bucket_checksums, buckets_of, layout_of, pack_into
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.shm import SHM_DIR, cleanup_stale, sync_local
from rlix_async.weights.sinks import SyncError, TensorSink
from rlix_async.weights.tcp import sync_remote

OWNER = Path(__file__).parents[1] / "helpers" / "weights_owner.py"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def leftovers(pipeline: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"rlix-{pipeline}-*"))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([512, 1024, 4096, 65536]),
)
def test_packing_round_trip_is_exact(specs, bucket_bytes) -> None:
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        t = torch.randn(shape) * 100
        tensors[f"t{i}"] = t.to(dtype)
    layout = layout_of(tensors, bucket_bytes)
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    for e in layout.entries:  # small tensors share buckets, large ones get their own
        if e.nbytes > bucket_bytes:
            assert [x.name for x in layout.in_bucket(e.bucket)] == [e.name]
    buf = bytearray(layout.total_bytes)
    pack_into(tensors, layout, memoryview(buf))
    out = dict(kv for b in buckets_of(layout, memoryview(buf)) for kv in b.tensors(layout))
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        # bit-exact (NaN-safe): compare the raw bytes
        assert torch.equal(
            out[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
        )
    assert layout_of(tensors, bucket_bytes).fingerprint() == layout.fingerprint()


def test_cache_keeps_two_versions_private_and_cleans_up() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    stale = SHM_DIR / f"rlix-{pipe}-rank0-slot0"
    stale.write_bytes(b"left by a crashed owner")
    cache = WeightCache(pipe, bucket_bytes=4096)
    assert not stale.exists() or stale.stat().st_size != 23  # removed at start
    r1 = cache.build(1, state(1))
    cache.promote(1)
    r2 = cache.build(2, state(2))
    assert r1.segment != r2.segment
    cache.promote(2)
    cache.build(3, state(3))  # evicts v1 (not current), keeps v2
    assert sorted(cache.versions) == [2, 3]
    for name in leftovers(pipe):
        assert stat.S_IMODE((SHM_DIR / name).stat().st_mode) == 0o600
    # a reader of v1 notices it was overwritten instead of loading torn data
    sink = TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})
    with pytest.raises(SyncError, match="overwritten"):
        sync_local(r1, sink)
    assert sink.version is None
    sync_local(cache.ref(2), sink)
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(2).items())
    cache.close()
    assert leftovers(pipe) == []
    assert cleanup_stale(pipe, "rank0") == []


def test_checksum_catches_corruption() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    cache = WeightCache(pipe, bucket_bytes=4096)
    ref = cache.build(1, state(1))
    assert cache.layout is not None
    sums = bucket_checksums(cache.layout, cache.buffer(1))
    cache.buffer(1)[10] ^= 0xFF
    sink = TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})
    with pytest.raises(SyncError, match="checksum mismatch"):
        sync_local(ref, sink, checksums=sums)
    cache.close()


class Owner:
    def __init__(self, pipeline: str, endpoint: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(OWNER), pipeline, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.endpoint = self._expect("READY")

    def _expect(self, word: str) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().split(maxsplit=1)
        assert line and line[0] == word, line
        return line[1].strip()

    def build(self, version: int, seed: int) -> CacheRef:
        assert self.p.stdin is not None
        self.p.stdin.write(f"build {version} {seed}\n")
        self.p.stdin.flush()
        return msgspec.json.decode(self._expect("REF"), type=CacheRef)

    def stop(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=20)


class SlowSink(TensorSink):
    def __init__(self, tensors, delay: float) -> None:
        super().__init__(tensors)
        self.delay = delay

    def load(self, named) -> None:
        time.sleep(self.delay)  # like an engine loading on a busy device
        super().load(named)


def fresh(seed: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(seed).items()}


def test_local_sync_in_another_process() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    owner = Owner(pipe, ipc_endpoint(f"wo-{pipe}"))
    try:
        ref = owner.build(1, 1)
        sink = TensorSink(fresh(1))
        layout = sync_local(ref, sink)
        assert sink.version == 1
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())
        ref2 = owner.build(2, 2)
        sync_local(ref2, sink, layout)  # same layout: nothing re-read but the data
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(2).items())
    finally:
        owner.stop()
    assert leftovers(pipe) == []


def test_remote_sync_and_owner_killed_mid_sync() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    ep = ipc_endpoint(f"wo-{pipe}")
    owner = Owner(pipe, ep)
    sink = SlowSink(fresh(1), delay=0.0)
    try:
        ref1 = owner.build(1, 1)
        run(sync_remote(ref1, owner.endpoint, sink, credits=2))
        assert sink.version == 1
        ref2 = owner.build(2, 2)
        sink.delay = 0.3  # slow enough to kill the owner in the middle

        def kill_soon() -> None:
            time.sleep(0.5)
            owner.p.kill()

        threading.Thread(target=kill_soon).start()
        with pytest.raises(SyncError):
            run(sync_remote(ref2, owner.endpoint, sink, credits=1, timeout=3))
        assert sink.version == 1  # the failed sync did not change the version
        owner.p.wait(timeout=10)
        owner = Owner(pipe, ep)  # restarted owner removes the dead one's segments
        sink.delay = 0.0
        ref3 = owner.build(3, 3)
        run(sync_remote(ref3, owner.endpoint, sink))
        assert sink.version == 3
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(3).items())
    finally:
        owner.stop()
    assert leftovers(pipe) == []


def test_two_pipelines_sync_concurrently() -> None:
    """Each sync sleeps 50 ms per bucket; run together they overlap instead of queueing."""
    pipes = [f"t{uuid.uuid4().hex[:6]}" for _ in range(2)]
    owners = [Owner(p, ipc_endpoint(f"wo-{p}")) for p in pipes]
    spans: dict[str, tuple[float, float]] = {}
    try:
        refs = [o.build(1, 1) for o in owners]

        def one(i: int) -> None:
            sink = SlowSink(fresh(1), delay=0.05)
            t0 = time.monotonic()
            run(sync_remote(refs[i], owners[i].endpoint, sink, credits=1))
            spans[pipes[i]] = (t0, time.monotonic())
            assert sink.version == 1

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for o in owners:
            o.stop()
    (a0, a1), (b0, b1) = spans.values()
    overlap = min(a1, b1) - max(a0, b0)
    assert overlap > 0.5 * min(a1 - a0, b1 - b0), spans
