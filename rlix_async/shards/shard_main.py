"""The shard worker process (``rlix-async shard``): bind the devices, build the
engine, serve the coordinator's commands and the routers' requests until signalled.
The worker itself is :class:`~rlix_async.shards.worker.ShardWorker`."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import zlib

from rlix_async.aio import stop_signals
from rlix_async.config import EngineConfig, ShardConfig
from rlix_async.protocols.engine import ShardEngine
from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint
from rlix_async.shards import vllm_api
from rlix_async.shards.devices import DeviceBindingError, check_binding, cuda_device_count
from rlix_async.shards.first_wake import FirstWakeEngine, shutdown_engine
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import TransportConfig


def build_engine(
    engine: EngineConfig,
    model: str | None,
    *,
    seed: int = 0,
    tp: int = 1,
    cuda: bool = False,
    keys_dir: str | None = None,
    key_name: str = "",
    adapters: bool = False,
) -> ShardEngine:
    """The shard's engine; ``adapters``: a base group's, serving LoRA adapters."""
    if engine.kind == "custom":
        from rlix_async.user_code import load_object

        assert engine.custom is not None  # the config refuses custom without it
        return load_object(engine.custom)(**engine.custom_args)  # type: ignore[no-any-return]
    from rlix_async.shards.vllm_engine import VllmEngine

    assert model is not None  # the config refuses vllm without it
    return VllmEngine(
        model,
        engine.for_device(cuda),
        seed=seed,
        tp=tp,
        cuda=cuda,
        keys_dir=keys_dir,
        key_name=key_name,
        lora=engine.lora if adapters else None,
    )


def engine_seed(pipeline: str, rank: int) -> int:
    """The sampling seed of a shard's engine: its own. With one seed for all, two fresh
    shards draw the same random numbers, and a GRPO group's requests spread over them
    come back identical (no advantage, no gradient)."""
    return zlib.crc32(f"{pipeline}/infer/{rank}".encode())


async def serve(cfg: ShardConfig) -> int:
    """The shard worker process (``rlix-async shard``): serve until signalled. Returns 3
    when the engine died, so a launcher replaces this worker; 2 when it does not see
    the devices it is bound to, the coordinator refuses them, or the installed vLLM
    is not one this package supports."""
    me = f"shard {cfg.pipeline}/{cfg.rank}"
    try:
        cuda = _check_start(cfg)
    except (DeviceBindingError, vllm_api.VllmVersionError) as exc:
        print(f"error: {me}: {exc}", file=sys.stderr, flush=True)
        return 2
    worker, engine = _worker(cfg, cuda)
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
    await asyncio.wait([dead, signalled], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    t0 = time.monotonic()
    await worker.close()
    if dead.done():
        return 3
    dead.cancel()
    t1 = time.monotonic()
    shutdown_engine(engine)
    print(
        f"stopped: worker closed in {t1 - t0:.1f} s, engine in {time.monotonic() - t1:.1f} s; "
        f"served {dict(sorted(worker.served.items()))} (requests answered, by pipeline)",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _check_start(cfg: ShardConfig) -> bool:
    """Before anything loads: the worker sees exactly its devices, and the installed
    vLLM is one this package supports (a warning line for a newer one). The devices come
    first: a launch that shows a worker the wrong devices is wrong whatever is
    installed. Returns whether it runs on CUDA. Raises a one-line DeviceBindingError or
    VllmVersionError."""
    if cfg.engine.kind != "vllm":
        check_binding(cfg.devices, cfg.tensor_parallel_size, None)
        return False
    # Counted without initialising CUDA here: vLLM forks its engine core from this
    # process (see cuda_device_count).
    seen = cuda_device_count()
    check_binding(cfg.devices, cfg.tensor_parallel_size, seen if seen else None)
    warning = vllm_api.check_version()
    if cfg.members:  # adapters from memory use vLLM internals: checked now
        vllm_api.check_internals()
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return seen > 0


def _worker(cfg: ShardConfig, cuda: bool) -> tuple[ShardWorker, ShardEngine]:
    """The worker and its engine (built now, or at the first wake)."""
    engine_cfg = cfg.engine.for_device(cuda)
    # The shard's own key: shard-HOST, else shard, else the shared client key. Its
    # tcp data plane serves with that same pair (never the coordinator's secret);
    # routers learn its public key from the coordinator. vLLM's worker pulls weights
    # from owners on other nodes with it too.
    key_name, keys = (
        ClientKeys.load_first(cfg.keys, f"shard-{socket.gethostname()}", "shard", "client")
        if cfg.keys
        else ("", None)
    )

    def build() -> ShardEngine:
        return build_engine(
            engine_cfg,
            cfg.model,
            seed=engine_seed(cfg.pipeline, cfg.rank),
            tp=cfg.tensor_parallel_size,
            cuda=cuda,
            keys_dir=cfg.keys,
            key_name=key_name,
            adapters=bool(cfg.members),
        )

    engine: ShardEngine = FirstWakeEngine(build) if engine_cfg.load == "first_wake" else build()
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
