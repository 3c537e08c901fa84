"""A shard worker's shrink/wake paths as sequences, run against any engine.

The same sequences run on the scripted engine in the CPU suite
(tests/integration/test_shard_states.py) and on a real vLLM engine on a GPU
(tests/gpu/test_vllm_cycle_gpu.py), so what the double accepts is what vLLM is
asked to do. Each returns what it saw after every step: the worker's state and the
memory its acknowledgement reports (device memory on CUDA, resident memory on CPU).
Commands go through the worker's command handler, one at a time as the
coordinator's would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.messages import ShardState
from rlix_async.shards.worker import ShardWorker
from rlix_async.weights.cache import WeightCache


@dataclass(frozen=True)
class Seen:
    step: str
    state: ShardState
    weights_valid: bool
    version: int | None
    memory_bytes: int | None


def look(worker: ShardWorker, step: str) -> Seen:
    ack = worker.ack()
    return Seen(step, worker.state, worker.weights_valid, worker.synced_version, ack.memory_bytes)


async def command(worker: ShardWorker, action: str, ref: CacheRef | None = None) -> m.ShardAck:
    return await worker._on_command(m.ShardCommand(action, ref), None)  # type: ignore[arg-type]


async def wake_without_weights_then_shrink(
    worker: ShardWorker, cache: WeightCache, tensors: Mapping[str, torch.Tensor], version: int
) -> list[Seen]:
    """A level-2 shard woken with no version to reach (weights awake, KV cache asleep,
    serving nothing), shrunk, then woken with weights and shrunk again."""
    seen = [look(worker, "asleep")]
    await command(worker, "wake")
    seen.append(look(worker, "woken without weights"))
    await command(worker, "sleep")
    seen.append(look(worker, "shrunk"))
    cache.build(version, tensors)
    await command(worker, "wake", cache.promote(version))
    seen.append(look(worker, "woken with weights"))
    await command(worker, "sleep")
    seen.append(look(worker, "shrunk again"))
    return seen


async def failed_load_then_wake(
    worker: ShardWorker, bad: CacheRef, good: CacheRef
) -> tuple[list[Seen], BaseException | None]:
    """A wake whose sync fails puts the shard back to sleep holding nothing valid; the
    next wake with a good version serves."""
    seen = [look(worker, "asleep")]
    error: BaseException | None = None
    try:
        await command(worker, "wake", bad)
    except Exception as exc:
        error = exc
    seen.append(look(worker, "failed wake"))
    await command(worker, "wake", good)
    seen.append(look(worker, "woken"))
    return seen, error


async def sleep_during_a_sync(worker: ShardWorker, ref: CacheRef) -> list[Seen]:
    """An awake shard told to sync, and told to sleep while the sync runs: the sleep
    waits for the sync (commands run one at a time), then the shard sleeps."""
    seen = [look(worker, "awake")]
    sync = asyncio.ensure_future(command(worker, "sync", ref))
    await asyncio.sleep(0)  # the sync holds the command lock first
    sleep = asyncio.ensure_future(command(worker, "sleep"))
    synced = await sync
    seen.append(Seen("synced", synced.state, worker.weights_valid, synced.weight_version, None))
    await sleep
    seen.append(look(worker, "slept"))
    return seen
