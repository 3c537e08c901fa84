"""``rlix-async bench weights``: weight sync throughput and the receiver's extra memory.

An owner process builds the cache (layer-like fp32 tensors totalling
``--size-mb``) and serves it; this process is the receiving shard with its own
destination tensors. Measured in one run: plain host copy (memcpy), same-node
sync through shared memory (local), sync over tcp loopback from the owner's
WeightServer (remote, CURVE like every tcp endpoint), and the same bytes as plain
ZMQ frames with the same security and no cache logic (zmq_raw).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import tempfile
import threading
import time
from typing import Any

import torch

from rlix_async.aio import run as aio_run
from rlix_async.security import ClientKeys, ServerKeys, keygen
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.shm import sync_local
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.tcp import WeightServer, sync_remote

GIB = 1 << 30
MIB = 1 << 20


def model_like(total_bytes: int) -> dict[str, torch.Tensor]:
    """Transformer-ish fp32 tensors: per layer four 4 MiB and three 12 MiB matrices."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    left, layer = total_bytes, 0
    while left > 0:
        for name, n in (
            ("q", 1 << 20),
            ("k", 1 << 20),
            ("v", 1 << 20),
            ("o", 1 << 20),
            ("up", 3 << 20),
            ("gate", 3 << 20),
            ("down", 3 << 20),
        ):
            n = min(n, max(left // 4, 1))
            shapes.append((f"layers.{layer}.{name}.weight", (n,)))
            left -= 4 * n
            if left <= 0:
                break
        layer += 1
    return {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes}


def _rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Highest anonymous (private) memory seen while the block runs."""

    def __enter__(self) -> PeakSampler:
        self.base = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / MIB


def _owner(size: int, bucket: int, keys_dir: str, q_out: Any, q_in: Any) -> None:
    import zmq

    async def main() -> None:
        tensors = model_like(size)
        for t in tensors.values():
            t.normal_()
        cache = WeightCache("bench", "owner0", bucket_bytes=bucket)
        cache.build(1, tensors)
        ref = cache.promote(1)
        del tensors
        server = await WeightServer(
            cache, "tcp://127.0.0.1:0", keys=ServerKeys.load(keys_dir)
        ).start()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        ServerKeys.load(keys_dir).apply(push)
        port = push.bind_to_random_port("tcp://127.0.0.1")
        q_out.put((ref, server.endpoint, f"tcp://127.0.0.1:{port}"))
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, q_in.get)
            if cmd == "raw":  # the same bytes, bucket-sized frames, no cache logic
                await loop.run_in_executor(None, _push_all, push, cache)
            else:
                break
        push.close(linger=0)
        ctx.term()
        await server.close()
        cache.close()

    aio_run(main())


def _push_all(push: Any, cache: WeightCache) -> None:
    buf = cache.buffer(1)
    assert cache.layout is not None
    for start, n in zip(cache.layout.bucket_offsets, cache.layout.bucket_sizes, strict=True):
        push.send(buf[start : start + n], copy=False)


def _raw_receive(endpoint: str, keys: ClientKeys, frames: int, total: int) -> float:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    keys.apply(pull)
    pull.connect(endpoint)
    try:
        got = 0
        first = pull.recv(copy=False)
        t0 = time.perf_counter()
        got += len(first)
        for _ in range(frames - 1):
            got += len(pull.recv(copy=False))
        dt = time.perf_counter() - t0
        return (got - len(first)) / dt / GIB if dt > 0 else 0.0
    finally:
        pull.close(linger=0)
        ctx.term()


def run_weights_bench(size_mb: int = 1024, bucket_mb: int = 64, credits: int = 2) -> dict[str, Any]:
    size, bucket = size_mb * MIB, bucket_mb * MIB
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rlix-wbench-") as tmp:
        keygen(f"{tmp}/keys")
        q_out, q_in = ctx.Queue(), ctx.Queue()
        owner = ctx.Process(
            target=_owner, args=(size, bucket, f"{tmp}/keys", q_out, q_in), daemon=True
        )
        owner.start()
        try:
            ref, server_ep, raw_ep = q_out.get(timeout=600)
            assert isinstance(ref, CacheRef)
            keys = ClientKeys.load(f"{tmp}/keys")
            dest = model_like(size)
            for t in dest.values():
                t.zero_()  # touch every page now, not during the timed copies
            result = _measure(ref, server_ep, raw_ep, keys, dest, size, bucket, credits, q_in)
        finally:
            q_in.put("stop")
            owner.join(timeout=60)
            if owner.is_alive():
                owner.kill()
    result.update(size_mb=size_mb, bucket_mb=bucket_mb, credits=credits)
    return result


def _measure(
    ref: CacheRef,
    server_ep: str,
    raw_ep: str,
    keys: ClientKeys,
    dest: dict[str, torch.Tensor],
    size: int,
    bucket: int,
    credits: int,
    q_in: Any,
) -> dict[str, Any]:
    src = torch.empty(size // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src).zero_()
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy = size / (time.perf_counter() - t0) / GIB
    del src, dst

    sink = TensorSink(dest)
    layout = sync_local(ref, sink)  # warm: maps the pages once
    with PeakSampler() as local_mem:
        t0 = time.perf_counter()
        sync_local(ref, sink, layout)
        local = size / (time.perf_counter() - t0) / GIB

    async def remote() -> float:
        await sync_remote(ref, server_ep, sink, layout, credits=credits, keys=keys)  # warm-up
        t = time.perf_counter()
        await sync_remote(ref, server_ep, sink, layout, credits=credits, keys=keys)
        return size / (time.perf_counter() - t) / GIB

    with PeakSampler() as remote_mem:
        remote_gibps = aio_run(remote())

    q_in.put("raw")
    raw = _raw_receive(raw_ep, keys, len(layout.bucket_sizes), layout.total_bytes)
    return {
        "memcpy_gibps": memcpy,
        "local_gibps": local,
        "remote_gibps": remote_gibps,
        "zmq_raw_gibps": raw,
        "peak_extra_mb": max(local_mem.extra_mb, remote_mem.extra_mb),
        "local_extra_mb": local_mem.extra_mb,
        "remote_extra_mb": remote_mem.extra_mb,
        "buckets": len(layout.bucket_sizes),
    }
