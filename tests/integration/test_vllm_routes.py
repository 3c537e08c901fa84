"""Routing replay, engine side (shards/vllm/routes.py): vLLM records the experts each
mixture-of-experts layer's router chose for every token it computed as an input, and
they are transformers' own router's top k, in its rank order, exactly (float32).

The model has a dense layer between its two MoE layers (the routes hold the MoE
layers only, in order), 8 experts of which each token takes 3 (the rank order is
seen). The prompts share a prefix and prefix caching is on, with a small token
budget (chunked prefill): the later requests' cached positions come from the slot
store, the routes of the KV they reuse. An aborted request's routes cover what its
caller holds; a weight update keeps the hooks (a dense model records nothing:
test_vllm_engine.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from helpers.tiny_text import save_tiny_model  # noqa: E402

from rlix_async.protocols.engine import GenerationChunk  # noqa: E402
from rlix_async.protocols.generation import Sampling  # noqa: E402

pytestmark = pytest.mark.vllm
MOE_LAYERS, K = 2, 3
SHARED = [(7 * i) % 50 + 3 for i in range(40)]  # the common prefix: a KV block and more
PROMPTS = [[*SHARED, 11, 12, 13], [*SHARED, 21, 22], [*SHARED, 31, 32, 33, 34, 35]]


def _engine(path: Path, record: bool) -> Any:
    from rlix_async.config import VllmEngineConfig
    from rlix_async.shards.vllm.engine import VllmEngine

    vllm_args = {"enable_prefix_caching": True, "max_num_batched_tokens": 16, "block_size": 32}
    config = VllmEngineConfig(max_model_len=128, kv_cache_mb=16, vllm_args=vllm_args)
    return VllmEngine(str(path), config, record_routes=record)


def _hf_routes(model: Any, seq: list[int]) -> np.ndarray:
    """transformers' routers' chosen experts at every position of ``seq``, in their
    rank order: uint8 [len(seq), MoE layers, k]."""
    chosen: dict[int, torch.Tensor] = {}
    gates = [(i, getattr(layer.mlp, "gate", None)) for i, layer in enumerate(model.model.layers)]
    hooks = [  # (a dense layer's MLP has no router)
        gate.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2]))
        for i, gate in gates
        if gate is not None
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([chosen[i] for i in sorted(chosen)], 1).numpy().astype(np.uint8)


def _check(model: Any, prompt: list[int], chunk: GenerationChunk) -> None:
    """The chunk's routes are transformers' at positions 0 .. len(prompt + tokens) - 2."""
    seq = prompt + chunk.token_ids
    routes = np.frombuffer(chunk.routes, np.uint8).reshape(-1, MOE_LAYERS, K)
    assert len(routes) == len(seq) - 1
    np.testing.assert_array_equal(routes, _hf_routes(model, seq)[: len(seq) - 1])


async def _last(engine: Any, prompt: list[int], sampling: Sampling, rid: str) -> GenerationChunk:
    last = None
    async for chunk in engine.generate(prompt, sampling, request_id=rid):
        last = chunk
    assert last is not None and last.finished
    return last


async def _cut_and_cancelled(engine: Any, model: Any) -> None:
    """A request aborted after a few tokens: its routes cover what the caller holds. A
    cancelled one: its routes are dropped with the next take."""
    long = Sampling(max_tokens=60, temperature=0.0)
    cut = None
    async for chunk in engine.generate(PROMPTS[2], long, request_id="cut"):
        if len(chunk.token_ids) >= 4 and not chunk.finished:
            await engine.abort(["cut"])
        cut = chunk
    assert cut is not None and cut.finished and len(cut.token_ids) < 60
    _check(model, PROMPTS[2], cut)
    stream = engine.generate(PROMPTS[0], long, request_id="gone")
    async for chunk in stream:
        if len(chunk.token_ids) >= 2:
            break
    await stream.aclose()
    greedy = Sampling(max_tokens=6, temperature=0.0)
    _check(model, PROMPTS[1], await _last(engine, PROMPTS[1], greedy, "after"))
    stats = (await engine.llm.collective_rpc("rlix_routes_stats"))[0]
    assert stats["held"] == 0 and stats["evicted"] == 0


@pytest.mark.timeout(240)
async def test_vllm_records_transformers_routes(tmp_path: Path) -> None:
    """Concurrent requests sharing a cached prefix, a cut one, a cancelled one, and
    requests after a weight update that changed every router."""
    from rlix_async.weights.cache import WeightCache

    path = save_tiny_model(
        tmp_path / "moe", "qwen3_moe", seed=3, norm_topk_prob=True, num_hidden_layers=3,
        mlp_only_layers=[1], num_experts=8, num_experts_per_tok=K,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = _engine(path, record=True)
    cache = WeightCache(f"routes{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 20)
    greedy = Sampling(max_tokens=10, temperature=0.0)
    try:
        async with asyncio.timeout(120):
            chunks = await asyncio.gather(
                *(_last(engine, p, greedy, f"g{i}") for i, p in enumerate(PROMPTS))
            )
        assert engine.routes.off is None and engine.routes.row_bytes == MOE_LAYERS * K
        for prompt, chunk in zip(PROMPTS, chunks, strict=True):
            _check(model, prompt, chunk)
        stats = (await engine.llm.collective_rpc("rlix_routes_stats"))[0]
        assert stats["cached_positions"] > 0  # the shared prefix came from the cache
        assert stats["held"] == 0  # every finished request's routes were taken
        async with asyncio.timeout(60):
            await _cut_and_cancelled(engine, model)

        # a weight update (vLLM's layerwise reload on CPU) keeps the hooks, and a prompt
        # whose blocks the old weights cached is computed afresh (the prefix cache is
        # salted by version: VllmEngine._salt), with the new routers' routes
        cached = PROMPTS[0]
        old_model = copy.deepcopy(model)
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.mul_(-1.5)
        update = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        cache.build(1, update)
        async with asyncio.timeout(120):
            await engine.load_version(cache.promote(1))
            after = await _last(engine, cached, greedy, "synced")
            again = await _last(engine, cached, greedy, "again")  # the same, recorded again
        _check(model, cached, after)
        assert after.routes == again.routes
        old_routes = _hf_routes(old_model, cached + after.token_ids)[: len(cached) - 1]
        assert old_routes.tobytes() != after.routes[: old_routes.nbytes]  # new routers
        assert engine.routes.missing == 0

        # the cost of one take: a collective_rpc round trip through the engine core
        t0 = time.perf_counter()
        for _ in range(20):
            await engine.llm.collective_rpc("rlix_routes_take", args=(["none"], []))
        print(f"one take: {(time.perf_counter() - t0) / 20 * 1000:.2f} ms")
    finally:
        engine.shutdown()
        cache.close()
