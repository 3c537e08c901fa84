"""``rlix-async bench preempt``: shrink a shard with requests in flight, on real vLLM engines.

One pipeline, two shards (vLLM ``AsyncLLM`` each, a tiny random float32 Llama)
on devices 0 and 1; its trainer declares device 0. Each round: both shards
awake and synced from the weight cache, N sampled requests in flight and
partly decoded, then the pipeline requests training -> the coordinator
shrinks shard 0 (pause keep, abort, drain, sleep) and the router resumes the
cut requests on shard 1 from their partial output. Training is released and
shard 0 expands back for the next round.

- ``shrink_ms``: the training request (the scheduling decision) until it is
  granted, which the coordinator does only once shard 0 is asleep.
- ``drain_ms``: abort sent until the engine reports zero running.
- ``wasted_tokens``: tokens the engines streamed to the shard workers minus
  the tokens kept in trajectories.
- ``reprefill_tokens``: tokens prefilled again because of the shrink: for every
  resumed attempt a shard answered (the router's ``resumed``, reported as
  ``resumed_attempts``), its prompt plus the partial output it carries over
  (the router's ``reprefill_tokens``). Nominal: a prefix-cache hit on the new
  shard would make the real compute smaller.
- ``preemption_cost_tokens``: ``wasted_tokens + reprefill_tokens``.
- ``lost_requests``: requests that did not complete with all their tokens.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.generation import Sampling
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterName, ClusterShape, ClusterSpec
from rlix_async.security import ipc_endpoint
from rlix_async.shards.router import Router, Trajectory
from rlix_async.shards.worker import ShardWorker
from rlix_async.weights.cache import WeightCache

TOPOLOGY: dict[ClusterName, ClusterSpec] = {
    "actor_train": ClusterSpec(1, (0,)),
    "actor_infer": ClusterSpec(1, (0, 1)),
}


async def _until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench preempt: {what} not reached within {timeout:.0f}s")
        await asyncio.sleep(0.01)


async def run_preempt_bench(
    *,
    requests: int = 32,
    max_tokens: int = 96,
    rounds: int = 3,
    kv_cache_mb: int = 64,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    from rlix_async.config import VllmEngineConfig
    from rlix_async.models.tiny import save_tiny_llama, tiny_llama
    from rlix_async.shards.vllm.engine import VllmEngine

    pid = f"bp{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="rlix-bench-preempt-") as tmp:
        model_dir = save_tiny_llama(Path(tmp) / "model", seed=0)
        cfg = VllmEngineConfig(dtype="float32", max_model_len=512, kv_cache_mb=kv_cache_mb)
        engines = [VllmEngine(str(model_dir), cfg) for _ in range(2)]
        cache = WeightCache(pid, bucket_bytes=1 << 20)
        workers: list[ShardWorker] = []
        co = Coordinator(ipc_endpoint(f"bench-preempt-{pid}"), ClusterShape(1, 2))
        await co.start()
        driver = await PipelineClient.connect(co.endpoint, pipeline_id=pid)
        router = Router(driver)
        try:
            await driver.register(TOPOLOGY)
            await driver.admit()
            for rank, engine in enumerate(engines):
                workers.append(await ShardWorker(engine, co.endpoint, pid, rank).start())
            cache.build(1, tiny_llama(seed=1).state_dict())
            await driver.publish_weights(cache.promote(1))
            rows = [
                await _round(driver, router, workers, i, requests, max_tokens, timeout_s)
                for i in range(rounds)
            ]
        finally:
            await router.close()
            for w in workers:
                await w.close()
            await driver.close()
            await co.close()
            cache.close()
            for engine in engines:
                engine.shutdown()

    def p50(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 1)

    return {
        "engine": "vllm",
        "requests": requests,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "shrink_ms_p50": p50("shrink_ms"),
        "drain_ms_p50": p50("drain_ms"),
        "pause_ms_p50": p50("pause_ms"),
        "sleep_ms_p50": p50("sleep_ms"),
        "cut_at_tokens_p50": p50("cut_at_tokens"),
        "resumed_requests": sum(r["resumed_requests"] for r in rows),
        "resumed_attempts": sum(r["resumed_attempts"] for r in rows),
        "wasted_tokens": sum(r["wasted_tokens"] for r in rows),
        "reprefill_tokens": sum(r["reprefill_tokens"] for r in rows),
        "preemption_cost_tokens": sum(r["preemption_cost_tokens"] for r in rows),
        "lost_requests": sum(r["lost_requests"] for r in rows),
        "rounds_detail": rows,
    }


async def _round(
    driver: PipelineClient,
    router: Router,
    workers: list[ShardWorker],
    index: int,
    requests: int,
    max_tokens: int,
    timeout_s: float,
) -> dict[str, Any]:
    await driver.report_progress(requests, 0, force=True)
    await driver.request("actor_infer", "GENERATION", timeout=timeout_s)
    await _until(
        lambda: (
            all(w.state == ShardState.ACTIVE for w in workers)
            and sorted(driver.active_ranks) == [0, 1]
            and len(driver.endpoints) == 2
        ),
        timeout_s,
        "both shards awake",
    )
    decoded_before = sum(w.decoded_tokens for w in workers)
    resumed_before, reprefill_before = router.resumed, router.reprefill_tokens
    shard0_before = workers[0].decoded_tokens
    jobs = [
        asyncio.ensure_future(
            router.generate(
                [(7 * i + index) % 500 + 1, 5, 9],
                Sampling(max_tokens=max_tokens, seed=1000 * index + i),
            )
        )
        for i in range(requests)
    ]
    # shrink mid-decode: once shard 0 has produced about a twelfth of its share (at a
    # sixth, a loaded machine twice let it finish them all while the shrink was decided)
    await _until(
        lambda: workers[0].decoded_tokens - shard0_before >= requests * max_tokens // 24,
        timeout_s,
        "shard 0 decoding",
    )
    cut_at = workers[0].decoded_tokens - shard0_before
    t0 = time.monotonic()
    await driver.report_progress(requests, requests)
    await driver.request("actor_train", "ACTOR_TRAINING", timeout=timeout_s)
    shrink_ms = (time.monotonic() - t0) * 1000
    assert workers[0].state == ShardState.ASLEEP
    done = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout_s)
    trajs = [t for t in done if isinstance(t, Trajectory)]
    complete = [t for t in trajs if len(t.token_ids) == max_tokens]
    kept = sum(len(t.token_ids) for t in trajs)
    decoded = sum(w.decoded_tokens for w in workers) - decoded_before
    reprefill = router.reprefill_tokens - reprefill_before
    phases = workers[0].phase_ms
    await driver.release("actor_train")
    return {
        "shrink_ms": shrink_ms,
        "drain_ms": phases["abort"] + phases["drain"],
        "pause_ms": phases.get("pause", 0.0),
        "sleep_ms": phases["sleep"],
        "cut_at_tokens": cut_at,
        "resumed_requests": sum(1 for t in trajs if t.resumes),
        "resumed_attempts": router.resumed - resumed_before,
        "wasted_tokens": decoded - kept,
        "reprefill_tokens": reprefill,
        "preemption_cost_tokens": decoded - kept + reprefill,
        "lost_requests": requests - len(complete),
    }


def format_preempt_result(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{r['requests']} requests x {r['max_tokens']} tokens on 2 vLLM shards, "
            f"shard 0 shrunk mid-decode, {r['rounds']} rounds",
            f"  shrink_ms_p50     {r['shrink_ms_p50']:8.1f}  (decision -> shard asleep)",
            f"  pause_ms_p50      {r['pause_ms_p50']:8.1f}",
            f"  drain_ms_p50      {r['drain_ms_p50']:8.1f}  (abort -> zero running)",
            f"  sleep_ms_p50      {r['sleep_ms_p50']:8.1f}",
            f"  resumed_requests  {r['resumed_requests']:8d}",
            f"  resumed_attempts  {r['resumed_attempts']:8d}",
            f"  wasted_tokens     {r['wasted_tokens']:8d}  (streamed, not kept)",
            f"  reprefill_tokens  {r['reprefill_tokens']:8d}  (prompt + partial, prefilled again)",
            f"  preemption_cost   {r['preemption_cost_tokens']:8d}  (wasted + reprefill tokens)",
            "  per round (resumed, wasted, reprefill): "
            + ", ".join(
                f"({d['resumed_requests']}, {d['wasted_tokens']}, {d['reprefill_tokens']})"
                for d in r["rounds_detail"]
            ),
            f"  lost_requests     {r['lost_requests']:8d}",
        ]
    )
