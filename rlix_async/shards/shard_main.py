"""The shard worker process (``rlix-async shard``): bind the devices, build the
engine, serve the coordinator's commands and the routers' requests until signalled.
The worker itself is :class:`~rlix_async.shards.worker.ShardWorker`."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
import zlib

from rlix_async.aio import stop_signals
from rlix_async.config import ShardConfig
from rlix_async.protocols.engine import ShardEngine
from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint
from rlix_async.shards.devices import DeviceBindingError, check_binding, cuda_device_count
from rlix_async.shards.engines import EngineBackend, EngineStart, EngineUnavailable, engine_backend
from rlix_async.shards.first_wake import FirstWakeEngine, shutdown_engine
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import TransportConfig


def engine_seed(pipeline: str, rank: int) -> int:
    """The sampling seed of a shard's engine: its own. With one seed for all, two fresh
    shards draw the same random numbers, and a GRPO group's requests spread over them
    come back identical (no advantage, no gradient)."""
    return zlib.crc32(f"{pipeline}/infer/{rank}".encode())


async def serve(cfg: ShardConfig) -> int:
    """The shard worker process (``rlix-async shard``): serve until signalled. Returns 3
    when the engine died or the coordinator declared the shard broken, so a launcher
    replaces this worker; 2 when it does not see
    the devices it is bound to, the coordinator refuses them, or the installed vLLM
    is not one this package supports."""
    me = f"shard {cfg.pipeline}/{cfg.rank}"
    try:
        backend, cuda = check_start(cfg)
    except (DeviceBindingError, EngineUnavailable) as exc:
        print(f"error: {me}: {exc}", file=sys.stderr, flush=True)
        return 2
    worker, engine = _worker(cfg, backend, cuda)
    try:
        await worker.start()
    except ConnectionError as exc:  # e.g. the coordinator refused our devices
        print(f"error: {me}: {exc}", file=sys.stderr, flush=True)
        await worker.close()
        shutdown_engine(engine)
        return 2
    signalled = asyncio.ensure_future(stop_signals().wait())
    print(f"READY {worker.data.endpoint}", flush=True)  # handlers first: SIGTERM is clean
    dead = asyncio.ensure_future(worker.engine_dead.wait())
    retired = asyncio.ensure_future(worker.retired.wait())
    await asyncio.wait([dead, retired, signalled], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    t0 = time.monotonic()
    if retired.done():
        print(f"error: {me}: the coordinator declared it {worker.retire_reason}: exiting for "
              "a new worker", file=sys.stderr, flush=True)  # fmt: skip
        # the engine may be the wedged part: whatever hangs below, the process goes
        threading.Thread(target=_exit_after, args=(RETIRE_GRACE_S,), daemon=True).start()
        await asyncio.sleep(0.2)  # the acknowledgement leaves before the socket closes
    await worker.close()
    if retired.done():
        shutdown_engine(engine)  # still alive: its processes go with this worker
        return 3
    if dead.done():
        return 3
    dead.cancel()
    retired.cancel()
    t1 = time.monotonic()
    shutdown_engine(engine)
    print(
        f"stopped: worker closed in {t1 - t0:.1f} s, engine in {time.monotonic() - t1:.1f} s; "
        f"served {dict(sorted(worker.served.items()))} (requests answered, by pipeline)",
        file=sys.stderr,
        flush=True,
    )
    return 0


RETIRE_GRACE_S = 60.0  # a broken shard's worker exits within this, closed or not


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    print("error: the worker did not close in time: exiting anyway", file=sys.stderr, flush=True)
    os._exit(3)


def check_start(cfg: ShardConfig) -> tuple[EngineBackend, bool]:
    """Before anything loads: the worker sees exactly its devices, and its engine can
    run here (a warning line for, e.g., a vLLM newer than those checked). The devices
    come first: a launch that shows a worker the wrong devices is wrong whatever is
    installed. Returns the engine's backend and whether it runs on CUDA (the backend
    says, from the devices seen). Raises a one-line DeviceBindingError or
    EngineUnavailable."""
    # Counted without initialising CUDA here: an engine may fork its processes from
    # this one (vLLM does; see cuda_device_count).
    seen = cuda_device_count()
    check_binding(cfg.devices, cfg.tensor_parallel_size, seen if seen else None)
    backend = engine_backend(cfg.engine)
    warning = backend.check_installed(bool(cfg.members))
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return backend, backend.uses_cuda(seen)


def engine_start(cfg: ShardConfig, cuda: bool, key_name: str = "") -> EngineStart:
    """What the shard builds its engine from: its engine section with the defaults of
    the device it runs on (CUDA as its backend said: bfloat16, built at the first wake;
    CPU: float32, built at start)."""
    return EngineStart(
        model=cfg.model,
        engine=cfg.engine.for_device(cuda),
        tp=cfg.tensor_parallel_size,
        cuda=cuda,
        seed=engine_seed(cfg.pipeline, cfg.rank),
        keys_dir=cfg.keys,
        key_name=key_name,
        adapters=bool(cfg.members),
        record_routes=cfg.record_routes,
    )


def _worker(
    cfg: ShardConfig, backend: EngineBackend, cuda: bool
) -> tuple[ShardWorker, ShardEngine]:
    """The worker and its engine (built now, or at the first wake)."""
    # The shard's own key: shard-HOST, else shard, else the shared client key. Its
    # tcp data plane serves with that same pair (never the coordinator's secret);
    # routers learn its public key from the coordinator. vLLM's worker pulls weights
    # from owners on other nodes with it too.
    key_name, keys = (
        ClientKeys.load_first(cfg.keys, f"shard-{socket.gethostname()}", "shard", "client")
        if cfg.keys
        else ("", None)
    )
    start = engine_start(cfg, cuda, key_name)

    def build() -> ShardEngine:
        return backend.build(start)

    first_wake = start.engine.load == "first_wake"
    engine: ShardEngine = FirstWakeEngine(build) if first_wake else build()
    worker = ShardWorker(
        engine,
        cfg.coordinator or ipc_endpoint("coordinator"),
        cfg.pipeline,
        cfg.rank,
        keys=keys,
        transport=TransportConfig.with_heartbeat(cfg.heartbeat_interval_s),
        drain_timeout_s=cfg.drain_timeout_s,
        data_endpoint=cfg.data_endpoint,
        # a tcp data plane (routers on other nodes) is authenticated like every tcp socket
        data_keys=ServerKeys.load(cfg.keys, key_name)
        if cfg.keys and (cfg.data_endpoint or "").startswith("tcp://")
        else None,
        devices=cfg.devices,
        sleep_level=cfg.engine.sleep_level,
        cuda=cuda,
        sleep_timeout_s=cfg.sleep_timeout_s,
        members=cfg.members,
    )
    return worker, engine
