"""vLLM on a GPU, through the engine and the worker the shards run (VllmEngine with
cuda=True: sleep mode on, CUDA graphs on). Marked ``gpu_vllm``: vLLM built for CUDA
is too large to carry to a GPU machine without a network, so ``scripts/gpu-check``
reports these as not run where it is missing. Never run yet (docs/PERF.md).

The worker's shrink/wake paths are the sequences of tests/helpers/shard_cycles.py,
the same ones the CPU suite runs on the scripted engine; here the memory each step
leaves on the device is measured (NVML, this process's tree).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.shard_cycles import (
    failed_load_then_wake,
    sleep_during_a_sync,
    wake_without_weights_then_shrink,
)

from rlix_async.config import VllmEngineConfig
from rlix_async.control.coordinator import Coordinator
from rlix_async.models.tiny import save_tiny_llama, tiny_llama
from rlix_async.protocols.generation import Sampling
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterShape
from rlix_async.security import ipc_endpoint
from rlix_async.shards.worker import ShardWorker
from rlix_async.weights.cache import WeightCache

pytestmark = pytest.mark.gpu_vllm
SHAPE = {"vocab_size": 512, "layers": 2, "hidden": 128}
MiB = 1 << 20


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


async def _greedy(engine: object, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async for chunk in engine.generate(prompt, Sampling(max_tokens=8, temperature=0.0)):  # type: ignore[attr-defined]
        out = chunk.token_ids
    return out


def _engine(model: Path, level: int = 2, **cfg: object) -> object:
    from rlix_async.shards.vllm.engine import VllmEngine

    config = VllmEngineConfig(
        gpu_memory_utilization=0.3,
        max_model_len=256,
        sleep_level=level,
        **cfg,  # type: ignore[arg-type]
    )
    return VllmEngine(str(model), config, cuda=True)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    save_tiny_llama(path, seed=0, **SHAPE)
    return path


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_restores_it(model: Path, level: int) -> None:
    async def run() -> None:
        engine = _engine(model, level)
        try:
            before = await _greedy(engine, [1, 2, 3])
            awake = _used()
            await engine.sleep(level)  # type: ignore[attr-defined]
            asleep = _used()
            # the KV cache (30% of the device) goes at either level
            assert awake - asleep >= 0.2 * torch.cuda.mem_get_info()[1]
            await engine.wake_up(["weights"])  # type: ignore[attr-defined]
            await engine.wake_up(["kv_cache"])  # type: ignore[attr-defined]
            assert _used() >= awake - (256 << 20)
            if level == 1:  # weights came back from host memory: same greedy output
                assert await _greedy(engine, [1, 2, 3]) == before
        finally:
            engine.shutdown()  # type: ignore[attr-defined]

    asyncio.run(run())


def test_cuda_graphs_are_on_by_default_and_survive_a_sleep(model: Path) -> None:
    async def run() -> None:
        engine = _engine(model, 1)
        try:
            config = engine.llm.vllm_config  # type: ignore[attr-defined]
            assert not config.model_config.enforce_eager
            before = await _greedy(engine, [4, 5, 6])
            await engine.sleep(1)  # type: ignore[attr-defined]
            await engine.wake_up(["weights"])  # type: ignore[attr-defined]
            await engine.wake_up(["kv_cache"])  # type: ignore[attr-defined]
            assert await _greedy(engine, [4, 5, 6]) == before
        finally:
            engine.shutdown()  # type: ignore[attr-defined]

    asyncio.run(run())


@asynccontextmanager
async def _shard(model: Path, level: int) -> AsyncIterator[tuple[ShardWorker, WeightCache]]:
    engine = _engine(model, level)
    cache = WeightCache("P", f"g{uuid.uuid4().hex[:6]}", bucket_bytes=4 * MiB)
    async with Coordinator(ipc_endpoint(f"gpu-{uuid.uuid4().hex[:8]}"), ClusterShape(1, 1)) as co:
        worker = await ShardWorker(
            engine,  # type: ignore[arg-type]
            co.endpoint,
            "P",
            0,
            sleep_level=level,
            cuda=True,
        ).start()
        try:
            yield worker, cache
        finally:
            await worker.close()
            engine.shutdown()  # type: ignore[attr-defined]
            cache.close()


def test_wake_without_weights_then_shrink_frees_what_vllm_holds(model: Path) -> None:
    """The memory after each step: asleep (context only), weights awake without a KV
    cache, asleep again, fully awake, asleep again."""

    async def run() -> None:
        async with _shard(model, 2) as (worker, cache):
            seen = await wake_without_weights_then_shrink(
                worker, cache, tiny_llama(1, **SHAPE).state_dict(), 0
            )
        mem = {s.step: s.memory_bytes for s in seen}
        assert all(v is not None for v in mem.values()), mem
        kv = 0.2 * torch.cuda.mem_get_info()[1]  # 30% of the device for the KV cache
        assert [s.state for s in seen] == [
            ShardState.ASLEEP,
            ShardState.WAKING,
            ShardState.ASLEEP,
            ShardState.ACTIVE,
            ShardState.ASLEEP,
        ]
        assert mem["woken with weights"] - mem["woken without weights"] >= kv  # no KV cache yet
        assert mem["shrunk"] <= mem["asleep"] + 64 * MiB  # the wake's weights released again
        assert mem["shrunk again"] <= mem["asleep"] + 64 * MiB
        print({k: round(v / MiB) for k, v in mem.items()})

    asyncio.run(run())


def test_a_failed_load_at_wake_then_a_good_one(model: Path) -> None:
    async def run() -> None:
        async with _shard(model, 2) as (worker, cache):
            cache.build(0, tiny_llama(1, **SHAPE).state_dict())
            good = cache.promote(0)
            gone = msgspec.structs.replace(good, segment="rlix-no-such-slot")
            seen, error = await failed_load_then_wake(worker, gone, good)
        assert error is not None and "gone" in str(error)
        assert seen[1].state == ShardState.ASLEEP and not seen[1].weights_valid
        assert seen[2].state == ShardState.ACTIVE and seen[2].version == 0

    asyncio.run(run())


def test_a_sleep_during_a_sync_runs_after_it(model: Path) -> None:
    async def run() -> None:
        async with _shard(model, 1) as (worker, cache):
            cache.build(0, tiny_llama(1, **SHAPE).state_dict())
            from helpers.shard_cycles import command

            await command(worker, "wake", cache.promote(0))
            cache.build(1, tiny_llama(2, **SHAPE).state_dict())
            seen = await sleep_during_a_sync(worker, cache.promote(1))
        assert [(s.state, s.version) for s in seen] == [
            (ShardState.ACTIVE, 0),
            (ShardState.ACTIVE, 1),
            (ShardState.ASLEEP, 1),
        ]

    asyncio.run(run())


def test_a_sync_copies_straight_into_the_parameters_and_serves_the_new_weights(
    model: Path, tmp_path: Path
) -> None:
    """Unquantised on CUDA the layerwise reload is skipped (vllm_api.reload_needed):
    the version goes from the page-locked slot into the serving parameters, and the
    engine then answers as one started from those weights does."""
    new = tmp_path / "new"
    save_tiny_llama(new, seed=7, **SHAPE)

    async def run() -> None:
        from rlix_async.shards.vllm.engine import VllmEngine

        reference = _engine(new, 1)
        try:
            expected = await _greedy(reference, [7, 8, 9])
        finally:
            reference.shutdown()  # type: ignore[attr-defined]
        engine = _engine(model, 1)
        assert isinstance(engine, VllmEngine)
        cache = WeightCache("P", f"g{uuid.uuid4().hex[:6]}", bucket_bytes=4 * MiB)
        try:
            cache.build(1, tiny_llama(7, **SHAPE).state_dict())
            await engine.load_version(cache.promote(1))
            how = await engine.last_load()
            assert {r["path"] for r in how} == {"direct"}, how
            assert await _greedy(engine, [7, 8, 9]) == expected
        finally:
            engine.shutdown()
            cache.close()

    asyncio.run(run())


def test_a_shard_process_starts_its_engine_on_cuda(model: Path, tmp_path: Path) -> None:
    """The fork fix: the shard counts devices without initialising CUDA, so vLLM's
    engine core (forked by default) can use the device."""
    script = (
        "import asyncio, sys\n"
        "from rlix_async.shards.devices import cuda_device_count\n"
        "import torch\n"
        "n = cuda_device_count()\n"
        "assert n >= 1 and not torch.cuda.is_initialized(), n\n"
        "from rlix_async.config import VllmEngineConfig\n"
        "from rlix_async.protocols.generation import Sampling\n"
        "from rlix_async.shards.vllm.engine import VllmEngine\n"
        f"e = VllmEngine({str(model)!r}, VllmEngineConfig(gpu_memory_utilization=0.3, "
        "max_model_len=256), cuda=True)\n"
        "async def go():\n"
        "    async for c in e.generate([1, 2], Sampling(max_tokens=4, temperature=0.0)):\n"
        "        pass\n"
        "    print('TOKENS', len(c.token_ids))\n"
        "asyncio.run(go())\n"
        "e.shutdown()\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS 4" in done.stdout


@pytest.mark.gpu2
def test_a_tensor_parallel_shard_syncs_every_rank(model: Path, tmp_path: Path) -> None:
    """tp=2: both ranks load from the same leased slot, each its own slices."""
    from rlix_async.shards.vllm.engine import VllmEngine

    async def run() -> None:
        engine = VllmEngine(
            str(model),
            VllmEngineConfig(gpu_memory_utilization=0.3, max_model_len=256),
            tp=2,
            cuda=True,
        )
        cache = WeightCache("P", f"g{uuid.uuid4().hex[:6]}", bucket_bytes=4 * MiB)
        try:
            cache.build(1, tiny_llama(3, **SHAPE).state_dict())
            await engine.load_version(cache.promote(1))
            how = await engine.last_load()
            assert len(how) == 2 and {r["version"] for r in how} == {1}
        finally:
            engine.shutdown()
            cache.close()

    asyncio.run(run())
