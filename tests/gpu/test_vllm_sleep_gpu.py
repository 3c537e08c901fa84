"""vLLM sleep mode on a GPU, through the engine the shard workers run (VllmEngine with
cuda=True: sleep mode on). Runs where vLLM with CUDA is installed; scripts/gpu-check
deselects it (-k "not vllm") on machines with torch only. Never run yet."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlix_async.config import EngineConfig
from rlix_async.models.tiny import save_tiny_llama

pytestmark = pytest.mark.vllm  # gpu-check deselects it where vLLM is not installed


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


async def _greedy(engine: object, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async for chunk in engine.generate(prompt, max_tokens=8, temperature=0.0):  # type: ignore[attr-defined]
        out = chunk.token_ids
    return out


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_restores_it(tmp_path: Path, level: int) -> None:
    pytest.importorskip("vllm", reason="this module needs vLLM built for CUDA")
    from rlix_async.shards.vllm_engine import VllmEngine

    model = tmp_path / "model"
    save_tiny_llama(model, seed=0, vocab_size=512, layers=2, hidden=128)
    cfg = EngineConfig(gpu_memory_utilization=0.3, max_model_len=256, sleep_level=level)

    async def run() -> None:
        engine = VllmEngine(str(model), cfg, cuda=True)
        try:
            before = await _greedy(engine, [1, 2, 3])
            awake = _used()
            await engine.sleep(level)
            asleep = _used()
            # the KV cache (30% of the device) goes at either level
            assert awake - asleep >= 0.2 * torch.cuda.mem_get_info()[1]
            await engine.wake_up(["weights"])
            await engine.wake_up(["kv_cache"])
            assert _used() >= awake - (256 << 20)
            if level == 1:  # weights came back from host memory: same greedy output
                assert await _greedy(engine, [1, 2, 3]) == before
        finally:
            engine.shutdown()

    asyncio.run(run())
