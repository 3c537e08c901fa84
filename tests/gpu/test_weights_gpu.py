"""The weight cache against a real CUDA device: pinned memory, registered slots, device
tensors packed straight into shared memory, and a shard reading the slot onto the device.

Slots live in RLIX_SHM_DIR (default /dev/shm): a container's 64 MiB /dev/shm is too
small for the 1 GiB build and fails with ShmSpaceError naming the fix.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import torch
from helpers.weights_owner import state

from rlix_async.bench.gpu import best_seconds, device_tensors, pinned_copy_seconds
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.security import ipc_endpoint
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.packing import layout_of, pack_into
from rlix_async.weights.shm import forget_mappings, mapped_slot, sync_local
from rlix_async.weights.sinks import TensorSink

OWNER = Path(__file__).parents[1] / "helpers" / "weights_owner.py"
MIB, GIB = 1 << 20, 1 << 30


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def test_pinned_copies_beat_pageable_both_ways() -> None:
    n = 256 * MIB
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(n, dtype=torch.uint8).fill_(1)  # pages touched before timing
    d2h_pinned, h2d_pinned = pinned_copy_seconds(n, repeats=5)
    d2h_pageable = best_seconds(lambda: pageable.copy_(device), 5)
    h2d_pageable = best_seconds(lambda: device.copy_(pageable), 5)
    gibps = {
        "d2h pinned": n / d2h_pinned / GIB,
        "d2h pageable": n / d2h_pageable / GIB,
        "h2d pinned": n / h2d_pinned / GIB,
        "h2d pageable": n / h2d_pageable / GIB,
    }
    assert d2h_pinned < d2h_pageable and h2d_pinned < h2d_pageable, gibps


def test_cache_slots_are_registered_and_read_back_on_the_device() -> None:
    tensors = {
        "a": torch.randn(1000, 33),
        "b": torch.randn(77).to(torch.bfloat16),
        "c": torch.randint(-128, 127, (4096,), dtype=torch.int8),
    }
    cache = WeightCache(f"g{uuid.uuid4().hex[:6]}", bucket_bytes=64 << 10)
    try:
        cache.build(1, tensors)
        assert cache.layout is not None and all(seg.pinned for seg in cache.slots)
        host = torch.frombuffer(cache.buffer(1), dtype=torch.uint8)
        assert host.is_pinned()  # CUDA itself reports the registered mapping as page-locked
        on_device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        packed = bytearray(cache.layout.total_bytes)
        pack_into(tensors, cache.layout, memoryview(packed))
        assert torch.equal(on_device.cpu(), torch.frombuffer(packed, dtype=torch.uint8))
        del host, on_device
    finally:
        cache.close()


def test_cache_build_from_device_tensors_reaches_the_pinned_copy() -> None:
    """Device tensors go straight into the registered slot: >= 70% of one plain D2H
    copy of the same bytes into pinned memory, and the bytes are the tensors'."""
    n = GIB
    d2h, _ = pinned_copy_seconds(n, repeats=5)
    tensors = device_tensors(n)
    cache = WeightCache(f"g{uuid.uuid4().hex[:6]}")
    try:
        cache.build(0, tensors)  # creates and registers the slots: not timed
        versions = iter(range(1, 10))
        build = best_seconds(lambda: cache.build(next(versions), tensors), 5)
        ratio = d2h / build
        assert ratio >= 0.70, f"cache {n / build / GIB:.1f} GiB/s, pinned {n / d2h / GIB:.1f}"
        assert cache.layout is not None
        packed = torch.frombuffer(cache.buffer(max(cache.versions)), dtype=torch.uint8)
        starts = cache.layout.bucket_offsets
        for e in cache.layout.entries:
            start = starts[e.bucket] + e.offset
            assert torch.equal(packed[start : start + e.nbytes], as_bytes(tensors[e.name]))
        del packed
    finally:
        cache.close()


def test_odd_device_tensors_pack_exactly() -> None:
    """Non-contiguous, empty, and mixed CPU/CUDA tensors of several dtypes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "transposed": torch.randn(300, 70, device="cuda", generator=g).t(),
        "half": torch.randn(513, device="cuda", generator=g).half(),
        "empty": torch.empty(0, 5, device="cuda"),
        "bool": torch.randn(99, device="cuda", generator=g) > 0,
        "on_cpu": torch.arange(1000, dtype=torch.int64),
    }
    layout = layout_of(tensors, 4096)
    packed = bytearray(layout.total_bytes)
    pack_into(tensors, layout, memoryview(packed))
    raw = torch.frombuffer(packed, dtype=torch.uint8)
    starts = layout.bucket_offsets
    for e in layout.entries:
        start = starts[e.bucket] + e.offset
        assert torch.equal(raw[start : start + e.nbytes], as_bytes(tensors[e.name])), e.name


def test_a_shard_reads_the_owners_slot_into_device_tensors() -> None:
    """The owner is another process (CPU tensors, as the test helper builds them); this
    process, which uses CUDA, maps the slot page-locked and loads it into CUDA tensors."""
    pipe = f"g{uuid.uuid4().hex[:6]}"
    owner = subprocess.Popen(
        [sys.executable, str(OWNER), pipe, ipc_endpoint(f"wo-{pipe}")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdin is not None and owner.stdout is not None
    try:
        assert owner.stdout.readline().startswith("READY")
        owner.stdin.write("build 1 7\n")
        owner.stdin.flush()
        word, ref_json = owner.stdout.readline().split(maxsplit=1)
        assert word == "REF"
        ref = msgspec.json.decode(ref_json, type=CacheRef)
        expected = state(7)
        sink = TensorSink({k: torch.zeros_like(v, device="cuda") for k, v in expected.items()})
        sync_local(ref, sink)
        assert sink.version == 1
        assert mapped_slot(ref.segment).pinned
        for name, t in expected.items():
            assert torch.equal(sink.tensors[name].cpu(), t), name
    finally:
        forget_mappings()
        owner.communicate("quit\n", timeout=30)
