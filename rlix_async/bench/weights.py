"""``rlix-async bench weights``: weight sync throughput and the receiver's extra memory.

Two receivers (``--receiver``):

- ``tensors``: an owner process builds the cache (layer-like fp32 tensors
  totalling ``--size-mb``) and serves it; this process receives into its own
  plain tensors. Measured in one run: plain host copy (memcpy), same-node sync
  through shared memory (local), sync from the owner's WeightServer over tcp
  loopback by the default remote path (remote: CURVE control, sealed AES-GCM
  stream) and by bucket frames on the CURVE socket itself (curve_sync), and the
  same bytes as bare ZMQ frames with no cache logic, once with CURVE
  (curve) and once with no security at all (plain_tcp).
- ``vllm``: the path a shard really uses. A vLLM engine serves a random Llama
  of about ``--size-mb``; this process owns the cache and each round builds a
  new version and loads it with ``VllmEngine.load_version`` (vLLM's weight
  transfer API, our ``rlix_shm`` backend handing the leased slot's bytes to the
  model's ``load_weights``, in a layerwise reload or a direct copy). Measured:
  the sync's throughput; its floor, ``vllm_inmemory_gibps`` (the same version
  loaded by the same path from a private copy already in the worker's memory:
  vLLM's own cost, no transfer); the same version copied into plain tensors in
  this process; and the peak extra private memory of the engine's processes
  during the sync.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from rlix_async.aio import run as aio_run
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.security import ClientKeys, ServerKeys, keygen
from rlix_async.weights.cache import WeightCache
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


def _rss_anon(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:  # the process ended
        pass
    return 0


class PeakSampler:
    """Highest anonymous (private) memory seen while the block runs: of this process,
    or summed over ``pids``."""

    def __init__(self, pids: list[int] | None = None) -> None:
        self.pids = pids

    def now(self) -> int:
        if self.pids is None:
            return _rss_anon()
        return sum(_rss_anon(pid) for pid in self.pids)

    def __enter__(self) -> PeakSampler:
        self.base = self.peak = self.now()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / MIB


def _owner(size: int, bucket: int, streams: int, keys_dir: str, q_out: Any, q_in: Any) -> None:
    import zmq

    async def main() -> None:
        tensors = model_like(size)
        for t in tensors.values():
            t.normal_()
        cache = WeightCache("bench", "owner0", bucket_bytes=bucket)
        cache.build(1, tensors)
        ref = cache.promote(1)
        del tensors
        # one server per stream count, each as a trainer serves (plain allowed: the
        # bench compares the two on the same bytes)
        servers = {
            n: await WeightServer(
                cache, "tcp://127.0.0.1:0", keys=ServerKeys.load(keys_dir), streams=n
            ).start()
            for n in sorted({1, streams})
        }
        cache.serve(servers[1].endpoint, "", "plain")
        ctx = zmq.Context()
        curve_push = ctx.socket(zmq.PUSH)
        ServerKeys.load(keys_dir).apply(curve_push)
        plain_push = ctx.socket(zmq.PUSH)  # no security: the bytes' upper bound over ZMQ
        pushes = {
            "curve": curve_push,
            "plain_tcp": plain_push,
        }
        ports = {name: sock.bind_to_random_port("tcp://127.0.0.1") for name, sock in pushes.items()}
        q_out.put(
            (
                ref,
                {n: server.endpoint for n, server in servers.items()},
                {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()},
            )
        )
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, q_in.get)
            if cmd in pushes:  # the same bytes, bucket-sized frames, no cache logic
                await loop.run_in_executor(None, _push_all, pushes[cmd], cache)
            else:
                break
        for sock in pushes.values():
            sock.close(linger=0)
        ctx.term()
        for server in servers.values():
            await server.close()
        cache.close()

    aio_run(main())


def _push_all(push: Any, cache: WeightCache) -> None:
    buf = cache.buffer(1)
    assert cache.layout is not None
    for start, n in zip(cache.layout.bucket_offsets, cache.layout.bucket_sizes, strict=True):
        push.send(buf[start : start + n], copy=False)


def _raw_receive(endpoint: str, keys: ClientKeys | None, frames: int) -> float:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    if keys is not None:
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


def run_weights_bench(
    size_mb: int = 1024, bucket_mb: int = 64, credits: int = 2, streams: int = 2
) -> dict[str, Any]:
    size, bucket = size_mb * MIB, bucket_mb * MIB
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rlix-wbench-") as tmp:
        keygen(f"{tmp}/keys")
        q_out, q_in = ctx.Queue(), ctx.Queue()
        owner = ctx.Process(
            target=_owner, args=(size, bucket, streams, f"{tmp}/keys", q_out, q_in), daemon=True
        )
        owner.start()
        try:
            ref, server_eps, raw_eps = q_out.get(timeout=600)
            assert isinstance(ref, CacheRef)
            keys = ClientKeys.load(f"{tmp}/keys")
            dest = model_like(size)
            for t in dest.values():
                t.zero_()  # touch every page now, not during the timed copies
            result = _measure(ref, server_eps, raw_eps, keys, dest, size, streams, credits, q_in)
        finally:
            q_in.put("stop")
            owner.join(timeout=60)
            if owner.is_alive():
                owner.kill()
    result.update(size_mb=size_mb, bucket_mb=bucket_mb, credits=credits, streams=streams)
    return result


def _measure(
    ref: CacheRef,
    server_eps: dict[int, str],
    raw_eps: dict[str, str],
    keys: ClientKeys,
    dest: dict[str, torch.Tensor],
    size: int,
    streams: int,
    credits: int,
    q_in: Any,
) -> dict[str, Any]:
    """Each path once warm, then timed; the sealed and plain streams alternate twice
    (the best of the two counts), so a slow moment of this VM hits both alike."""
    memcpy = _memcpy_gibps(size)
    sink = TensorSink(dest)
    layout = sync_local(ref, sink)  # warm: maps the pages once
    with PeakSampler() as local_mem:
        t0 = time.perf_counter()
        sync_local(ref, sink, layout)
        local = size / (time.perf_counter() - t0) / GIB

    async def remote(transport: str, n: int) -> float:
        server = server_eps[n]
        for _ in range(2):  # the first warms up
            t = time.perf_counter()
            await sync_remote(
                ref, server, sink, layout, credits=credits, keys=keys, transport=transport
            )
        return size / (time.perf_counter() - t) / GIB

    paths = [("sealed", 1), ("plain", 1)]
    if streams > 1:
        paths += [("sealed", streams), ("plain", streams)]
    speeds: dict[str, float] = {}
    with PeakSampler() as remote_mem:
        for _ in range(2):
            for transport, n in paths:
                name = f"{transport}_x{n}_gibps"
                speeds[name] = max(speeds.get(name, 0.0), aio_run(remote(transport, n)))
    curve_sync = aio_run(remote("zmq", 1))
    raw: dict[str, float] = {}
    for name, endpoint in raw_eps.items():
        q_in.put(name)
        raw[name] = _raw_receive(
            endpoint, keys if name == "curve" else None, len(layout.bucket_sizes)
        )
    sealed = speeds[f"sealed_x{streams}_gibps"]  # the default path: sealed, S streams
    return {
        "memcpy_gibps": memcpy,
        "local_gibps": local,
        "remote_gibps": sealed,
        **speeds,
        "curve_sync_gibps": curve_sync,
        "curve_gibps": raw["curve"],
        "plain_tcp_gibps": raw["plain_tcp"],
        "remote_vs_curve": sealed / raw["curve"],
        "remote_vs_plain_tcp": sealed / raw["plain_tcp"],
        "remote_vs_plain_x1": sealed / speeds["plain_x1_gibps"],
        "peak_extra_mb": max(local_mem.extra_mb, remote_mem.extra_mb),
        "local_extra_mb": local_mem.extra_mb,
        "remote_extra_mb": remote_mem.extra_mb,
        "buckets": len(layout.bucket_sizes),
    }


def _memcpy_gibps(size: int) -> float:
    """A plain host copy of ``size`` bytes (pages touched first), GiB/s."""
    src = torch.empty(size // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src).zero_()
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return size / (time.perf_counter() - t0) / GIB


# --- the receiving path of a vLLM shard ----------------------------------------------

LLAMA_HIDDEN, LLAMA_VOCAB = 768, 8192  # heads of 64, as vLLM's CPU attention needs


def llama_for(size_mb: int) -> dict[str, int]:
    """A tiny-Llama config of about ``size_mb`` MiB of fp32 weights (whole layers, >= 1)."""
    h = LLAMA_HIDDEN
    per_layer = (4 * h * h + 3 * h * 2 * h) * 4  # attention and MLP matrices
    embeddings = 2 * LLAMA_VOCAB * h * 4  # embed_tokens and lm_head
    layers = max(1, round((size_mb * MIB - embeddings) / per_layer))
    return {"vocab_size": LLAMA_VOCAB, "layers": layers, "hidden": h}


def run_vllm_weights_bench(
    size_mb: int = 256, bucket_mb: int = 64, rounds: int = 5
) -> dict[str, Any]:
    """``load_version`` into a vLLM engine, ``rounds`` times after one warm-up sync."""
    return aio_run(_vllm_bench(size_mb, bucket_mb * MIB, rounds))


async def _vllm_bench(size_mb: int, bucket: int, rounds: int) -> dict[str, Any]:
    import psutil

    from rlix_async.config import VllmEngineConfig
    from rlix_async.models.tiny import save_tiny_llama, tiny_llama
    from rlix_async.shards.devices import cuda_device_count
    from rlix_async.shards.vllm.engine import VllmEngine

    config = llama_for(size_mb)
    versions = [tiny_llama(seed, **config).state_dict() for seed in (1, 2)]
    total = sum(t.nbytes for t in versions[0].values())
    with tempfile.TemporaryDirectory(prefix="rlix-wbench-") as tmp:
        path = save_tiny_llama(f"{tmp}/model", seed=0, **config)
        cuda = cuda_device_count() > 0  # not torch.cuda.is_available(): vLLM forks from here
        engine = VllmEngine(str(path), VllmEngineConfig(max_model_len=256), cuda=cuda)
        cache = WeightCache(f"wbench{os.getpid()}", "owner0", bucket_bytes=bucket)
        try:
            # The engine's processes (engine core, worker), measured against their
            # memory before the first sync: what a sync leaves allocated counts too.
            memory = PeakSampler([p.pid for p in psutil.Process().children(recursive=True)])
            before = memory.now()
            seconds, floors, peaks = [], [], []
            retained = 0
            for v in range(1, rounds + 2):  # version 1 is the warm-up (first mapping, layout)
                cache.build(v, versions[(v + 1) % 2])
                ref = cache.promote(v)
                with memory:
                    t0 = time.perf_counter()
                    await engine.load_version(ref)
                    if v > 1:
                        seconds.append(time.perf_counter() - t0)
                peaks.append(memory.peak)
                retained = max(retained, memory.now() - before)
                if v > 1:
                    # The floor, right after, in the same conditions: vLLM loading the
                    # same version by the same path from a private copy in the worker's
                    # memory (made first, not timed; freed before the next sync).
                    floors.append(min(min(r) for r in await engine.reload_from_memory(ref)))
            assert engine.weight_version == 1 + rounds
            how = (await engine.last_load())[0]
            plain = TensorSink({k: torch.empty_like(t) for k, t in versions[0].items()})
            layout = sync_local(ref, plain)  # warm: this process maps the slot once
            t0 = time.perf_counter()
            sync_local(ref, plain, layout)
            plain_gibps = total / (time.perf_counter() - t0) / GIB
        finally:
            engine.shutdown()
            cache.close()
    best = min(seconds)
    mid, mid_floor = statistics.median(seconds), statistics.median(floors)
    return {
        "receiver": "vllm",
        "size_mb": round(total / MIB, 1),
        "tensors": len(versions[0]),
        "layers": config["layers"],
        "rounds": rounds,
        "bucket_mb": bucket // MIB,
        "device": "cuda" if cuda else "cpu",
        "vllm_gibps": total / best / GIB,
        "vllm_seconds": seconds,
        "vllm_inmemory_gibps": total / min(floors) / GIB,
        "vllm_inmemory_seconds": floors,
        # medians of rounds that alternate sync and floor: one run's noise hits both
        "vllm_vs_inmemory": mid_floor / mid,
        "load_path": how.get("path"),
        "reload_reason": how.get("reload_reason"),
        "plain_tensors_gibps": plain_gibps,
        "memcpy_gibps": _memcpy_gibps(total),
        "engine_extra_mb": (max(peaks) - before) / MIB,
        "engine_extra_per_model": (max(peaks) - before) / total,
        "engine_retained_mb": retained / MIB,
    }
