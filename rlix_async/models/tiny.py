"""Tiny Llama and Qwen3-MoE models built from a config (no model hub on CPU machines).

Shapes fit vLLM's CPU attention (head_dim 64) and stay small enough that two
vLLM engines and two trainers share a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_llama_config(
    vocab_size: int = 512, layers: int = 2, hidden: int = 128, tied: bool = False
) -> Any:
    """``tied``: the output layer is the embedding (as in SmolLM2)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,  # vLLM CPU attention supports 32/64/80/96/112/128...
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )


def tiny_llama(seed: int = 0, **config: Any) -> Any:
    """A random float32 ``LlamaForCausalLM`` (same seed, same weights)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(**config)).float()


def save_tiny_llama(path: str | Path, seed: int = 0, **config: Any) -> Path:
    """Write a random tiny Llama as a HF checkpoint directory vLLM can serve."""
    import transformers

    path = Path(path)
    transformers.utils.logging.disable_progress_bar()  # keep the demo's console clean
    tiny_llama(seed, **config).save_pretrained(path)
    return path


def save_tiny_qwen3_moe(
    path: str | Path,
    seed: int = 0,
    *,
    vocab_size: int = 512,
    layers: int = 2,
    hidden: int = 128,
    experts: int = 8,
    topk: int = 2,
) -> Path:
    """Write a random tiny Qwen3-MoE (``model_type: qwen3_moe``: QK-norm, a top-k
    softmax router renormalized over the k, per-expert SwiGLU MLPs of width
    ``hidden``) as a HF checkpoint directory the Megatron trainer (expert parallel
    included) and vLLM both load; float32, no tokenizer (token-id tasks)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,  # vLLM CPU attention supports 32/64/80/96/112/128...
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=True,  # as Qwen3-MoE's checkpoints
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
        dtype="float32",
    )
    path = Path(path)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).float().save_pretrained(path)
    return path
