"""A tiny random float32 Llama (built from a config, no hub) and greedy decoding with
HF transformers and with a vLLM engine, for tests that compare the two."""

from __future__ import annotations

import torch
import transformers

from rlix_async.protocols.generation import Sampling
from rlix_async.shards.vllm.engine import VllmEngine

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
    async for chunk in engine.generate(prompt, Sampling(max_tokens=n, temperature=0.0)):
        last = chunk
    assert last is not None and last.finished
    return last.token_ids
