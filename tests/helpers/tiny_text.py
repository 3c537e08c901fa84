"""An offline tokenizer and tiny random Hugging Face models for text-recipe tests.

There is no model hub here, yet the text recipes need a real tokenizer (chat
template, special tokens, ``apply_chat_template``) and a model directory that
``AutoModelForCausalLM`` and vLLM can load. ``tiny_tokenizer`` builds a
byte-level BPE tokenizer in-process, with no merges: every byte is one token,
so any text (digits, ``+``, ``?``, words) encodes without unknowns, in 260
tokens, and decodes back (NFC-normalized). Its normalizer and pre-tokenizer are
Qwen2's, because transformers rebuilds a qwen2 directory's tokenizer with those:
a llama and a qwen2 directory then encode every text alike. ``save_tiny_model``
writes a random Llama or Qwen2 model of about 0.3 M parameters with that
tokenizer, the kind of directory vLLM serves in the engine tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
UNK = "<unk>"
# Ids 0..3, ahead of the 256 byte tokens; eos ends an assistant turn, as in Qwen's ChatML.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, UNK)

# Qwen2's pre-tokenizer split: transformers rebuilds a qwen2 directory's tokenizer with it
# (and NFC), so the tiny tokenizer uses them too and both families encode alike.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 260 tokens with ChatML special tokens and chat template.

    Built from a fixed vocabulary rather than trained, so the ids are the same
    on every run and machine."""
    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *byte_tokens))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        # No BOS, as in Qwen: the chat template's first <|im_start|> opens the text.
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def save_tiny_model(
    directory: Path,
    family: Literal["llama", "qwen2", "qwen3_moe"] = "llama",
    *,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    **config: object,
) -> Path:
    """Write a random tiny causal LM and ``tiny_tokenizer()`` to ``directory``; return it.

    The same seed gives the same weights. The embedding rows past the tokenizer
    (vocab rounded up to 64, as real checkpoints pad it) are never produced by
    the tokenizer but can be sampled by the model. A qwen3_moe model has 4 experts of
    which each token takes 2 unless ``config`` says otherwise (any other field too)."""
    tokenizer = tiny_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id
    # The tokenizer has no BOS; configs still want one, and Qwen's names <|endoftext|>.
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad_id
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=64,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=512,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
        # wider than the default 0.02: at that scale a tied model's greedy output
        # repeats one token whatever the seed, and tests that compare outputs
        # across weights or cut a response at a token need varied text
        initializer_range=0.3,
    )
    if family == "qwen3_moe":
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    shape.update(config)
    torch.manual_seed(seed)
    model: LlamaForCausalLM | Qwen2ForCausalLM | Qwen3MoeForCausalLM
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
        with torch.no_grad():  # norms of 1 everywhere would hide a q_norm/k_norm mix-up
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
    else:
        raise ValueError(f"family {family!r}: expected 'llama', 'qwen2' or 'qwen3_moe'")
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
